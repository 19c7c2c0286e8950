//! `POST /inference/v1/generate`: vLLM's token-in, token-out route, which RL orchestrators call
//! (the `verifiers` train client, prime-rl): `{"model", "token_ids", "sampling_params": {...}}`
//! -> `{"request_id", "choices": [{"index", "token_ids", "logprobs": {"content": [{"token":
//! "token_id:<id>", "logprob", "top_logprobs"}]}, "finish_reason"}], "usage"}`. The prompt is
//! taken as given (no template, no re-tokenization), so what a client trains on is exactly what
//! was generated. Through a learning adapter the choices are logged like any completion, under
//! the response's `id`.

use super::body::JsonBody;
use super::error::ApiError;
use super::generation::{Dialect, Generation};
use super::job::Flavor;
use super::openai::Fields;
use super::respond::respond;
use super::state::AppState;
use axum::extract::State;
use axum::response::Response;
use serde_json::{Map, Value};

/// Sampling parameters that only shape the text or the logprobs' encoding, which this route
/// does not return as text: accepted, and they change nothing.
const TEXT_ONLY: &[&str] = &[
    "detokenize",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "flat_logprobs",
    "output_kind",
];

pub async fn generate(
    State(state): State<AppState>,
    turn: Option<axum::Extension<super::sessions::SessionTurn>>,
    headers: axum::http::HeaderMap,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let ready = state.ready()?;
    let f = Fields::parse(&body)?;
    let model = f
        .str("model")?
        .ok_or_else(|| ApiError::invalid("model", "'model' is required"))?;
    let prompt_ids = f
        .token_ids("token_ids", ready.vocab_size)?
        .ok_or_else(|| ApiError::invalid("token_ids", "'token_ids' is required"))?;
    if prompt_ids.is_empty() {
        return Err(ApiError::invalid("token_ids", "the prompt is empty"));
    }
    if f.bool("stream")?.unwrap_or(false) {
        return Err(ApiError::invalid(
            "stream",
            "'stream' is not available on /inference/v1/generate",
        ));
    }
    for (name, neutral) in [("priority", Value::from(0)), ("cache_salt", Value::Null)] {
        if f.get(name).is_some_and(|v| *v != neutral) {
            return Err(ApiError::invalid(
                name,
                format!("'{name}' is not supported"),
            ));
        }
    }
    for name in ["features", "content_parts", "multi_modal_data"] {
        if f.get(name).is_some() {
            return Err(ApiError::invalid(
                name,
                format!("'{name}': multimodal inputs are not supported"),
            ));
        }
    }
    let sp = match f.get("sampling_params") {
        None => Map::new(),
        Some(Value::Object(o)) => o.clone(),
        Some(_) => {
            return Err(ApiError::invalid(
                "sampling_params",
                "'sampling_params' must be an object",
            ))
        }
    };
    let mut fields = sampling_fields(&sp)?;
    fields.insert("model".into(), Value::String(model.to_string()));
    for k in ["return_token_ids"] {
        if let Some(v) = f.get(k) {
            fields.insert(k.into(), v.clone());
        }
    }
    let fv = Value::Object(fields);
    let sf = Fields::parse(&fv)?;
    let generation = Generation::validate(
        &state,
        &sf,
        Dialect::Generate,
        None,
        turn.map(|axum::Extension(t)| t),
    )
    .await?;
    let job = generation.job(Flavor::Generate, prompt_ids, "token_ids", &headers);
    respond(&state, job).await
}

/// The sampling parameters as the common parser reads them: checked against what this server
/// implements, text-only ones dropped.
fn sampling_fields(sp: &Map<String, Value>) -> Result<Map<String, Value>, ApiError> {
    let mut out = Map::new();
    for (k, v) in sp {
        let neutral = |n: Value| v.is_null() || *v == n;
        let ok = match k.as_str() {
            k if TEXT_ONLY.contains(&k) => continue,
            "length_penalty" => neutral(Value::from(1.0)),
            "min_tokens" | "truncate_prompt_tokens" => neutral(Value::from(0)),
            "include_stop_str_in_output" | "use_beam_search" => neutral(Value::from(false)),
            "allowed_token_ids" | "bad_words" | "guided_decoding" | "logits_processors" => {
                v.is_null()
            }
            "extra_args" => match v {
                Value::Null => true,
                // prime-rl's hint for a compact logprob encoding; the JSON one is its fallback.
                Value::Object(o) => o.keys().all(|k| k == "prl_compact_logprobs"),
                _ => false,
            },
            "stream" => {
                return Err(ApiError::invalid(
                    "sampling_params.stream",
                    "'stream' is not a sampling parameter",
                ))
            }
            _ => {
                out.insert(k.clone(), v.clone());
                continue;
            }
        };
        if !ok {
            return Err(ApiError::invalid(
                &format!("sampling_params.{k}"),
                format!("'{k}' = {v} is not supported"),
            ));
        }
    }
    Ok(out)
}
