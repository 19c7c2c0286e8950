//! The one mapping from failures to HTTP status + OpenAI error body
//! `{"error": {"message", "type", "param", "code"}}`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    pub retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 400 naming the offending field.
    pub fn invalid(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            param: Some(param.to_string()),
            ..ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }

    /// The same error about a field nested in `parent` (its `param` becomes `parent.param`).
    pub fn within(mut self, parent: &str) -> ApiError {
        if let Some(p) = &self.param {
            self.param = Some(format!("{parent}.{p}"));
        }
        self
    }

    /// An error of the request as a whole with this status (413, 415, 408, 405).
    pub fn status(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError::new(status, "invalid_request_error", message)
    }

    pub fn bad_body(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    pub fn unauthorized() -> ApiError {
        ApiError {
            code: Some("invalid_api_key"),
            ..ApiError::new(
                StatusCode::UNAUTHORIZED,
                "authentication_error",
                "missing or wrong API key: send 'Authorization: Bearer <key>'",
            )
        }
    }

    /// 403 with `code` saying what was refused.
    pub fn forbidden(code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            code: Some(code),
            ..ApiError::new(StatusCode::FORBIDDEN, "permission_error", message)
        }
    }

    pub fn conflict(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            param: Some(param.to_string()),
            ..ApiError::new(StatusCode::CONFLICT, "invalid_request_error", message)
        }
    }

    pub fn model_not_found(model: &str) -> ApiError {
        ApiError {
            param: Some("model".into()),
            code: Some("model_not_found"),
            ..ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!("the model '{model}' does not exist"),
            )
        }
    }

    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", message)
    }

    pub fn overloaded(message: impl Into<String>, retry_after: u64) -> ApiError {
        ApiError {
            retry_after: Some(retry_after),
            code: Some("rate_limit_exceeded"),
            ..ApiError::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message)
        }
    }

    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            message,
        )
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// The body, also sent as a `data:` line when a stream fails midway.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if let Some(s) = self.retry_after {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}

/// The rollout log's errors: 503 once its database became unusable, 500 otherwise.
impl From<crate::online::records::LogError> for ApiError {
    fn from(e: crate::online::records::LogError) -> ApiError {
        use crate::online::records::LogError;
        match e {
            LogError::Broken(_) => ApiError {
                code: Some("rollout_log_unavailable"),
                ..ApiError::unavailable(format!("{e}; nothing more is recorded until a restart"))
            },
            // Out of space, read-only, I/O errors: the storage, not the request; retry later.
            LogError::Db(rusqlite::Error::SqliteFailure(f, _))
                if matches!(
                    f.code,
                    rusqlite::ErrorCode::DiskFull
                        | rusqlite::ErrorCode::ReadOnly
                        | rusqlite::ErrorCode::SystemIoFailure
                        | rusqlite::ErrorCode::CannotOpen
                ) =>
            {
                ApiError {
                    code: Some("rollout_log_storage"),
                    ..ApiError::unavailable(format!(
                        "the rollout log cannot write ({e}); nothing was recorded"
                    ))
                }
            }
            LogError::Db(e) => ApiError::internal(format!("the rollout log failed: {e}")),
            // PostgreSQL unreachable, restarted or timed out: nothing was recorded; retry.
            LogError::Pg(ref pg) if pg.as_db_error().is_none() || pg.is_closed() => ApiError {
                code: Some("rollout_log_unavailable"),
                ..ApiError::unavailable(format!("{e}; nothing was recorded"))
            },
            LogError::Pg(_) | LogError::Conflict(_) => {
                ApiError::internal(format!("the rollout log failed: {e}"))
            }
        }
    }
}
