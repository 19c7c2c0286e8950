//! Bringing back, after a start, the sessions and training runs an earlier process kept
//! (`online::runs::kept`): at the first Tinker call (once the caller's key is checked), before
//! any handler reads a session or a run, the trainer is started, loads each run's newest state,
//! and the sessions and runs are put back in memory as they were made, each session heard from
//! now. A server that does not train (`--role serve`) keeps nothing to bring back.

use super::super::error::ApiError;
use super::super::state::AppState;
use super::runs::{Run, RunInfo};
use super::session::Session;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

/// Route layer of the Tinker routes: bring back what was kept, then answer.
pub async fn restore_first(State(state): State<AppState>, req: Request, next: Next) -> Response {
    if let Err(e) = restored(&state).await {
        return e.into_response();
    }
    next.run(req).await
}

/// Bring back the kept sessions and runs, once (a failure is tried again at the next call).
async fn restored(state: &AppState) -> Result<(), ApiError> {
    // Not ready: the handler answers that itself.
    let Ok(ready) = state.ready() else {
        return Ok(());
    };
    if !ready.online.cfg().role.trains() {
        return Ok(());
    }
    state
        .tinker_restored
        .get_or_try_init(|| bring_back(state))
        .await
        .map(|_| ())
}

async fn bring_back(state: &AppState) -> Result<(), ApiError> {
    let trainer = state.start_trainer().await?;
    let kept = trainer.restore_runs().await.map_err(|e| {
        ApiError::unavailable(format!("cannot bring back the training runs kept: {e}"))
    })?;
    let now = crate::util::now_secs();
    let mut sessions = Vec::new();
    for s in kept.sessions {
        let Ok(mut session) = serde_json::from_str::<Session>(&s.info) else {
            tracing::error!(session = %s.id, "a kept session's record is unreadable: left out");
            continue;
        };
        session.last_heartbeat = now;
        state
            .tinker_sessions
            .restore(s.id.clone(), &s.owner, session);
        sessions.push(s.id);
    }
    let mut runs = 0;
    for (r, num_params) in kept.runs {
        let info = serde_json::from_str::<RunInfo>(&r.info);
        let (Ok(info), true) = (info, sessions.contains(&r.session)) else {
            tracing::error!(run = %r.id, "a kept run's record or session is unreadable: left out");
            continue;
        };
        let run = Run::new(r.owner, info, num_params);
        match state.tinker_runs.add(&r.id, run, usize::MAX) {
            Ok(()) => runs += 1,
            Err(e) => tracing::error!(run = %r.id, "a kept run cannot come back: {}", e.message),
        }
    }
    if !sessions.is_empty() {
        tracing::info!(
            sessions = sessions.len(),
            runs,
            "the Tinker sessions and training runs kept were brought back"
        );
    }
    Ok(())
}
