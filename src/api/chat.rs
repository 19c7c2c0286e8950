//! `POST /v1/chat/completions`: messages through the model's chat template, then generation.

use super::body::JsonBody;
use super::error::ApiError;
use super::job::{Flavor, Job};
use super::openai::{check_scoring, parse_chat_logprobs, parse_common, parse_messages, Fields};
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
    let (_, adapter) = state.resolve_model(&params.model)?;
    let tok = ready.tokenizer.clone();
    let prompt_ids = blocking(move || {
        let text = tok
            .apply_chat_template(&messages, true)
            .map_err(|e| ApiError::invalid("messages", format!("chat template: {e}")))?;
        tok.encode(&text)
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
