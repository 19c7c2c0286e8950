//! Thinking Machines' Tinker training API (`/api/v1/...`) as its official SDK (`tinker` 0.38)
//! calls it. This part serves what every client does before it trains or samples: it reads the
//! server's feature flags (`client/config`), opens a session and keeps it alive with heartbeats,
//! and lists the models it can train and sample (`get_server_capabilities`). Training runs,
//! futures, `forward_backward` (protobuf) and sampling are the next parts; `docs/tinker.md` holds
//! the protocol as read from the SDK. The caller's key travels in `X-API-Key` (the SDK's header),
//! checked like a bearer key.

pub mod session;

use super::body::JsonBody;
use super::error::ApiError;
use super::state::AppState;
use axum::extract::State;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

/// The routes (under the API key, like the OpenAI ones).
pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/api/v1/healthz", get(healthz))
        .route("/api/v1/client/config", post(client_config))
        .route("/api/v1/get_server_capabilities", get(capabilities))
        .route("/api/v1/create_session", post(session::create))
        .route("/api/v1/session_heartbeat", post(session::heartbeat))
        .route("/api/v1/sessions/{id}", get(session::get))
        .route("/api/v1/telemetry", post(telemetry))
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
/// `forward_backward` bodies uncompressed; custom losses run in the client; samples polled one
/// future at a time. (Flags the SDK does not know are ignored by it; those it knows and we do
/// not set keep its defaults.)
async fn client_config(
    State(state): State<AppState>,
    JsonBody(body): JsonBody,
) -> Result<Json<Value>, ApiError> {
    state.ready()?;
    let f = super::openai::Fields::parse(&body)?;
    f.str("sdk_version")?;
    Ok(Json(json!({
        "pjwt_auth_enabled": false,
        "credential_default_source": "api_key",
        "proto_compress_fwdbwd": false,
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
        // Not yet through this API: training runs (`create_model`) and sampling sessions
        // (`asample`) are its next parts (docs/tinker.md).
        "trainable": false,
        "sampleable": false,
    }]})))
}

/// `POST /api/v1/telemetry`: the SDK's own diagnostics (`{events: [{event, severity, ...}],
/// session_id, platform, sdk_version, process_uuid}`: session start and end, exceptions in the
/// client). Meant for Thinking Machines; here each event goes to the server's log (debug, error
/// events at warn) and is otherwise dropped: `{"status": "accepted"}`.
async fn telemetry(JsonBody(body): JsonBody) -> Result<Json<Value>, ApiError> {
    let f = super::openai::Fields::parse(&body)?;
    let events = f
        .get("events")
        .and_then(Value::as_array)
        .ok_or_else(|| super::openai::type_error("events", "a list of events"))?;
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
