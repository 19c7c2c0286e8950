//! Tinker futures: a training or sampling call answers `{request_id, model_id?}` at once, and the
//! SDK fetches its result with `POST /api/v1/retrieve_future`. Results are kept per key, the
//! newest `MAX_FUTURES`; an id that is unknown, forgotten or another key's is 410, on which the
//! SDK sends its original request again. (Calls that finish later will add a pending state,
//! answered with `try_again`: docs/tinker.md.)

use super::super::body::JsonBody;
use super::super::error::{clip, ApiError};
use super::super::openai::Fields;
use super::super::owned::Owned;
use super::super::state::{bearer_of, AppState};
use super::{check_type, required_str};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use serde_json::Value;

/// Results kept at most (the oldest are forgotten).
pub const MAX_FUTURES: usize = 4096;

/// The results of calls, per key (`api::owned`).
pub struct Futures(Owned<Value>);

impl Default for Futures {
    fn default() -> Futures {
        Futures(Owned::new(MAX_FUTURES))
    }
}

impl Futures {
    /// Keep `result` for `key` under a new request id, which is returned.
    pub fn done(&self, key: &str, result: Value) -> String {
        let id = crate::util::random_id("req-");
        self.0.put(id.clone(), key, result);
        id
    }
}

/// `POST /api/v1/retrieve_future`: `{request_id, allow_metadata_only?}` -> the call's result
/// (results are small enough to send whole: `allow_metadata_only` changes nothing).
pub async fn retrieve(
    State(state): State<AppState>,
    headers: HeaderMap,
    JsonBody(body): JsonBody,
) -> Result<Json<Value>, ApiError> {
    let f = Fields::parse(&body)?;
    check_type(&f, "retrieve_future")?;
    f.bool("allow_metadata_only")?;
    let id = required_str(&f, "request_id")?;
    state
        .tinker_futures
        .0
        .get(id, bearer_of(&headers))
        .map(Json)
        .ok_or_else(|| ApiError {
            code: Some("future_not_found"),
            ..ApiError::status(
                StatusCode::GONE,
                format!(
                    "no result for request '{}' (unknown, or forgotten)",
                    clip(id)
                ),
            )
        })
}
