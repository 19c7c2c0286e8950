//! Tinker futures: a training or sampling call answers `{request_id, model_id?}` at once, and the
//! SDK fetches its result with `POST /api/v1/retrieve_future`. Results are kept per key, the
//! newest `MAX_FUTURES`; an id that is unknown, forgotten or another key's is 410, on which the
//! SDK sends its original request again. (Calls that finish later will add a pending state,
//! answered with `try_again`: docs/tinker.md.)

use super::super::body::JsonBody;
use super::super::error::{clip, ApiError};
use super::super::openai::Fields;
use super::super::state::{bearer_of, AppState};
use super::{check_type, required_str};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use serde_json::Value;
use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

/// Results kept at most (the oldest are forgotten).
pub const MAX_FUTURES: usize = 4096;

struct Entry {
    key: String,
    result: Value,
}

/// The results of calls, oldest first out.
#[derive(Default)]
pub struct Futures {
    inner: Mutex<(HashMap<String, Entry>, VecDeque<String>)>,
}

impl Futures {
    /// Keep `result` for `key` under a new request id, which is returned.
    pub fn done(&self, key: &str, result: Value) -> String {
        let id = crate::util::random_id("req-");
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let (map, order) = &mut *g;
        map.insert(
            id.clone(),
            Entry {
                key: key.to_string(),
                result,
            },
        );
        order.push_back(id.clone());
        while order.len() > MAX_FUTURES {
            if let Some(old) = order.pop_front() {
                map.remove(&old);
            }
        }
        id
    }

    /// The result of `id` as `key` may see it.
    fn get(&self, id: &str, key: &str) -> Option<Value> {
        let g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        g.0.get(id)
            .filter(|e| e.key == key)
            .map(|e| e.result.clone())
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
