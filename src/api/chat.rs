//! `POST /v1/chat/completions`: messages through the model's chat template, then generation.

use super::body::JsonBody;
use super::error::ApiError;
use super::job::{Flavor, Job};
use super::openai::{
    check_scoring, parse_chat_logprobs, parse_common, parse_messages, parse_tools, Fields,
};
use super::respond::respond;
use super::{blocking, AppState};
use axum::extract::State;
use axum::response::Response;

pub async fn chat_completions(
    State(state): State<AppState>,
    headers: axum::http::HeaderMap,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let ready = state.ready()?;
    let f = Fields::parse(&body)?;
    let mut params = parse_common(&f, ready.vocab_size)?;
    parse_chat_logprobs(&f, &mut params)?;
    check_scoring(&f, &mut params, false)?;
    let messages = parse_messages(&f)?;
    let tools = parse_tools(&f)?;
    check_tool_choice(&f, tools.is_some())?;
    let (_, adapter) = state.resolve_model(&params.model)?;
    let tok = ready.tokenizer.clone();
    let prompt_ids = blocking(move || {
        let text = tok
            .render_chat(&messages, tools.as_ref(), true)
            .map_err(|e| ApiError::invalid("messages", format!("chat template: {e}")))?;
        // The template writes its own BOS.
        tok.encode_with(&text, false)
            .map_err(|e| ApiError::invalid("messages", e.to_string()))
    })
    .await?;
    let job = Job {
        flavor: Flavor::Chat,
        params,
        prompt_ids,
        echo: None,
        adapter,
        prompt_param: "messages",
        key: super::bearer_of(&headers).to_string(),
    };
    respond(&state, job).await
}

/// `tool_choice` (`function_call`, legacy): "none" and "auto" (the default) are served — the
/// tools are in the prompt through the model's template; a required or named call needs
/// constrained decoding, not built yet: a 400 naming the field. `parallel_tool_calls` must be a
/// boolean.
fn check_tool_choice(f: &Fields, has_tools: bool) -> Result<(), ApiError> {
    f.bool("parallel_tool_calls")?;
    for name in ["tool_choice", "function_call"] {
        let Some(v) = f.get(name) else { continue };
        match v.as_str() {
            Some("none" | "auto") => {}
            Some("required") | None if v.is_object() || v.as_str() == Some("required") => {
                return Err(ApiError::invalid(
                    name,
                    format!(
                        "'{name}' = {v}: forcing a tool call needs constrained decoding, which \
                         this server does not have yet; use \"auto\""
                    ),
                ))
            }
            _ => {
                return Err(ApiError::invalid(
                    name,
                    format!(
                        "'{name}' must be \"none\", \"auto\", \"required\" or a named function"
                    ),
                ))
            }
        }
        if !has_tools && v.as_str() != Some("none") {
            return Err(ApiError::invalid(name, format!("'{name}' needs 'tools'")));
        }
    }
    Ok(())
}
