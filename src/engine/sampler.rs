//! Turning logits into a token: penalties, temperature, top-k, top-p, min-p, seeded randomness,
//! and the log-probs the caller reports: log-softmax of the model's logits / temperature (plain
//! logits at temperature 0), before penalties and truncation, so that a trainer can recompute them
//! exactly. Penalties and truncation change only which token is drawn.

use super::constraint::TokenMask;
use crate::policy::{is_greedy, scale_and_normalize};
use crate::util::Rng;
use flywheel_kernels::Cpu;
use std::collections::HashMap;
use std::sync::Arc;

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
    pub logprob: f32,
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
    scale_and_normalize(cpu, logits, p.temperature);
    let lp: &[f32] = logits;
    let draw_from = penalized.as_deref().unwrap_or(lp);
    let token = if is_greedy(p.temperature) {
        argmax(draw_from)
    } else {
        sample_truncated(draw_from, p, rng)
    };
    Sampled {
        token,
        forced: allowed.is_some_and(|m| m.num_set() == 1),
        logprob: lp[token as usize],
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

/// The index of the largest value (the lowest index on ties).
pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// The `k` best (token, logprob), best first.
pub fn top_k(lp: &[f32], k: usize) -> Vec<TopLogprob> {
    if k == 0 {
        return Vec::new();
    }
    let mut idx: Vec<u32> = (0..lp.len() as u32).collect();
    let k = k.min(idx.len());
    let cmp = |a: &u32, b: &u32| lp[*b as usize].total_cmp(&lp[*a as usize]).then(a.cmp(b));
    idx.select_nth_unstable_by(k - 1, cmp);
    idx.truncate(k);
    idx.sort_by(cmp);
    idx.into_iter()
        .map(|i| TopLogprob {
            token_id: i,
            logprob: lp[i as usize],
        })
        .collect()
}

fn sample_truncated(lp: &[f32], p: &SamplingParams, rng: &mut Rng) -> u32 {
    let (top_k, top_p) = (p.top_k, p.top_p);
    let u = rng.next_f64();
    if top_k == 0 && top_p >= 1.0 && p.min_p <= 0.0 {
        // Inverse CDF over the full distribution.
        let mut acc = 0.0f64;
        let target = u * lp.iter().map(|v| (*v as f64).exp()).sum::<f64>();
        for (i, v) in lp.iter().enumerate() {
            acc += (*v as f64).exp();
            if acc > target {
                return i as u32;
            }
        }
        return argmax(lp);
    }
    let mut idx: Vec<u32> = (0..lp.len() as u32).collect();
    let cmp = |a: &u32, b: &u32| lp[*b as usize].total_cmp(&lp[*a as usize]).then(a.cmp(b));
    if top_k > 0 && top_k < idx.len() {
        idx.select_nth_unstable_by(top_k - 1, cmp);
        idx.truncate(top_k);
    }
    idx.sort_by(cmp);
    let probs: Vec<f64> = idx.iter().map(|&i| (lp[i as usize] as f64).exp()).collect();
    let total: f64 = probs.iter().sum();
    let mut keep = probs.len();
    if top_p < 1.0 {
        let mut acc = 0.0;
        for (j, p) in probs.iter().enumerate() {
            acc += p / total;
            if acc >= top_p as f64 {
                keep = j + 1;
                break;
            }
        }
    }
    if p.min_p > 0.0 {
        // probs is sorted: keep the prefix at or above min_p times the best.
        let floor = probs[0] * p.min_p as f64;
        keep = keep.min(probs.iter().take_while(|&&q| q >= floor).count().max(1));
    }
    let kept: f64 = probs[..keep].iter().sum();
    let target = u * kept;
    let mut acc = 0.0;
    for j in 0..keep {
        acc += probs[j];
        if acc > target {
            return idx[j];
        }
    }
    idx[keep - 1]
}

#[cfg(test)]
mod tests {
    use super::*;
    use flywheel_kernels::{Isa, ThreadPool};

    fn cpu() -> Cpu {
        Cpu::new(
            Isa::Reference,
            ThreadPool::new(1, std::time::Duration::ZERO),
        )
    }

    #[test]
    fn greedy_picks_argmax_and_reports_plain_log_softmax() {
        let mut l = vec![1.0, 3.0, 2.0];
        let s = sample(
            &cpu(),
            &mut l,
            &SamplingParams {
                temperature: 0.0,
                top_logprobs: 2,
                ..Default::default()
            },
            &HashMap::new(),
            &mut Rng::new(0),
        );
        assert_eq!(s.token, 1);
        let lse = (1f64.exp() + 3f64.exp() + 2f64.exp()).ln();
        assert!((s.logprob as f64 - (3.0 - lse)).abs() < 1e-6);
        assert_eq!(
            s.top.iter().map(|t| t.token_id).collect::<Vec<_>>(),
            vec![1, 2]
        );
    }

    /// A temperature of 1e-45 (found by fuzzing: logits / T overflowed and every log-prob was NaN)
    /// samples greedily and reports temperature-0 log-probs; 1e-5 still scales.
    #[test]
    fn tiny_temperatures_are_greedy() {
        for (t, greedy) in [(1e-45f32, true), (1e-6, true), (1e-5, false)] {
            let mut l = vec![1.0, 3.0, 2.0 + 1e-5];
            let s = sample(
                &cpu(),
                &mut l,
                &SamplingParams {
                    temperature: t,
                    top_logprobs: 3,
                    ..Default::default()
                },
                &HashMap::new(),
                &mut Rng::new(0),
            );
            assert_eq!(s.token, 1, "T={t}");
            assert!(s.logprob.is_finite() && s.top.iter().all(|x| x.logprob.is_finite()));
            let plain = 3.0 - (1f64.exp() + 3f64.exp() + (2.0f64 + 1e-5).exp()).ln();
            assert_eq!((s.logprob as f64 - plain).abs() < 1e-6, greedy, "T={t}");
        }
    }

    #[test]
    fn temperature_scales_logprobs() {
        let mut l = vec![0.0, 2.0];
        let s = sample(
            &cpu(),
            &mut l,
            &SamplingParams {
                temperature: 2.0,
                top_k: 1,
                ..Default::default()
            },
            &HashMap::new(),
            &mut Rng::new(0),
        );
        // With top_k = 1 only token 1 can be drawn; its log-prob is of logits / 2, untruncated.
        assert_eq!(s.token, 1);
        let want = 1.0 - (1.0f64 + 1f64.exp()).ln();
        assert!((s.logprob as f64 - want).abs() < 1e-6);
    }

    #[test]
    fn sampling_follows_the_distribution_and_top_p_truncates() {
        let base = [0.5f64.ln(), 0.3f64.ln(), 0.2f64.ln()];
        let mut rng = Rng::new(42);
        let mut counts = [0usize; 3];
        let n = 20000;
        for _ in 0..n {
            let mut l: Vec<f32> = base.iter().map(|v| *v as f32).collect();
            let none = HashMap::new();
            counts[sample(&cpu(), &mut l, &SamplingParams::default(), &none, &mut rng).token
                as usize] += 1;
        }
        for (c, p) in counts.iter().zip([0.5, 0.3, 0.2]) {
            assert!((*c as f64 / n as f64 - p).abs() < 0.02, "{counts:?}");
        }
        let mut seen = [false; 3];
        for _ in 0..2000 {
            let mut l: Vec<f32> = base.iter().map(|v| *v as f32).collect();
            let p = SamplingParams {
                top_p: 0.7,
                ..Default::default()
            };
            seen[sample(&cpu(), &mut l, &p, &HashMap::new(), &mut rng).token as usize] = true;
        }
        assert_eq!(
            seen,
            [true, true, false],
            "top_p 0.7 keeps the first two tokens only"
        );
    }

    #[test]
    fn min_p_drops_unlikely_tokens_and_penalties_steer_without_changing_logprobs() {
        let base = [0.6f64.ln(), 0.3f64.ln(), 0.1f64.ln()];
        let mut rng = Rng::new(3);
        let none = HashMap::new();
        let mut seen = [false; 3];
        for _ in 0..2000 {
            let mut l: Vec<f32> = base.iter().map(|v| *v as f32).collect();
            let p = SamplingParams {
                min_p: 0.2,
                ..Default::default()
            };
            seen[sample(&cpu(), &mut l, &p, &none, &mut rng).token as usize] = true;
        }
        assert_eq!(seen, [true, true, false], "0.1 < 0.2 * 0.6");
        // A large presence penalty on token 0 makes greedy pick token 1; the reported log-prob is
        // still the unpenalized one.
        let mut l: Vec<f32> = base.iter().map(|v| *v as f32).collect();
        let p = SamplingParams {
            temperature: 0.0,
            presence_penalty: 2.0,
            ..Default::default()
        };
        let counts = HashMap::from([(0u32, 1u32)]);
        let s = sample(&cpu(), &mut l, &p, &counts, &mut rng);
        assert_eq!(s.token, 1);
        assert!((s.logprob as f64 - 0.3f64.ln()).abs() < 1e-5);
        // Frequency penalty scales with the count: 0.6 -> e^-0.4 * 0.6 beats 0.3 with one
        // occurrence, not with three.
        for (c, want) in [(1u32, 0u32), (3, 1)] {
            let mut l: Vec<f32> = base.iter().map(|v| *v as f32).collect();
            let p = SamplingParams {
                temperature: 0.0,
                frequency_penalty: 0.4,
                ..Default::default()
            };
            let s = sample(&cpu(), &mut l, &p, &HashMap::from([(0u32, c)]), &mut rng);
            assert_eq!(s.token, want, "count {c}");
        }
    }

    #[test]
    fn same_seed_same_draws() {
        let (mut a, mut b) = (Rng::new(7), Rng::new(7));
        assert!((0..100).all(|_| a.next_u64() == b.next_u64()));
        assert_ne!(Rng::new(7).next_u64(), Rng::new(8).next_u64());
    }

    #[test]
    fn logit_bias_steers_the_draw_and_marks_it_off_policy() {
        let base = [0.6f64.ln(), 0.3f64.ln(), 0.1f64.ln()];
        let mut rng = Rng::new(5);
        for (bias, want) in [(vec![(0u32, -100.0f32)], 1u32), (vec![(2, 100.0)], 2)] {
            let mut l: Vec<f32> = base.iter().map(|v| *v as f32).collect();
            let p = SamplingParams {
                temperature: 0.0,
                logit_bias: bias,
                ..Default::default()
            };
            assert!(!p.samples_the_policy());
            let s = sample(&cpu(), &mut l, &p, &HashMap::new(), &mut rng);
            assert_eq!(s.token, want);
            // The reported log-prob is the model's own.
            let lp = base[want as usize];
            assert!(
                (s.logprob as f64 - lp).abs() < 1e-5,
                "{} vs {lp}",
                s.logprob
            );
        }
        assert!(SamplingParams::default().samples_the_policy());
        let truncated = SamplingParams {
            top_k: 5,
            ..Default::default()
        };
        assert!(!truncated.samples_the_policy());
    }

    #[test]
    fn the_repetition_penalty_scales_seen_tokens_logits_and_reports_the_models() {
        let p = SamplingParams {
            temperature: 0.0,
            repetition_penalty: 2.0,
            ..Default::default()
        };
        let mut rng = Rng::new(1);
        // Token 0 (logit 2) seen in the prompt: 2 / 2 = 1 < 1.5, so token 1 is drawn; a seen
        // negative logit is multiplied (token 2: -1 -> -2), an unseen one kept.
        let mut l = vec![2.0f32, 1.5, -1.0];
        let s = sample_seen(
            &cpu(),
            &mut l,
            &p,
            &HashMap::new(),
            &[0, 2],
            None,
            &[],
            &mut rng,
        );
        assert_eq!(s.token, 1);
        // The reported log-prob is the model's own (unpenalized) distribution's.
        let z = (2.0f32.exp() + 1.5f32.exp() + (-1.0f32).exp()).ln();
        assert!((s.logprob - (1.5 - z)).abs() < 1e-6, "{}", s.logprob);
        // Generated tokens count too; without any seen token nothing changes.
        let mut l = vec![2.0f32, 1.5, -1.0];
        let s = sample_seen(
            &cpu(),
            &mut l,
            &p,
            &HashMap::from([(0u32, 1u32)]),
            &[],
            None,
            &[],
            &mut rng,
        );
        assert_eq!(s.token, 1);
        let mut l = vec![2.0f32, 1.5, -1.0];
        assert_eq!(
            sample_seen(
                &cpu(),
                &mut l,
                &p,
                &HashMap::new(),
                &[],
                None,
                &[],
                &mut rng
            )
            .token,
            0
        );
        assert!(!p.samples_the_policy());
    }

    #[test]
    fn a_mask_limits_the_draw_and_leaves_the_reported_logprobs_the_models() {
        let logits = [3.0f32, 1.0, 0.5, -2.0];
        let mut mask = TokenMask::alloc(4);
        mask.allow_token(2);
        mask.allow_token(3);
        let p = SamplingParams::default();
        let mut rng = Rng::new(7);
        let mut seen = [0usize; 4];
        for _ in 0..200 {
            let mut l = logits.to_vec();
            let s = sample_seen(
                &cpu(),
                &mut l,
                &p,
                &HashMap::new(),
                &[],
                Some(&mask),
                &[],
                &mut rng,
            );
            seen[s.token as usize] += 1;
            // The model's log-softmax, not the masked one.
            let z = logits.iter().map(|v| v.exp()).sum::<f32>().ln();
            assert!((s.logprob - (logits[s.token as usize] - z)).abs() < 1e-5);
        }
        assert_eq!(seen[0] + seen[1], 0, "{seen:?}");
        let mut one = TokenMask::alloc(4);
        one.allow_token(1);
        let mut l = logits.to_vec();
        let s = sample_seen(
            &cpu(),
            &mut l,
            &p,
            &HashMap::new(),
            &[],
            Some(&one),
            &[],
            &mut rng,
        );
        assert!(s.token == 1 && s.forced);
        assert!(seen[2] > seen[3] && seen[3] > 0, "{seen:?}");
        // Greedy: the best allowed token.
        let greedy = SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        };
        let mut l = logits.to_vec();
        let s = sample_seen(
            &cpu(),
            &mut l,
            &greedy,
            &HashMap::new(),
            &[],
            Some(&mask),
            &[],
            &mut rng,
        );
        assert_eq!(s.token, 2);
    }
}
