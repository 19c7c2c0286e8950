//! A run's checkpoints as the SDK's `RestClient` lists and deletes them: the saved states
//! (`weights/NAME`, from the data directory, so a run's states are listed after a restart too)
//! that the caller's key saved. Sampler weights are registry versions (`/v1/models` lists them).

use super::super::error::{clip, ApiError};
use super::super::state::{bearer_of, blocking, AppState};
use super::key_hash;
use super::sample::SCHEME;
use super::saved::{check_name, owner_file, rel_of, WEIGHTS};
use crate::adapter::registry::adapter_file_name;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

/// A run id as the SDK computes it (`{session}:train:{n}`): no `.` or `/` to climb a folder.
fn check_run(run: &str) -> Result<(), ApiError> {
    let ok = !run.is_empty()
        && run.len() <= 128
        && run
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | ':'));
    match ok {
        true => Ok(()),
        false => Err(super::runs::not_found(run)),
    }
}

/// `GET /api/v1/training_runs/{id}/checkpoints`: `{checkpoints: [{checkpoint_id: "weights/NAME",
/// checkpoint_type: "training", time, tinker_path, size_bytes}], cursor: null}`, oldest first;
/// 404 when the key has neither the run nor a state of it.
pub async fn list(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(run): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let ready = state.ready()?;
    check_run(&run)?;
    let key = bearer_of(&headers).to_string();
    let live = state.tinker_runs.get(&run, &key).is_some();
    let data_dir = ready.online.cfg().data_dir.clone();
    let hash = key_hash(&key);
    let r = run.clone();
    let mut found: Vec<(f64, String, u64)> = blocking(move || {
        let dir = data_dir.join("tinker").join(adapter_file_name(&r));
        let mut out = Vec::new();
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return Ok(out);
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let is_dir = e.file_type().is_ok_and(|t| t.is_dir());
            if !is_dir || check_name(&name, "path").is_err() {
                continue;
            }
            let rel = rel_of(&r, &name);
            let owner = std::fs::read_to_string(owner_file(&data_dir, &rel)).unwrap_or_default();
            if owner.trim() != hash {
                continue;
            }
            let files = std::fs::read_dir(e.path()).into_iter().flatten().flatten();
            let size = files
                .filter_map(|f| f.metadata().ok())
                .map(|m| m.len())
                .sum();
            let time = e
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0.0, |d| d.as_secs_f64());
            out.push((time, name, size));
        }
        Ok(out)
    })
    .await?;
    if found.is_empty() && !live {
        return Err(super::runs::not_found(&run));
    }
    found.sort_by(|a, b| a.0.total_cmp(&b.0).then_with(|| a.1.cmp(&b.1)));
    let checkpoints: Vec<Value> = found
        .into_iter()
        .map(|(time, name, size)| {
            json!({
                "checkpoint_id": format!("weights/{name}"),
                "checkpoint_type": "training",
                "time": time,
                "tinker_path": format!("{SCHEME}{run}{WEIGHTS}{name}"),
                "size_bytes": size,
            })
        })
        .collect();
    Ok(Json(json!({"checkpoints": checkpoints, "cursor": null})))
}

/// `DELETE /api/v1/training_runs/{id}/checkpoints/weights/{name}`: remove a saved state the
/// key saved (204); 404 when there is none.
pub async fn delete(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path((run, name)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let ready = state.ready()?;
    check_run(&run)?;
    check_name(&name, "checkpoint_id")?;
    let data_dir = ready.online.cfg().data_dir.clone();
    let hash = key_hash(bearer_of(&headers));
    let rel = rel_of(&run, &name);
    let path = format!("{SCHEME}{run}{WEIGHTS}{name}");
    blocking(move || {
        let owner = owner_file(&data_dir, &rel);
        if std::fs::read_to_string(&owner).unwrap_or_default().trim() != hash {
            return Err(ApiError {
                param: Some("checkpoint_id".into()),
                code: Some("checkpoint_not_found"),
                ..ApiError::not_found(format!("no saved state '{}'", clip(&path)))
            });
        }
        // The folder first: a crash between leaves an owner file with nothing to load, never a
        // state no key owns.
        crate::online::checkpoint::remove_dir(&data_dir.join(&rel))
            .and_then(|_| std::fs::remove_file(&owner))
            .map_err(|e| ApiError::internal(format!("cannot remove '{}': {e}", clip(&path))))
    })
    .await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}
