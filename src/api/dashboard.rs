//! The live dashboard: `GET /dashboard` serves one self-contained page (HTML, CSS and script in
//! the binary: no build step, nothing fetched from the network), which polls
//! `GET /v1/train/status`, each learning adapter's `GET /v1/train/{name}/history` and
//! `/metrics`, and draws charts of them as SVG. The page holds no data itself (it is served
//! without a key); its calls carry the key the user gives it (`?key=`, kept in the tab's
//! session storage).

use super::error::ApiError;
use super::state::{blocking, AppState};
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
    let learning = ready
        .online
        .learning(&name)
        .cloned()
        .ok_or_else(|| ApiError {
            code: Some("adapter_not_learning"),
            ..ApiError::not_found(format!("'{name}' is not a learning adapter"))
        })?;
    let store = learning.store.clone();
    let n = name.clone();
    let (steps, decisions) = blocking(move || {
        let unavailable = |e: crate::online::store::records::LogError| ApiError {
            code: Some("rollout_log_unavailable"),
            ..ApiError::unavailable(e.to_string())
        };
        Ok((
            store.steps(&n, limit).map_err(unavailable)?,
            store.decisions(&n, 100).map_err(unavailable)?,
        ))
    })
    .await?;
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
