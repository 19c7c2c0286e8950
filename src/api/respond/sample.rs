//! A job run to its end for the Tinker API's samples (`api::tinker::sample`): submitted now,
//! collected as token ids and log-probs rather than shaped as an OpenAI body.

use super::{collect, start};
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
    job: Job,
) -> Result<impl std::future::Future<Output = Result<Sampled, ApiError>> + Send + 'static, ApiError>
{
    let (r, stream) = start(state, job)?;
    Ok(async move {
        let r = collect(r, stream).await?;
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
