//! `POST /v1/chat/completions`: messages through the model's chat template, then generation.

use super::body::JsonBody;
use super::error::ApiError;
use super::job::{Flavor, Job};
use super::messages::{
    history_without_tools, parse_chat_render, parse_messages, render_param, request_tools,
};
use super::openai::{check_scoring, parse_chat_logprobs, parse_common, Fields};
use super::reasoning;
use super::respond::respond;
use super::state::{blocking, AppState};
use super::structured::output_grammar;
use axum::extract::State;
use axum::response::Response;

pub async fn chat_completions(
    State(state): State<AppState>,
    headers: axum::http::HeaderMap,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    run_chat(&state, &headers, &body, None).await
}

/// A chat request, answered under `id` when given (the Responses API's own ids).
pub(super) async fn run_chat(
    state: &AppState,
    headers: &axum::http::HeaderMap,
    body: &serde_json::Value,
    id: Option<String>,
) -> Result<Response, ApiError> {
    let ready = state.ready()?;
    let f = Fields::parse(body)?;
    let render = parse_chat_render(&f)?;
    let mut params = parse_common(&f, ready.vocab_size)?;
    parse_chat_logprobs(&f, &mut params)?;
    check_scoring(&f, &mut params, false)?;
    let messages = parse_messages(&f)?;
    // The template (the request's, else the model's) renders the tools and teaches the calls'
    // format (else the generic format).
    let template = render
        .template
        .as_deref()
        .or(ready.tokenizer.chat_template());
    let tools = request_tools(&f, template)?;
    let reasons = template.is_some_and(reasoning::template_reasons);
    let (messages, tool_defs, tool_mode, tool_grammar) = match &tools {
        Some(t) => {
            let (m, defs) = t.render_inputs(messages);
            (m, defs, t.mode, t.grammar()?)
        }
        None => (history_without_tools(messages, template), None, None, None),
    };
    let grammar = output_grammar(&f, tool_grammar)?;
    let (_, adapter) = state.resolve_model(&params.model)?;
    let constraint = match grammar {
        Some(g) => {
            params.sampling.constrained = true;
            Some(ready.compile(g.field, g.spec).await?)
        }
        None => None,
    };
    let tok = ready.tokenizer.clone();
    // A turn of an episode through a learning adapter continues the episode's last turn with
    // the very tokens it sampled where the conversation re-renders them (token in, token out).
    let last_turn = match (&params.episode, &adapter) {
        (Some(ep), Some(a)) => ready.learning(&a.name).map(|o| {
            (
                o.log.clone(),
                ep.clone(),
                super::state::bearer_of(headers).to_string(),
            )
        }),
        _ => None,
    };
    let (prompt_ids, thinking_at_start) = blocking(move || {
        let text = tok
            .render_chat_with(&messages, tool_defs.as_ref(), &render)
            .map_err(|e| ApiError::invalid(render_param(&render), e.to_string()))?;
        let at_start = reasoning::starts_thinking(&text);
        if let Some((log, ep, key)) = last_turn {
            if let Some((prompt, completion)) = log.last_turn(&ep, &key).map_err(ApiError::from)? {
                let before = [prompt, completion].concat();
                let said = tok.decode(&before);
                if let Some(rest) = text.strip_prefix(said.as_str()) {
                    let more = tok
                        .encode_with(rest, false)
                        .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
                    return Ok(([before, more].concat(), at_start));
                }
            }
        }
        // The template writes its own BOS.
        tok.encode_with(&text, false)
            .map(|ids| (ids, at_start))
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
        key: super::state::bearer_of(headers).to_string(),
        tools: tool_mode,
        constraint,
        reasoning: reasons.then_some(thinking_at_start),
        id,
    };
    respond(state, job).await
}
