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
use super::sessions::SessionTurn;
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
    /// The agent session the request is a turn of.
    pub turn: Option<SessionTurn>,
}

impl Generation {
    /// Validate `f` as `dialect` spells it; `tools` is the grammar a chat request's tools impose;
    /// `turn` the agent session the request is a turn of.
    pub async fn validate(
        state: &AppState,
        f: &Fields<'_>,
        dialect: Dialect,
        tools: Option<Structured>,
        turn: Option<SessionTurn>,
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
        let adapter = match &turn {
            None => state.resolve_model(&params.model)?.1,
            Some(t) => Some(in_session(state, &mut params, t)?),
        };
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
            turn,
        })
    }

    /// Who the request's completions belong to: the caller's key, or the session's principal.
    pub fn key(&self, headers: &HeaderMap) -> String {
        match &self.turn {
            Some(t) => t.principal(),
            None => bearer_of(headers).to_string(),
        }
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
        let key = self.key(headers);
        Job {
            flavor,
            params: self.params,
            prompt_ids,
            echo: None,
            adapter: self.adapter,
            prompt_param,
            key,
            group_owner: self.turn.map(|t| t.owner),
            tools: None,
            constraint: self.constraint,
            reasoning: None,
            id: None,
            unlogged: false,
        }
    }
}

/// A session turn's parameters: the session's episode and group, one completion, on the
/// session's adapter whatever `model` the agent names (the response's `model` says which served).
fn in_session(
    state: &AppState,
    params: &mut CommonParams,
    t: &SessionTurn,
) -> Result<Pinned, ApiError> {
    t.check_turns()?;
    for (field, given) in [
        ("episode", params.episode.is_some()),
        ("group", params.group.is_some()),
    ] {
        if given {
            return Err(ApiError::invalid(
                field,
                format!("a session's turns take the session's {field}: leave out '{field}'"),
            ));
        }
    }
    if params.n > 1 {
        return Err(ApiError::invalid(
            "n",
            "a session's turn is one completion: 'n' must be 1",
        ));
    }
    params.episode = Some(t.id.clone());
    params.group = Some(t.group.clone());
    params.model = t.adapter.clone();
    state
        .ready()?
        .registry
        .pin(&t.adapter)
        .ok_or_else(|| ApiError::model_not_found(&t.adapter))
}
