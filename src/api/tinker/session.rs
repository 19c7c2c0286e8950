//! Tinker sessions: `create_session` opens one for the caller's key, keeping what the SDK says
//! of it (tags, metadata, SDK version, project, display name); `session_heartbeat` (every 10 s
//! from the SDK) keeps it alive. Held in memory: the newest `MAX_SESSIONS`, each seen only with
//! the key that opened it (by its hash); one not heard from in `SESSION_TIMEOUT_SECS` is closed,
//! and its training runs with it (the SDK warns its user after two minutes without a heartbeat).
//! Where runs are trained, a session is also kept in the rollout store (`online::runs::kept`):
//! a restart brings it back, heard from at the restart.

use super::super::body::JsonBody;
use super::super::error::ApiError;
use super::super::openai::{type_error, Fields};
use super::super::owned::Owned;
use super::super::state::{bearer_of, blocking, AppState};
use super::{check_type, key_hash, optional_str, required_str, string_map};
use crate::online::store::records::SessionRecord;
use crate::util::{now_secs, random_id};
use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::Json;
use serde_json::{json, Map, Value};
use std::collections::HashMap;

/// Sessions kept at most (the oldest are forgotten).
pub const MAX_SESSIONS: usize = 4096;

/// A session silent this long is closed.
pub const SESSION_TIMEOUT_SECS: f64 = 300.0;

/// One session as its client described it.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Session {
    pub tags: Vec<String>,
    pub user_metadata: Map<String, Value>,
    pub sdk_version: String,
    pub project_id: Option<String>,
    pub display_name: Option<String>,
    pub created_at: f64,
    pub last_heartbeat: f64,
}

/// The open sessions, per key hash (`api::owned`).
pub struct Sessions(Owned<Session>);

impl Default for Sessions {
    fn default() -> Sessions {
        Sessions(Owned::new(MAX_SESSIONS))
    }
}

impl Sessions {
    /// Open session `s` for `key`: its id, and those of the sessions closed to make room.
    fn open(&self, key: &str, s: Session) -> (String, Vec<String>) {
        let id = random_id("session-");
        let closed = self.0.put(id.clone(), &key_hash(key), s);
        (id, closed)
    }

    /// Bring back session `id` of the key hashed `owner`: those closed to make room.
    pub(super) fn restore(&self, id: String, owner: &str, s: Session) -> Vec<String> {
        self.0.put(id, owner, s)
    }

    /// Close the sessions silent since before `now - SESSION_TIMEOUT_SECS`: their ids.
    pub fn expire(&self, now: f64) -> Vec<String> {
        self.0
            .forget(|s| s.last_heartbeat < now - SESSION_TIMEOUT_SECS)
    }

    /// Note a heartbeat of session `id` from `key`; false when `key` has no such session.
    fn beat(&self, id: &str, key: &str) -> bool {
        self.0
            .update(id, &key_hash(key), |s| s.last_heartbeat = now_secs())
    }

    /// Session `id` as `key` may see it.
    pub fn get(&self, id: &str, key: &str) -> Option<Session> {
        self.0.get(id, &key_hash(key))
    }
}

/// `POST /api/v1/create_session`: `{tags, user_metadata, sdk_version, project_id?,
/// display_name?}` -> `{"type": "create_session", "session_id"}`.
pub async fn create(
    State(state): State<AppState>,
    headers: HeaderMap,
    JsonBody(body): JsonBody,
) -> Result<Json<Value>, ApiError> {
    state.ready()?;
    let f = Fields::parse(&body)?;
    check_type(&f, "create_session")?;
    let tags = match f.get("tags") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|t| t.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| type_error("tags", "a list of strings"))?,
        Some(_) => return Err(type_error("tags", "a list of strings")),
    };
    let user_metadata = string_map(&f, "user_metadata")?;
    let now = now_secs();
    close_silent(&state, now);
    let key = bearer_of(&headers);
    let session = Session {
        tags,
        user_metadata,
        sdk_version: optional_str(&f, "sdk_version")?.unwrap_or_default(),
        project_id: optional_str(&f, "project_id")?,
        display_name: optional_str(&f, "display_name")?,
        created_at: now,
        last_heartbeat: now,
    };
    let (id, closed) = state.tinker_sessions.open(key, session.clone());
    super::end_runs_of(&state, &closed);
    if let Err(e) = keep(&state, &id, key, &session).await {
        super::end_runs_of(&state, std::slice::from_ref(&id));
        return Err(e);
    }
    Ok(Json(json!({"type": "create_session", "session_id": id})))
}

/// Keep session `id` in the rollout store where runs are trained (a serving replica keeps its
/// sessions in memory: they hold no runs).
async fn keep(state: &AppState, id: &str, key: &str, s: &Session) -> Result<(), ApiError> {
    if !state.ready()?.online.cfg().role.trains() {
        return Ok(());
    }
    let trainer = state.start_trainer().await?;
    let rec = SessionRecord {
        id: id.to_string(),
        owner: key_hash(key),
        info: serde_json::to_string(s).unwrap_or_default(),
        created: s.created_at,
    };
    blocking(move || {
        trainer
            .store()
            .put_session(&rec)
            .map_err(|e| ApiError::unavailable(format!("cannot keep the session: {e}")))
    })
    .await
}

/// `POST /api/v1/session_heartbeat`: `{session_id}`; 404 for a session this key did not open
/// (or one forgotten).
pub async fn heartbeat(
    State(state): State<AppState>,
    headers: HeaderMap,
    JsonBody(body): JsonBody,
) -> Result<Json<Value>, ApiError> {
    let f = Fields::parse(&body)?;
    check_type(&f, "session_heartbeat")?;
    let id = required_str(&f, "session_id")?;
    if !state.tinker_sessions.beat(id, bearer_of(&headers)) {
        return Err(not_found(id));
    }
    Ok(Json(json!({"type": "session_heartbeat"})))
}

/// `GET /api/v1/sessions/{id}` (`access_scope`: "owned", the default, or "accessible": the same
/// here, where a key sees only its own): `{training_run_ids, sampler_ids, user_metadata,
/// display_name}` as the SDK reads it, and when the session was opened and last heard from
/// (`created_at`, `last_heartbeat_at`, Unix seconds).
pub async fn get(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<Value>, ApiError> {
    super::check_query(&query, &[])?;
    let key = bearer_of(&headers);
    let s = state
        .tinker_sessions
        .get(&id, key)
        .ok_or_else(|| not_found(&id))?;
    Ok(Json(json!({
        "training_run_ids": state.tinker_runs.of_session(&id, key),
        "sampler_ids": [],
        "user_metadata": s.user_metadata,
        "display_name": s.display_name,
        "created_at": s.created_at,
        "last_heartbeat_at": s.last_heartbeat,
    })))
}

/// Close the sessions silent too long, and end their training runs.
pub(super) fn close_silent(state: &AppState, now: f64) {
    let closed = state.tinker_sessions.expire(now);
    super::end_runs_of(state, &closed);
}

/// Session `id` must be open for `key` (404 otherwise).
pub(super) fn require(state: &AppState, id: &str, key: &str) -> Result<(), ApiError> {
    match state.tinker_sessions.get(id, key) {
        Some(_) => Ok(()),
        None => Err(not_found(id)),
    }
}

pub(super) fn not_found(id: &str) -> ApiError {
    ApiError {
        code: Some("session_not_found"),
        ..ApiError::not_found(format!("no session '{}'", super::super::error::clip(id)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session(at: f64) -> Session {
        Session {
            tags: Vec::new(),
            user_metadata: Map::new(),
            sdk_version: String::new(),
            project_id: None,
            display_name: None,
            created_at: at,
            last_heartbeat: at,
        }
    }

    /// A session silent for longer than the timeout is closed; one that beat is kept; a session
    /// is its key's alone.
    #[test]
    fn silent_sessions_close_and_sessions_belong_to_their_key() {
        let s = Sessions::default();
        let now = now_secs();
        let (old, _) = s.open("a", session(now - SESSION_TIMEOUT_SECS - 1.0));
        let (beating, _) = s.open("a", session(now - SESSION_TIMEOUT_SECS - 1.0));
        assert!(s.beat(&beating, "a"));
        assert!(!s.beat(&beating, "b"));
        assert!(s.get(&beating, "b").is_none());
        assert_eq!(s.expire(now), vec![old.clone()]);
        assert!(s.get(&old, "a").is_none());
        assert!(s.get(&beating, "a").is_some());
        assert!(s.expire(now).is_empty());
    }
}
