//! `flywheel serve`'s connection loop: bind, load the model while answering 503, accept at most
//! `max_connections` connections at once (more wait in the listen backlog), close a connection
//! whose request head does not arrive within `header_read_timeout_secs` (slow-loris clients),
//! and on SIGTERM/SIGINT stop accepting and drain for up to the shutdown timeout.

use super::router;
use super::state::{AppState, Limits, Ready};
use crate::config::Config;
use crate::metrics::Metrics;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;

/// `flywheel serve`: bind, say where (`listening on ADDR` on stdout), load the model while
/// answering 503, serve until SIGTERM/SIGINT, then drain for up to the shutdown timeout.
/// `build` makes what the server runs on (the composition root's `app::serving`).
pub fn run(
    cfg: Config,
    build: fn(&Config, Arc<Metrics>) -> anyhow::Result<Ready>,
) -> anyhow::Result<()> {
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
        )
        .with_limits(Limits {
            max_body_bytes: cfg.max_body_bytes,
            body_read_timeout: Duration::from_secs_f64(cfg.body_read_timeout_secs),
            max_sequences_per_request: cfg.max_sequences_per_request,
            allowed_origins: cfg.allowed_origins.clone(),
        });
        let loader = {
            let (state, cfg) = (state.clone(), cfg.clone());
            tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
                state.set_ready(build(&cfg, metrics)?);
                // Learning adapters' evaluation sets run through this server's chat path.
                let runner =
                    super::eval::EvalRunner::new(&state, tokio::runtime::Handle::current());
                if let Ok(r) = state.ready() {
                    r.online.set_evaluator(Arc::new(runner));
                }
                tracing::info!("ready");
                Ok(())
            })
        };
        tokio::spawn(super::sessions::sweeper(state.clone()));
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
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
        let graceful = GracefulShutdown::new();
        let accept = accept_loop(listener, router(state.clone()), &cfg, &graceful, stop_rx);
        tokio::select! {
            r = accept => r?,
            e = load_failed => return Err(e),
        }
        let timeout = Duration::from_secs_f64(cfg.shutdown_timeout_secs);
        let t0 = std::time::Instant::now();
        tokio::select! {
            _ = graceful.shutdown() => {},
            _ = tokio::time::sleep(timeout) => {
                tracing::warn!("shutdown timeout reached with requests still running")
            }
        }
        // Then the trainer: its step in progress finishes within what is left of the timeout.
        if let Some(online) = state.ready().ok().and_then(|r| r.online.get()) {
            online.stop(timeout.saturating_sub(t0.elapsed())).await;
        }
        tracing::info!("stopped");
        Ok(())
    })
}

/// Accept connections (at most `max_connections` open) until the stop signal.
async fn accept_loop(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    cfg: &Config,
    graceful: &GracefulShutdown,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let slots = Arc::new(Semaphore::new(cfg.max_connections));
    let header_timeout = Duration::from_secs_f64(cfg.header_read_timeout_secs);
    loop {
        let permit = tokio::select! {
            p = slots.clone().acquire_owned() => p?,
            _ = stop.wait_for(|s| *s) => return Ok(()),
        };
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    // Out of descriptors and the like: wait instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = stop.wait_for(|s| *s) => return Ok(()),
        };
        let _ = stream.set_nodelay(true);
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(header_timeout)
            .serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _ = conn.await;
            drop(permit);
        });
    }
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
