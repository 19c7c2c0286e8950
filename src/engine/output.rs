//! A sequence's output side, kept by the engine: its random stream, token counts for penalties,
//! incremental detokenization, stop-string matching (text that could begin a stop string is held
//! back until it cannot), timings, and the channel its events go to.

use super::constraint::{Constraint, GrammarError, TokenMask};
use super::repetition::Detector;
use super::sampler::{self, PromptLogprob, Sampled};
use super::{EngineEvent, FinishReason, GenerateRequest, StopReason};
use crate::metrics::Metrics;
use crate::model::tokenizer::{Detokenizer, Tokenizer};
use crate::util::Rng;
use flywheel_kernels::Cpu;
use std::cell::Cell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

/// What the choices of one request share.
pub struct RequestState {
    pub req: GenerateRequest,
    pub tx: UnboundedSender<EngineEvent>,
    pub arrival: Instant,
    pub seed: u64,
    /// This request's series of `adapter_generation_tokens_total` (looked up once, not per token).
    pub adapter_tokens: prometheus::IntCounter,
    /// The tokens that end a choice: the tokenizer's EOS (unless `ignore_eos`) and the stop
    /// tokens; a grammar's end maps onto them. Decided once (shared with the mask thread).
    pub end_tokens: Arc<[u32]>,
    choices_left: Cell<usize>,
}

impl RequestState {
    pub fn new(
        req: GenerateRequest,
        tx: UnboundedSender<EngineEvent>,
        arrival: Instant,
        seed: u64,
        eos: Option<u32>,
        metrics: &Metrics,
    ) -> RequestState {
        let n = req.n;
        let adapter = req.adapter.as_ref().map_or("", |a| &a.name);
        let adapter_tokens = metrics
            .adapter_generation_tokens
            .with_label_values(&[adapter]);
        let eos = eos.filter(|_| !req.ignore_eos);
        let end_tokens = eos
            .into_iter()
            .chain(req.stop_token_ids.iter().copied())
            .collect();
        RequestState {
            req,
            tx,
            arrival,
            seed,
            adapter_tokens,
            end_tokens,
            choices_left: Cell::new(n),
        }
    }
}

pub struct SeqOutput {
    pub req: Rc<RequestState>,
    pub choice: usize,
    rng: Rng,
    counts: HashMap<u32, u32>,
    /// The prompt's distinct tokens, sorted (only with a repetition penalty).
    prompt_seen: Vec<u32>,
    detok: Detokenizer,
    held: String,
    /// Sibling choices to fork off when this (first) choice samples its first token.
    pub pending_forks: usize,
    pub scheduled_at: Option<Instant>,
    last_token_at: Option<Instant>,
    pub num_cached_tokens: usize,
    /// Prompt scores computed so far (requests with prompt log-probs), and whether they were sent.
    pub prompt_scores: Vec<PromptLogprob>,
    pub prompt_scores_sent: bool,
    /// Constrained decoding: where this choice stands in its grammar, and the mask for its next
    /// token when it was computed ahead (beside the forward pass that makes the logits).
    pub constraint: Option<Constraint>,
    pub next_mask: Option<Result<TokenMask, GrammarError>>,
    /// Embedding requests: the sum of the prompt positions' hidden states seen so far, and how
    /// many (a preempted sequence recomputes its prompt: positions are added once).
    pub embed_sum: Vec<f64>,
    pub embed_count: usize,
    /// Repeat detection, when the request asks for it.
    repeats: Option<Detector>,
}

/// The seed of choice `choice`: choice 0 uses the request's seed itself.
pub fn choice_seed(seed: u64, choice: usize) -> u64 {
    seed ^ (choice as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

impl SeqOutput {
    pub fn new(req: Rc<RequestState>, choice: usize) -> SeqOutput {
        let prompt_seen = if req.req.sampling.repetition_penalty != 1.0 {
            let mut v = req.req.prompt.clone();
            v.sort_unstable();
            v.dedup();
            v
        } else {
            Vec::new()
        };
        let constraint = req.req.constraint.clone();
        let repeats = req.req.repetition.map(Detector::new);
        SeqOutput {
            rng: Rng::new(choice_seed(req.seed, choice)),
            req,
            choice,
            counts: HashMap::new(),
            prompt_seen,
            detok: Detokenizer::default(),
            held: String::new(),
            pending_forks: 0,
            scheduled_at: None,
            last_token_at: None,
            num_cached_tokens: 0,
            prompt_scores: Vec::new(),
            prompt_scores_sent: false,
            constraint,
            next_mask: None,
            embed_sum: Vec::new(),
            embed_count: 0,
            repeats,
        }
    }

    /// Compute the mask for the next token now (a constrained choice whose mask was not
    /// computed ahead).
    pub fn prepare_mask(&mut self) {
        if self.next_mask.is_none() {
            if let Some(c) = &mut self.constraint {
                self.next_mask = Some(c.mask(&self.req.end_tokens));
            }
        }
    }

    /// Draw the next token after `generated` (this choice's tokens so far: what `min_tokens`
    /// counts and bad words are matched against) from `logits`, with the device's log-sum-exp of
    /// them where it gave one (`sampler::sample_row`); under a grammar, only from what it allows
    /// (and the grammar follows the token). Err: the grammar failed.
    pub fn sample(
        &mut self,
        cpu: &Cpu,
        logits: &mut [f32],
        lse: Option<f32>,
        generated: &[u32],
    ) -> Result<Sampled, GrammarError> {
        self.prepare_mask();
        let mask = self.next_mask.take().transpose()?;
        let p = &self.req.req.sampling;
        let banned = p.banned(generated, &self.req.end_tokens);
        let s = sampler::sample_row(
            cpu,
            logits,
            lse,
            p,
            &self.counts,
            &self.prompt_seen,
            mask.as_ref(),
            &banned,
            &mut self.rng,
        );
        if let Some(c) = &mut self.constraint {
            if !self.req.end_tokens.contains(&s.token) {
                c.advance(s.token)?;
            }
        }
        Ok(s)
    }

    /// The draw a device can make for this choice's next token (`SamplingParams::device_draw`,
    /// its uniform taken from this choice's stream), or None: a grammar, sibling choices to fork
    /// off this row's logits, scoring only, or what only the host's sampler does.
    pub fn device_draw(&mut self) -> Option<sampler::DeviceDraw> {
        let r = &self.req.req;
        if self.pending_forks > 0 || r.max_tokens == 0 || r.constraint.is_some() {
            return None;
        }
        r.sampling.device_draw(&mut self.rng)
    }

    /// End choice `choice` of this request without a token (`max_tokens` 0: prompt scoring).
    pub fn finish_without_tokens(&self, choice: usize, m: &Metrics) {
        let reason = FinishReason::Length;
        self.count_finished(reason, Instant::now(), m);
        let _ = self.req.tx.send(EngineEvent::Finished {
            choice,
            reason,
            stop_reason: None,
            num_cached_tokens: self.num_cached_tokens,
        });
    }

    fn count_finished(&self, reason: FinishReason, now: Instant, m: &Metrics) {
        m.request_success
            .with_label_values(&[reason.as_str()])
            .inc();
        let left = self.req.choices_left.get().saturating_sub(1);
        self.req.choices_left.set(left);
        if left == 0 {
            m.e2e_request_latency
                .observe((now - self.req.arrival).as_secs_f64());
        }
    }

    /// Record token `s` (the `num_generated`-th of this choice, computed by adapter version
    /// `version.0`, exactly when `version.1`) and send its event; true when the choice is
    /// finished (its `Finished` event sent too).
    pub fn emit(
        &mut self,
        tok: &Tokenizer,
        s: &Sampled,
        num_generated: usize,
        version: (u64, bool),
        at_context_end: bool,
        m: &Metrics,
    ) -> bool {
        let now = Instant::now();
        match self.last_token_at {
            None => m
                .time_to_first_token
                .observe((now - self.req.arrival).as_secs_f64()),
            Some(t) => m.inter_token_latency.observe((now - t).as_secs_f64()),
        }
        self.last_token_at = Some(now);
        m.generation_tokens.inc();
        self.req.adapter_tokens.inc();
        *self.counts.entry(s.token).or_default() += 1;

        let r = &self.req.req;
        let mut finish = None;
        let mut stop_reason = None;
        let mut text = String::new();
        if r.stop_token_ids.contains(&s.token) {
            finish = Some(FinishReason::Stop);
            stop_reason = Some(StopReason::Token(s.token));
        } else if !r.ignore_eos && Some(s.token) == tok.eos_id {
            finish = Some(FinishReason::Stop);
        } else {
            if !tok.is_control(s.token) {
                let piece = self.detok.push(tok, s.token);
                self.held.push_str(&piece);
            }
            // Before `min_tokens`, stop strings do not end the choice (vLLM's rule).
            let stop_found = (num_generated >= r.sampling.min_tokens)
                .then(|| find_stop(&self.held, &r.stop))
                .flatten();
            if let Some((pos, stop)) = stop_found {
                let end = if r.include_stop_str_in_output {
                    pos + stop.len()
                } else {
                    pos
                };
                text = self.held[..end].to_string();
                self.held.clear();
                finish = Some(FinishReason::Stop);
                stop_reason = Some(StopReason::Text(stop.to_string()));
            } else {
                let keep = holdback(&self.held, &r.stop);
                text = self.held.drain(..self.held.len() - keep).collect();
            }
        }
        let looped = self.repeats.as_mut().is_some_and(|d| d.push(s.token));
        if finish.is_none() && looped {
            finish = Some(FinishReason::Repetition);
        }
        if finish.is_none() && (num_generated >= r.max_tokens || at_context_end) {
            finish = Some(FinishReason::Length);
        }
        if finish.is_some()
            && stop_reason
                .as_ref()
                .is_none_or(|s| !matches!(s, StopReason::Text(_)))
        {
            // Nothing can complete a stop string any more: flush what was held back.
            text.push_str(&std::mem::take(&mut self.held));
            text.push_str(&self.detok.finish());
        }
        // Metrics first: a client that has its answer sees them updated.
        if let Some(reason) = finish {
            self.count_finished(reason, now, m);
        }
        let _ = self.req.tx.send(EngineEvent::Token {
            choice: self.choice,
            token_id: s.token,
            forced: s.forced,
            logprob: s.logprob,
            sampling_logprob: s.sampling_logprob,
            top_logprobs: s.top.clone(),
            text,
            version: version.0,
            exact: version.1,
        });
        let Some(reason) = finish else {
            return false;
        };
        let _ = self.req.tx.send(EngineEvent::Finished {
            choice: self.choice,
            reason,
            stop_reason,
            num_cached_tokens: self.num_cached_tokens,
        });
        true
    }
}

/// The earliest stop string in `text`: (its byte offset, the string).
fn find_stop<'a>(text: &str, stops: &'a [String]) -> Option<(usize, &'a str)> {
    stops
        .iter()
        .filter_map(|s| text.find(s.as_str()).map(|p| (p, s.as_str())))
        .min_by_key(|(p, _)| *p)
}

/// How many trailing bytes of `text` could be the start of a stop string.
fn holdback(text: &str, stops: &[String]) -> usize {
    let max = stops.iter().map(|s| s.len()).max().unwrap_or(0);
    (1..max.min(text.len() + 1))
        .rev()
        .find(|&k| {
            let start = text.len() - k;
            text.is_char_boundary(start) && stops.iter().any(|s| s.starts_with(&text[start..]))
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_are_found_and_their_prefixes_held_back() {
        let stops = vec!["\n\n".to_string(), "END".to_string()];
        assert_eq!(find_stop("ab\n\ncEND", &stops), Some((2, "\n\n")));
        assert_eq!(find_stop("abEN", &stops), None);
        assert_eq!(holdback("abEN", &stops), 2);
        assert_eq!(holdback("ab\n", &stops), 1);
        assert_eq!(holdback("abc", &stops), 0);
        assert_eq!(holdback("é", &["éa".to_string()]), 2);
        assert_eq!(holdback("xé", &["éa".to_string()]), 2);
        assert_eq!(holdback("anything", &[]), 0);
    }
}
