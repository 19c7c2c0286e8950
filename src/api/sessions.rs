//! Agent sessions over HTTP (`online::sessions`): `POST /v1/sessions` returns a session id and a
//! session key; every generating call made with that key (or with the caller's own key and the
//! `X-Flywheel-Session` header naming the session) is a turn of the session's episode, with no
//! field of ours in the body; `POST /v1/sessions/{id}/reward` ends it with a reward, `DELETE`
//! without one; an idle session ends by its timeout (`sweep`).

use super::body::JsonBody;
use super::error::{clip, ApiError, Rewarded};
use super::feedback::reward_value;
use super::openai::Fields;
use super::state::{bearer_of, blocking, AppState};
use crate::online::sessions::{
    self, AgentSession, SessionReward, SessionState, SessionView, DEFAULT_GROUP, ID_PREFIX,
    KEY_PREFIX,
};
use crate::online::start::Learning;
use crate::online::store::{RolloutStore, SessionLookup};
use crate::util::{now_secs, random_id};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use std::sync::Arc;

/// The header naming a session, for clients that cannot change their key.
pub const HEADER: &str = "x-flywheel-session";

/// Idle timeout when a session sets none (seconds).
const DEFAULT_IDLE_SECS: f64 = 600.0;

/// The session a generating request is a turn of (a request extension set by the auth layer).
#[derive(Clone, Debug)]
pub struct SessionTurn {
    pub id: String,
    /// The owner's key hash: the session's group is scoped to it.
    pub owner: String,
    pub adapter: String,
    pub group: String,
    /// Its turns logged so far, and how many it may have.
    pub turns: u32,
    pub max_turns: Option<u32>,
}

impl SessionTurn {
    /// 409 when the session has had its `max_turns` (checked where a turn is made, not on the
    /// other routes its key reaches).
    pub fn check_turns(&self) -> Result<(), ApiError> {
        match self.max_turns.filter(|&m| self.turns >= m) {
            Some(max) => Err(ApiError {
                code: Some("session_max_turns"),
                ..ApiError::conflict(
                    HEADER,
                    format!(
                        "session '{}' has had its {max} turns (max_turns); reward it",
                        self.id
                    ),
                )
            }),
            None => Ok(()),
        }
    }
    /// What the turn is logged under in place of a key.
    pub fn principal(&self) -> String {
        sessions::principal(&self.id)
    }
}

/// The rollout store, once learning runs.
fn store(state: &AppState) -> Option<Arc<dyn RolloutStore>> {
    let ready = state.ready().ok()?;
    ready.online.started().map(|l| l.store.clone())
}

fn session_not_found(id: &str) -> ApiError {
    ApiError {
        code: Some("session_not_found"),
        ..ApiError::not_found(format!("no session '{}' of this key", clip(id)))
    }
}

fn unauthorized(message: &str) -> ApiError {
    ApiError {
        message: message.to_string(),
        ..ApiError::unauthorized()
    }
}

/// Whether `bearer` is a session key (then it is checked here, not against the API key).
pub fn is_session_key(bearer: &str) -> bool {
    bearer.starts_with(KEY_PREFIX)
}

/// The turn a request with `headers` is: by its session key, or by the header naming a session of
/// the caller's key (checked by the caller already). Ok(None): not a session's turn.
pub async fn turn_of(
    state: &AppState,
    headers: &HeaderMap,
) -> Result<Option<SessionTurn>, ApiError> {
    let bearer = bearer_of(headers).to_string();
    let named = headers
        .get(HEADER)
        .map(|v| v.to_str().unwrap_or("").to_string());
    if !is_session_key(&bearer) && named.is_none() {
        return Ok(None);
    }
    let Some(log) = store(state) else {
        return Err(match named {
            Some(id) => session_not_found(&id),
            None => unauthorized("no such session key (no adapter learns on this server)"),
        });
    };
    let by_key = is_session_key(&bearer);
    let (log2, b2, n2) = (log.clone(), bearer.clone(), named.clone());
    let view = blocking(move || {
        let v = if by_key {
            log2.agent_session(SessionLookup::KeyHash(&log2.key_hash(&b2)))
        } else {
            log2.agent_session(SessionLookup::Id(n2.as_deref().unwrap_or("")))
        };
        v.map_err(ApiError::from)
    })
    .await?;
    let v = match (view, by_key) {
        (Some(v), true) => v,
        (Some(v), false) if v.session.owner == log.key_hash(&bearer) => v,
        (None, true) => return Err(unauthorized("no such session key")),
        (_, false) => return Err(session_not_found(named.as_deref().unwrap_or(""))),
    };
    if let Some(other) = named.filter(|n| by_key && *n != v.session.id) {
        return Err(ApiError::invalid(
            HEADER,
            format!(
                "the session key is session '{}'s; the header names '{}'",
                v.session.id,
                clip(&other)
            ),
        ));
    }
    let s = &v.session;
    if s.state != SessionState::Open {
        return Err(ApiError {
            code: Some("session_ended"),
            ..ApiError::conflict(
                HEADER,
                format!("session '{}' has ended ({})", s.id, s.state.as_str()),
            )
        });
    }
    Ok(Some(SessionTurn {
        id: s.id.clone(),
        owner: s.owner.clone(),
        adapter: s.adapter.clone(),
        group: s.group.clone(),
        turns: v.turns,
        max_turns: s.max_turns,
    }))
}

/// The session key's owner, or 403 for a session key (a session's agent does not reward or end
/// its own session: its owner does).
fn owner_key(headers: &HeaderMap) -> Result<String, ApiError> {
    let key = bearer_of(headers);
    if is_session_key(key) {
        return Err(ApiError::forbidden(
            "session_key",
            "a session key makes turns; its owner's key creates, reads, rewards and ends sessions",
        ));
    }
    Ok(key.to_string())
}

/// `POST /v1/sessions`: `{"adapter"?, "group"?, "gamma"?, "max_turns"?, "idle_timeout"?,
/// "idle_reward"?}` → the session's id and key (shown once).
pub async fn create(
    State(state): State<AppState>,
    headers: HeaderMap,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let ready = state.ready()?;
    let key = owner_key(&headers)?;
    let o = body
        .as_object()
        .ok_or_else(|| ApiError::bad_body("the body is a JSON object"))?;
    const KNOWN: [&str; 6] = [
        "adapter",
        "group",
        "gamma",
        "max_turns",
        "idle_timeout",
        "idle_reward",
    ];
    if let Some(k) = o.keys().find(|k| !KNOWN.contains(&k.as_str())) {
        return Err(ApiError::invalid(
            k,
            format!(
                "unknown field '{}'; sessions take {}",
                clip(k),
                KNOWN.join(", ")
            ),
        ));
    }
    let f = Fields(o);
    let learning: Vec<String> = ready
        .online
        .get()
        .map(|t| t.status().into_keys().collect())
        .unwrap_or_default();
    let adapter = match f.str("adapter")? {
        Some(a) if learning.iter().any(|l| l == a) => a.to_string(),
        Some(a) => {
            return Err(ApiError::invalid(
                "adapter",
                format!("'{}' is not a learning adapter", clip(a)),
            ))
        }
        None if learning.len() == 1 => learning[0].clone(),
        None => {
            return Err(ApiError::invalid(
                "adapter",
                format!(
                    "name the learning adapter the session's turns run on (learning: {})",
                    if learning.is_empty() {
                        "none".to_string()
                    } else {
                        learning.join(", ")
                    }
                ),
            ))
        }
    };
    let group = match f.str("group")? {
        Some(g) if !g.is_empty() && g.len() <= 256 => g.to_string(),
        Some(_) => {
            return Err(ApiError::invalid(
                "group",
                "'group' must have 1 to 256 characters",
            ))
        }
        None => DEFAULT_GROUP.to_string(),
    };
    let gamma = f.f64_in("gamma", 0.0, 1.0, false)?.unwrap_or(1.0);
    let max_turns = f.int_in("max_turns", 1, 100_000)?.map(|t| t as u32);
    let idle_secs = f
        .f64_in("idle_timeout", 1.0, 7.0 * 86400.0, false)?
        .unwrap_or(DEFAULT_IDLE_SECS);
    let cfg = ready.online.cfg();
    let idle_reward = f.f64_in("idle_reward", cfg.reward_min, cfg.reward_max, false)?;
    let Some(Learning { store: log, .. }) = ready.online.started() else {
        return Err(ApiError::unavailable("the trainer is not running"));
    };
    let id = random_id(ID_PREFIX);
    let session_key = random_id(KEY_PREFIX);
    let s = AgentSession {
        id: id.clone(),
        key_hash: log.key_hash(&session_key),
        owner: log.key_hash(&key),
        adapter,
        group,
        gamma,
        max_turns,
        idle_secs,
        idle_reward,
        created: now_secs(),
        state: SessionState::Open,
        returns: None,
        episode: crate::online::store::records::episode_key(
            &log.key_hash(&sessions::principal(&id)),
            &id,
        ),
    };
    let (log, rec) = (log.clone(), s.clone());
    blocking(move || log.put_agent_session(&rec).map_err(ApiError::from)).await?;
    let mut v = shown(&SessionView {
        session: s,
        turns: 0,
        last_active: 0.0,
    });
    v["key"] = json!(session_key);
    Ok((StatusCode::CREATED, Json(v)).into_response())
}

/// A session as the routes show it.
fn shown(v: &SessionView) -> Value {
    let s = &v.session;
    json!({
        "id": s.id, "object": "session", "adapter": s.adapter, "group": s.group,
        "gamma": s.gamma, "max_turns": s.max_turns, "idle_timeout": s.idle_secs,
        "idle_reward": s.idle_reward, "created": s.created, "state": s.state.as_str(),
        "turns": v.turns, "returns": s.returns,
    })
}

/// Session `id` of the caller (404 for another key's).
async fn own(state: &AppState, headers: &HeaderMap, id: &str) -> Result<SessionView, ApiError> {
    let key = owner_key(headers)?;
    let log = store(state).ok_or_else(|| session_not_found(id))?;
    let admin = super::feedback::is_admin(state, headers);
    let (log2, id2) = (log.clone(), id.to_string());
    let v = blocking(move || {
        log2.agent_session(SessionLookup::Id(&id2))
            .map_err(ApiError::from)
    })
    .await?;
    v.filter(|v| admin || v.session.owner == log.key_hash(&key))
        .ok_or_else(|| session_not_found(id))
}

/// `GET /v1/sessions/{id}`: the session, its returns once rewarded, and each turn's completion
/// as the feedback routes show it (reward, trained step, or why dropped).
pub async fn get(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let v = own(&state, &headers, &id).await?;
    let log = store(&state).ok_or_else(|| session_not_found(&id))?;
    let (turns, _) = blocking(move || {
        log.episode_feedback(&id, &sessions::principal(&id))
            .map_err(ApiError::from)
    })
    .await?;
    let mut out = shown(&v);
    out["completions"] = turns
        .into_iter()
        .map(|(id, c)| {
            let mut t = json!(c);
            t["id"] = json!(id);
            t
        })
        .collect();
    Ok(Json(out))
}

/// `POST /v1/sessions/{id}/reward`: `{"reward": R}` (the last turn's; every turn's return is
/// γ^(T−t)·R) or `{"rewards": [r_1, …, r_T]}` (one per turn; returns G_t = Σ γ^(k−t) r_k).
/// Ends the session; 202 when new, 200 when it repeats the recorded reward.
pub async fn reward(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let ready = state.ready()?;
    let v = own(&state, &headers, &id).await?;
    let cfg = ready.online.cfg();
    let (lo, hi) = (cfg.reward_min, cfg.reward_max);
    let o = body
        .as_object()
        .ok_or_else(|| ApiError::bad_body("the body is a JSON object"))?;
    let in_range = |x: &Value, param: &str| reward_value(x, param, lo, hi);
    let reward = match (o.get("reward"), o.get("rewards")) {
        (Some(r), None) => SessionReward::Final(in_range(r, "reward")?),
        (None, Some(Value::Array(a))) => SessionReward::PerTurn(
            a.iter()
                .enumerate()
                .map(|(i, x)| in_range(x, &format!("rewards[{i}]")))
                .collect::<Result<_, _>>()?,
        ),
        (None, Some(_)) => return Err(ApiError::invalid("rewards", "'rewards' is a list")),
        _ => {
            return Err(ApiError::invalid(
                "reward",
                "give 'reward' (the session's final reward) or 'rewards' (one per turn)",
            ))
        }
    };
    if let Some(k) = o
        .keys()
        .find(|k| !matches!(k.as_str(), "reward" | "rewards"))
    {
        return Err(ApiError::invalid(k, format!("unknown field '{}'", clip(k))));
    }
    let Some(Learning { store, trainer }) = ready.online.started() else {
        return Err(session_not_found(&id));
    };
    let (log, accepting, id2) = (store.clone(), trainer.accepting(), id.clone());
    let r = blocking(move || Ok(log.reward_agent_session(&id2, &reward, &accepting))).await?;
    let new = r.map_err(|e| ApiError::feedback(e, Rewarded::Session(&id), false))?;
    let (log, id2) = (store.clone(), id.clone());
    let now = blocking(move || {
        log.agent_session(SessionLookup::Id(&id2))
            .map_err(ApiError::from)
    })
    .await?
    .unwrap_or(v);
    let turns = now.turns as usize;
    Ok(super::feedback::acknowledge(
        trainer,
        new,
        turns,
        shown(&now),
    ))
}

/// `DELETE /v1/sessions/{id}`: end the session without a reward (its turns are not trained on).
pub async fn delete(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    own(&state, &headers, &id).await?;
    let log = store(&state).ok_or_else(|| session_not_found(&id))?;
    let (log2, id2) = (log.clone(), id.clone());
    blocking(move || log2.end_agent_session(&id2).map_err(ApiError::from)).await?;
    let v = blocking(move || {
        log.agent_session(SessionLookup::Id(&id))
            .map_err(ApiError::from)
    })
    .await?
    .ok_or_else(|| ApiError::internal("the session is gone"))?;
    Ok(Json(shown(&v)))
}

/// Sweep idle sessions each second once learning runs (for the server's life).
pub async fn sweeper(state: AppState) {
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(l) = state.ready().ok().and_then(|r| r.online.started()) else {
            continue;
        };
        let (log, accepting) = (l.store.clone(), l.trainer.accepting());
        let _ = tokio::task::spawn_blocking(move || sweep(&*log, &accepting)).await;
    }
}

/// End the sessions idle past their timeout: rewarded with their `idle_reward`, else ended (their
/// turns dropped). Every replica sweeps; a session ends once (the store's transactions decide).
pub fn sweep(log: &dyn RolloutStore, accepting: &crate::online::store::records::Accepting) {
    let open = match log.open_agent_sessions() {
        Ok(o) => o,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the open agent sessions");
            return;
        }
    };
    let now = now_secs();
    for v in open.into_iter().filter(|v| v.idle(now)) {
        let s = &v.session;
        // An idle reward the store refuses (the adapter no longer learns): ended instead.
        let rewarded = s.idle_reward.is_some_and(|r| {
            log.reward_agent_session(&s.id, &SessionReward::Final(r), accepting)
                .is_ok()
        });
        let r = match rewarded {
            true => Ok(()),
            false => log.end_agent_session(&s.id).map(|_| ()),
        };
        match r {
            Ok(()) => tracing::info!(
                session = %s.id,
                turns = v.turns,
                rewarded,
                "agent session ended: idle"
            ),
            Err(e) => tracing::warn!(session = %s.id, error = %e, "cannot end an idle session"),
        }
    }
}
