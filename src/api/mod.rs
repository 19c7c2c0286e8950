//! The HTTP server (axum): the routes, and the auth and panic middleware around them; what the
//! handlers share is in `state`, start-up and graceful shutdown in `serve`. Handlers validate at
//! the edge and talk to the engine only through `EngineHandle`.

pub mod adapters;
mod admission;
pub mod body;
pub mod chat;
pub mod completions;
mod cors;
mod dashboard;
mod embeddings;
pub mod error;
mod eval;
pub mod feedback;
pub mod generate;
mod generation;
pub mod info;
pub mod job;
pub mod messages;
pub mod openai;
mod owned;
mod reasoning;
mod request;
pub mod respond;
mod response_store;
pub mod responses;
pub mod rollout;
pub mod scoring;
pub mod serve;
pub mod sessions;
pub mod state;
pub mod structured;
pub mod tinker;
pub mod tools;
pub mod train_policy;
pub mod wire;

pub use serve::run;
use state::{bearer_of, key_matches};
pub use state::{AppState, Limits, Ready, Shared};

use axum::extract::{MatchedPath, Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use error::ApiError;
use futures_util::FutureExt;
use std::panic::AssertUnwindSafe;

pub fn router(state: AppState) -> Router {
    let protected = Router::new()
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/responses", post(responses::create))
        .route("/v1/embeddings", post(embeddings::embeddings))
        .route("/v1/responses/{id}", get(responses::get))
        .route("/inference/v1/generate", post(generate::generate))
        .route("/v1/models", get(info::models))
        .route("/v1/models/{*id}", get(info::model))
        .route("/tokenizer_info", get(info::tokenizer_info))
        .route("/tokenize", post(info::tokenize))
        .route("/detokenize", post(info::detokenize))
        .route("/v1/adapters", get(adapters::list))
        .route("/v1/adapters/{name}", get(adapters::show))
        .route("/v1/adapters/{name}/versions", get(dashboard::versions))
        .route(
            "/v1/feedback",
            post(feedback::post).get(feedback::get_episode),
        )
        .route("/v1/feedback/{id}", get(feedback::get))
        .route("/v1/train/status", get(feedback::status))
        .route("/v1/train/{name}/history", get(dashboard::history))
        .route("/v1/train/policy", get(train_policy::get))
        .route("/v1/sessions", post(sessions::create))
        .route(
            "/v1/sessions/{id}",
            get(sessions::get).delete(sessions::delete),
        )
        .route("/v1/sessions/{id}/reward", post(sessions::reward))
        .merge(tinker::routes(&state))
        .route_layer(middleware::from_fn_with_state(state.clone(), auth));
    let admin = Router::new()
        .route("/v1/adapters", post(adapters::create))
        .route(
            "/v1/adapters/{name}",
            axum::routing::delete(adapters::delete),
        )
        .route("/v1/adapters/{name}/export", post(adapters::export))
        .route("/v1/load_lora_adapter", post(adapters::load_lora))
        .route("/v1/unload_lora_adapter", post(adapters::unload_lora))
        .route("/v1/adapters/{name}/train", post(feedback::train))
        .route("/v1/adapters/{name}/rollback", post(feedback::rollback))
        .route("/v1/adapters/{name}/pin", post(feedback::pin))
        .route("/v1/train/{name}/pause", post(feedback::pause))
        .route("/v1/train/{name}/resume", post(feedback::resume))
        .route("/v1/train/policy", axum::routing::put(train_policy::put))
        .route_layer(middleware::from_fn_with_state(state.clone(), admin_auth));
    Router::new()
        .merge(protected)
        .merge(admin)
        .route("/health", get(info::health))
        .route("/metrics", get(info::metrics))
        .route("/dashboard", get(dashboard::page))
        .fallback(|| async { ApiError::not_found("no such route") })
        .method_not_allowed_fallback(|| async {
            ApiError::status(
                axum::http::StatusCode::METHOD_NOT_ALLOWED,
                "this route does not take this method",
            )
        })
        .layer(middleware::from_fn_with_state(state.clone(), guard))
        .layer(middleware::from_fn_with_state(state.clone(), cors::cors))
        .with_state(state)
}

/// The bearer token of a request ("" when absent).
fn bearer(req: &Request) -> &str {
    bearer_of(req.headers())
}

/// Bearer-token check when an API key is configured; the admin key is accepted too, and an agent
/// session's key (checked against the store whether or not an API key is set). A request that
/// is a session's turn (its key, or the session header) carries the `SessionTurn`.
async fn auth(State(state): State<AppState>, mut req: Request, next: Next) -> Response {
    let by_session_key = sessions::is_session_key(bearer(&req));
    if let (Some(key), false) = (&state.api_key, by_session_key) {
        let given = bearer(&req);
        let admin = state
            .admin_key
            .as_deref()
            .is_some_and(|a| key_matches(given, a));
        if !key_matches(given, key) && !admin {
            return ApiError::unauthorized().into_response();
        }
    }
    match sessions::turn_of(&state, req.headers()).await {
        Ok(Some(turn)) => {
            req.extensions_mut().insert(turn);
        }
        Ok(None) => {}
        Err(e) => return e.into_response(),
    }
    next.run(req).await
}

/// Admin routes: the admin key when one is set; without one, open (under the API key, if any)
/// only on a server bound to loopback, refused otherwise.
async fn admin_auth(State(state): State<AppState>, req: Request, next: Next) -> Response {
    match &state.admin_key {
        Some(key) => {
            if !key_matches(bearer(&req), key) {
                return ApiError::unauthorized().into_response();
            }
        }
        None if !state.admin_open => {
            return ApiError::forbidden(
                "admin_disabled",
                "admin routes are disabled: this server binds a non-loopback address and has no \
                 admin key (set --admin-key or server.admin_key)",
            )
            .into_response()
        }
        None => {
            if let Some(key) = &state.api_key {
                if !key_matches(bearer(&req), key) {
                    return ApiError::unauthorized().into_response();
                }
            }
        }
    }
    next.run(req).await
}

/// A panicking handler answers 500 instead of dropping the connection; every answer of the API
/// is counted. Probes are not: `/health` answers 503 while the model loads (readiness), which
/// would read as server errors no client saw.
async fn guard(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "other".into());
    let resp = match AssertUnwindSafe(next.run(req)).catch_unwind().await {
        Ok(r) => r,
        Err(_) => ApiError::internal("the request handler failed").into_response(),
    };
    if !matches!(route.as_str(), "/health" | "/metrics") {
        state
            .metrics
            .http_requests
            .with_label_values(&[&route, resp.status().as_str()])
            .inc();
    }
    resp
}
