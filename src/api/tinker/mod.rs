//! Thinking Machines' Tinker training API (`/api/v1/...`) as its official SDK (`tinker` 0.38)
//! calls it. Served so far: what every client does before it trains or samples (the server's
//! feature flags, sessions and their heartbeats, the models), training runs created on the
//! served base (`create_model`, `get_info`), their training calls (`forward_backward` in
//! protobuf, `optim_step`), sampling (`save_weights_for_sampler`, sampling sessions, `asample`)
//! saved state (`save_weights`, `load_weights`) and the futures those answer with
//! (`retrieve_future`);
//! `docs/tinker.md` holds the protocol as read from the SDK. The caller's key travels in
//! `X-API-Key` (the SDK's header), checked like a bearer key.

pub mod checkpoints;
pub mod futures;
pub mod proto;
pub mod restore;
pub mod runs;
pub mod sample;
pub mod saved;
pub mod session;
pub mod train;

use super::body::JsonBody;
use super::error::{self, ApiError};
use super::openai::{type_error, Fields};
use super::state::AppState;
use axum::extract::State;
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use serde_json::{json, Map, Value};

/// The routes (under the API key, like the OpenAI ones), each after the kept sessions and runs
/// are brought back (`restore`).
pub fn routes(state: &AppState) -> Router<AppState> {
    Router::new()
        .route("/api/v1/healthz", get(healthz))
        .route("/api/v1/client/config", post(client_config))
        .route("/api/v1/get_server_capabilities", get(capabilities))
        .route("/api/v1/create_session", post(session::create))
        .route("/api/v1/session_heartbeat", post(session::heartbeat))
        .route("/api/v1/sessions/{id}", get(session::get))
        .route("/api/v1/telemetry", post(telemetry))
        .route("/api/v1/create_model", post(runs::create))
        .route("/api/v1/get_info", post(runs::info))
        .route("/api/v1/training_runs", get(runs::list))
        .route("/api/v1/training_runs/{id}", get(runs::get))
        .route("/api/v1/retrieve_future", post(futures::retrieve))
        .route("/api/v1/forward_backward", post(train::forward_backward))
        .route("/api/v1/optim_step", post(train::optim_step))
        .route(
            "/api/v1/save_weights_for_sampler",
            post(sample::save_for_sampler),
        )
        .route(
            "/api/v1/create_sampling_session",
            post(sample::create_session),
        )
        .route("/api/v1/samplers/{id}", get(sample::get_sampler))
        .route("/api/v1/asample", post(sample::asample))
        .route("/api/v1/save_weights", post(saved::save))
        .route("/api/v1/load_weights", post(saved::load))
        .route(
            "/api/v1/training_runs/{id}/checkpoints",
            get(checkpoints::list),
        )
        .route(
            "/api/v1/training_runs/{id}/checkpoints/weights/{name}",
            delete(checkpoints::delete),
        )
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            restore::restore_first,
        ))
}

/// `GET /api/v1/healthz`: ok while the model is loaded and the engine runs.
async fn healthz(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    let ready = state.ready()?;
    if !ready.engine.is_alive() {
        return Err(ApiError::unavailable("the engine stopped"));
    }
    Ok(Json(json!({"status": "ok"})))
}

/// `POST /api/v1/client/config`: the SDK's feature flags for this server. API keys, not JWTs;
/// `forward_backward` bodies uncompressed, in chunks sent in order; custom losses run in the
/// client; samples polled one future at a time. (Flags the SDK does not know are ignored by it; those it knows and we do
/// not set keep its defaults.)
async fn client_config(
    State(state): State<AppState>,
    JsonBody(body): JsonBody,
) -> Result<Json<Value>, ApiError> {
    state.ready()?;
    let f = Fields::parse(&body)?;
    f.str("sdk_version")?;
    // A forward_backward call's chunks within the body limit (the SDK's estimate is of the
    // values, before the protobuf's few bytes per field), sent one after the other: a run's calls
    // arrive in their order.
    let chunk_bytes = state.limits.max_body_bytes / 2;
    Ok(Json(json!({
        "pjwt_auth_enabled": false,
        "credential_default_source": "api_key",
        "proto_compress_fwdbwd": false,
        "parallel_fwdbwd_chunks": false,
        "fwdbwd_max_chunk_bytes_count": chunk_bytes,
        "custom_loss_server_side": false,
        "sample_use_retrieve_futures": false,
        "sample_join_sampling_session": false,
    })))
}

/// `GET /api/v1/get_server_capabilities`: the served base model and its context length.
async fn capabilities(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    let ready = state.ready()?;
    Ok(Json(json!({"supported_models": [{
        "model_name": ready.model_name,
        "max_context_length": ready.max_model_len,
        "trainable": true,
        "sampleable": true,
    }]})))
}

/// `POST /api/v1/telemetry`: the SDK's own diagnostics (`{events: [{event, severity, ...}],
/// session_id, platform, sdk_version, process_uuid}`: session start and end, exceptions in the
/// client). Meant for Thinking Machines; here each event goes to the server's log (debug, error
/// events at warn) and is otherwise dropped: `{"status": "accepted"}`.
async fn telemetry(JsonBody(body): JsonBody) -> Result<Json<Value>, ApiError> {
    let f = Fields::parse(&body)?;
    let events = f
        .get("events")
        .and_then(Value::as_array)
        .ok_or_else(|| type_error("events", "a list of events"))?;
    let session = f.str("session_id")?.unwrap_or("");
    for e in events {
        let kind = e.get("event").and_then(Value::as_str).unwrap_or("?");
        let severity = e.get("severity").and_then(Value::as_str).unwrap_or("?");
        if matches!(severity, "ERROR" | "CRITICAL") {
            tracing::warn!(session, kind, severity, event = %e, "tinker SDK telemetry");
        } else {
            tracing::debug!(session, kind, severity, event = %e, "tinker SDK telemetry");
        }
    }
    Ok(Json(json!({"status": "accepted"})))
}

/// The request's `type` tag, which the SDK sends with every body: absent or `want`.
fn check_type(f: &Fields, want: &str) -> Result<(), ApiError> {
    match f.str("type")? {
        None => Ok(()),
        Some(t) if t == want => Ok(()),
        Some(t) => Err(ApiError::invalid(
            "type",
            format!("'type' is '{t}'; this route takes '{want}'"),
        )),
    }
}

/// A required string field.
fn required_str<'a>(f: &Fields<'a>, name: &str) -> Result<&'a str, ApiError> {
    f.str(name)?
        .ok_or_else(|| ApiError::invalid(name, format!("'{name}' is required")))
}

/// An optional string field (null is absent).
fn optional_str(f: &Fields, name: &str) -> Result<Option<String>, ApiError> {
    match f.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(type_error(name, "a string")),
    }
}

/// An optional object of strings (`user_metadata`; null is empty).
fn string_map(f: &Fields, name: &str) -> Result<Map<String, Value>, ApiError> {
    match f.get(name) {
        None | Some(Value::Null) => Ok(Map::new()),
        Some(Value::Object(o)) if o.values().all(Value::is_string) => Ok(o.clone()),
        Some(_) => Err(type_error(name, "an object of strings")),
    }
}

/// End the closed sessions `sessions` and their runs, here, in the trainer and in the store.
fn end_runs_of(state: &AppState, sessions: &[String]) {
    let ended = state.tinker_runs.end_sessions(sessions);
    if let Some(t) = state.ready().ok().and_then(|r| r.online.get()) {
        t.end_sessions(sessions.to_vec(), ended);
    }
}

/// `base_model` must be the served model's name (404 naming the field otherwise).
fn check_base(ready: &super::state::Ready, base: &str) -> Result<(), ApiError> {
    if base != ready.model_name {
        return Err(ApiError {
            param: Some("base_model".into()),
            ..ApiError::model_not_found(base)
        });
    }
    Ok(())
}

/// A save's `ttl_seconds` and `user_metadata`: saved weights are kept until their run's state is
/// replaced (no expiry) and carry no metadata, so either set is a 400 naming it.
fn refuse_save_extras(f: &Fields) -> Result<(), ApiError> {
    if f.int("ttl_seconds")?.is_some() {
        return Err(ApiError::invalid(
            "ttl_seconds",
            "'ttl_seconds' is not implemented: saved weights are kept (send null)",
        ));
    }
    if !string_map(f, "user_metadata")?.is_empty() {
        return Err(ApiError::invalid(
            "user_metadata",
            "'user_metadata' on saved weights is not implemented (send null)",
        ));
    }
    Ok(())
}

/// A GET's query: `access_scope` ("owned", the default, or "accessible": the same here, where a
/// key sees only its own), and the integer parameters `ints`; anything else is a 400 naming it.
/// The integers given, by name.
fn check_query(
    query: &std::collections::HashMap<String, String>,
    ints: &[&str],
) -> Result<std::collections::HashMap<String, usize>, ApiError> {
    let mut out = std::collections::HashMap::new();
    for (k, v) in query {
        match (k.as_str(), v.as_str()) {
            ("access_scope", "owned" | "accessible") => {}
            ("access_scope", _) => {
                return Err(ApiError::invalid(
                    "access_scope",
                    "'access_scope' must be \"owned\" or \"accessible\"",
                ))
            }
            (k, v) if ints.contains(&k) => {
                let n = v.parse::<usize>().map_err(|_| {
                    ApiError::invalid(
                        k,
                        format!("'{k}' must be an integer ≥ 0, not '{}'", error::clip(v)),
                    )
                })?;
                out.insert(k.to_string(), n);
            }
            _ => {
                return Err(ApiError::invalid(
                    k,
                    format!("'{k}' is not a parameter of this route"),
                ))
            }
        }
    }
    Ok(out)
}

/// The SHA-256 of a key, hex: what is stored or shown of it (a saved state's owner, a run's).
fn key_hash(key: &str) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
