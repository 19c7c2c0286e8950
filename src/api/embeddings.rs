//! `POST /v1/embeddings` (OpenAI's shape): each input's mean-pooled final hidden states (after
//! the output norm), L2-normalised, from the model `model` names (the base, or an adapter on
//! it). This is what the language model's last layer says, not a trained embedding model's
//! vector: fine for clustering and near-duplicates of this model's own inputs, weaker than a
//! retrieval model for search. Runs through the engine with the other requests.

use super::admission::{admit, submit};
use super::body::JsonBody;
use super::error::ApiError;
use super::job::{Flavor, Job};
use super::openai::{parse_common, token_id_list, type_error, Fields};
use super::state::{blocking, AppState};
use crate::engine::{EngineEvent, GenerateRequest};
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

/// Inputs of one request at most.
pub const MAX_INPUTS: usize = 256;

/// One input: text, or token ids.
enum Input {
    Text(String),
    Ids(Vec<u32>),
}

fn parse_inputs(f: &Fields, vocab: usize) -> Result<Vec<Input>, ApiError> {
    let v = f
        .get("input")
        .ok_or_else(|| ApiError::invalid("input", "'input' is required"))?;
    let bad = || {
        type_error(
            "input",
            "a string, a list of strings, token ids, or a list of those",
        )
    };
    let ids = |v: &Value| token_id_list(v, vocab);
    let items: Vec<Input> = match v {
        Value::String(s) => vec![Input::Text(s.clone())],
        Value::Array(a) if a.iter().all(Value::is_number) => {
            vec![Input::Ids(ids(v).ok_or_else(bad)?)]
        }
        Value::Array(a) => a
            .iter()
            .map(|x| match x {
                Value::String(s) => Ok(Input::Text(s.clone())),
                x => ids(x).map(Input::Ids).ok_or_else(bad),
            })
            .collect::<Result<_, _>>()?,
        _ => return Err(bad()),
    };
    if items.is_empty() || items.len() > MAX_INPUTS {
        return Err(ApiError::invalid(
            "input",
            format!("'input' must hold 1 to {MAX_INPUTS} inputs"),
        ));
    }
    Ok(items)
}

/// Standard base64 (RFC 4648, padded): OpenAI's `encoding_format: "base64"` of the vector's
/// little-endian f32 bytes.
fn base64(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for c in bytes.chunks(3) {
        let n = (c[0] as u32) << 16
            | (*c.get(1).unwrap_or(&0) as u32) << 8
            | *c.get(2).unwrap_or(&0) as u32;
        for i in 0..4 {
            if i <= c.len() {
                out.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

pub async fn embeddings(
    State(state): State<AppState>,
    headers: axum::http::HeaderMap,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let ready = state.ready()?;
    let f = Fields::parse(&body)?;
    let base64_out = match f.str("encoding_format")? {
        None | Some("float") => false,
        Some("base64") => true,
        Some(_) => {
            return Err(ApiError::invalid(
                "encoding_format",
                "'encoding_format' must be \"float\" or \"base64\"",
            ))
        }
    };
    let width = ready.model.config.hidden;
    if let Some(d) = f.int("dimensions")? {
        if d != width as i128 {
            return Err(ApiError::invalid(
                "dimensions",
                format!("'dimensions' is {d}; this model's embeddings have {width} (it cannot shorten them)"),
            ));
        }
    }
    let model = f
        .str("model")?
        .ok_or_else(|| ApiError::invalid("model", "'model' is required"))?
        .to_string();
    let (_, adapter) = state.resolve_model(&model)?;
    let inputs = parse_inputs(&f, ready.vocab_size)?;
    let tok = ready.tokenizer.clone();
    let prompts: Vec<Vec<u32>> = blocking(move || {
        inputs
            .into_iter()
            .map(|i| match i {
                Input::Ids(ids) => Ok(ids),
                Input::Text(t) => tok
                    .encode(&t)
                    .map_err(|e| ApiError::invalid("input", e.to_string())),
            })
            .collect()
    })
    .await?;
    let max = ready.max_model_len;
    for p in &prompts {
        if p.is_empty() || p.len() > max {
            return Err(ApiError::invalid(
                "input",
                format!(
                    "an input has {} tokens; each must have 1 to {max} (the context length)",
                    p.len()
                ),
            ));
        }
    }
    let params = parse_common(
        &Fields(
            &json!({"model": model})
                .as_object()
                .cloned()
                .unwrap_or_default(),
        ),
        ready.vocab_size,
    )?;
    let job = Job {
        flavor: Flavor::Completion,
        params,
        prompt_ids: Vec::new(),
        echo: None,
        adapter,
        prompt_param: "input",
        key: super::state::bearer_of(&headers).to_string(),
        group_owner: None,
        tools: None,
        constraint: None,
        reasoning: None,
        id: None,
        unlogged: false,
    };
    let admission = admit(&state, &job, prompts.len())?;
    let mut streams = Vec::with_capacity(prompts.len());
    for p in &prompts {
        let req = GenerateRequest {
            prompt: p.clone(),
            n: 1,
            max_tokens: 0,
            sampling: Default::default(),
            seed: Some(0),
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: true,
            include_stop_str_in_output: false,
            adapter: job.adapter.as_ref().map(|a| a.version().clone()),
            prompt_logprobs: None,
            constraint: None,
            embed: true,
            repetition: None,
            follow: None,
        };
        streams.push(submit(&state, &job, req, &admission)?);
    }
    let mut data = Vec::with_capacity(streams.len());
    for (i, mut s) in streams.into_iter().enumerate() {
        let v = loop {
            match s.rx.recv().await {
                Some(EngineEvent::Embedding(v)) => break v,
                Some(EngineEvent::Error(e)) => return Err(ApiError::internal(e)),
                Some(EngineEvent::GrammarFailed(e)) => {
                    return Err(ApiError::internal(e.to_string()))
                }
                Some(_) => {}
                None => return Err(ApiError::internal("the engine stopped")),
            }
        };
        let embedding = if base64_out {
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            json!(base64(&bytes))
        } else {
            json!(v)
        };
        data.push(json!({"object": "embedding", "index": i, "embedding": embedding}));
    }
    let tokens: usize = prompts.iter().map(Vec::len).sum();
    let a = job.adapter.as_ref();
    Ok(axum::Json(json!({
        "object": "list",
        "data": data,
        "model": model,
        "adapter": a.map(|a| a.name.to_string()),
        "adapter_version": a.map_or(0, |a| a.version),
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }))
    .into_response())
}

#[cfg(test)]
mod tests {
    use super::base64;

    #[test]
    fn base64_is_rfc_4648() {
        for (raw, want) in [
            (&b""[..], ""),
            (b"f", "Zg=="),
            (b"fo", "Zm8="),
            (b"foo", "Zm9v"),
            (b"foobar", "Zm9vYmFy"),
            (&[0xff, 0xfe, 0x00, 0x80], "//4AgA=="),
        ] {
            assert_eq!(base64(raw), want);
        }
    }
}
