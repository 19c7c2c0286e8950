//! What every generating route (chat, completions, vLLM's generate) validates alike, in one
//! place: the sampling parameters, the logprobs fields in the route's dialect, prompt scoring's
//! rules, the model (the base or a pinned adapter version) and the grammar the output follows
//! (structured outputs or the tools'), compiled. Each route adds only its prompt.

use super::error::ApiError;
use super::job::{Flavor, Job};
use super::openai::{
    check_scoring, parse_chat_logprobs, parse_common, parse_completion_logprobs, CommonParams,
    Fields,
};
use super::state::{bearer_of, AppState};
use super::structured::{output_grammar, Structured};
use crate::adapter::registry::Pinned;
use axum::http::HeaderMap;

/// How a route spells its logprobs and where its parameters live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Dialect {
    /// `logprobs: bool` + `top_logprobs: k`.
    Chat,
    /// `logprobs: k`; `echo` scores the prompt.
    Completion { echo: bool },
    /// vLLM's `sampling_params` (`logprobs: k`): errors name the field under it.
    Generate,
}

/// A generating request's parameters, validated.
#[derive(Clone)]
pub(super) struct Generation {
    pub params: CommonParams,
    /// The adapter version pinned for the request (None: the base model).
    pub adapter: Option<Pinned>,
    /// The compiled grammar each choice starts from.
    pub constraint: Option<super::job::OutputConstraint>,
}

impl Generation {
    /// Validate `f` as `dialect` spells it; `tools` is the grammar a chat request's tools impose.
    pub async fn validate(
        state: &AppState,
        f: &Fields<'_>,
        dialect: Dialect,
        tools: Option<Structured>,
    ) -> Result<Generation, ApiError> {
        let ready = state.ready()?;
        let scope = |e: ApiError| match dialect {
            Dialect::Generate => e.within("sampling_params"),
            _ => e,
        };
        let mut params = parse_common(f, ready.vocab_size).map_err(scope)?;
        match dialect {
            Dialect::Chat => {
                parse_chat_logprobs(f, &mut params)?;
                check_scoring(f, &mut params, false)?;
            }
            Dialect::Completion { echo } => {
                parse_completion_logprobs(f, &mut params)?;
                check_scoring(f, &mut params, echo)?;
            }
            Dialect::Generate => {
                // logprobs: k returns the sampled token's and the k best (vLLM); 0 the sampled
                // one's. Tokens are named by id (the route returns no text).
                parse_completion_logprobs(f, &mut params).map_err(scope)?;
                params.return_tokens_as_token_ids = true;
            }
        }
        let (_, adapter) = state.resolve_model(&params.model)?;
        let constraint = match output_grammar(f, tools).map_err(scope)? {
            Some(g) => {
                params.sampling.constrained = true;
                let field = match dialect {
                    Dialect::Generate => format!("sampling_params.{}", g.field),
                    _ => g.field,
                };
                Some(ready.compile(field, g.spec).await?)
            }
            None => None,
        };
        Ok(Generation {
            params,
            adapter,
            constraint,
        })
    }

    /// The request as `respond` takes it, for the caller in `headers`, with the prompt's tokens
    /// (from field `prompt_param`, named in length errors); the route sets what else it has.
    pub fn job(
        self,
        flavor: Flavor,
        prompt_ids: Vec<u32>,
        prompt_param: &'static str,
        headers: &HeaderMap,
    ) -> Job {
        Job {
            flavor,
            params: self.params,
            prompt_ids,
            echo: None,
            adapter: self.adapter,
            prompt_param,
            key: bearer_of(headers).to_string(),
            tools: None,
            constraint: self.constraint,
            reasoning: None,
            id: None,
            unlogged: false,
        }
    }
}
