//! `POST /v1/completions`: a raw prompt (text or token ids), optionally echoed.

use super::body::JsonBody;
use super::error::ApiError;
use super::job::{Flavor, Job};
use super::openai::{
    check_scoring, parse_common, parse_completion_logprobs, parse_prompt, Fields, Prompt,
};
use super::respond::respond;
use super::{blocking, AppState};
use axum::extract::State;
use axum::response::Response;

pub async fn completions(
    State(state): State<AppState>,
    headers: axum::http::HeaderMap,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let ready = state.ready()?;
    let f = Fields::parse(&body)?;
    let mut params = parse_common(&f, ready.vocab_size)?;
    parse_completion_logprobs(&f, &mut params)?;
    let prompt = parse_prompt(&f, ready.vocab_size)?;
    let echo = f.bool("echo")?.unwrap_or(false);
    check_scoring(&f, &mut params, echo)?;
    let (_, adapter) = state.resolve_model(&params.model)?;
    let tok = ready.tokenizer.clone();
    let (prompt_ids, text) = blocking(move || match prompt {
        Prompt::Text(t) => {
            let ids = tok
                .encode(&t)
                .map_err(|e| ApiError::invalid("prompt", e.to_string()))?;
            if ids.is_empty() {
                return Err(ApiError::invalid("prompt", "the prompt is empty"));
            }
            Ok((ids, t))
        }
        Prompt::Ids(ids) => {
            let t = tok.decode(&ids);
            Ok((ids, t))
        }
    })
    .await?;
    let job = Job {
        flavor: Flavor::Completion,
        params,
        prompt_ids,
        echo: echo.then_some(text),
        adapter,
        prompt_param: "prompt",
        key: super::bearer_of(&headers).to_string(),
    };
    respond(&state, job).await
}
