//! `POST /v1/completions`: raw prompts (text or token ids, one or a batch), optionally echoed.

use super::body::JsonBody;
use super::error::ApiError;
use super::job::{Flavor, Job};
use super::openai::{
    check_scoring, parse_common, parse_completion_logprobs, parse_prompts, Fields, Prompt,
};
use super::respond::{respond, respond_many};
use super::state::{blocking, AppState};
use super::structured::output_grammar;
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
    let prompts = parse_prompts(&f, ready.vocab_size)?;
    let echo = f.bool("echo")?.unwrap_or(false);
    check_scoring(&f, &mut params, echo)?;
    let (_, adapter) = state.resolve_model(&params.model)?;
    let constraint = match output_grammar(&f, None)? {
        Some(g) => {
            params.sampling.constrained = true;
            Some(ready.compile(g.field, g.spec).await?)
        }
        None => None,
    };
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
    let key = super::state::bearer_of(&headers).to_string();
    let several = encoded.len() > 1;
    let mut jobs = Vec::with_capacity(encoded.len());
    for (prompt_ids, text) in encoded {
        jobs.push(Job {
            flavor: Flavor::Completion,
            params: params.clone(),
            prompt_ids,
            echo: echo.then_some(text),
            // Each prompt holds its own pin of the same version.
            adapter: adapter.clone(),
            prompt_param: "prompt",
            key: key.clone(),
            tools: None,
            constraint: constraint.clone(),
            reasoning: None,
            id: None,
        });
    }
    if several {
        respond_many(&state, jobs).await
    } else {
        respond(&state, jobs.pop().expect("one prompt")).await
    }
}
