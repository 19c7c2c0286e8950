//! Sampling through the Tinker API. `save_weights_for_sampler` publishes a run's adapter as it
//! stands as a version of the registry's adapter `{run}/sampler_weights/{name}` (immutable, like
//! every version); `tinker://{that name}` is its path, which a sampling session samples from and
//! which `/v1/chat/completions` also takes as `model`. `asample` generates through the engine
//! with that version pinned, as any completion does (so a sample's log-probs are the ones the
//! training forward computes for the same tokens and weights, to the bit), answering a
//! `SampleResponse` (protobuf) through a future.

use super::super::body::JsonBody;
use super::super::error::{clip, ApiError};
use super::super::generation::{Dialect, Generation};
use super::super::job::Flavor;
use super::super::openai::{type_error, Fields};
use super::super::owned::Owned;
use super::super::respond::sample;
use super::super::state::{bearer_of, AppState};
use super::futures::Outcome;
use super::proto::{SampleResponse, SampledSequence};
use super::{check_type, optional_str, required_str};
use crate::adapter::registry::check_adapter_name;
use crate::engine::FinishReason;
use crate::online::runs::{RunOutput, RunWork};
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::Json;
use prost::Message;
use serde_json::{json, Map, Value};

/// Sampling sessions and sampler paths kept per key (the newest of each).
pub const MAX_SAMPLERS: usize = 4096;

/// The scheme of a sampler path.
pub const SCHEME: &str = "tinker://";

/// A sampling session: what it samples from.
#[derive(Clone, Debug)]
pub struct Sampler {
    pub base_model: String,
    /// The registry's adapter (None: the base model).
    pub adapter: Option<String>,
}

/// Sampling sessions by id, and the sampler weights each key saved (by adapter name).
pub struct Samplers {
    sessions: Owned<Sampler>,
    saved: Owned<()>,
}

impl Default for Samplers {
    fn default() -> Samplers {
        Samplers {
            sessions: Owned::new(MAX_SAMPLERS),
            saved: Owned::new(MAX_SAMPLERS),
        }
    }
}

/// The registry's adapter a `tinker://` path names, if `key` saved it.
fn adapter_of(state: &AppState, path: &str, key: &str, param: &str) -> Result<String, ApiError> {
    let name = path.strip_prefix(SCHEME).unwrap_or(path);
    if state.tinker_samplers.saved.get(name, key).is_none() {
        return Err(ApiError {
            param: Some(param.into()),
            code: Some("sampler_weights_not_found"),
            ..ApiError::not_found(format!("no sampler weights '{}'", clip(path)))
        });
    }
    Ok(name.to_string())
}

/// `POST /api/v1/save_weights_for_sampler`: `{model_id, path?, sampling_session_seq_id?, kind?,
/// seq_id?}` (`ttl_seconds` and `user_metadata` refused when set) -> a future whose result is `{path}` (with a name) or
/// `{sampling_session_id}` (without: the SDK's `save_weights_and_get_sampling_client`), the run's
/// adapter published as it stands (after the calls queued before this one).
pub async fn save_for_sampler(
    State(state): State<AppState>,
    headers: HeaderMap,
    JsonBody(body): JsonBody,
) -> Result<Json<Value>, ApiError> {
    let ready = state.ready()?;
    let f = Fields::parse(&body)?;
    check_type(&f, "save_weights_for_sampler")?;
    f.int("seq_id")?;
    super::refuse_save_extras(&f)?;
    let key = bearer_of(&headers).to_string();
    let run = required_str(&f, "model_id")?.to_string();
    let trainer = super::train::run_trainer(&state, &run, &key)?;
    match optional_str(&f, "kind")?.as_deref() {
        None | Some("snapshot") => {}
        Some(k) => {
            return Err(ApiError::invalid(
                "kind",
                format!("kind '{}': this server saves snapshots only", clip(k)),
            ))
        }
    }
    let path = optional_str(&f, "path")?;
    let session_seq = f.int("sampling_session_seq_id")?;
    let label = match (&path, session_seq) {
        (Some(p), _) => p.clone(),
        (None, Some(n)) => format!("sampler-{n}"),
        (None, None) => {
            return Err(ApiError::invalid(
                "path",
                "'path' (a name for the weights) or 'sampling_session_seq_id' is required",
            ))
        }
    };
    let plain = label
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if !plain || label.starts_with('.') {
        return Err(ApiError::invalid(
            "path",
            format!(
                "'path' '{}': a name of letters, digits, '-', '_' and '.' (not first)",
                clip(&label)
            ),
        ));
    }
    let name = format!("{run}/sampler_weights/{label}");
    if let Err(why) = check_adapter_name(&name) {
        return Err(ApiError::invalid(
            "path",
            format!("'path' '{}': the name {why}", clip(&label)),
        ));
    }
    let answer = trainer
        .run_work(&run, RunWork::Snapshot)
        .map_err(ApiError::from)?;
    let (id, cell) = state.tinker_futures.pending(&key);
    let st = state.clone();
    let base_model = ready.model_name.clone();
    tokio::spawn(async move {
        let published = async {
            let weights = match answer.await {
                Ok(Ok(RunOutput::Weights(w))) => w,
                Ok(Ok(_)) => return Err("the trainer answered with another call's result".into()),
                Ok(Err(e)) => return Err(e.to_string()),
                _ => return Err("the trainer did not answer".to_string()),
            };
            let ready = st.ready().map_err(|e| e.message.clone())?;
            ready
                .registry
                .publish(&name, weights)
                .map_err(|e| e.to_string())?;
            st.tinker_samplers.saved.put(name.clone(), &key, ());
            Ok(match path {
                Some(_) => {
                    json!({"type": "save_weights_for_sampler", "path": format!("{SCHEME}{name}")})
                }
                None => {
                    let sid = crate::util::random_id("sampler-");
                    let s = Sampler {
                        base_model,
                        adapter: Some(name),
                    };
                    st.tinker_samplers.sessions.put(sid.clone(), &key, s);
                    json!({"type": "save_weights_for_sampler", "sampling_session_id": sid})
                }
            })
        };
        cell.finish(match published.await {
            Ok(v) => Outcome::Json(v),
            Err(error) => Outcome::Failed {
                error,
                category: "server",
            },
        });
    });
    Ok(Json(json!({"request_id": id, "model_id": run})))
}

/// `POST /api/v1/create_sampling_session`: `{session_id, sampling_session_seq_id, base_model?,
/// model_path?}` -> `{sampling_session_id}` (a path this key saved, or the base model).
pub async fn create_session(
    State(state): State<AppState>,
    headers: HeaderMap,
    JsonBody(body): JsonBody,
) -> Result<Json<Value>, ApiError> {
    let ready = state.ready()?;
    let f = Fields::parse(&body)?;
    check_type(&f, "create_sampling_session")?;
    let key = bearer_of(&headers).to_string();
    let session = required_str(&f, "session_id")?;
    super::session::require(&state, session, &key)?;
    f.int("sampling_session_seq_id")?;
    let adapter = match optional_str(&f, "model_path")? {
        Some(p) => Some(adapter_of(&state, &p, &key, "model_path")?),
        None => None,
    };
    match optional_str(&f, "base_model")? {
        Some(b) => super::check_base(ready, &b)?,
        None if adapter.is_none() => {
            return Err(ApiError::invalid(
                "base_model",
                "'base_model' or 'model_path' is required",
            ))
        }
        _ => {}
    }
    let id = crate::util::random_id("sampler-");
    let s = Sampler {
        base_model: ready.model_name.clone(),
        adapter,
    };
    state.tinker_samplers.sessions.put(id.clone(), &key, s);
    Ok(Json(
        json!({"type": "create_sampling_session", "sampling_session_id": id}),
    ))
}

/// `GET /api/v1/samplers/{id}`: `{sampler_id, base_model, model_path}`.
pub async fn get_sampler(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let s = sampler(&state, &id, bearer_of(&headers))?;
    Ok(Json(json!({
        "sampler_id": id,
        "base_model": s.base_model,
        "model_path": s.adapter.map(|a| format!("{SCHEME}{a}")),
    })))
}

fn sampler(state: &AppState, id: &str, key: &str) -> Result<Sampler, ApiError> {
    state
        .tinker_samplers
        .sessions
        .get(id, key)
        .ok_or_else(|| ApiError {
            param: Some("sampling_session_id".into()),
            code: Some("sampler_not_found"),
            ..ApiError::not_found(format!("no sampling session '{}'", clip(id)))
        })
}

/// The prompt's token ids (`ModelInput`: `{chunks: [{type: "encoded_text", tokens}]}`).
fn prompt_tokens(v: Option<&Value>, vocab: usize) -> Result<Vec<u32>, ApiError> {
    let chunks = v
        .and_then(|p| p.get("chunks"))
        .and_then(Value::as_array)
        .ok_or_else(|| type_error("prompt", "a model input: {\"chunks\": [...]}"))?;
    let mut ids = Vec::new();
    for (i, c) in chunks.iter().enumerate() {
        let at = format!("prompt.chunks[{i}]");
        match c.get("type").and_then(Value::as_str) {
            None | Some("encoded_text") => {}
            Some(t) => {
                return Err(ApiError::invalid(
                    &at,
                    format!("a '{}' chunk: this server's models take text only", clip(t)),
                ))
            }
        }
        let toks = c
            .get("tokens")
            .and_then(Value::as_array)
            .ok_or_else(|| type_error(&format!("{at}.tokens"), "a list of token ids"))?;
        for t in toks {
            match t.as_u64() {
                Some(id) if (id as usize) < vocab => ids.push(id as u32),
                _ => {
                    return Err(ApiError::invalid(
                        &format!("{at}.tokens"),
                        format!("{t} is not a token of the vocabulary (0..{vocab})"),
                    ))
                }
            }
        }
    }
    if ids.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt holds no token"));
    }
    Ok(ids)
}

/// The completions request a `SampleRequest` is, for `Generation::validate`: the sampling
/// parameters under their OpenAI/vLLM names, the sampled tokens' log-probs always.
fn as_completion(f: &Fields, model: &str) -> Result<Value, ApiError> {
    let mut c = Map::new();
    c.insert("model".into(), json!(model));
    c.insert(
        "n".into(),
        json!(f.int_in("num_samples", 1, 128)?.unwrap_or(1)),
    );
    c.insert("logprobs".into(), json!(0));
    if f.bool("prompt_logprobs")?.unwrap_or(false) {
        c.insert("prompt_logprobs".into(), json!(0));
    }
    for name in [
        "topk_prompt_logprobs",
        "topk_sample_logprobs",
        "prompt_alt_tokens_k",
    ] {
        if f.int(name)?.unwrap_or(0) != 0 {
            return Err(ApiError::invalid(
                name,
                format!("'{name}' is not implemented by this server: send 0"),
            ));
        }
    }
    for name in [
        "target_prompt_logprobs",
        "prompt_logprobs_last_n",
        "record_stability_info",
    ] {
        if !matches!(
            f.get(name),
            None | Some(Value::Null) | Some(Value::Bool(false))
        ) {
            return Err(ApiError::invalid(
                name,
                format!("'{name}' is not implemented by this server"),
            ));
        }
    }
    let p = match f.get("sampling_params") {
        Some(Value::Object(o)) => o,
        _ => return Err(type_error("sampling_params", "an object")),
    };
    for (k, v) in p {
        if v.is_null() {
            continue;
        }
        match k.as_str() {
            "max_tokens" | "seed" | "temperature" | "top_k" | "top_p" => {
                c.insert(k.clone(), v.clone());
            }
            "stop" => match v {
                Value::String(_) => {
                    c.insert("stop".into(), v.clone());
                }
                Value::Array(a) if a.is_empty() => {
                    // No stop at all, EOS included: generation goes on to max_tokens.
                    c.insert("ignore_eos".into(), json!(true));
                }
                Value::Array(a) if a.iter().all(Value::is_string) => {
                    c.insert("stop".into(), v.clone());
                }
                Value::Array(a) if a.iter().all(Value::is_u64) => {
                    c.insert("stop_token_ids".into(), v.clone());
                }
                _ => {
                    return Err(type_error(
                        "sampling_params.stop",
                        "a string, a list of strings or a list of token ids",
                    ))
                }
            },
            other => {
                return Err(ApiError::invalid(
                    &format!("sampling_params.{other}"),
                    format!("'{other}' is not a sampling parameter"),
                ))
            }
        }
    }
    Ok(Value::Object(c))
}

/// `POST /api/v1/asample`: `{prompt, num_samples, sampling_params, sampling_session_id | base_model
/// | model_path, prompt_logprobs?, seq_id?}` -> a future whose result is a `SampleResponse`
/// (protobuf): per sample its tokens, their log-probs and why it stopped; the prompt's log-probs
/// when asked for (the first, which has no context, NaN).
pub async fn asample(
    State(state): State<AppState>,
    headers: HeaderMap,
    JsonBody(body): JsonBody,
) -> Result<Json<Value>, ApiError> {
    let ready = state.ready()?;
    let f = Fields::parse(&body)?;
    check_type(&f, "sample")?;
    f.int("seq_id")?;
    let key = bearer_of(&headers).to_string();
    let model = match optional_str(&f, "sampling_session_id")? {
        Some(id) => sampler(&state, &id, &key)?
            .adapter
            .unwrap_or_else(|| ready.model_name.clone()),
        None => match optional_str(&f, "model_path")? {
            Some(p) => adapter_of(&state, &p, &key, "model_path")?,
            None => {
                let base = optional_str(&f, "base_model")?.ok_or_else(|| {
                    ApiError::invalid(
                        "sampling_session_id",
                        "'sampling_session_id', 'model_path' or 'base_model' is required",
                    )
                })?;
                super::check_base(ready, &base)?;
                base
            }
        },
    };
    let prompt = prompt_tokens(f.get("prompt"), ready.vocab_size)?;
    let completion = as_completion(&f, &model)?;
    let cf = Fields::parse(&completion)?;
    let in_params = |e: ApiError| match e.param.as_deref() {
        Some("n") => ApiError {
            param: Some("num_samples".into()),
            ..e
        },
        Some(p) if p != "model" && p != "prompt_logprobs" => e.within("sampling_params"),
        _ => e,
    };
    let generation =
        Generation::validate(&state, &cf, Dialect::Completion { echo: false }, None, None)
            .await
            .map_err(in_params)?;
    let job = generation.job(Flavor::Completion, prompt, "prompt", &headers);
    let sequence_ids: Vec<String> = (0..job.params.n)
        .map(|_| crate::util::random_id("seq-"))
        .collect();
    let running = sample(&state, job)?;
    let (id, cell) = state.tinker_futures.pending(&key);
    tokio::spawn(async move {
        cell.finish(match running.await {
            Ok(s) => {
                let sequences = s
                    .choices
                    .into_iter()
                    .map(|c| SampledSequence {
                        stop_reason: match c.finish {
                            FinishReason::Stop => 0,
                            FinishReason::Length | FinishReason::Repetition => 1,
                        },
                        tokens: c
                            .token_ids
                            .iter()
                            .flat_map(|t| (*t as i32).to_le_bytes())
                            .collect(),
                        logprobs: Some(c.logprobs.iter().flat_map(|l| l.to_le_bytes()).collect()),
                    })
                    .collect();
                let prompt_logprobs = s.prompt.map(|p| {
                    std::iter::once(f32::NAN)
                        .chain(p.iter().map(|x| x.logprob))
                        .flat_map(f32::to_le_bytes)
                        .collect()
                });
                let r = SampleResponse {
                    sequences,
                    prompt_logprobs,
                };
                Outcome::Proto(r.encode_to_vec())
            }
            Err(e) => Outcome::Failed {
                error: e.message.clone(),
                category: if e.status.is_client_error() {
                    "user"
                } else {
                    "server"
                },
            },
        });
    });
    Ok(Json(
        json!({"request_id": id, "sample_sequence_ids": sequence_ids}),
    ))
}
