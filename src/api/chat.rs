//! `POST /v1/chat/completions`: messages through the model's chat template, then generation.

use super::body::JsonBody;
use super::error::ApiError;
use super::job::{Flavor, Job};
use super::openai::{
    check_scoring, parse_chat_logprobs, parse_common, parse_messages, parse_tools, Fields,
};
use super::respond::respond;
use super::tools::{ToolFormat, ToolMode};
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
    // The model's own template renders the tools and teaches the calls' format, which the
    // answer is parsed in; a template without tool support cannot take them.
    let tool_format =
        match &tools {
            None => None,
            Some(_) => {
                Some(
                    ready
                        .tokenizer
                        .chat_template()
                        .and_then(ToolFormat::of_template)
                        .ok_or_else(|| {
                            ApiError::invalid(
                        if f.get("tools").is_some() { "tools" } else { "functions" },
                        "this model's chat template does not render tools in a format this \
                         server parses (Hermes <tool_call> or Llama 3 JSON); the generic format \
                         needs constrained decoding, not built yet",
                    )
                        })?,
                )
            }
        };
    let choice_none = f
        .get("tool_choice")
        .or_else(|| f.get("function_call"))
        .and_then(|v| v.as_str())
        == Some("none");
    let parallel = f.bool("parallel_tool_calls")?.unwrap_or(true);
    let (_, adapter) = state.resolve_model(&params.model)?;
    let tok = ready.tokenizer.clone();
    // A turn of an episode through a learning adapter continues the episode's last turn with
    // the very tokens it sampled where the conversation re-renders them (token in, token out).
    let last_turn = match (&params.episode, &adapter) {
        (Some(ep), Some(a)) => ready.learning(&a.name).map(|o| {
            (
                o.log.clone(),
                ep.clone(),
                super::bearer_of(&headers).to_string(),
            )
        }),
        _ => None,
    };
    let prompt_ids = blocking(move || {
        let text = tok
            .render_chat(&messages, tools.as_ref(), true)
            .map_err(|e| ApiError::invalid("messages", format!("chat template: {e}")))?;
        if let Some((log, ep, key)) = last_turn {
            if let Some((prompt, completion)) = log.last_turn(&ep, &key).map_err(ApiError::from)? {
                let before = [prompt, completion].concat();
                let said = tok.decode(&before);
                if let Some(rest) = text.strip_prefix(said.as_str()) {
                    let more = tok
                        .encode_with(rest, false)
                        .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
                    return Ok([before, more].concat());
                }
            }
        }
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
        tools: tool_format.filter(|_| !choice_none).map(|format| ToolMode {
            format,
            parallel,
            legacy: f.get("functions").is_some(),
        }),
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
