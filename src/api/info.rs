//! The small endpoints: `GET /v1/models`, `POST /tokenize`, `POST /detokenize` (vLLM shapes),
//! `GET /health`, `GET /metrics`.

use super::body::JsonBody;
use super::error::ApiError;
use super::messages::Conversation;
use super::openai::Fields;
use super::state::{blocking, AppState};
use crate::online::trainer::Unhealthy;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

pub async fn models(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    Ok(Json(
        json!({"object": "list", "data": model_cards(&state)?}),
    ))
}

/// `GET /v1/models/{id}`: one card (adapter names may hold '/'), 404 in OpenAI's shape.
pub async fn model(
    State(state): State<AppState>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<Json<Value>, ApiError> {
    model_cards(&state)?
        .into_iter()
        .find(|c| c["id"] == id.as_str())
        .map(Json)
        .ok_or_else(|| ApiError::model_not_found(&id))
}

/// The base model's card and every adapter's (vLLM's shape, with `max_model_len`).
fn model_cards(state: &AppState) -> Result<Vec<Value>, ApiError> {
    let r = state.ready()?;
    let mut data = vec![json!({
        "id": r.model_name,
        "object": "model",
        "created": r.created,
        "owned_by": "flywheel",
        "root": r.model_name,
        "parent": null,
        "max_model_len": r.max_model_len,
        "adapter_version": 0,
    })];
    for slot in r.registry.list() {
        let cur = slot.current();
        data.push(json!({
            "id": slot.name.as_ref(),
            "object": "model",
            "created": slot.created,
            "owned_by": "flywheel",
            "root": r.model_name,
            "parent": r.model_name,
            "max_model_len": r.max_model_len,
            "adapter_version": cur.version,
            "adapter_kind": cur.weights.layout.config.method.kind(),
        }));
    }
    Ok(data)
}

/// `GET /tokenizer_info` (vLLM's): the special tokens, the chat template and the context length,
/// all a remote tokenizer needs next to `/tokenize` and `/detokenize` (lm-eval's
/// `tokenizer_backend=remote`).
pub async fn tokenizer_info(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    let r = state.ready()?;
    let t = &r.tokenizer;
    let text = |id: Option<u32>| id.map(|i| String::from_utf8_lossy(t.token_bytes(i)).into_owned());
    Ok(Json(json!({
        "tokenizer_class": t.kind_name(),
        "bos_token": text(t.bos_id),
        "eos_token": text(t.eos_id),
        "pad_token": text(t.eos_id),
        "unk_token": Value::Null,
        "bos_token_id": t.bos_id,
        "eos_token_id": t.eos_id,
        "add_bos_token": t.add_bos,
        "chat_template": t.chat_template(),
        "model_max_length": r.max_model_len,
        "max_model_len": r.max_model_len,
        "vocab_size": r.vocab_size,
    })))
}

/// `{"model"?, "prompt": str}` or `{"model"?, "messages": [...], "add_generation_prompt"?}` ->
/// `{"count", "max_model_len", "tokens"}`.
pub async fn tokenize(
    State(state): State<AppState>,
    JsonBody(body): JsonBody,
) -> Result<Json<Value>, ApiError> {
    let r = state.ready()?;
    let f = Fields::parse(&body)?;
    if let Some(m) = f.str("model")? {
        state.check_model(m)?;
    }
    let tok = r.tokenizer.clone();
    // vLLM's defaults: special tokens (BOS) added to a prompt, not to a rendered chat (whose
    // template writes its own).
    let chat = f.get("messages").is_some();
    let special = f.bool("add_special_tokens")?.unwrap_or(!chat);
    let tokens = if chat {
        // As chat renders it: the template's tools, or the generic format's conversation.
        let inputs = Conversation::parse(&f, tok.chat_template())?.into_inputs();
        blocking(move || {
            let text = inputs.render(&tok)?;
            tok.encode_with(&text, special)
                .map_err(|e| ApiError::invalid("messages", e.to_string()))
        })
        .await?
    } else {
        let prompt = f
            .str("prompt")?
            .ok_or_else(|| ApiError::invalid("prompt", "give 'prompt' or 'messages'"))?
            .to_string();
        blocking(move || {
            tok.encode_with(&prompt, special)
                .map_err(|e| ApiError::invalid("prompt", e.to_string()))
        })
        .await?
    };
    Ok(Json(json!({
        "count": tokens.len(),
        "max_model_len": r.max_model_len,
        "tokens": tokens,
    })))
}

/// `{"model"?, "tokens": [ids]}` -> `{"prompt": text}`.
pub async fn detokenize(
    State(state): State<AppState>,
    JsonBody(body): JsonBody,
) -> Result<Json<Value>, ApiError> {
    let r = state.ready()?;
    let f = Fields::parse(&body)?;
    if let Some(m) = f.str("model")? {
        state.check_model(m)?;
    }
    let ids = f
        .token_ids("tokens", r.vocab_size)?
        .ok_or_else(|| ApiError::invalid("tokens", "'tokens' is required"))?;
    Ok(Json(json!({"prompt": r.tokenizer.decode(&ids)})))
}

/// 200 when the model is loaded and the engine thread alive; 503 otherwise.
/// The learning side's health (None: not learning), asked on the blocking pool: a rollout log
/// on PostgreSQL answers over the network.
pub async fn learning_health(state: &AppState) -> Option<Result<(), Unhealthy>> {
    let st = state.clone();
    tokio::task::spawn_blocking(move || st.ready().ok()?.online.get().map(|o| o.health()))
        .await
        .unwrap_or_else(|_| Some(Err(Unhealthy::Unchecked)))
}

pub async fn health(State(state): State<AppState>) -> Response {
    let r = match state.ready() {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    if !r.engine.is_alive() {
        return ApiError::unavailable("the engine stopped").into_response();
    }
    // Learning: the rollout log must be usable and the trainer running. A serving replica
    // stays ready without them (its base model and adapters answer; completions through a
    // learning adapter are refused with 503 while they cannot be logged): its learning state
    // is in the body.
    if let Some(Err(why)) = learning_health(&state).await {
        let replica = r
            .online
            .get()
            .is_some_and(|o| o.cfg.role == crate::online::config::Role::Serve);
        let why = crate::util::hide_paths(&why.to_string());
        if replica {
            let learning = json!({"state": "unavailable", "reason": why});
            return (
                StatusCode::OK,
                Json(json!({"status": "ok", "learning": learning})),
            )
                .into_response();
        }
        return ApiError::unavailable(format!("learning is unavailable: {why}")).into_response();
    }
    // Ready to serve; learning may be degraded (a learner failed, or retrying after failures:
    // a full disk, say), which the body says without server paths.
    let body = match r.online.get() {
        None => json!({"status": "ok"}),
        Some(o) => json!({"status": "ok", "learning": learning_state(&o.status())}),
    };
    (StatusCode::OK, Json(body)).into_response()
}

/// `{"state": "ok"}`, or `"degraded"` with each failed or failing learner: its state, failures
/// in a row and last error (kind and message without paths).
fn learning_state(
    status: &std::collections::BTreeMap<String, crate::online::learner::Status>,
) -> Value {
    use crate::online::learner::State;
    let troubled: serde_json::Map<String, Value> = status
        .iter()
        .filter(|(_, s)| s.state == State::Failed || s.consecutive_failures > 0)
        .map(|(name, s)| {
            let error = s.last_error.as_ref().map(|e| {
                json!({"kind": e.kind.as_str(), "message": crate::util::hide_paths(&e.message)})
            });
            (
                name.clone(),
                json!({"state": s.state, "consecutive_failures": s.consecutive_failures,
                       "error": error}),
            )
        })
        .collect();
    if troubled.is_empty() {
        json!({"state": "ok"})
    } else {
        json!({"state": "degraded", "adapters": troubled})
    }
}

pub async fn metrics(State(state): State<AppState>) -> Response {
    if let Ok(r) = state.ready() {
        r.registry.num_versions_alive();
        let gate = &r.cpu.pool.gate;
        let (serve, train) = gate.busy();
        let m = &state.metrics;
        // The gate's totals only grow: the counters catch up with them at each scrape.
        for (role, busy) in [("serve", serve), ("train", train)] {
            let c = m.compute_busy_seconds.with_label_values(&[role]);
            let ahead = busy.as_secs_f64() - c.get();
            if ahead > 0.0 {
                c.inc_by(ahead);
            }
        }
        if r.online.get().is_none() {
            m.train_share.set(r.online.cfg().share.train_share);
        }
    }
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
        .into_response()
}
