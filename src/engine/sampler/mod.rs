//! Turning logits into a token: penalties, temperature, top-k, top-p, min-p, seeded randomness,
//! and the log-probs the caller reports: log-softmax of the model's logits / temperature (plain
//! logits at temperature 0), before penalties and truncation, so that a trainer can recompute them
//! exactly. Penalties and truncation change only which token is drawn.

use super::constraint::TokenMask;
use crate::policy::{is_greedy, normalize_with, scale_and_normalize};
use crate::util::Rng;
use flywheel_kernels::reference::{self, Truncate};
use flywheel_kernels::Cpu;
use std::collections::HashMap;
use std::sync::Arc;

/// The index of the largest logit (the lowest of equals).
pub use flywheel_kernels::reference::argmax;

#[derive(Clone, Debug)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// In (0, 1]; 1 disables.
    pub top_p: f32,
    /// 0 disables.
    pub top_k: usize,
    /// In [0, 1]: drop tokens whose probability is below `min_p` times the best one's; 0 disables.
    pub min_p: f32,
    /// OpenAI's penalties, over the tokens generated so far: subtracted from a token's logit once
    /// if it occurred (presence) and once per occurrence (frequency).
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// vLLM's (and transformers'): a token seen in the prompt or the output so far has a positive
    /// logit divided by it, a negative one multiplied; 1 disables.
    pub repetition_penalty: f32,
    /// How many top alternatives to report per token (0..=20).
    pub top_logprobs: usize,
    /// OpenAI's logit_bias: (token, bias in [-100, 100]) added to the logits before sampling.
    pub logit_bias: Vec<(u32, f32)>,
    /// Drawn under a grammar (constrained decoding): the draw is restricted to the tokens the
    /// grammar allows, so it is not a draw from the policy.
    pub constrained: bool,
    /// vLLM's `min_tokens`: the end tokens (EOS, stop tokens) cannot be drawn, and stop strings
    /// do not end the choice, before this many tokens.
    pub min_tokens: usize,
    /// vLLM's `allowed_token_ids` (sorted): only these can be drawn.
    pub allowed_tokens: Option<Arc<[u32]>>,
    /// vLLM's `bad_words`, as token sequences: the last token of one cannot be drawn where the
    /// output so far ends with the rest of it.
    pub bad_words: Arc<[Vec<u32>]>,
}

impl SamplingParams {
    /// Whether the distribution drawn from is changed by logit edits (penalties, biases, bans).
    pub fn edits_logits(&self) -> bool {
        self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.repetition_penalty != 1.0
            || !self.logit_bias.is_empty()
            || self.constrained
            || self.min_tokens > 0
            || self.allowed_tokens.is_some()
            || !self.bad_words.is_empty()
    }

    /// The tokens banned at this step: the end tokens before `min_tokens`, and each bad word's
    /// last token where the output ends with the rest of it.
    pub fn banned(&self, generated: &[u32], end_tokens: &[u32]) -> Vec<u32> {
        let mut out = Vec::new();
        if generated.len() < self.min_tokens {
            out.extend_from_slice(end_tokens);
        }
        for w in self.bad_words.iter() {
            if let Some((last, rest)) = w.split_last() {
                if generated.ends_with(rest) {
                    out.push(*last);
                }
            }
        }
        out
    }

    /// The top-k, top-p and min-p a sampled token is drawn after (`reference::draw_cut`).
    pub fn cut(&self) -> Truncate {
        Truncate {
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p.max(0.0),
        }
    }

    /// Whether a completion is drawn from exactly log-softmax(logits / T), the distribution the
    /// reported (behaviour) log-probs describe: false with truncation (top-p, top-k, min-p),
    /// penalties or logit biases. A trainer treats other completions as off-policy.
    pub fn samples_the_policy(&self) -> bool {
        self.top_p >= 1.0 && self.top_k == 0 && self.min_p <= 0.0 && !self.edits_logits()
    }
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            top_logprobs: 0,
            logit_bias: Vec::new(),
            constrained: false,
            min_tokens: 0,
            allowed_tokens: None,
            bad_words: Arc::from(Vec::new()),
        }
    }
}

/// The most alternatives a device's draw reports (the API's `top_logprobs` ≤ 20), and the largest
/// top-k it draws among (llama.cpp's clients send 40).
pub const DEVICE_DRAW_TOP: usize = 20;
pub const DEVICE_DRAW_TOP_K: usize = 128;

/// A token drawn where the logits are (the GPU) by the sampler's rule — from the whole
/// distribution, among the top-k candidates with top-p and min-p, or a nucleus (top-p or min-p
/// alone) — so that only the token, its log-prob and the alternatives come back.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeviceDraw {
    /// None: greedy (the argmax of log-softmax(logits)); Some((T, u)): the inverse CDF of
    /// log-softmax(logits / T) at u (`reference::inverse_cdf`, or `reference::truncated_draw`
    /// with a cut).
    pub sample: Option<(f32, f64)>,
    /// How many alternatives to report.
    pub top: usize,
    /// The cut when sampled; `Truncate::NONE` when greedy or nothing is cut.
    pub truncate: Truncate,
}

impl SamplingParams {
    /// The draw a device can make for the next token, its uniform taken from `rng` as
    /// `sample_seen` takes it (one `next_f64` when not greedy, none when greedy), so that a
    /// choice's random stream is the same wherever its tokens are drawn. None where only the
    /// host's sampler applies: penalties, biases, bans, grammars, allowed tokens, and a top-k
    /// above `DEVICE_DRAW_TOP_K` when not greedy (rng untouched).
    pub fn device_draw(&self, rng: &mut Rng) -> Option<DeviceDraw> {
        if self.edits_logits() || self.top_logprobs > DEVICE_DRAW_TOP {
            return None;
        }
        let greedy = is_greedy(self.temperature);
        let truncate = match greedy || self.samples_the_policy() {
            // Greedy: the argmax is inside any cut.
            true => Truncate::NONE,
            // A top-k of up to DEVICE_DRAW_TOP_K, or none (a nucleus of the whole row: drawn
            // among the device's best where its cut falls among them, else from the row's
            // log-probs by `reference::truncated_draw`).
            false if self.top_k <= DEVICE_DRAW_TOP_K => self.cut(),
            false => return None,
        };
        Some(DeviceDraw {
            sample: (!greedy).then(|| (self.temperature, rng.next_f64())),
            top: self.top_logprobs,
            truncate,
        })
    }
}

impl DeviceDraw {
    /// What `sample_seen` returns for the token the device drew, `kept` the probability mass the
    /// cut kept (1: none): the log-prob it was drawn with is logprob − ln kept (0 when greedy, as
    /// there).
    pub fn sampled(&self, token: u32, logprob: f32, kept: f64, top: &[(u32, f32)]) -> Sampled {
        Sampled {
            token,
            forced: false,
            logprob,
            sampling_logprob: match self.sample {
                Some(_) => (logprob as f64 - kept.ln()) as f32,
                None => 0.0,
            },
            top: top
                .iter()
                .map(|&(token_id, logprob)| TopLogprob { token_id, logprob })
                .collect(),
        }
    }
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct TopLogprob {
    pub token_id: u32,
    pub logprob: f32,
}

#[derive(Clone, Debug)]
pub struct Sampled {
    pub token: u32,
    /// The grammar allowed this token only (constrained decoding): the model chose nothing.
    pub forced: bool,
    /// The model's log-prob of the token (log-softmax(logits / T)): what a trainer recomputes.
    pub logprob: f32,
    /// The log-prob of the token under the distribution it was drawn from (after penalties,
    /// biases, bans, a grammar's mask and top-k/top-p/min-p; 0 when greedy): μ for off-policy
    /// corrections. Equal to `logprob` when nothing edited or truncated the distribution.
    pub sampling_logprob: f32,
    pub top: Vec<TopLogprob>,
}

/// Sample from one row of logits (overwritten with log-probs). `counts` holds how often each
/// token was generated so far (for the penalties).
pub fn sample(
    cpu: &Cpu,
    logits: &mut [f32],
    p: &SamplingParams,
    counts: &HashMap<u32, u32>,
    rng: &mut Rng,
) -> Sampled {
    sample_seen(cpu, logits, p, counts, &[], None, &[], rng)
}

/// `sample`, with the prompt's distinct tokens (sorted) for the repetition penalty, the tokens a
/// grammar allows (constrained decoding: only they can be drawn), and the tokens banned at this
/// step (`SamplingParams::banned`; a ban that would leave nothing to draw is lifted).
#[allow(clippy::too_many_arguments)]
pub fn sample_seen(
    cpu: &Cpu,
    logits: &mut [f32],
    p: &SamplingParams,
    counts: &HashMap<u32, u32>,
    prompt_seen: &[u32],
    allowed: Option<&TokenMask>,
    banned: &[u32],
    rng: &mut Rng,
) -> Sampled {
    sample_row(
        cpu,
        logits,
        None,
        p,
        counts,
        prompt_seen,
        allowed,
        banned,
        rng,
    )
}

/// `sample_seen`, the row's log-probs (those reported, and drawn from where nothing edits them)
/// computed with `lse`, the log-sum-exp of logits / T a device's log-softmax subtracted
/// (`policy::normalize_with`: the device's log-probs, bit for bit), where one is given.
#[allow(clippy::too_many_arguments)]
pub fn sample_row(
    cpu: &Cpu,
    logits: &mut [f32],
    lse: Option<f32>,
    p: &SamplingParams,
    counts: &HashMap<u32, u32>,
    prompt_seen: &[u32],
    allowed: Option<&TokenMask>,
    banned: &[u32],
    rng: &mut Rng,
) -> Sampled {
    // The distribution drawn from differs from the reported one only when penalties or biases
    // apply (the reported log-probs are the model's: what a trainer recomputes).
    let penalties = p.presence_penalty != 0.0 || p.frequency_penalty != 0.0;
    let repetition = p.repetition_penalty != 1.0 && !(counts.is_empty() && prompt_seen.is_empty());
    let edited = (penalties && !counts.is_empty())
        || repetition
        || !p.logit_bias.is_empty()
        || allowed.is_some()
        || p.allowed_tokens.is_some()
        || !banned.is_empty();
    let penalized = edited.then(|| {
        let mut l = logits.to_vec();
        if let Some(mask) = allowed {
            let n = mask.len().min(l.len());
            mask.iter_unset_entries(|i| {
                if i < n {
                    l[i] = f32::NEG_INFINITY;
                }
            });
            // Logits past the mask's width (none: it spans the logits) are never allowed.
            l[n..].iter_mut().for_each(|v| *v = f32::NEG_INFINITY);
        }
        if let Some(only) = &p.allowed_tokens {
            let kept: Vec<(usize, f32)> = only
                .iter()
                .filter_map(|&t| l.get(t as usize).map(|&v| (t as usize, v)))
                .collect();
            l.fill(f32::NEG_INFINITY);
            for (t, v) in kept {
                l[t] = v;
            }
        }
        if !banned.is_empty() {
            let before: Vec<(usize, f32)> = banned
                .iter()
                .filter_map(|&t| l.get(t as usize).map(|&v| (t as usize, v)))
                .collect();
            before.iter().for_each(|&(t, _)| l[t] = f32::NEG_INFINITY);
            if l.iter().all(|v| *v == f32::NEG_INFINITY) {
                for (t, v) in before {
                    l[t] = v;
                }
            }
        }
        if repetition {
            // Each seen token once (vLLM's order: repetition first, then the OpenAI penalties).
            let rp = p.repetition_penalty;
            let mut penalize = |t: u32| {
                if let Some(v) = l.get_mut(t as usize) {
                    *v = if *v > 0.0 { *v / rp } else { *v * rp };
                }
            };
            prompt_seen.iter().for_each(|&t| penalize(t));
            let mut out: Vec<u32> = counts
                .keys()
                .copied()
                .filter(|t| prompt_seen.binary_search(t).is_err())
                .collect();
            out.sort_unstable();
            out.into_iter().for_each(penalize);
        }
        if penalties {
            for (&t, &c) in counts {
                if let Some(v) = l.get_mut(t as usize) {
                    *v -= p.presence_penalty + p.frequency_penalty * c as f32;
                }
            }
        }
        for &(t, b) in &p.logit_bias {
            if let Some(v) = l.get_mut(t as usize) {
                *v += b;
            }
        }
        scale_and_normalize(cpu, &mut l, p.temperature);
        l
    });
    match lse {
        Some(lse) => normalize_with(logits, p.temperature, lse),
        None => scale_and_normalize(cpu, logits, p.temperature),
    }
    let lp: &[f32] = logits;
    let draw_from = penalized.as_deref().unwrap_or(lp);
    let (token, sampling_logprob) = if is_greedy(p.temperature) {
        (argmax(draw_from), 0.0)
    } else {
        let (t, log_kept) = sample_truncated(draw_from, p, rng);
        (t, (draw_from[t as usize] as f64 - log_kept) as f32)
    };
    Sampled {
        token,
        forced: allowed.is_some_and(|m| m.num_set() == 1),
        logprob: lp[token as usize],
        sampling_logprob,
        top: top_k(lp, p.top_logprobs),
    }
}

/// A prompt token's score: its log-prob given the tokens before it, its rank (1 = the most
/// likely), and the `k` most likely tokens at that position.
#[derive(Clone, Debug)]
pub struct PromptLogprob {
    pub token_id: u32,
    pub logprob: f32,
    pub rank: usize,
    pub top: Vec<TopLogprob>,
}

/// Score `token` with one row of logits (overwritten with log-softmax(logits / T), the sampler's
/// arithmetic, so a completion scored as a prompt gets the log-probs it was sampled with).
pub fn score_row(
    cpu: &Cpu,
    logits: &mut [f32],
    temperature: f32,
    token: u32,
    k: usize,
) -> PromptLogprob {
    scale_and_normalize(cpu, logits, temperature);
    let logprob = logits[token as usize];
    let rank = 1 + logits.iter().filter(|&&v| v > logprob).count();
    PromptLogprob {
        token_id: token,
        logprob,
        rank,
        top: top_k(logits, k),
    }
}

/// The `k` best (token, logprob), best first.
pub fn top_k(lp: &[f32], k: usize) -> Vec<TopLogprob> {
    reference::top_indices(lp, k)
        .into_iter()
        .map(|i| TopLogprob {
            token_id: i,
            logprob: lp[i as usize],
        })
        .collect()
}

/// Draw from log-probs `lp` after top-k/top-p/min-p: the token and the log of the probability
/// mass kept (0 when nothing was cut: the token's probability under the truncated distribution is
/// exp(lp[token]) / kept).
fn sample_truncated(lp: &[f32], p: &SamplingParams, rng: &mut Rng) -> (u32, f64) {
    let (t, kept) = reference::draw_cut(lp, p.cut(), rng.next_f64());
    (t, kept.ln())
}

#[cfg(test)]
mod device_tests;
#[cfg(test)]
mod tests;
