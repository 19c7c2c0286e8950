//! A job run to its end for the Tinker API's samples (`api::tinker::sample`): submitted now,
//! collected as token ids and log-probs rather than shaped as an OpenAI body.

use super::{admit, collect, engine_request, responder, submit, truncate_prompt};
use crate::api::error::ApiError;
use crate::api::job::Job;
use crate::api::state::AppState;
use crate::engine::sampler::PromptLogprob;
use crate::engine::FinishReason;

/// A job run to its end for the Tinker API's samples: per choice its token ids, the sampler's
/// log-prob of each and why it ended, and the prompt's scores when asked for.
pub struct Sampled {
    pub choices: Vec<SampledChoice>,
    pub prompt: Option<Vec<PromptLogprob>>,
}

pub struct SampledChoice {
    pub token_ids: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub finish: FinishReason,
}

/// Submit `job` now (admitted like any request: a 429 or 400 is returned here); the future
/// collects it.
pub fn sample(
    state: &AppState,
    mut job: Job,
) -> Result<impl std::future::Future<Output = Result<Sampled, ApiError>> + Send + 'static, ApiError>
{
    let ready = state.ready()?;
    truncate_prompt(&mut job, ready.max_model_len);
    let req = engine_request(&job, ready)?;
    let admission = admit(state, &job, 1)?;
    let stream = submit(state, &job, req, &admission)?;
    let r = responder(ready, job);
    Ok(async move {
        let r = collect(r, stream).await?;
        drop(admission);
        Ok(Sampled {
            choices: r
                .choices
                .into_iter()
                .map(|c| SampledChoice {
                    finish: c.finish.map_or(FinishReason::Length, |(f, _)| f),
                    token_ids: c.token_ids,
                    logprobs: c.behavior,
                })
                .collect(),
            prompt: r.prompt_scores,
        })
    })
}
