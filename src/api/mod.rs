//! The HTTP server (axum): routes, shared state, auth and panic middleware, start-up and graceful
//! shutdown. Handlers validate at the edge and talk to the engine only through `EngineHandle`.

pub mod adapters;
pub mod chat;
pub mod completions;
pub mod error;
pub mod info;
pub mod openai;
pub mod respond;

use crate::adapter::registry::{Pinned, Registry};
use crate::config::Config;
use crate::engine::{Engine, EngineConfig, EngineHandle};
use crate::metrics::Metrics;
use crate::model::llama::Llama;
use crate::model::tokenizer::Tokenizer;
use axum::extract::{MatchedPath, Request, State};
use axum::http::header;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use error::ApiError;
use flywheel_kernels::{Cpu, Isa, ThreadPool};
use futures_util::FutureExt;
use std::net::SocketAddr;
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
        }))
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
        .route("/v1/models", get(info::models))
        .route("/tokenize", post(info::tokenize))
        .route("/detokenize", post(info::detokenize))
        .route("/v1/adapters", get(adapters::list))
        .route("/v1/adapters/{name}", get(adapters::show))
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
        .route_layer(middleware::from_fn_with_state(state.clone(), admin_auth));
    Router::new()
        .merge(protected)
        .merge(admin)
        .route("/health", get(info::health))
        .route("/metrics", get(info::metrics))
        .fallback(|| async { ApiError::not_found("no such route") })
        .layer(middleware::from_fn_with_state(state.clone(), guard))
        .with_state(state)
}

/// The bearer token of a request ("" when absent).
fn bearer(req: &Request) -> &str {
    req.headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("")
}

/// Constant-time comparison of a given key with the configured one.
fn key_matches(given: &str, key: &str) -> bool {
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

/// A panicking handler answers 500 instead of dropping the connection; every answer is counted.
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
    state
        .metrics
        .http_requests
        .with_label_values(&[&route, resp.status().as_str()])
        .inc();
    resp
}

/// Run `f` on the blocking pool (tokenization, chat templates): keeps the async threads free.
pub async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|_| ApiError::internal("a worker task failed"))?
}

fn model_name(cfg: &Config) -> String {
    cfg.served_model_name.clone().unwrap_or_else(|| {
        cfg.model_path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into())
    })
}

/// Load the model and start the engine (blocking).
fn load(cfg: &Config, metrics: Arc<Metrics>) -> anyhow::Result<Ready> {
    let path = crate::fetch::ensure_model(&cfg.model_path)?;
    let model = Llama::open(&path)?;
    let tokenizer = Arc::new(Tokenizer::from_gguf(&model.gguf)?);
    let c = &model.config;
    let max_model_len = cfg.max_model_len(c.context_length);
    let num_kv_blocks = cfg.num_kv_blocks(c.num_layers, c.kv_dim(), max_model_len)?;
    let vocab_size = c.vocab_size;
    let cpu = Cpu::new(
        Isa::detect(),
        ThreadPool::new(cfg.threads, Duration::from_micros(100)),
    );
    let ecfg = EngineConfig {
        max_num_seqs: cfg.max_num_seqs,
        max_num_batched_tokens: cfg.max_num_batched_tokens,
        num_kv_blocks,
        block_size: cfg.block_size,
        enable_prefix_caching: cfg.enable_prefix_caching,
        max_pending_requests: cfg.max_pending_requests,
    };
    tracing::info!(
        model = %path.display(),
        layers = c.num_layers,
        max_model_len,
        num_kv_blocks,
        isa = ?cpu.isa,
        threads = cfg.threads,
        "model loaded"
    );
    let name = model_name(cfg);
    let registry = Arc::new(Registry::new(
        c.clone(),
        vec![name.clone()],
        metrics.clone(),
    ));
    for (adapter, dir) in &cfg.adapters {
        let w = crate::adapter::peft::load(dir, c)
            .map_err(|e| anyhow::anyhow!("adapter {adapter} ({}): {e}", dir.display()))?;
        registry
            .publish(adapter, w)
            .map_err(|e| anyhow::anyhow!("adapter {adapter}: {e}"))?;
        tracing::info!(adapter, path = %dir.display(), "adapter loaded");
    }
    let model = Arc::new(model);
    let cpu = Arc::new(cpu);
    let (engine, _join) =
        Engine::start(model.clone(), tokenizer.clone(), cpu.clone(), ecfg, metrics)?;
    Ok(Ready {
        engine,
        tokenizer,
        model_name: name,
        max_model_len,
        vocab_size,
        created: respond::unix_now(),
        registry,
        model,
        cpu,
    })
}

/// `flywheel serve`: bind, say where (`listening on ADDR` on stdout), load the model while
/// answering 503, serve until SIGTERM/SIGINT, then drain for up to the shutdown timeout.
pub fn run(cfg: Config) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cfg.http_threads)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let addr: SocketAddr = tokio::net::lookup_host((cfg.host.as_str(), cfg.port))
            .await?
            .next()
            .ok_or_else(|| anyhow::anyhow!("cannot resolve {}", cfg.host))?;
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let local = listener.local_addr()?;
        println!("listening on {local}");
        tracing::info!(%local, "listening");
        let metrics = Arc::new(Metrics::new());
        let admin_open = cfg.admin_key.is_none() && local.ip().is_loopback();
        if cfg.admin_key.is_none() && !admin_open {
            tracing::warn!("no admin key and a non-loopback address: admin routes are disabled");
        }
        let state = AppState::new(
            cfg.api_key.clone(),
            cfg.admin_key.clone(),
            admin_open,
            metrics.clone(),
            cfg.retry_after_secs,
        );
        let loader = {
            let (state, cfg) = (state.clone(), cfg.clone());
            tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
                state.set_ready(load(&cfg, metrics)?);
                tracing::info!("ready");
                Ok(())
            })
        };
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let app = router(state);
        let server = axum::serve(listener, app).with_graceful_shutdown({
            let mut rx = stop_rx.clone();
            async move {
                let _ = rx.wait_for(|s| *s).await;
            }
        });
        let timeout = Duration::from_secs_f64(cfg.shutdown_timeout_secs);
        let drain_deadline = {
            let mut rx = stop_rx;
            async move {
                let _ = rx.wait_for(|s| *s).await;
                tokio::time::sleep(timeout).await;
            }
        };
        tokio::spawn(async move {
            shutdown_signal().await;
            tracing::info!("shutting down: no new connections; draining");
            let _ = stop_tx.send(true);
        });
        let load_failed = async {
            match loader.await {
                Ok(Ok(())) => std::future::pending::<anyhow::Error>().await,
                Ok(Err(e)) => e,
                Err(e) => anyhow::anyhow!("model loading panicked: {e}"),
            }
        };
        tokio::select! {
            r = server => r?,
            _ = drain_deadline => tracing::warn!("shutdown timeout reached with requests still running"),
            e = load_failed => return Err(e),
        }
        tracing::info!("stopped");
        Ok(())
    })
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
