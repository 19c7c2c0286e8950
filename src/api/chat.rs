//! `POST /v1/chat/completions`: messages through the model's chat template, then generation.

use super::body::JsonBody;
use super::error::ApiError;
use super::generation::{Dialect, Generation};
use super::job::Flavor;
use super::messages::Conversation;
use super::openai::Fields;
use super::reasoning;
use super::respond::respond;
use super::sessions::SessionTurn;
use super::state::{blocking, AppState};
use crate::adapter::registry::Pinned;
use axum::extract::State;
use axum::response::Response;
use axum::Extension;

pub async fn chat_completions(
    State(state): State<AppState>,
    turn: Option<Extension<SessionTurn>>,
    headers: axum::http::HeaderMap,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let opts = ChatOptions {
        turn: turn.map(|Extension(t)| t),
        ..ChatOptions::default()
    };
    run_chat(&state, &headers, &body, opts).await
}

/// What a route that makes a chat request itself chooses.
#[derive(Default)]
pub(super) struct ChatOptions {
    /// The response's id (the Responses API's own ids).
    pub id: Option<String>,
    /// The version to run on instead of the one `model` names (an evaluation's candidate).
    pub version: Option<Pinned>,
    /// Not logged for training (an evaluation's request).
    pub unlogged: bool,
    /// The agent session the request is a turn of.
    pub turn: Option<SessionTurn>,
}

/// A chat request, as `opts` say.
pub(super) async fn run_chat(
    state: &AppState,
    headers: &axum::http::HeaderMap,
    body: &serde_json::Value,
    opts: ChatOptions,
) -> Result<Response, ApiError> {
    let ready = state.ready()?;
    let f = Fields::parse(body)?;
    let conversation = Conversation::parse(&f, ready.tokenizer.chat_template())?;
    let tool_grammar = conversation.tool_grammar()?;
    let mut generation =
        Generation::validate(state, &f, Dialect::Chat, tool_grammar, opts.turn).await?;
    if let Some(v) = opts.version {
        generation.adapter = Some(v);
    }
    let (tool_mode, reasons) = (conversation.tool_mode(), conversation.reasons);
    let inputs = conversation.into_inputs();
    let tok = ready.tokenizer.clone();
    // A turn of an episode through a learning adapter continues the episode's last turn with
    // the very tokens it sampled where the conversation re-renders them (token in, token out).
    let last_turn = match (&generation.params.episode, &generation.adapter) {
        (Some(ep), Some(a)) => ready
            .learning(&a.name)
            .map(|l| (l.store.clone(), ep.clone(), generation.key(headers))),
        _ => None,
    };
    let (prompt_ids, thinking_at_start) = blocking(move || {
        let text = inputs.render(&tok)?;
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
    let mut job = generation.job(Flavor::Chat, prompt_ids, "messages", headers);
    job.tools = tool_mode;
    job.reasoning = reasons.then_some(thinking_at_start);
    job.id = opts.id;
    job.unlogged = opts.unlogged;
    respond(state, job).await
}
