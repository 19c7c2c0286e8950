//! The HTTP server (axum): routes, shared state, auth and panic middleware, start-up and graceful
//! shutdown. Handlers validate at the edge and talk to the engine only through `EngineHandle`.

pub mod adapters;
mod admission;
pub mod body;
pub mod chat;
pub mod completions;
mod cors;
mod embeddings;
pub mod error;
pub mod feedback;
pub mod generate;
pub mod info;
pub mod job;
pub mod messages;
pub mod openai;
mod reasoning;
mod request;
pub mod respond;
pub mod responses;
pub mod rollout;
pub mod scoring;
pub mod serve;
pub mod structured;
pub mod tool_grammar;
pub mod tools;
pub mod train_policy;
pub mod wire;

pub use serve::run;

use crate::adapter::registry::{Pinned, Registry};
use crate::engine::constraint::{GrammarSpec, Grammars};
use crate::engine::EngineHandle;
use crate::metrics::Metrics;
use crate::model::llama::Llama;
use crate::model::tokenizer::Tokenizer;
use crate::online::config::OnlineConfig;
use crate::online::trainer::{Compute, TrainerHandle};
use axum::extract::{MatchedPath, Request, State};
use axum::http::header;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use error::ApiError;
use flywheel_kernels::Cpu;
use futures_util::FutureExt;
use std::ops::Deref;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// What exists once the model is loaded and the engine runs.
pub struct Ready {
    pub engine: EngineHandle,
    pub tokenizer: Arc<Tokenizer>,
    pub model_name: String,
    pub max_model_len: usize,
    pub vocab_size: usize,
    pub created: u64,
    pub registry: Arc<Registry>,
    /// The model and the compute seam the engine runs on, shared (mmapped weights, one pool) with
    /// whatever else runs forwards beside it.
    pub model: Arc<Llama>,
    pub cpu: Arc<Cpu>,
    /// The rollout log and trainer: started with the server when it has learning adapters,
    /// else on the first `POST /v1/adapters/{name}/train`.
    pub online: OnceLock<TrainerHandle>,
    pub online_cfg: OnlineConfig,
    pub metrics: Arc<Metrics>,
    /// Constrained decoding's compiler for this vocabulary, built on first use.
    pub grammars: Arc<OnceLock<Result<Arc<Grammars>, String>>>,
}

impl Ready {
    /// Compile a request's output constraint (off the async threads: building the vocabulary's
    /// trie the first time and compiling a schema take a moment); a 400 naming `field` when the
    /// grammar library rejects it.
    pub async fn compile(
        &self,
        field: String,
        spec: GrammarSpec,
    ) -> Result<job::OutputConstraint, ApiError> {
        let (cell, tok, vocab) = (
            self.grammars.clone(),
            self.tokenizer.clone(),
            self.vocab_size,
        );
        on_compile_stack(move || {
            let g = cell
                .get_or_init(|| {
                    let t0 = std::time::Instant::now();
                    let g = Grammars::new(tok, vocab).map(Arc::new);
                    tracing::info!(
                        ms = t0.elapsed().as_millis() as u64,
                        ok = g.is_ok(),
                        "constrained decoding: the vocabulary's grammar tables built"
                    );
                    g
                })
                .as_ref()
                .map_err(|e| {
                    ApiError::internal(format!("constrained decoding is unavailable: {e}"))
                })?;
            match g.compile(&spec) {
                Ok(grammar) => Ok(job::OutputConstraint { field, grammar }),
                Err(e) => Err(ApiError::invalid(&field, format!("'{field}': {e}"))),
            }
        })
        .await
    }

    /// The online side, started now if it was not.
    pub fn online_or_start(&self) -> anyhow::Result<&TrainerHandle> {
        if let Some(o) = self.online.get() {
            return Ok(o);
        }
        static START: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _g = START.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(o) = self.online.get() {
            return Ok(o);
        }
        let o = TrainerHandle::start(
            self.online_cfg.clone(),
            &[],
            Compute {
                model: self.model.clone(),
                cpu: self.cpu.clone(),
                registry: self.registry.clone(),
            },
            self.metrics.clone(),
        )?;
        let _ = self.online.set(o);
        Ok(self.online.get().expect("just set"))
    }

    /// The online side if `name` is a learning adapter.
    pub fn learning(&self, name: &str) -> Option<&TrainerHandle> {
        self.online.get().filter(|o| o.is_learning(name))
    }
}

pub struct Shared {
    ready: OnceLock<Ready>,
    pub api_key: Option<String>,
    /// Key of the admin routes (adapters); None: see `admin_open`.
    pub admin_key: Option<String>,
    /// With no admin key: admin routes are open only when the server binds loopback addresses.
    pub admin_open: bool,
    pub metrics: Arc<Metrics>,
    pub retry_after_secs: u64,
    pub limits: Limits,
    /// The Responses API's stored responses (`previous_response_id`).
    pub responses: responses::ResponseStore,
}

/// What a request body may be.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Larger bodies get 413.
    pub max_body_bytes: usize,
    /// A body not received whole in this long gets 408.
    pub body_read_timeout: Duration,
    /// Sequences (prompts × n) one request may hold; more get 400.
    pub max_sequences_per_request: usize,
    /// Web origins whose pages may call (`api::cors`).
    pub allowed_origins: Vec<String>,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_body_bytes: 2 << 20,
            body_read_timeout: Duration::from_secs(30),
            max_sequences_per_request: 256,
            allowed_origins: Vec::new(),
        }
    }
}

#[derive(Clone)]
pub struct AppState(Arc<Shared>);

impl Deref for AppState {
    type Target = Shared;
    fn deref(&self) -> &Shared {
        &self.0
    }
}

impl AppState {
    pub fn new(
        api_key: Option<String>,
        admin_key: Option<String>,
        admin_open: bool,
        metrics: Arc<Metrics>,
        retry_after_secs: u64,
    ) -> AppState {
        AppState(Arc::new(Shared {
            ready: OnceLock::new(),
            api_key,
            admin_key,
            admin_open,
            metrics,
            retry_after_secs,
            limits: Limits::default(),
            responses: Default::default(),
        }))
    }

    /// Set the body limits (before the state is shared).
    pub fn with_limits(mut self, limits: Limits) -> AppState {
        Arc::get_mut(&mut self.0)
            .expect("limits are set before the state is shared")
            .limits = limits;
        self
    }

    /// The loaded model and engine, or 503 while starting.
    pub fn ready(&self) -> Result<&Ready, ApiError> {
        self.ready
            .get()
            .ok_or_else(|| ApiError::unavailable("the server is starting: the model is loading"))
    }

    pub fn set_ready(&self, r: Ready) {
        let _ = self.ready.set(r);
    }

    /// 404 unless `model` is the served base model or an adapter.
    pub fn check_model(&self, model: &str) -> Result<&Ready, ApiError> {
        self.resolve_model(model).map(|(r, _)| r)
    }

    /// The base (None) or the pinned current version of the adapter named `model`; 404 otherwise.
    pub fn resolve_model(&self, model: &str) -> Result<(&Ready, Option<Pinned>), ApiError> {
        let r = self.ready()?;
        if model == r.model_name {
            return Ok((r, None));
        }
        match r.registry.pin(model) {
            Some(p) => Ok((r, Some(p))),
            None => Err(ApiError::model_not_found(model)),
        }
    }
}

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
        .route(
            "/v1/feedback",
            post(feedback::post).get(feedback::get_episode),
        )
        .route("/v1/feedback/{id}", get(feedback::get))
        .route("/v1/train/status", get(feedback::status))
        .route("/v1/train/policy", get(train_policy::get))
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
        .route("/v1/train/{name}/pause", post(feedback::pause))
        .route("/v1/train/{name}/resume", post(feedback::resume))
        .route("/v1/train/policy", axum::routing::put(train_policy::put))
        .route_layer(middleware::from_fn_with_state(state.clone(), admin_auth));
    Router::new()
        .merge(protected)
        .merge(admin)
        .route("/health", get(info::health))
        .route("/metrics", get(info::metrics))
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

/// The bearer token in `headers` ("" when absent). The scheme is matched case-insensitively
/// (RFC 7235), the token exactly.
pub fn bearer_of(headers: &axum::http::HeaderMap) -> &str {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map_or("", |(_, token)| token.trim_start_matches(' '))
}

/// Constant-time comparison of a given key with the configured one.
pub fn key_matches(given: &str, key: &str) -> bool {
    given.len() == key.len()
        && given
            .bytes()
            .zip(key.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

/// Bearer-token check when an API key is configured; the admin key is accepted too.
async fn auth(State(state): State<AppState>, req: Request, next: Next) -> Response {
    if let Some(key) = &state.api_key {
        let given = bearer(&req);
        let admin = state
            .admin_key
            .as_deref()
            .is_some_and(|a| key_matches(given, a));
        if !key_matches(given, key) && !admin {
            return ApiError::unauthorized().into_response();
        }
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

/// Run `f` on a thread of its own with the stack a grammar within `grammar_bounds` may need to
/// compile (the blocking pool's threads have 2 MB).
pub async fn on_compile_stack<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("grammar-compile".into())
        .stack_size(crate::engine::grammar_bounds::COMPILE_STACK)
        .spawn(move || {
            let _ = tx.send(f());
        })
        .map_err(|e| ApiError::internal(format!("cannot start a grammar compile: {e}")))?;
    rx.await
        .map_err(|_| ApiError::internal("a grammar compile failed"))?
}

/// Run `f` on the blocking pool (tokenization, chat templates): keeps the async threads free.
pub async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|_| ApiError::internal("a worker task failed"))?
}
