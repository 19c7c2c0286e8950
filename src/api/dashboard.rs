//! The live dashboard: `GET /dashboard` serves one self-contained page (HTML, CSS and script in
//! the binary: no build step, nothing fetched from the network), which polls
//! `GET /v1/train/status`, each learning adapter's `GET /v1/train/{name}/history` and
//! `/metrics`, and draws charts of them as SVG. The page holds no data itself (it is served
//! without a key); its calls carry the key the user gives it (`?key=`, kept in the tab's
//! session storage).

use super::error::ApiError;
use super::state::{blocking, AppState};
use crate::online::store::records::{Decision, StepRow};
use axum::extract::{Path, Query, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use std::collections::HashMap;

/// The page.
const PAGE: &str = include_str!("static/dashboard.html");

/// Steps a history returns by default, and at most.
const DEFAULT_STEPS: usize = 200;
const MAX_STEPS: usize = 5000;

/// `GET /dashboard`.
pub async fn page() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        PAGE,
    )
        .into_response()
}

/// `GET /v1/train/{name}/history?limit=N`: the adapter's newest N steps (default 200, at most
/// 5000), oldest first, each its version, lineage, time and report (reward mean and spread, KL,
/// entropy, clip fraction, loss, step time, ...), and its newest decisions (rollbacks and
/// resumes, with their reasons and evidence), newest first.
pub async fn history(
    State(state): State<AppState>,
    Path(name): Path<String>,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<Value>, ApiError> {
    let ready = state.ready()?;
    let mut limit = DEFAULT_STEPS;
    for (k, v) in &query {
        match (k.as_str(), v.parse::<usize>()) {
            ("limit", Ok(n)) if (1..=MAX_STEPS).contains(&n) => limit = n,
            ("limit", _) => {
                return Err(ApiError::invalid(
                    "limit",
                    format!("'limit' must be an integer in 1..={MAX_STEPS}"),
                ))
            }
            _ => {
                return Err(ApiError::invalid(
                    k,
                    format!("'{k}' is not a parameter of this route"),
                ))
            }
        }
    }
    let (steps, decisions) = records(ready, &name, limit).await?;
    let steps: Vec<Value> = steps
        .into_iter()
        .map(|(lineage, version, created, stats)| {
            let mut v: Value = serde_json::from_str(&stats).unwrap_or_else(|_| json!({}));
            v["lineage"] = json!(lineage);
            v["version"] = json!(version);
            v["created"] = json!(created);
            v
        })
        .collect();
    Ok(Json(json!({
        "object": "train.history",
        "adapter": name,
        "steps": steps,
        "decisions": decisions,
    })))
}

/// A learning adapter's newest `limit` steps and 100 decisions, from the rollout store.
async fn records(
    ready: &super::state::Ready,
    name: &str,
    limit: usize,
) -> Result<(Vec<StepRow>, Vec<Decision>), ApiError> {
    let learning = ready
        .online
        .learning(name)
        .cloned()
        .ok_or_else(|| ApiError {
            code: Some("adapter_not_learning"),
            ..ApiError::not_found(format!("'{name}' is not a learning adapter"))
        })?;
    let store = learning.store.clone();
    let n = name.to_string();
    blocking(move || {
        let unavailable = |e: crate::online::store::records::LogError| ApiError {
            code: Some("rollout_log_unavailable"),
            ..ApiError::unavailable(e.to_string())
        };
        Ok((
            store.steps(&n, limit).map_err(unavailable)?,
            store.decisions(&n, 100).map_err(unavailable)?,
        ))
    })
    .await
}

/// `GET /v1/adapters/{name}/versions`: a learning adapter's versions, oldest first, each with
/// its status (`serving`, `published`, `held`: never served, or `rolled_back`), its evaluation
/// score where it was scored, its step's mean reward, and whether it serves now; an adapter
/// that does not learn lists the versions it holds in memory.
pub async fn versions(
    State(state): State<AppState>,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let ready = state.ready()?;
    let slot = ready
        .registry
        .get(&name)
        .ok_or_else(|| ApiError::model_not_found(&name))?;
    let serving = slot.current().version;
    let Some(status) = ready.online.get().and_then(|o| o.status().remove(&name)) else {
        let data: Vec<Value> = slot
            .versions_alive()
            .iter()
            .map(|v| {
                json!({"version": v.version, "created": v.created,
                            "status": if v.version == serving { "serving" } else { "published" },
                            "serving": v.version == serving})
            })
            .collect();
        return Ok(Json(
            json!({"object": "list", "adapter": name, "data": data}),
        ));
    };
    let (steps, decisions) = records(ready, &name, MAX_STEPS).await?;
    let mut rows: std::collections::BTreeMap<u64, Value> = Default::default();
    for (lineage, version, created, stats) in steps {
        let r: Value = serde_json::from_str(&stats).unwrap_or_else(|_| json!({}));
        let held = r["held"].as_bool().unwrap_or(false);
        rows.insert(
            version,
            json!({"version": version, "lineage": lineage, "created": created,
                   "status": if held { "held" } else { "published" },
                   "eval_score": r["eval"]["score"], "reward_mean": r["reward_mean"]}),
        );
    }
    // Decisions, oldest first: held candidates that were never kept, and rolled-back ranges.
    for d in decisions.iter().rev() {
        let ev: Value = serde_json::from_str(&d.evidence).unwrap_or_default();
        match d.decision.as_str() {
            "hold" => {
                let row = rows.entry(d.from_version).or_insert_with(|| {
                    json!({"version": d.from_version, "lineage": d.lineage,
                           "created": d.created, "reward_mean": null})
                });
                row["status"] = json!("held");
                row["eval_score"] = ev["candidate_score"].clone();
            }
            "rollback" => {
                for (v, row) in rows.range_mut(d.to_version + 1..=d.from_version) {
                    if *v != d.to_version {
                        row["status"] = json!("rolled_back");
                    }
                }
            }
            _ => {}
        }
    }
    for (v, score) in &status.eval_scores {
        rows.entry(*v)
            .or_insert_with(|| json!({"version": v, "status": "published"}))["eval_score"] =
            json!(score);
    }
    rows.entry(serving)
        .or_insert_with(|| json!({"version": serving}));
    let data: Vec<Value> = rows
        .into_values()
        .map(|mut r| {
            let is = r["version"] == serving;
            r["serving"] = json!(is);
            if is {
                r["status"] = json!("serving");
            }
            r
        })
        .collect();
    Ok(Json(
        json!({"object": "list", "adapter": name, "data": data,
                   "serving": serving, "pinned_version": status.pinned_version,
                   "held_version": status.held_version}),
    ))
}
