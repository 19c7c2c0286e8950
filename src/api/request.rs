//! A request as the engine takes it: the prompt truncated as asked (`truncate_prompt_tokens`),
//! lengths checked against the context, `max_tokens` defaulted, bad words tokenized.

use super::error::ApiError;
use super::job::{Flavor, Job};
use crate::engine::GenerateRequest;
use crate::model::tokenizer::Tokenizer;

/// `max_tokens` of a legacy completion that does not say it.
pub const LEGACY_DEFAULT_MAX_TOKENS: usize = 16;

/// vLLM's `truncate_prompt_tokens`: keep the prompt's last k tokens (-1: the context length).
pub(super) fn truncate_prompt(job: &mut Job, max_model_len: usize) {
    if let Some(k) = job.params.truncate_prompt_tokens {
        let k = if k < 0 { max_model_len } else { k as usize };
        let n = job.prompt_ids.len();
        if n > k {
            job.prompt_ids.drain(..n - k);
        }
    }
}

/// vLLM's bad words as token sequences: each as written and after a space (its form inside a
/// text), both without special tokens.
fn bad_word_tokens(tok: &Tokenizer, words: &[String]) -> Result<Vec<Vec<u32>>, ApiError> {
    let mut out: Vec<Vec<u32>> = Vec::new();
    for w in words {
        let w = w.trim_start();
        for text in [w.to_string(), format!(" {w}")] {
            let ids = tok
                .encode_with(&text, false)
                .map_err(|e| ApiError::invalid("bad_words", e.to_string()))?;
            if !ids.is_empty() && !out.contains(&ids) {
                out.push(ids);
            }
        }
    }
    Ok(out)
}

/// Check lengths against the context and build the engine request.
pub(super) fn engine_request(job: &Job, ready: &super::Ready) -> Result<GenerateRequest, ApiError> {
    let max_model_len = ready.max_model_len;
    let n_prompt = job.prompt_ids.len();
    if n_prompt >= max_model_len {
        return Err(ApiError::invalid(
            job.prompt_param,
            format!(
                "the prompt has {n_prompt} tokens; this model's context length is {max_model_len}, \
                 which must also leave room for at least one generated token"
            ),
        ));
    }
    let p = &job.params;
    let max_tokens = match p.max_tokens {
        Some(m) if n_prompt + m > max_model_len => {
            return Err(ApiError::invalid(
                "max_tokens",
                format!(
                    "the prompt ({n_prompt} tokens) plus max_tokens ({m}) is over this model's \
                     context length ({max_model_len})"
                ),
            ))
        }
        Some(m) => m,
        // Legacy completions default to 16 tokens, as OpenAI's and vLLM's do; chat runs to the
        // end of the context.
        None if job.flavor == Flavor::Completion => {
            LEGACY_DEFAULT_MAX_TOKENS.min(max_model_len - n_prompt)
        }
        None => max_model_len - n_prompt,
    };
    let mut sampling = p.sampling.clone();
    if !p.bad_words.is_empty() {
        sampling.bad_words = bad_word_tokens(&ready.tokenizer, &p.bad_words)?.into();
    }
    Ok(GenerateRequest {
        prompt: job.prompt_ids.clone(),
        n: p.n,
        max_tokens,
        sampling,
        seed: p.seed,
        stop: p.stop.clone(),
        stop_token_ids: p.stop_token_ids.clone(),
        ignore_eos: p.ignore_eos,
        include_stop_str_in_output: p.include_stop_str_in_output,
        adapter: job.adapter.as_ref().map(|a| a.version().clone()),
        prompt_logprobs: p.prompt_logprobs,
        constraint: job.constraint.as_ref().map(|c| c.grammar.clone()),
        embed: false,
        // The request's say, else its learning adapter's.
        repetition: match p.stop_on_repetition {
            Some(r) => r,
            None => job
                .adapter
                .as_ref()
                .and_then(|a| ready.online.get()?.repetition_rule(&a.name)),
        },
        // A learning adapter with `version_policy = "latest"`: its logged generations move to
        // each version its trainer publishes (partial rollouts).
        follow: job
            .adapter
            .as_ref()
            .filter(|_| !job.unlogged)
            .and_then(|a| {
                let keep = ready.online.get()?.follows_latest(&a.name)?;
                let slot = ready.registry.get(&a.name)?;
                Some(crate::engine::Follow::new(slot, a, keep))
            }),
    })
}
