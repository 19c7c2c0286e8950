//! Advantages and policy-gradient losses, pure: per-token log-probs and per-sequence advantages in;
//! the loss, its gradient with respect to every token's log-prob, and statistics out. Like the
//! scheduler, no model and no I/O: the backward turns `grad_logp[t]` into logit gradients
//! (dL/dz_t = grad_logp[t]·(onehot(o_t) − softmax(z_t))).
//!
//! Notation (REFERENCE.md §4): π the trainer's policy (log-probs `logp`, from logits divided by the
//! sampling temperature), μ the policy that sampled (`behavior`, recorded at serving time), π_ref
//! the base with the adapter off (`ref_logp`), r_t = exp(log π − log μ), A_i the sequence's
//! advantage; an off-policy correction (`correction`) takes π_old as the ratio's base instead.

use super::correction::Correction;

/// How a group's rewards become advantages.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum AdvantageKind {
    /// (R − mean) / (std + eps), std with Bessel's correction (as TRL's GRPOTrainer).
    Grpo { eps: f32 },
    /// R − mean (Dr. GRPO: no division by the standard deviation).
    DrGrpo,
}

/// A group's baseline and scale: (mean, divisor) of `rewards`; None when there are fewer than two
/// or all are equal (no signal: DAPO drops such groups).
fn group_stats(rewards: &[f32], kind: AdvantageKind) -> Option<(f64, f64)> {
    let n = rewards.len();
    if n < 2 {
        return None;
    }
    let mean = rewards.iter().map(|&r| r as f64).sum::<f64>() / n as f64;
    if rewards.iter().all(|&r| r as f64 == mean) {
        return None;
    }
    Some(match kind {
        AdvantageKind::Grpo { eps } => {
            let var = rewards
                .iter()
                .map(|&r| (r as f64 - mean).powi(2))
                .sum::<f64>()
                / (n - 1) as f64;
            (mean, var.sqrt() + eps as f64)
        }
        AdvantageKind::DrGrpo => (mean, 1.0),
    })
}

/// Advantages of one group; None when all rewards are equal (no signal: DAPO drops such groups).
pub fn group_advantages(rewards: &[f32], kind: AdvantageKind) -> Option<Vec<f32>> {
    let (mean, d) = group_stats(rewards, kind)?;
    Some(
        rewards
            .iter()
            .map(|&r| ((r as f64 - mean) / d) as f32)
            .collect(),
    )
}

/// Advantages of a group whose members may be turns of episodes: the members with the same
/// `unit` (an episode) count once in the group's statistics, with the reward of the unit's first
/// member (its first turn: the episode's return); each member's advantage is its own reward
/// against those statistics — the unit's advantage when its turns share one reward, each turn's
/// return's when they carry discounted returns (an agent session's). Members with `None` are
/// units of their own. None: no signal.
pub fn unit_advantages(
    units: &[Option<&str>],
    rewards: &[f32],
    kind: AdvantageKind,
) -> Option<Vec<f32>> {
    let mut names: Vec<&str> = Vec::new();
    let mut unit_rewards: Vec<f32> = Vec::new();
    for (u, &r) in units.iter().zip(rewards) {
        match u {
            Some(name) if names.contains(name) => {}
            Some(name) => {
                names.push(name);
                unit_rewards.push(r);
            }
            None => unit_rewards.push(r),
        }
    }
    let (mean, d) = group_stats(&unit_rewards, kind)?;
    Some(
        rewards
            .iter()
            .map(|&r| ((r as f64 - mean) / d) as f32)
            .collect(),
    )
}

/// How the per-token terms are summed into one loss.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Normalization {
    /// Mean over each sequence's tokens, then over sequences (GRPO).
    PerSequence,
    /// Sum over every token of the batch divided by their number (DAPO).
    PerToken,
    /// Sum over every token divided by a constant, e.g. G × max tokens (Dr. GRPO).
    Constant(f32),
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Objective {
    /// Token-level clipped ratio: min(r·A, clip(r, 1−ε_low, 1+ε_high)·A) (GRPO, DAPO clip-higher).
    Clipped { eps_low: f32, eps_high: f32 },
    /// GSPO: the sequence ratio s = exp(mean_t log r_t), clipped like the token ratio.
    SequenceClipped { eps_low: f32, eps_high: f32 },
    /// Masked importance sampling: a token counts only if r ∈ [token_low, token_high] and its
    /// sequence's exp(mean log r) ∈ [seq_low, seq_high]; its detached coefficient is
    /// r·(A − tau·log r) and the loss −Σ coeff·log π.
    MaskedIs {
        token_low: f32,
        token_high: f32,
        seq_low: f32,
        seq_high: f32,
        tau: f32,
    },
    /// Supervised fine-tuning: −log π of every completion token (advantages ignored).
    Sft,
}

/// The named losses (`LossConfig::named`), as settings and requests spell them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LossName {
    Grpo,
    Dapo,
    DrGrpo,
    Gspo,
    MaskedIs,
    Sft,
    /// On-policy distillation: each token's advantage is the teacher's log-prob minus the
    /// student's (the negative per-token reverse KL); no reward needed.
    Distill,
}

impl LossName {
    pub const ALL: [LossName; 7] = [
        LossName::Grpo,
        LossName::Dapo,
        LossName::DrGrpo,
        LossName::Gspo,
        LossName::MaskedIs,
        LossName::Sft,
        LossName::Distill,
    ];

    pub fn name(self) -> &'static str {
        match self {
            LossName::Grpo => "grpo",
            LossName::Dapo => "dapo",
            LossName::DrGrpo => "dr_grpo",
            LossName::Gspo => "gspo",
            LossName::MaskedIs => "masked_is",
            LossName::Sft => "sft",
            LossName::Distill => "distill",
        }
    }
}

impl std::str::FromStr for LossName {
    type Err = String;
    fn from_str(s: &str) -> Result<LossName, String> {
        LossName::ALL
            .into_iter()
            .find(|n| n.name() == s)
            .ok_or_else(|| format!("'{s}': grpo, dapo, dr_grpo, gspo, masked_is, sft or distill"))
    }
}

impl std::fmt::Display for LossName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A loss: its objective, normalization, KL coefficient to the reference policy (k3 estimator),
/// and an optional off-policy correction (`correction`: the ratio is then π/π_old and each token
/// weighed by its correction of π_old/μ).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossConfig {
    pub objective: Objective,
    pub normalization: Normalization,
    pub kl_coef: f32,
    pub correction: Option<Correction>,
}

impl LossConfig {
    /// The named variants: grpo, dapo, dr_grpo, gspo, masked_is, sft (defaults of their papers).
    pub fn named(name: LossName, max_tokens: usize, group_size: usize) -> LossConfig {
        let clipped = |lo, hi| Objective::Clipped {
            eps_low: lo,
            eps_high: hi,
        };
        let (objective, normalization) = match name {
            LossName::Grpo => (clipped(0.2, 0.2), Normalization::PerSequence),
            LossName::Dapo => (clipped(0.2, 0.28), Normalization::PerToken),
            LossName::DrGrpo => (
                clipped(0.2, 0.2),
                Normalization::Constant((group_size * max_tokens).max(1) as f32),
            ),
            LossName::Gspo => (
                Objective::SequenceClipped {
                    eps_low: 3e-4,
                    eps_high: 4e-4,
                },
                Normalization::PerSequence,
            ),
            LossName::MaskedIs => (
                Objective::MaskedIs {
                    token_low: 0.125,
                    token_high: 8.0,
                    seq_low: 0.1,
                    seq_high: 10.0,
                    tau: 0.0,
                },
                Normalization::PerToken,
            ),
            LossName::Sft => (Objective::Sft, Normalization::PerToken),
            // Token advantages, importance-sampled as DAPO's tokens are.
            LossName::Distill => (clipped(0.2, 0.28), Normalization::PerToken),
        };
        LossConfig {
            objective,
            normalization,
            kl_coef: 0.0,
            correction: None,
        }
    }

    /// The advantage kind that goes with the loss (Dr. GRPO: mean only).
    pub fn advantage_kind(name: LossName) -> AdvantageKind {
        if name == LossName::DrGrpo {
            AdvantageKind::DrGrpo
        } else {
            AdvantageKind::Grpo { eps: 1e-4 }
        }
    }
}

/// One completion's tokens as the loss sees them (all slices of the completion's length).
#[derive(Clone, Copy, Debug)]
pub struct SeqInput<'a> {
    pub logp: &'a [f32],
    pub behavior: &'a [f32],
    /// π_ref's log-probs (needed when kl_coef > 0).
    pub ref_logp: Option<&'a [f32]>,
    /// π_old's log-probs (the trainer's at the step, detached): the ratio's base and the
    /// correction's numerator (needed with a correction).
    pub old_logp: Option<&'a [f32]>,
    /// The log-probs of the distribution the tokens were drawn from, where it differs from
    /// `behavior` (constrained, penalized, truncated sampling): the correction's μ.
    pub mu: Option<&'a [f32]>,
    pub advantage: f32,
    /// Per-token advantages added to `advantage` (a teacher's, in distillation).
    pub token_advantage: Option<&'a [f32]>,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct LossStats {
    pub loss: f64,
    pub tokens: usize,
    /// Tokens whose clipped branch was active (no gradient through the ratio).
    pub clip_fraction: f64,
    /// Tokens dropped by masked importance sampling (the loss's or a correction's).
    pub masked_fraction: f64,
    /// Mean k3 KL to the reference over tokens (0 without reference log-probs).
    pub kl: f64,
    pub ratio_mean: f64,
    pub ratio_min: f64,
    pub ratio_max: f64,
}

/// The loss of a batch and dL/dlog π for every token (`grad[i][t]`, in the sequences' order).
pub fn policy_loss(cfg: &LossConfig, seqs: &[SeqInput]) -> (LossStats, Vec<Vec<f32>>) {
    let total_tokens: usize = seqs.iter().map(|s| s.logp.len()).sum();
    let mut st = LossStats {
        tokens: total_tokens,
        ratio_min: f64::INFINITY,
        ratio_max: f64::NEG_INFINITY,
        ..Default::default()
    };
    let mut grads = Vec::with_capacity(seqs.len());
    let (mut clipped, mut masked, mut kl_sum, mut ratio_sum) = (0usize, 0usize, 0.0f64, 0.0f64);
    let num_seqs = seqs.iter().filter(|s| !s.logp.is_empty()).count().max(1);
    for s in seqs {
        let n = s.logp.len();
        let mut g = vec![0.0f32; n];
        if n == 0 {
            grads.push(g);
            continue;
        }
        // Weight of one token's term in the total.
        let w = match cfg.normalization {
            Normalization::PerSequence => 1.0 / (n as f64 * num_seqs as f64),
            Normalization::PerToken => 1.0 / total_tokens.max(1) as f64,
            Normalization::Constant(c) => 1.0 / c as f64,
        };
        // The ratio's base: μ, or π_old under a correction (which weighs each token by ρ_t).
        let (base, w_is) = match (cfg.correction, s.old_logp) {
            (Some(c), Some(old)) => {
                let (w, m) = c.weights(old, s.mu.unwrap_or(s.behavior));
                masked += m;
                (old, w)
            }
            _ => (s.behavior, vec![1.0; n]),
        };
        let log_r: Vec<f64> = (0..n).map(|t| s.logp[t] as f64 - base[t] as f64).collect();
        let mean_log_r = log_r.iter().sum::<f64>() / n as f64;
        let a = s.advantage as f64;
        for lr in &log_r {
            let r = lr.exp();
            ratio_sum += r;
            st.ratio_min = st.ratio_min.min(r);
            st.ratio_max = st.ratio_max.max(r);
        }
        match cfg.objective {
            Objective::Clipped { eps_low, eps_high } => {
                for t in 0..n {
                    let a = a + s.token_advantage.map_or(0.0, |ta| ta[t] as f64);
                    let r = log_r[t].exp();
                    let rc = r.clamp(1.0 - eps_low as f64, 1.0 + eps_high as f64);
                    let (unc, clp) = (r * a, rc * a);
                    let wt = w * w_is[t];
                    if unc <= clp {
                        st.loss -= wt * unc;
                        // d(r·A)/dlog π = r·A
                        g[t] = (-wt * unc) as f32;
                    } else {
                        st.loss -= wt * clp;
                        clipped += 1;
                    }
                }
            }
            Objective::SequenceClipped { eps_low, eps_high } => {
                let sr = mean_log_r.exp();
                let src = sr.clamp(1.0 - eps_low as f64, 1.0 + eps_high as f64);
                let (unc, clp) = (sr * a, src * a);
                // The sequence term counts once per token of the sequence under the weight w (each
                // token's correction weight with it).
                let wn = w * w_is.iter().sum::<f64>();
                if unc <= clp {
                    st.loss -= wn * unc;
                    // ds/dlog π_t = s/n
                    for gt in g.iter_mut() {
                        *gt = (-wn * unc / n as f64) as f32;
                    }
                } else {
                    st.loss -= wn * clp;
                    clipped += n;
                }
            }
            Objective::MaskedIs {
                token_low,
                token_high,
                seq_low,
                seq_high,
                tau,
            } => {
                let seq_r = mean_log_r.exp();
                let seq_ok = seq_r >= seq_low as f64 && seq_r <= seq_high as f64;
                for t in 0..n {
                    let r = log_r[t].exp();
                    if !seq_ok || r < token_low as f64 || r > token_high as f64 {
                        masked += 1;
                        continue;
                    }
                    let a = a + s.token_advantage.map_or(0.0, |ta| ta[t] as f64);
                    let coeff = r * (a - tau as f64 * log_r[t]) * w_is[t];
                    st.loss -= w * coeff * s.logp[t] as f64;
                    g[t] = (-w * coeff) as f32;
                }
            }
            Objective::Sft => {
                for (gt, lp) in g.iter_mut().zip(s.logp) {
                    st.loss -= w * *lp as f64;
                    *gt = -w as f32;
                }
            }
        }
        if let Some(rl) = s.ref_logp {
            for t in 0..n {
                let d = s.logp[t] as f64 - rl[t] as f64;
                let k3 = (-d).exp() + d - 1.0;
                kl_sum += k3;
                if cfg.kl_coef != 0.0 {
                    let b = cfg.kl_coef as f64;
                    st.loss += w * b * k3;
                    g[t] += (w * b * (1.0 - (-d).exp())) as f32;
                }
            }
        }
        grads.push(g);
    }
    let nt = total_tokens.max(1) as f64;
    st.clip_fraction = clipped as f64 / nt;
    st.masked_fraction = masked as f64 / nt;
    st.kl = kl_sum / nt;
    st.ratio_mean = ratio_sum / nt;
    if total_tokens == 0 {
        st.ratio_min = 0.0;
        st.ratio_max = 0.0;
    }
    (st, grads)
}

#[cfg(test)]
mod tests;
