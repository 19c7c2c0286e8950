//! The JSON request body every POST route reads: media type and encoding checked (415), size
//! bounded (413, the limit configurable), read within a deadline (408, slow clients), parsed
//! (400), each in the OpenAI error shape.

use super::error::ApiError;
use super::state::AppState;
use axum::extract::{FromRequest, Request};
use axum::http::{header, StatusCode};
use serde_json::Value;

/// Bodies declared up to this many times the limit are read to their end before the 413.
const DRAIN_FACTOR: usize = 4;

/// A request body parsed as JSON.
pub struct JsonBody(pub Value);

impl FromRequest<AppState> for JsonBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<JsonBody, ApiError> {
        let h = req.headers();
        check_identity(h, "JSON")?;
        // No Content-Type is taken as JSON (hand-written clients), and so is curl's default for
        // `-d` (a form type) when the body is JSON, as llama-server takes it; any other type is
        // refused.
        let mut form = None;
        if let Some(ct) = h.get(header::CONTENT_TYPE) {
            let ct = ct.to_str().unwrap_or("?");
            let essence = ct
                .split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase();
            let json = essence == "application/json"
                || (essence.starts_with("application/") && essence.ends_with("+json"));
            if essence == "application/x-www-form-urlencoded" {
                form = Some(ct.to_string());
            } else if !json {
                return Err(ApiError::status(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    format!("Content-Type '{ct}' is not supported: send application/json"),
                ));
            }
        }
        let bytes = read_limited(req, state).await?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            // No body: the handler decides whether it needs one (most say "a JSON object").
            return Ok(JsonBody(serde_json::Value::Null));
        }
        serde_json::from_slice(&bytes)
            .map(JsonBody)
            .map_err(|e| match &form {
                Some(ct) => ApiError::status(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    format!(
                        "Content-Type '{ct}' is taken only for a JSON body: send application/json"
                    ),
                ),
                None => ApiError::bad_body(format!("the request body is not valid JSON: {e}")),
            })
    }
}

/// The body, at most `limits.max_body_bytes` (413), within `limits.body_read_timeout` (408).
async fn read_limited(req: Request, state: &AppState) -> Result<axum::body::Bytes, ApiError> {
    let h = req.headers();
    let limit = state.limits.max_body_bytes;
    let too_large = || {
        ApiError::status(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the request body is larger than the limit of {limit} bytes"),
        )
    };
    let declared = h
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let timeout = state.limits.body_read_timeout;
    if declared.is_some_and(|n| n > limit as u64) {
        // Read (and drop) a body up to DRAIN_FACTOR × the limit so that a client still
        // sending reads the 413 instead of a reset; a larger one is cut off.
        if declared.is_some_and(|n| n <= (DRAIN_FACTOR * limit) as u64) {
            let drain = axum::body::to_bytes(req.into_body(), DRAIN_FACTOR * limit);
            let _ = tokio::time::timeout(timeout, drain).await;
        }
        return Err(too_large());
    }
    let read = axum::body::to_bytes(req.into_body(), limit);
    match tokio::time::timeout(timeout, read).await {
        Err(_) => Err(ApiError::status(
            StatusCode::REQUEST_TIMEOUT,
            "the request body did not arrive in time",
        )),
        Ok(Err(e)) => {
            let length_limit = std::error::Error::source(&e)
                .is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
            Err(if length_limit {
                too_large()
            } else {
                ApiError::bad_body(format!("reading the request body: {e}"))
            })
        }
        Ok(Ok(b)) => Ok(b),
    }
}

/// A body sent uncompressed (`Content-Encoding` absent or identity), else 415.
fn check_identity(h: &axum::http::HeaderMap, what: &str) -> Result<(), ApiError> {
    if let Some(enc) = h.get(header::CONTENT_ENCODING) {
        let enc = enc.to_str().unwrap_or("?").trim().to_ascii_lowercase();
        if !enc.is_empty() && enc != "identity" {
            return Err(ApiError::status(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                format!(
                    "Content-Encoding '{enc}' is not supported: send the {what} body uncompressed"
                ),
            ));
        }
    }
    Ok(())
}

/// A protobuf request body (`Content-Type: application/x-protobuf`, the Tinker SDK's
/// `forward_backward`), bounded and read like a JSON one, not yet decoded.
pub struct ProtoBody(pub axum::body::Bytes);

impl FromRequest<AppState> for ProtoBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<ProtoBody, ApiError> {
        let h = req.headers();
        check_identity(h, "protobuf")?;
        let ct = h
            .get(header::CONTENT_TYPE)
            .map(|v| v.to_str().unwrap_or("?").to_string())
            .unwrap_or_default();
        if ct.split(';').next().unwrap_or("").trim() != "application/x-protobuf" {
            return Err(ApiError::status(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                format!("Content-Type '{ct}' is not supported: send application/x-protobuf"),
            ));
        }
        Ok(ProtoBody(read_limited(req, state).await?))
    }
}
