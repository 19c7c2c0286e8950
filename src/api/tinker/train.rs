//! Training calls on a run: `forward_backward` (protobuf: `Datum`s of token chunks and loss
//! inputs; `forward` is the same with `forward_only`) and `optim_step` (AdamW with the SDK's
//! `AdamParams`). Each is checked whole here (a bad datum is a 400 naming it; nothing of the
//! call runs), queued on the trainer thread in arrival order (the SDK sends a run's calls one
//! after the other), and answered through a future (`futures`).

use super::super::body::{JsonBody, ProtoBody};
use super::super::error::{clip, ApiError};
use super::super::openai::{type_error, Fields};
use super::super::state::{bearer_of, AppState};
use super::futures::{Cell, Outcome};
use super::proto::{self, chunk, tokens_of, ArrayRecord, BatchedTensor, ForwardBackwardOutput};
use super::{check_type, required_str};
use crate::online::runs::{RunDatum, RunOutput, RunWork, StepParams};
use crate::online::trainer::{CommandError, TrainerHandle};
use crate::train::optim::AdamWConfig;
use crate::train::token_loss::{TokenInputs, TokenLoss, NAMES};
use axum::extract::State;
use axum::http::HeaderMap;
use axum::Json;
use prost::Message;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::Arc;

/// Tokens one `forward_backward` call may carry in all (its datums run in passes of
/// `online::runs::MAX_PASS_TOKENS`).
pub const MAX_CALL_TOKENS: usize = 1 << 16;

/// `POST /api/v1/forward_backward` (`Content-Type: application/x-protobuf`): a
/// `ForwardBackwardRequest` -> a future whose result is a `ForwardBackwardOutput` (protobuf):
/// per datum `logprobs` and `elementwise_loss`, and `metrics["loss:sum"]`.
pub async fn forward_backward(
    State(state): State<AppState>,
    headers: HeaderMap,
    ProtoBody(body): ProtoBody,
) -> Result<Json<Value>, ApiError> {
    let ready = state.ready()?;
    let req = proto::ForwardBackwardRequest::decode(body).map_err(|e| {
        ApiError::bad_body(format!(
            "the body is not a ForwardBackwardRequest (protobuf): {e}"
        ))
    })?;
    let key = bearer_of(&headers).to_string();
    let trainer = run_trainer(&state, &req.model_id, &key)?;
    let loss = parse_loss(&req)?;
    let data = parse_data(&req.data, loss, ready.vocab_size, ready.max_model_len)?;
    let work = RunWork::ForwardBackward {
        data,
        loss,
        forward_only: req.forward_only,
    };
    let (id, cell) = state.tinker_futures.pending(&key);
    queue(&trainer, &req.model_id, work, cell, encode)?;
    Ok(Json(json!({"request_id": id, "model_id": req.model_id})))
}

/// `POST /api/v1/optim_step`: `{model_id, adam_params, seq_id?}` -> a future whose result is
/// `{"metrics": {...}}` (the step's number, the gradient norm before clipping, the datums it
/// applied).
pub async fn optim_step(
    State(state): State<AppState>,
    headers: HeaderMap,
    JsonBody(body): JsonBody,
) -> Result<Json<Value>, ApiError> {
    state.ready()?;
    let f = Fields::parse(&body)?;
    check_type(&f, "optim_step")?;
    f.int("seq_id")?;
    let model_id = required_str(&f, "model_id")?.to_string();
    let key = bearer_of(&headers).to_string();
    let trainer = run_trainer(&state, &model_id, &key)?;
    if f.get("optimizer_params").is_some() {
        return Err(ApiError::invalid(
            "optimizer_params",
            "this server's runs train with AdamW: send adam_params",
        ));
    }
    let params = parse_adam(f.get("adam_params"))?;
    let (id, cell) = state.tinker_futures.pending(&key);
    queue(
        &trainer,
        &model_id,
        RunWork::OptimStep(params),
        cell,
        encode,
    )?;
    Ok(Json(json!({"request_id": id, "model_id": model_id})))
}

/// The trainer that holds run `id`, which `key` must own (404 otherwise).
pub(super) fn run_trainer(
    state: &AppState,
    id: &str,
    key: &str,
) -> Result<TrainerHandle, ApiError> {
    let run = state
        .tinker_runs
        .get(id, key)
        .ok_or_else(|| super::runs::not_found(id))?;
    run.touch();
    let ready = state.ready()?;
    ready
        .online
        .get()
        .cloned()
        .ok_or_else(|| ApiError::from(CommandError::NoRun(id.to_string())))
}

/// Queue `work` on run `id` now (the order of calls), and finish `cell` with its answer as
/// `answer` writes it.
pub(super) fn queue(
    trainer: &TrainerHandle,
    id: &str,
    work: RunWork,
    cell: Arc<Cell>,
    answer: impl FnOnce(RunOutput) -> Outcome + Send + 'static,
) -> Result<(), ApiError> {
    let reply = trainer.run_work(id, work).map_err(ApiError::from)?;
    tokio::spawn(async move {
        let out = match reply.await {
            Ok(Ok(o)) => answer(o),
            Ok(Err(e)) => Outcome::Failed {
                category: match &e {
                    CommandError::Run(r) if r.is_user() => "user",
                    _ => "server",
                },
                error: e.to_string(),
            },
            Err(_) => Outcome::Failed {
                error: CommandError::Stopped.to_string(),
                category: "server",
            },
        };
        cell.finish(out);
    });
    Ok(())
}

/// A call's answer as the SDK reads it.
fn encode(o: RunOutput) -> Outcome {
    match o {
        RunOutput::ForwardBackward {
            logprobs,
            losses,
            loss_sum,
        } => {
            let mut fields = HashMap::new();
            fields.insert(
                "logprobs".to_string(),
                BatchedTensor::f32_per_datum(&logprobs),
            );
            fields.insert(
                "elementwise_loss".to_string(),
                BatchedTensor::f32_per_datum(&losses),
            );
            let out = ForwardBackwardOutput {
                loss_fn_output_type: "ArrayRecord".into(),
                loss_fn_outputs: vec![ArrayRecord {
                    type_tag: "ArrayRecord".into(),
                    fields,
                    num_datums: logprobs.len() as i64,
                }],
                metrics: HashMap::from([("loss:sum".to_string(), loss_sum)]),
            };
            Outcome::Proto(out.encode_to_vec())
        }
        RunOutput::OptimStep {
            step,
            grad_norm,
            datums,
        } => Outcome::Json(json!({"metrics": {
            "step:max": step as f64,
            "grad_norm:mean": grad_norm,
            "datums:sum": datums as f64,
        }})),
        _ => unexpected(),
    }
}

/// A call answered with what another kind of call answers (a server bug, said so).
pub(super) fn unexpected() -> Outcome {
    Outcome::Failed {
        error: "the trainer answered with another call's result".into(),
        category: "server",
    }
}

/// The loss and its config (`loss_fn_config` and `loss_fn_config_v2`, numbers only).
fn parse_loss(req: &proto::ForwardBackwardRequest) -> Result<TokenLoss, ApiError> {
    let mut loss = TokenLoss::named(&req.loss_fn).ok_or_else(|| {
        ApiError::invalid(
            "loss_fn",
            format!(
                "loss_fn '{}' is not one this server computes: {} (forward_backward_custom runs \
                 any loss in the client)",
                clip(&req.loss_fn),
                NAMES.join(", ")
            ),
        )
    })?;
    let mut config: Vec<(&str, f64)> = req
        .loss_fn_config
        .iter()
        .map(|(k, v)| (k.as_str(), *v))
        .collect();
    for (k, v) in &req.loss_fn_config_v2 {
        match &v.value {
            Some(proto::loss_config_value::Value::Number(x)) => config.push((k, *x)),
            _ => {
                return Err(ApiError::invalid(
                    &format!("loss_fn_config.{k}"),
                    format!("'{k}' must be a number"),
                ))
            }
        }
    }
    for (k, v) in config {
        if !loss.config_keys().contains(&k) {
            return Err(ApiError::invalid(
                &format!("loss_fn_config.{k}"),
                format!(
                    "'{k}' is not a setting of {loss} (its settings: {})",
                    loss.config_keys().join(", ")
                ),
            ));
        }
        if !v.is_finite() || v < 0.0 {
            return Err(ApiError::invalid(
                &format!("loss_fn_config.{k}"),
                format!("'{k}' is {v}; it must be a finite number ≥ 0"),
            ));
        }
        loss.set(k, v);
    }
    if let TokenLoss::Ppo { low, high } | TokenLoss::Cispo { low, high } = loss {
        if low > high {
            return Err(ApiError::invalid(
                "loss_fn_config.clip_low_threshold",
                format!("the clip range [{low}, {high}] is empty"),
            ));
        }
    }
    Ok(loss)
}

/// The datums, checked: text chunks of token ids in the vocabulary, targets that are the input
/// shifted by one, and the loss's inputs, one value per input position.
fn parse_data(
    data: &[proto::Datum],
    loss: TokenLoss,
    vocab: usize,
    max_len: usize,
) -> Result<Vec<RunDatum>, ApiError> {
    if data.is_empty() {
        return Err(ApiError::invalid("data", "'data' holds no datum"));
    }
    let mut total = 0;
    let mut out = Vec::with_capacity(data.len());
    for (i, d) in data.iter().enumerate() {
        let at = |field: &str| format!("data[{i}].{field}");
        let bad = |field: &str, why: String| ApiError::invalid(&at(field), why);
        let mut tokens: Vec<u32> = Vec::new();
        for c in &d.model_input {
            match &c.chunk {
                Some(chunk::Kind::EncodedText(t)) => {
                    let ids = tokens_of(&t.tokens)
                        .map_err(|e| bad("model_input", format!("a text chunk: {e}")))?;
                    for id in ids {
                        if id < 0 || id as usize >= vocab {
                            return Err(bad(
                                "model_input",
                                format!("token {id} is not in the vocabulary (0..{vocab})"),
                            ));
                        }
                        tokens.push(id as u32);
                    }
                }
                _ => {
                    return Err(bad(
                        "model_input",
                        "only text chunks: this server's models take no images or audio".into(),
                    ))
                }
            }
        }
        let n = tokens.len();
        if n == 0 {
            return Err(bad("model_input", "it holds no token".into()));
        }
        if n + 1 > max_len {
            return Err(bad(
                "model_input",
                format!("{n} tokens and a target pass the context length {max_len}"),
            ));
        }
        total += n + 1;
        let wanted = loss.inputs();
        for k in d.loss_fn_inputs.keys() {
            if k != "target_tokens" && k != "weights" && !wanted.contains(&k.as_str()) {
                return Err(bad(
                    &format!("loss_fn_inputs.{k}"),
                    format!(
                        "'{k}' is not an input of {loss} (it reads target_tokens, weights{})",
                        wanted.iter().map(|w| format!(", {w}")).collect::<String>()
                    ),
                ));
            }
        }
        let input = |k: &str, required: bool| -> Result<Option<Vec<f64>>, ApiError> {
            let Some(t) = d.loss_fn_inputs.get(k) else {
                return match required {
                    true => Err(bad(
                        &format!("loss_fn_inputs.{k}"),
                        format!("{loss} needs '{k}'"),
                    )),
                    false => Ok(None),
                };
            };
            let field = format!("loss_fn_inputs.{k}");
            let v = t.values().map_err(|e| bad(&field, format!("'{k}': {e}")))?;
            if v.len() != n {
                return Err(bad(
                    &field,
                    format!("'{k}' has {} values for {n} input tokens", v.len()),
                ));
            }
            if let Some(x) = v.iter().find(|x| !x.is_finite()) {
                return Err(bad(&field, format!("'{k}' holds {x}")));
            }
            Ok(Some(v))
        };
        let targets = input("target_tokens", true)?.unwrap_or_default();
        for (j, &t) in targets.iter().enumerate() {
            if t < 0.0 || t >= vocab as f64 || t.fract() != 0.0 {
                return Err(bad(
                    "loss_fn_inputs.target_tokens",
                    format!("target {t} at {j} is not a token of the vocabulary (0..{vocab})"),
                ));
            }
            if j + 1 < n && t as u32 != tokens[j + 1] {
                return Err(bad(
                    "loss_fn_inputs.target_tokens",
                    format!(
                        "target {t} at {j} is not model_input[{}] = {}: this server scores \
                         each position's next token, so the targets must be the input shifted \
                         by one (the last target is the token after the input)",
                        j + 1,
                        tokens[j + 1]
                    ),
                ));
            }
        }
        tokens.push(targets[n - 1] as u32);
        let weights = input("weights", false)?;
        let sampled = input("logprobs", !wanted.is_empty())?;
        let advantages = input("advantages", !wanted.is_empty())?;
        let inputs = (0..n)
            .map(|j| TokenInputs {
                weight: weights.as_ref().map_or(1.0, |w| w[j]),
                sampling_logprob: sampled.as_ref().map_or(0.0, |s| s[j]),
                advantage: advantages.as_ref().map_or(0.0, |a| a[j]),
            })
            .collect();
        out.push(RunDatum { tokens, inputs });
    }
    if total > MAX_CALL_TOKENS {
        return Err(ApiError::invalid(
            "data",
            format!(
                "the call holds {total} tokens; one call takes at most {MAX_CALL_TOKENS}: send \
                 fewer datums per call"
            ),
        ));
    }
    Ok(out)
}

/// `adam_params` (the SDK's `AdamParams`; its defaults where a field is absent).
fn parse_adam(v: Option<&Value>) -> Result<StepParams, ApiError> {
    let o = match v {
        Some(Value::Object(o)) => o,
        None | Some(Value::Null) => {
            return Err(ApiError::invalid(
                "adam_params",
                "'adam_params' is required",
            ))
        }
        Some(_) => return Err(type_error("adam_params", "an object")),
    };
    let inner = Value::Object(o.clone());
    let f = Fields::parse(&inner)?;
    let within = |e: ApiError| e.within("adam_params");
    let allowed = [
        "learning_rate",
        "beta1",
        "beta2",
        "eps",
        "weight_decay",
        "grad_clip_norm",
    ];
    f.only(&allowed, "adam_params").map_err(within)?;
    let num = |k: &str, lo: f64, hi: f64, lo_open: bool, default: f32| {
        f.f32_in(k, lo, hi, lo_open)
            .map(|x| x.unwrap_or(default))
            .map_err(within)
    };
    let d = AdamWConfig::default();
    Ok(StepParams {
        lr: num("learning_rate", 0.0, f64::INFINITY, false, d.lr)?,
        beta1: num("beta1", 0.0, 0.999_999, false, 0.9)?,
        beta2: num("beta2", 0.0, 0.999_999_9, false, 0.95)?,
        eps: num("eps", 0.0, f64::INFINITY, true, 1e-12)?,
        weight_decay: num("weight_decay", 0.0, f64::INFINITY, false, 0.0)?,
        grad_clip_norm: num("grad_clip_norm", 0.0, f64::INFINITY, false, 0.0)?,
    })
}
