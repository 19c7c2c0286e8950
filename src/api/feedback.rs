//! `POST /v1/feedback` (rewards for completions served through learning adapters),
//! `GET /v1/feedback/{id}`, and the training admin routes: `POST /v1/adapters/{name}/train`,
//! `POST /v1/train/{name}/pause|resume`, `GET /v1/train/status` (with the share policy:
//! `train_policy`).

use super::body::JsonBody;
use super::error::{clip, shown, ApiError, Rewarded};
use super::openai::Fields;
use super::state::{bearer_of, blocking, key_matches, AppState};
use crate::online::config::RawLearn;
use crate::online::learner::{self, ServeOp};
use crate::online::start::Learning;
use crate::online::store::records::Reward;
use crate::online::trainer::{CommandError, TrainerHandle};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

pub(super) fn is_admin(state: &AppState, headers: &HeaderMap) -> bool {
    state
        .admin_key
        .as_deref()
        .is_some_and(|k| key_matches(bearer_of(headers), k))
}

/// One reward item; `at` is its place in a list (None for a single object).
fn parse_item(v: &Value, at: Option<usize>, lo: f64, hi: f64) -> Result<Reward, ApiError> {
    let name = |f: &str| at.map_or(f.to_string(), |i| format!("[{i}].{f}"));
    let o = v.as_object().ok_or_else(|| {
        ApiError::invalid(&name("id"), "each reward is an object {id, choice, reward}")
    })?;
    let f = Fields(o);
    let id = f
        .str("id")
        .map_err(|_| ApiError::invalid(&name("id"), "'id' must be a string"))?
        .ok_or_else(|| ApiError::invalid(&name("id"), "'id' is required"))?
        .to_string();
    let choice = f
        .int_in("choice", 0, u32::MAX as i128)
        .map_err(|e| ApiError::invalid(&name("choice"), e.message))?
        .unwrap_or(0) as u32;
    let reward = parse_reward(o, &name("reward"), lo, hi)?;
    Ok(Reward { id, choice, reward })
}

/// A reward: a finite number in [lo, hi] (`param` names it in errors).
fn parse_reward(
    o: &serde_json::Map<String, Value>,
    param: &str,
    lo: f64,
    hi: f64,
) -> Result<f64, ApiError> {
    match o.get("reward") {
        Some(v) => reward_value(v, param, lo, hi),
        None => Err(ApiError::invalid(param, "'reward' is required")),
    }
}

/// A reward value: a finite number in [lo, hi] (`param` names it in errors).
pub(super) fn reward_value(v: &Value, param: &str, lo: f64, hi: f64) -> Result<f64, ApiError> {
    // NaN and infinities are not JSON numbers (the body is refused); huge ones are, and are
    // out of range.
    let reward = match v {
        Value::Number(n) => n.as_f64().unwrap_or(f64::NAN),
        _ => return Err(ApiError::invalid(param, "'reward' must be a number")),
    };
    if !(reward.is_finite() && (lo..=hi).contains(&reward)) {
        return Err(ApiError::invalid(
            param,
            format!("'reward' is {v}; it must be a finite number in [{lo}, {hi}]"),
        ));
    }
    Ok(reward)
}

/// `POST /v1/feedback`: `{"id", "choice"?, "reward"}` or a list of them, recorded all or none.
/// 202 once committed (200 when every reward repeats a stored one).
pub async fn post(
    State(state): State<AppState>,
    headers: HeaderMap,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let ready = state.ready()?;
    let cfg = &ready.online.cfg();
    let (lo, hi) = (cfg.reward_min, cfg.reward_max);
    if let Some(o) = body.as_object().filter(|o| o.contains_key("episode")) {
        return post_episode(&state, &headers, o, lo, hi).await;
    }
    let items: Vec<Reward> = match &body {
        Value::Array(a) if a.is_empty() => {
            return Err(ApiError::bad_body("the list of rewards is empty"))
        }
        Value::Array(a) if a.len() > 4096 => {
            return Err(ApiError::bad_body("at most 4096 rewards per request"))
        }
        Value::Array(a) => a
            .iter()
            .enumerate()
            .map(|(i, v)| parse_item(v, Some(i), lo, hi))
            .collect::<Result<_, _>>()?,
        v => vec![parse_item(v, None, lo, hi)?],
    };
    let Some(Learning {
        store: log,
        trainer: online,
    }) = ready.online.started()
    else {
        return Err(ApiError {
            code: Some("completion_not_found"),
            ..ApiError::not_found(format!(
                "no completion '{}' (this server has no learning adapter)",
                clip(&items[0].id)
            ))
        });
    };
    let (key, admin) = (bearer_of(&headers).to_string(), is_admin(&state, &headers));
    let list = body.is_array();
    let n = items.len();
    let (log, accepting) = (log.clone(), online.accepting());
    let r = blocking(move || Ok(log.post_rewards(&items, &key, admin, &accepting))).await?;
    match r {
        Ok(new) => Ok(acknowledge(online, new, n, json!({}))),
        Err(e) => Err(ApiError::feedback(e, Rewarded::Completions { list }, admin)),
    }
}

/// The answer to recorded rewards: 202 when one is new (the trainer is woken), 200 when every
/// one repeats a stored reward; counted in `flywheel_feedback_rewards_total`.
pub(super) fn acknowledge(online: &TrainerHandle, new: bool, n: usize, extra: Value) -> Response {
    let outcome = if new { "new" } else { "repeat" };
    online
        .metrics
        .feedback_rewards
        .with_label_values(&[outcome])
        .inc_by(n as u64);
    if new {
        online.notify();
    }
    let status = if new {
        StatusCode::ACCEPTED
    } else {
        StatusCode::OK
    };
    let mut body = json!({"object": "feedback", "rewards": n,
                          "status": if new { "accepted" } else { "unchanged" }});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    (status, Json(body)).into_response()
}

/// `{"episode", "reward"}`: one reward for every turn of an episode (the completions a client
/// tagged with that `episode`, under its key), recorded at once; turns logged later take it
/// too. 202 when new, 200 when it repeats the stored reward.
async fn post_episode(
    state: &AppState,
    headers: &HeaderMap,
    o: &serde_json::Map<String, Value>,
    lo: f64,
    hi: f64,
) -> Result<Response, ApiError> {
    let ready = state.ready()?;
    let f = Fields(o);
    let episode = f
        .str("episode")?
        .filter(|e| !e.is_empty() && e.len() <= 256)
        .ok_or_else(|| ApiError::invalid("episode", "'episode' must have 1 to 256 characters"))?
        .to_string();
    let reward = parse_reward(o, "reward", lo, hi)?;
    let Some(Learning {
        store: log,
        trainer: online,
    }) = ready.online.started()
    else {
        return Err(ApiError::episode_not_found(&episode));
    };
    let key = bearer_of(headers).to_string();
    let admin = is_admin(state, headers);
    let (log, accepting, ep) = (log.clone(), online.accepting(), episode.clone());
    let r = blocking(move || Ok(log.post_episode_reward(&ep, reward, &key, &accepting))).await?;
    match r {
        Ok(new) => Ok(acknowledge(online, new, 1, json!({"episode": episode}))),
        Err(e) => Err(ApiError::feedback(e, Rewarded::Episode(&episode), admin)),
    }
}

/// `GET /v1/feedback?episode=ID`: an episode's turns (of the caller's key) and its reward.
pub async fn get_episode(
    State(state): State<AppState>,
    headers: HeaderMap,
    axum::extract::Query(q): axum::extract::Query<std::collections::HashMap<String, String>>,
) -> Result<Json<Value>, ApiError> {
    let ready = state.ready()?;
    let episode = q
        .get("episode")
        .filter(|e| !e.is_empty())
        .ok_or_else(|| ApiError::invalid("episode", "give ?episode=ID"))?
        .clone();
    let not_found = || ApiError {
        param: Some("episode".into()),
        code: Some("episode_not_found"),
        ..ApiError::not_found(format!("no episode '{}' of this key", clip(&episode)))
    };
    let log = &ready.online.started().ok_or_else(not_found)?.store;
    let (log, key, ep) = (
        log.clone(),
        bearer_of(&headers).to_string(),
        episode.clone(),
    );
    let (turns, reward) =
        blocking(move || log.episode_feedback(&ep, &key).map_err(ApiError::from)).await?;
    if turns.is_empty() {
        return Err(not_found());
    }
    let turns: Vec<Value> = turns
        .into_iter()
        .map(|(id, c)| {
            let mut v = json!(c);
            v["id"] = json!(id);
            v
        })
        .collect();
    Ok(Json(
        json!({"object": "feedback.episode", "episode": episode, "reward": reward,
                   "turns": turns}),
    ))
}

/// `GET /v1/feedback/{id}`: what is stored for each choice (owner or admin only).
pub async fn get(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let ready = state.ready()?;
    let not_found = || ApiError {
        code: Some("completion_not_found"),
        ..ApiError::not_found(format!("no completion '{}'", clip(&id)))
    };
    let log = ready.online.started().ok_or_else(not_found)?.store.clone();
    let key = log.key_hash(bearer_of(&headers));
    let q = id.clone();
    let rows = blocking(move || log.feedback(&q).map_err(ApiError::from)).await?;
    if rows.is_empty() {
        return Err(not_found());
    }
    if !is_admin(&state, &headers) && rows.iter().any(|(owner, _)| owner != &key) {
        return Err(ApiError::forbidden(
            "not_owner",
            format!("completion '{id}' was made with another key"),
        ));
    }
    let choices: Vec<Value> = rows.into_iter().map(|(_, c)| json!(c)).collect();
    Ok(Json(
        json!({"object": "feedback", "id": id, "choices": choices}),
    ))
}

/// `POST /v1/adapters/{name}/train` (admin): make `name` a learning adapter (created as the
/// identity or resumed from its checkpoint), or change a learning adapter's settings (its shape
/// stays: method, block size and rank are fixed for its lineage).
pub async fn train(
    State(state): State<AppState>,
    Path(name): Path<String>,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let ready = state.ready()?;
    // On a learning adapter, the fields not given keep their current values.
    let mut merged = ready
        .learning(&name)
        .and_then(|l| l.trainer.status().remove(&name))
        .map(|s| json!(s.config))
        .unwrap_or_else(|| json!({}));
    match body {
        Value::Null => {}
        Value::Object(o) => {
            for (k, v) in o {
                merged[k] = v;
            }
        }
        _ => {
            return Err(ApiError::bad_body(
                "the body must be a JSON object of settings",
            ))
        }
    }
    let mut raw: RawLearn =
        serde_json::from_value(merged).map_err(|e| ApiError::bad_body(e.to_string()))?;
    if !raw.name.is_empty() && raw.name != name {
        return Err(ApiError::invalid(
            "name",
            "the body's name differs from the path's",
        ));
    }
    raw.name = name.clone();
    let cfg = raw.validate().map_err(|(k, m)| ApiError::invalid(k, m))?;
    // The adapter's size, within the limits, before anything is allocated.
    let shape = learner::adapter_config(&cfg, &ready.model.config);
    if let Err(e) = ready.registry.limits.layout(shape, &ready.model.config) {
        return Err(ApiError::invalid(cfg.method.size_setting(), e.to_string()));
    }
    let online = state.start_trainer().await?;
    let (status, created) = online.train(cfg).await.map_err(ApiError::from)?;
    let code = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((
        code,
        Json(json!({"object": "train.adapter", "id": name, "status": status})),
    )
        .into_response())
}

async fn set_paused(state: &AppState, name: &str, paused: bool) -> Result<Json<Value>, ApiError> {
    let ready = state.ready()?;
    let online = ready
        .online
        .get()
        .ok_or_else(|| ApiError::from(CommandError::NotLearning(name.to_string())))?;
    let status = online
        .set_paused(name, paused)
        .await
        .map_err(ApiError::from)?;
    Ok(Json(
        json!({"object": "train.adapter", "id": name, "status": status}),
    ))
}

pub async fn pause(
    State(state): State<AppState>,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    set_paused(&state, &name, true).await
}

pub async fn resume(
    State(state): State<AppState>,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    set_paused(&state, &name, false).await
}

/// `POST /v1/adapters/{name}/rollback` (admin): `{"version": N, "pause": false}` serves version
/// N of a learning adapter again, with its optimizer, training going on from it (or paused); a
/// decision recorded with reason "manual". N must be older than the version served and still
/// have its checkpoint (a 400 naming `version` otherwise).
pub async fn rollback(
    State(state): State<AppState>,
    Path(name): Path<String>,
    crate::api::body::JsonBody(body): crate::api::body::JsonBody,
) -> Result<Json<Value>, ApiError> {
    let ready = state.ready()?;
    let f = crate::api::openai::Fields::parse(&body)?;
    f.only(&["version", "pause"], "this route")?;
    let to = f
        .int_in("version", 1, i64::MAX as i128)?
        .ok_or_else(|| ApiError::invalid("version", "'version' is required"))? as u64;
    let pause = f.bool("pause")?.unwrap_or(false);
    serve_op(ready, name, ServeOp::Rollback { to, pause }).await
}

/// Carry out `op` on learner `name`: its status after, as the train routes answer.
async fn serve_op(
    ready: &super::state::Ready,
    name: String,
    op: ServeOp,
) -> Result<Json<Value>, ApiError> {
    let online = ready
        .online
        .get()
        .ok_or_else(|| ApiError::from(CommandError::NotLearning(name.clone())))?;
    let status = online.serve(&name, op).await.map_err(ApiError::from)?;
    Ok(Json(
        json!({"object": "train.adapter", "id": name, "status": status}),
    ))
}

/// `POST /v1/adapters/{name}/pin` (admin): `{"version": N}` serves version N (one with a
/// checkpoint, or the one serving) while training goes on without serving what it makes;
/// `{"version": null}` unpins. The adapter's status after.
pub async fn pin(
    State(state): State<AppState>,
    Path(name): Path<String>,
    crate::api::body::JsonBody(body): crate::api::body::JsonBody,
) -> Result<Json<Value>, ApiError> {
    let ready = state.ready()?;
    let f = crate::api::openai::Fields::parse(&body)?;
    f.only(&["version"], "this route")?;
    let op = match body.get("version") {
        Some(Value::Null) => ServeOp::Unpin,
        Some(_) => ServeOp::Pin(f.int_in("version", 1, i64::MAX as i128)?.unwrap_or(1) as u64),
        None => {
            return Err(ApiError::invalid(
                "version",
                "'version' is required (a number, or null to unpin)",
            ))
        }
    };
    serve_op(ready, name, op).await
}

/// `GET /v1/train/status`: each learning adapter's state (running, paused, failed), version,
/// steps, pending and dropped groups, last step's statistics and last error.
pub async fn status(
    State(state): State<AppState>,
    headers: HeaderMap,
) -> Result<Json<Value>, ApiError> {
    let ready = state.ready()?;
    let admin = is_admin(&state, &headers);
    let adapters = ready
        .online
        .get()
        .map(|o| {
            let mut st = o.status();
            for s in st.values_mut() {
                if let Some(e) = &mut s.last_error {
                    e.message = shown(&e.message, admin);
                }
            }
            json!(st)
        })
        .unwrap_or_else(|| json!({}));
    let log_ok = super::info::learning_health(&state)
        .await
        .map(|h| h.is_ok());
    Ok(Json(
        json!({"object": "train.status", "adapters": adapters, "rollout_log_ok": log_ok,
               "policy": super::train_policy::view(&state).ok()}),
    ))
}
