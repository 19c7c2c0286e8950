//! Browsers: CORS for the origins `--allowed-origins` names (preflights answered, responses
//! marked), and a 403 for a request a browser sends from any other origin, so that no web page
//! can drive this server (its admin routes are open on loopback without a key, and a JSON body
//! sent as a form is taken) from a user's browser.

use super::error::ApiError;
use super::state::AppState;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

const METHODS: &str = "GET, POST, PUT, DELETE, OPTIONS";

/// Whether `origin` may call: listed (or `*` listed), or the server's own (same scheme-less
/// host and port as the request's `Host`).
fn allowed(origins: &[String], origin: &str, headers: &HeaderMap) -> bool {
    if origins
        .iter()
        .any(|o| o == "*" || o.eq_ignore_ascii_case(origin))
    {
        return true;
    }
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("");
    let bare = origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"));
    !host.is_empty() && bare.is_some_and(|b| b.eq_ignore_ascii_case(host))
}

pub async fn cors(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let origin = req
        .headers()
        .get(header::ORIGIN)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let origins = &state.limits.allowed_origins;
    let Some(origin) = origin else {
        // Not a browser's cross-origin call: an OPTIONS says what the server takes.
        if req.method() == Method::OPTIONS {
            return (
                StatusCode::NO_CONTENT,
                [(header::ALLOW, HeaderValue::from_static(METHODS))],
            )
                .into_response();
        }
        return next.run(req).await;
    };
    if !allowed(origins, &origin, req.headers()) {
        return ApiError::forbidden(
            "origin_not_allowed",
            format!(
                "requests from origin '{origin}' are not allowed: start the server with \
                 --allowed-origins {origin} (or '*')"
            ),
        )
        .into_response();
    }
    let allow_origin = if origins.iter().any(|o| o == "*") {
        HeaderValue::from_static("*")
    } else {
        HeaderValue::from_str(&origin).unwrap_or(HeaderValue::from_static("null"))
    };
    if req.method() == Method::OPTIONS {
        let asked = req
            .headers()
            .get(header::ACCESS_CONTROL_REQUEST_HEADERS)
            .cloned()
            .unwrap_or(HeaderValue::from_static("authorization, content-type"));
        return (
            StatusCode::NO_CONTENT,
            [
                (header::ACCESS_CONTROL_ALLOW_ORIGIN, allow_origin),
                (
                    header::ACCESS_CONTROL_ALLOW_METHODS,
                    HeaderValue::from_static(METHODS),
                ),
                (header::ACCESS_CONTROL_ALLOW_HEADERS, asked),
                (
                    header::ACCESS_CONTROL_MAX_AGE,
                    HeaderValue::from_static("600"),
                ),
                (header::VARY, HeaderValue::from_static("Origin")),
            ],
        )
            .into_response();
    }
    let mut resp = next.run(req).await;
    let h = resp.headers_mut();
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, allow_origin);
    h.insert(
        header::ACCESS_CONTROL_EXPOSE_HEADERS,
        HeaderValue::from_static("*"),
    );
    h.append(header::VARY, HeaderValue::from_static("Origin"));
    resp
}

#[cfg(test)]
mod tests {
    use super::allowed;
    use axum::http::{header, HeaderMap, HeaderValue};

    #[test]
    fn listed_any_or_own_origins_are_allowed() {
        let mut h = HeaderMap::new();
        h.insert(header::HOST, HeaderValue::from_static("127.0.0.1:8080"));
        let list = vec!["https://app.example".to_string()];
        assert!(allowed(&list, "https://app.example", &h));
        assert!(allowed(&list, "http://127.0.0.1:8080", &h));
        assert!(!allowed(&list, "https://evil.example", &h));
        assert!(!allowed(&list, "http://127.0.0.1:8081", &h));
        assert!(!allowed(&[], "null", &h));
        assert!(allowed(&["*".into()], "https://evil.example", &h));
    }
}
