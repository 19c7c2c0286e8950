//! `GET /v1/train/policy` and `PUT /v1/train/policy` (admin): how the cores are split between
//! serving and training (`online::share_policy`): the settings, the share in force, and what the
//! policy measured (steps per minute, the fraction dropped as stale, how far training stretched
//! serving's steps).

use super::body::JsonBody;
use super::error::ApiError;
use super::state::AppState;
use crate::online::share_policy::{PolicyView, SharePolicy, Steering};
use axum::extract::State;
use axum::Json;

/// The view: the trainer's, or the configured policy's while no trainer runs.
pub fn view(state: &AppState) -> Result<PolicyView, ApiError> {
    let ready = state.ready()?;
    Ok(match ready.online.get() {
        Some(o) => o.policy(),
        None => Steering::new(ready.online.cfg().share.clone())
            .view()
            .clone(),
    })
}

pub async fn get(State(state): State<AppState>) -> Result<Json<PolicyView>, ApiError> {
    Ok(Json(view(&state)?))
}

/// Replace the policy as a whole (an omitted field takes its default); 400 naming a bad field,
/// 409 `trainer_not_started` while nothing learns in this process.
pub async fn put(
    State(state): State<AppState>,
    JsonBody(body): JsonBody,
) -> Result<Json<PolicyView>, ApiError> {
    let ready = state.ready()?;
    if !body.is_object() {
        return Err(ApiError::bad_body(
            "the body must be a JSON object: train_share, target_steps_per_minute, \
             max_stale_fraction, itl_budget",
        ));
    }
    let p: SharePolicy =
        serde_json::from_value(body).map_err(|e| ApiError::bad_body(e.to_string()))?;
    p.validate().map_err(|(k, m)| ApiError::invalid(k, m))?;
    let Some(online) = ready.online.get() else {
        return Err(ApiError {
            code: Some("trainer_not_started"),
            ..ApiError::conflict(
                "train_share",
                "no trainer runs in this process: start learning first (serve --learn, \
                 POST /v1/adapters/{name}/train) or set [online] train_* in the config",
            )
        });
    };
    let v = online
        .set_policy(p)
        .await
        .map_err(|e| ApiError::unavailable(e.to_string()))?;
    Ok(Json(v))
}
