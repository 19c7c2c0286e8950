//! Prompt scores in the response: vLLM's `prompt_logprobs` (one entry per prompt token, `null`
//! first, each mapping token ids to `{logprob, rank, decoded_token}`) and the legacy completions
//! `logprobs` of an echoed prompt (OpenAI's shape: the prompt's tokens first, `null` for the
//! first one's log-prob and alternatives).

use super::wire::TextLogprobs;
use crate::engine::sampler::PromptLogprob;
use crate::model::tokenizer::Tokenizer;
use serde_json::{json, Map, Value};

/// vLLM's `prompt_logprobs` list for `prompt` scored by `scores` (one per token after the first):
/// each entry holds the prompt token (with its rank) and the top alternatives.
pub fn vllm_prompt_logprobs(tok: &Tokenizer, prompt: &[u32], scores: &[PromptLogprob]) -> Value {
    let decoded = |id: u32| String::from_utf8_lossy(tok.token_bytes(id)).into_owned();
    let mut out = vec![Value::Null];
    for s in scores.iter().take(prompt.len().saturating_sub(1)) {
        let mut m = Map::new();
        m.insert(
            s.token_id.to_string(),
            json!({"logprob": s.logprob, "rank": s.rank, "decoded_token": decoded(s.token_id)}),
        );
        for (i, t) in s.top.iter().enumerate() {
            m.entry(t.token_id.to_string()).or_insert_with(|| {
                json!({"logprob": t.logprob, "rank": i + 1, "decoded_token": decoded(t.token_id)})
            });
        }
        out.push(Value::Object(m));
    }
    Value::Array(out)
}

/// The prompt's part of legacy completions logprobs, column by column. `token_text` writes a
/// token as the response does (text, or `token_id:<id>`).
pub fn legacy_prompt(
    prompt: &[u32],
    scores: &[PromptLogprob],
    token_text: impl Fn(u32) -> String,
) -> TextLogprobs {
    let mut p = TextLogprobs {
        tokens: Vec::with_capacity(prompt.len()),
        token_logprobs: vec![None],
        top_logprobs: vec![None],
        text_offset: Vec::with_capacity(prompt.len()),
    };
    let mut offset = 0;
    for &id in prompt {
        let t = token_text(id);
        p.text_offset.push(offset);
        offset += t.len();
        p.tokens.push(t);
    }
    for s in scores.iter().take(prompt.len().saturating_sub(1)) {
        p.token_logprobs.push(Some(s.logprob as f64));
        let mut m = Map::new();
        for t in &s.top {
            m.entry(token_text(t.token_id)).or_insert(json!(t.logprob));
        }
        m.entry(token_text(s.token_id)).or_insert(json!(s.logprob));
        p.top_logprobs.push(Some(m));
    }
    p
}
