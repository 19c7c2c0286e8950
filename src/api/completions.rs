//! `POST /v1/completions`: raw prompts (text or token ids, one or a batch), optionally echoed.

use super::body::JsonBody;
use super::error::ApiError;
use super::generation::{Dialect, Generation};
use super::job::Flavor;
use super::openai::{parse_prompts, Fields, Prompt};
use super::respond::{respond, respond_many};
use super::sessions::SessionTurn;
use super::state::{blocking, AppState};
use axum::extract::State;
use axum::response::Response;
use axum::Extension;

pub async fn completions(
    State(state): State<AppState>,
    turn: Option<Extension<SessionTurn>>,
    headers: axum::http::HeaderMap,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let ready = state.ready()?;
    let f = Fields::parse(&body)?;
    let prompts = parse_prompts(&f, ready.vocab_size)?;
    let echo = f.bool("echo")?.unwrap_or(false);
    let turn = turn.map(|Extension(t)| t);
    if turn.is_some() && prompts.len() > 1 {
        return Err(ApiError::invalid(
            "prompt",
            "a session's turn is one prompt: send the prompts as turns one by one",
        ));
    }
    let generation =
        Generation::validate(&state, &f, Dialect::Completion { echo }, None, turn).await?;
    let tok = ready.tokenizer.clone();
    let encoded = blocking(move || {
        prompts
            .into_iter()
            .map(|prompt| match prompt {
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
            .collect::<Result<Vec<_>, ApiError>>()
    })
    .await?;
    let several = encoded.len() > 1;
    // Each prompt holds its own pin of the same version.
    let jobs: Vec<_> = encoded
        .into_iter()
        .map(|(prompt_ids, text)| {
            let mut job =
                generation
                    .clone()
                    .job(Flavor::Completion, prompt_ids, "prompt", &headers);
            job.echo = echo.then_some(text);
            job
        })
        .collect();
    if several {
        respond_many(&state, jobs).await
    } else {
        respond(&state, jobs.into_iter().next().expect("one prompt")).await
    }
}
