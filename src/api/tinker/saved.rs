//! Saved training state: `save_state` (`POST /api/v1/save_weights`) writes a run's adapter and
//! AdamW as a checkpoint folder in the data directory (the learners' format: PEFT files,
//! `optimizer.safetensors`, a manifest; written atomically), named `tinker://{run}/weights/{name}`;
//! `load_state` and `create_training_client_from_state[_with_optimizer]` (`POST
//! /api/v1/load_weights`) read one back into a run, or into a new run of the session. The folder
//! lives under `tinker/` with each name written as one encoded file-name component (never a raw
//! path), beside a file holding the SHA-256 of the key that saved it: only that key loads it,
//! also after a restart of the server.

use super::super::body::JsonBody;
use super::super::error::{clip, ApiError};
use super::super::openai::Fields;
use super::super::state::{bearer_of, blocking, AppState};
use super::futures::Outcome;
use super::train::{queue, run_trainer};
use super::{check_type, optional_str, required_str, string_map};
use crate::adapter::registry::adapter_file_name;
use crate::online::checkpoint::load_checkpoint;
use crate::online::runs::{RunOutput, RunWork};
use axum::extract::State;
use axum::http::HeaderMap;
use axum::Json;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

/// What a state path holds between the run's id and the checkpoint's name.
pub(super) const WEIGHTS: &str = "/weights/";

/// The folder of checkpoint `name` of run `run`, relative to the data directory.
pub(super) fn rel_of(run: &str, name: &str) -> String {
    format!(
        "tinker/{}/{}",
        adapter_file_name(run),
        adapter_file_name(name)
    )
}

/// The file beside a checkpoint folder naming (by hash) the key that saved it.
pub(super) fn owner_file(data_dir: &Path, rel: &str) -> PathBuf {
    data_dir.join(format!("{rel}.owner"))
}

/// A checkpoint name: letters, digits, '-', '_' and '.' (not first), at most 128.
pub(super) fn check_name(name: &str, param: &str) -> Result<(), ApiError> {
    let plain = !name.is_empty()
        && name.len() <= 128
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if !plain {
        return Err(ApiError::invalid(
            param,
            format!(
                "'{}': a name of 1 to 128 letters, digits, '-', '_' and '.' (not first)",
                clip(name)
            ),
        ));
    }
    Ok(())
}

fn not_found(path: &str) -> ApiError {
    ApiError {
        param: Some("path".into()),
        code: Some("checkpoint_not_found"),
        ..ApiError::not_found(format!("no saved state '{}'", clip(path)))
    }
}

/// `POST /api/v1/save_weights`: `{model_id, path, seq_id?, overwrite?}` (`ttl_seconds` and
/// `user_metadata` refused when set) -> a future whose result is `{"type": "save_weights", "path":
/// "tinker://{run}/weights/{path}"}`: the run's adapter and optimizer as they stand after the
/// calls queued before this one. An existing name is a 409 unless `overwrite`.
pub async fn save(
    State(state): State<AppState>,
    headers: HeaderMap,
    JsonBody(body): JsonBody,
) -> Result<Json<Value>, ApiError> {
    let ready = state.ready()?;
    let f = Fields::parse(&body)?;
    check_type(&f, "save_weights")?;
    f.int("seq_id")?;
    super::refuse_save_extras(&f)?;
    let overwrite = f.bool("overwrite")?.unwrap_or(false);
    let key = bearer_of(&headers).to_string();
    let run = required_str(&f, "model_id")?.to_string();
    let trainer = run_trainer(&state, &run, &key)?;
    let name = optional_str(&f, "path")?
        .ok_or_else(|| ApiError::invalid("path", "'path' (a name for the state) is required"))?;
    check_name(&name, "path")?;
    let data_dir = ready.online.cfg().data_dir.clone();
    let rel = rel_of(&run, &name);
    let (dir, owner) = (data_dir.join(&rel), owner_file(&data_dir, &rel));
    let hash = super::key_hash(&key);
    let exists = blocking(move || {
        let exists = dir.exists();
        if !exists || overwrite {
            std::fs::create_dir_all(owner.parent().unwrap_or(&data_dir))
                .and_then(|_| crate::util::write_synced(&owner, hash.as_bytes()))
                .map_err(|e| {
                    ApiError::internal(format!("cannot write {}: {e}", owner.display()))
                })?;
        }
        Ok(exists)
    })
    .await?;
    if exists && !overwrite {
        return Err(ApiError {
            code: Some("checkpoint_exists"),
            ..ApiError::conflict(
                "path",
                format!(
                    "the run has a saved state '{}' already (overwrite: true replaces it)",
                    clip(&name)
                ),
            )
        });
    }
    let path = format!("{}{run}{WEIGHTS}{name}", super::sample::SCHEME);
    let (id, cell) = state.tinker_futures.pending(&key);
    let work = RunWork::Save {
        data_dir: ready.online.cfg().data_dir.clone(),
        rel,
    };
    queue(&trainer, &run, work, cell, move |o| match o {
        RunOutput::Saved => Outcome::Json(json!({"type": "save_weights", "path": path})),
        _ => super::train::unexpected(),
    })?;
    Ok(Json(json!({"request_id": id, "model_id": run})))
}

/// `POST /api/v1/load_weights`: `{path, optimizer, model_id, seq_id}` loads a saved state into
/// run `model_id` (the same adapter shape; the optimizer's state too when `optimizer`);
/// `{path, optimizer, session_id, model_seq_id, base_model?, user_metadata?}` makes run
/// `{session_id}:train:{model_seq_id}` from it (the SDK's `create_training_client_from_state`).
/// A future whose result is `{"type": "load_weights", "path"}`.
pub async fn load(
    State(state): State<AppState>,
    headers: HeaderMap,
    JsonBody(body): JsonBody,
) -> Result<Json<Value>, ApiError> {
    let ready = state.ready()?;
    let f = Fields::parse(&body)?;
    check_type(&f, "load_weights")?;
    f.int("seq_id")?;
    if !matches!(f.get("weights_access_token"), None | Some(Value::Null)) {
        return Err(ApiError::invalid(
            "weights_access_token",
            "states are loaded by the key that saved them: no access tokens",
        ));
    }
    super::runs::check_optimizer(f.get("optimizer_config"))?;
    let key = bearer_of(&headers).to_string();
    let path = required_str(&f, "path")?.to_string();
    let optimizer = f
        .bool("optimizer")?
        .ok_or_else(|| ApiError::invalid("optimizer", "'optimizer' is required"))?;
    let (run_of_path, name) = path
        .strip_prefix(super::sample::SCHEME)
        .and_then(|p| p.split_once(WEIGHTS))
        .ok_or_else(|| {
            ApiError::invalid(
                "path",
                format!(
                    "'{}' is not a state path (tinker://RUN/weights/NAME)",
                    clip(&path)
                ),
            )
        })?;
    check_name(name, "path")?;
    // A run id (`{session}:train:{n}`): never `.` or `..` as a folder.
    let run_like = !run_of_path.is_empty()
        && run_of_path
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | ':'));
    if !run_like {
        return Err(not_found(&path));
    }
    let data_dir = ready.online.cfg().data_dir.clone();
    let rel = rel_of(run_of_path, name);
    let (model, limits) = (ready.model.clone(), ready.registry.limits);
    let hash = super::key_hash(&key);
    let p = path.clone();
    let (weights, opt) = blocking(move || {
        let saved_by = std::fs::read_to_string(owner_file(&data_dir, &rel)).unwrap_or_default();
        if saved_by.trim() != hash {
            return Err(not_found(&p));
        }
        load_checkpoint(&data_dir.join(&rel), &model.config, &limits).map_err(|e| {
            ApiError::invalid(
                "path",
                format!("the saved state '{}' cannot be read: {e}", clip(&p)),
            )
        })
    })
    .await?;
    let opt = optimizer.then_some(opt);
    let done = json!({"type": "load_weights", "path": path});
    if let Some(session) = optional_str(&f, "session_id")? {
        if let Some(b) = optional_str(&f, "base_model")? {
            super::check_base(ready, &b)?;
        }
        let seq = f
            .int_in("model_seq_id", 0, i32::MAX as i128)?
            .ok_or_else(|| {
                ApiError::invalid(
                    "model_seq_id",
                    "'model_seq_id' is required with 'session_id'",
                )
            })?;
        let meta = string_map(&f, "user_metadata")?;
        let id = format!("{session}:train:{seq}");
        let made = super::runs::NewRun {
            session: &session,
            id: &id,
            key: &key,
            seed: 0,
            user_metadata: meta,
        };
        super::runs::register(&state, made, weights, opt).await?;
        let request_id = state.tinker_futures.done(&key, done);
        return Ok(Json(json!({"request_id": request_id, "model_id": id})));
    }
    let run = optional_str(&f, "model_id")?
        .ok_or_else(|| ApiError::invalid("model_id", "'model_id' or 'session_id' is required"))?;
    let trainer = run_trainer(&state, &run, &key)?;
    let (id, cell) = state.tinker_futures.pending(&key);
    queue(
        &trainer,
        &run,
        RunWork::Load { weights, opt },
        cell,
        move |o| match o {
            RunOutput::Loaded => Outcome::Json(done),
            _ => super::train::unexpected(),
        },
    )?;
    Ok(Json(json!({"request_id": id, "model_id": run})))
}
