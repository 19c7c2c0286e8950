//! Tinker futures: a training or sampling call answers `{request_id, model_id?}` at once, and the
//! SDK fetches its result with `POST /api/v1/retrieve_future`. A call still running is waited for
//! up to `LONG_POLL` (then `{"type": "try_again"}`, on which the SDK asks again at once); a
//! result is JSON, protobuf (`ForwardBackwardOutput`, as the SDK asks for with `Accept`), or a
//! failure `{error, category}` ("user": the request was wrong, not retried; "server": ours).
//! Results are kept per key, the newest `MAX_FUTURES`; an id that is unknown, forgotten or
//! another key's is 410, on which the SDK sends its original request again.

use super::super::body::JsonBody;
use super::super::error::{clip, ApiError};
use super::super::openai::Fields;
use super::super::owned::Owned;
use super::super::state::{bearer_of, AppState};
use super::{check_type, required_str};
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::sync::Notify;

/// Results kept at most (the oldest are forgotten).
pub const MAX_FUTURES: usize = 4096;

/// How long `retrieve_future` waits for a running call before `try_again` (the SDK's own
/// timeout for it is 45 s).
pub const LONG_POLL: Duration = Duration::from_secs(20);

/// What a call came to.
#[derive(Clone, Debug)]
pub enum Outcome {
    Json(Value),
    /// Protobuf bytes (`Content-Type: application/x-protobuf`).
    Proto(Vec<u8>),
    Failed {
        error: String,
        /// "user" (the request: not retried) or "server".
        category: &'static str,
    },
}

/// One call's result, set once.
#[derive(Default)]
pub struct Cell {
    result: OnceLock<Outcome>,
    done: Notify,
}

impl Cell {
    /// Set the result (a second is ignored) and wake the waiting `retrieve_future`s.
    pub fn finish(&self, o: Outcome) {
        let _ = self.result.set(o);
        self.done.notify_waiters();
    }

    /// The result, waiting at most `wait` for it.
    async fn wait(&self, wait: Duration) -> Option<Outcome> {
        let notified = self.done.notified();
        tokio::pin!(notified);
        // Registered before the check: a `finish` between the two still wakes us.
        notified.as_mut().enable();
        if let Some(o) = self.result.get() {
            return Some(o.clone());
        }
        let _ = tokio::time::timeout(wait, notified).await;
        self.result.get().cloned()
    }
}

/// The calls' results, per key (`api::owned`).
pub struct Futures(Owned<Arc<Cell>>);

impl Default for Futures {
    fn default() -> Futures {
        Futures(Owned::new(MAX_FUTURES))
    }
}

impl Futures {
    /// Keep `result` for `key` under a new request id, which is returned.
    pub fn done(&self, key: &str, result: Value) -> String {
        let (id, cell) = self.pending(key);
        cell.finish(Outcome::Json(result));
        id
    }

    /// A new request id of `key`'s whose result comes later (`Cell::finish`).
    pub fn pending(&self, key: &str) -> (String, Arc<Cell>) {
        let id = crate::util::random_id("req-");
        let cell = Arc::new(Cell::default());
        self.0.put(id.clone(), key, cell.clone());
        (id, cell)
    }
}

/// `POST /api/v1/retrieve_future`: `{request_id, allow_metadata_only?}` -> the call's result
/// (results are small enough to send whole: `allow_metadata_only` changes nothing).
pub async fn retrieve(
    State(state): State<AppState>,
    headers: HeaderMap,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let f = Fields::parse(&body)?;
    check_type(&f, "retrieve_future")?;
    f.bool("allow_metadata_only")?;
    let id = required_str(&f, "request_id")?;
    let cell = state
        .tinker_futures
        .0
        .get(id, bearer_of(&headers))
        .ok_or_else(|| ApiError {
            code: Some("future_not_found"),
            ..ApiError::status(
                StatusCode::GONE,
                format!(
                    "no result for request '{}' (unknown, or forgotten)",
                    clip(id)
                ),
            )
        })?;
    Ok(match cell.wait(LONG_POLL).await {
        None => Json(json!({"type": "try_again", "request_id": id, "queue_state": "active"}))
            .into_response(),
        Some(Outcome::Json(v)) => Json(v).into_response(),
        Some(Outcome::Proto(b)) => {
            ([(header::CONTENT_TYPE, "application/x-protobuf")], b).into_response()
        }
        Some(Outcome::Failed { error, category }) => {
            Json(json!({"error": error, "category": category})).into_response()
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A result set while a retrieval waits wakes it; one set before is read at once; none
    /// within the wait is `None` (try again).
    #[tokio::test]
    async fn a_waiting_retrieval_gets_the_result_when_it_comes() {
        let futures = Futures::default();
        let (id, cell) = futures.pending("k");
        assert!(cell.wait(Duration::from_millis(20)).await.is_none());
        let waiter = {
            let cell = cell.clone();
            tokio::spawn(async move { cell.wait(Duration::from_secs(30)).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        cell.finish(Outcome::Proto(vec![1, 2]));
        let got = tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("woken")
            .unwrap();
        assert!(matches!(got, Some(Outcome::Proto(b)) if b == [1, 2]));
        assert!(matches!(
            cell.wait(Duration::ZERO).await,
            Some(Outcome::Proto(_))
        ));
        assert!(futures.0.get(&id, "other").is_none());
    }
}
