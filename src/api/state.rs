//! What every handler shares: the loaded model and engine (`Ready`), the settings and limits
//! (`Shared`, behind `AppState`), and the helpers handlers call (the bearer token, key checks,
//! blocking work off the async threads).

use super::error::ApiError;
use crate::adapter::registry::{Pinned, Registry};
use crate::engine::constraint::{GrammarError, GrammarSpec, Grammars};
use crate::engine::EngineHandle;
use crate::metrics::Metrics;
use crate::model::decoder::Decoder;
use crate::model::tokenizer::Tokenizer;
use crate::online::start::{Learning, Online};
use axum::http::header;
use flywheel_kernels::Cpu;
use std::ops::Deref;
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
    pub model: Arc<Decoder>,
    pub cpu: Arc<Cpu>,
    /// The rollout log and trainer: started with the server when it has learning adapters,
    /// else on the first `POST /v1/adapters/{name}/train`.
    pub online: Online,
    pub metrics: Arc<Metrics>,
    /// Constrained decoding's compiler for this vocabulary, built on first use.
    pub grammars: Arc<OnceLock<Result<Arc<Grammars>, GrammarError>>>,
}

impl Ready {
    /// Compile a request's output constraint (off the async threads: building the vocabulary's
    /// trie the first time and compiling a schema take a moment); a 400 naming `field` when the
    /// grammar library rejects it.
    pub async fn compile(
        &self,
        field: String,
        spec: GrammarSpec,
    ) -> Result<super::job::OutputConstraint, ApiError> {
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
                Ok(grammar) => Ok(super::job::OutputConstraint { field, grammar }),
                Err(e) => Err(ApiError::invalid(&field, format!("'{field}': {e}"))),
            }
        })
        .await
    }

    /// The rollout store and the trainer if `name` is a learning adapter.
    pub fn learning(&self, name: &str) -> Option<&Learning> {
        self.online.learning(name)
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
    pub responses: super::response_store::ResponseStore,
    /// The Tinker API's open sessions, training runs and call results.
    pub tinker_sessions: super::tinker::session::Sessions,
    pub tinker_runs: super::tinker::runs::Runs,
    pub tinker_futures: super::tinker::futures::Futures,
    pub tinker_samplers: super::tinker::sample::Samplers,
    /// Set once the sessions and runs kept by an earlier process are back (`tinker::restore`).
    pub tinker_restored: tokio::sync::OnceCell<()>,
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
    /// A reference that does not keep the server alive (held by what the server holds).
    pub fn downgrade(&self) -> std::sync::Weak<Shared> {
        Arc::downgrade(&self.0)
    }

    pub fn upgrade(w: &std::sync::Weak<Shared>) -> Option<AppState> {
        w.upgrade().map(AppState)
    }

    /// The trainer, started now if it was not (which opens, and may migrate, the rollout log:
    /// off the async threads).
    pub async fn start_trainer(&self) -> Result<crate::online::trainer::TrainerHandle, ApiError> {
        let st = self.clone();
        blocking(move || {
            st.ready()?
                .online
                .get_or_start()
                .cloned()
                .map_err(|e| ApiError::unavailable(format!("cannot start the trainer: {e}")))
        })
        .await
    }

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
            responses: super::owned::Owned::new(super::response_store::STORE_CAPACITY),
            tinker_sessions: Default::default(),
            tinker_runs: Default::default(),
            tinker_futures: Default::default(),
            tinker_samplers: Default::default(),
            tinker_restored: Default::default(),
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
        // A Tinker sampler path names its registry adapter.
        let model = model
            .strip_prefix(super::tinker::sample::SCHEME)
            .unwrap_or(model);
        match r.registry.pin(model) {
            Some(p) => Ok((r, Some(p))),
            None => Err(ApiError::model_not_found(model)),
        }
    }
}

/// The caller's key in `headers` ("" when absent): the bearer token (the scheme matched
/// case-insensitively, RFC 7235; the token exactly), else `X-API-Key` (the Tinker SDK's
/// header).
pub fn bearer_of(headers: &axum::http::HeaderMap) -> &str {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim_start_matches(' '))
        .or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()))
        .unwrap_or("")
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
