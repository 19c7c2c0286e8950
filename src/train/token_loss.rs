//! Per-token losses on a sequence's log-probs, as the Tinker API names them (`forward_backward`'s
//! `loss_fn`): each token's loss and its derivative by its log-prob, from which the model's
//! backward takes over (`Decoder::train_backward`). With p = exp(logp) the learner's
//! probability of the target token, q = exp(sampling logp) the sampler's, r = p/q, A the
//! advantage and w the weight (1 when not given):
//!
//! | loss | per-token loss | d loss / d logp |
//! |---|---|---|
//! | `cross_entropy` | −w·logp | −w |
//! | `importance_sampling` | −w·r·A | −w·r·A |
//! | `ppo` | −w·min(r·A, clip(r, lo, hi)·A) | −w·r·A where the unclipped term is the minimum, else 0 |
//! | `cispo` | −w·sg(clip(r, lo, hi))·logp·A | −w·clip(r, lo, hi)·A |
//! | `dro` | −w·(logp·A − β/2·(logp − log q)²) | −w·(A − β·(logp − log q)) |
//!
//! (Tinker's RL losses take no weights: the advantages are zero where nothing is trained; a
//! `weights` input multiplies them here.) Computed in f64, returned in f32.

use std::fmt;

/// A loss and its settings (`loss_fn_config`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum TokenLoss {
    CrossEntropy,
    ImportanceSampling,
    /// The ratio's clip range (`clip_low_threshold`, `clip_high_threshold`: 0.8 and 1.2 by
    /// default, Tinker's fixed ε = 0.2).
    Ppo {
        low: f64,
        high: f64,
    },
    Cispo {
        low: f64,
        high: f64,
    },
    /// The quadratic penalty's β (`beta`).
    Dro {
        beta: f64,
    },
}

/// The losses by name.
pub const NAMES: [&str; 5] = [
    "cross_entropy",
    "importance_sampling",
    "ppo",
    "cispo",
    "dro",
];

/// Tinker's PPO and CISPO clip range by default.
pub const CLIP_LOW: f64 = 0.8;
pub const CLIP_HIGH: f64 = 1.2;
/// DRO's β by default (Tinker's docs do not give theirs).
pub const DRO_BETA: f64 = 0.05;

impl TokenLoss {
    /// The inputs each token needs besides `target_tokens` (and the optional `weights`).
    pub fn inputs(self) -> &'static [&'static str] {
        match self {
            TokenLoss::CrossEntropy => &[],
            _ => &["logprobs", "advantages"],
        }
    }

    /// The `loss_fn_config` keys it takes.
    pub fn config_keys(self) -> &'static [&'static str] {
        match self {
            TokenLoss::Ppo { .. } | TokenLoss::Cispo { .. } => {
                &["clip_low_threshold", "clip_high_threshold"]
            }
            TokenLoss::Dro { .. } => &["beta"],
            _ => &[],
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            TokenLoss::CrossEntropy => NAMES[0],
            TokenLoss::ImportanceSampling => NAMES[1],
            TokenLoss::Ppo { .. } => NAMES[2],
            TokenLoss::Cispo { .. } => NAMES[3],
            TokenLoss::Dro { .. } => NAMES[4],
        }
    }

    /// The loss `name` with its defaults (None: not one of `NAMES`).
    pub fn named(name: &str) -> Option<TokenLoss> {
        Some(match name {
            "cross_entropy" => TokenLoss::CrossEntropy,
            "importance_sampling" => TokenLoss::ImportanceSampling,
            "ppo" => TokenLoss::Ppo {
                low: CLIP_LOW,
                high: CLIP_HIGH,
            },
            "cispo" => TokenLoss::Cispo {
                low: CLIP_LOW,
                high: CLIP_HIGH,
            },
            "dro" => TokenLoss::Dro { beta: DRO_BETA },
            _ => return None,
        })
    }

    /// Set `key` of its config (one of `config_keys`).
    pub fn set(&mut self, key: &str, value: f64) {
        match (self, key) {
            (TokenLoss::Ppo { low, .. } | TokenLoss::Cispo { low, .. }, "clip_low_threshold") => {
                *low = value
            }
            (
                TokenLoss::Ppo { high, .. } | TokenLoss::Cispo { high, .. },
                "clip_high_threshold",
            ) => *high = value,
            (TokenLoss::Dro { beta }, "beta") => *beta = value,
            _ => {}
        }
    }
}

impl fmt::Display for TokenLoss {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What one token's loss reads besides its log-prob.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TokenInputs {
    pub weight: f64,
    /// The sampler's log-prob of the token.
    pub sampling_logprob: f64,
    pub advantage: f64,
}

/// One token's loss and d loss / d logp.
pub fn token_loss(loss: TokenLoss, logp: f64, x: &TokenInputs) -> (f64, f64) {
    let w = x.weight;
    let ratio = || (logp - x.sampling_logprob).exp();
    let (l, g) = match loss {
        TokenLoss::CrossEntropy => (-logp, -1.0),
        TokenLoss::ImportanceSampling => {
            let r = ratio();
            (-r * x.advantage, -r * x.advantage)
        }
        TokenLoss::Ppo { low, high } => {
            let r = ratio();
            let (plain, clipped) = (r * x.advantage, r.clamp(low, high) * x.advantage);
            if plain <= clipped {
                // The unclipped term is the minimum (equal inside the range): its gradient.
                (-plain, -plain)
            } else {
                (-clipped, 0.0)
            }
        }
        TokenLoss::Cispo { low, high } => {
            let c = ratio().clamp(low, high);
            (-c * logp * x.advantage, -c * x.advantage)
        }
        TokenLoss::Dro { beta } => {
            let d = logp - x.sampling_logprob;
            (
                -(logp * x.advantage - 0.5 * beta * d * d),
                -(x.advantage - beta * d),
            )
        }
    };
    (w * l, w * g)
}

/// A sequence's per-token losses and gradients (f32), and their sum (f64).
pub fn sequence_loss(
    loss: TokenLoss,
    logps: &[f32],
    inputs: &[TokenInputs],
) -> (Vec<f32>, Vec<f32>, f64) {
    let mut sum = 0.0;
    let (losses, grads) = logps
        .iter()
        .zip(inputs)
        .map(|(&lp, x)| {
            let (l, g) = token_loss(loss, lp as f64, x);
            sum += l;
            (l as f32, g as f32)
        })
        .unzip();
    (losses, grads, sum)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each loss's derivative by the log-prob against a central finite difference in f64, at
    /// points inside and outside the clip ranges and for both signs of the advantage.
    #[test]
    fn each_loss_gradient_matches_a_finite_difference() {
        let losses = NAMES.map(|n| TokenLoss::named(n).unwrap());
        let h = 1e-6;
        for loss in losses {
            for &(lp, q, a) in &[
                (-1.0, -1.1, 0.7),
                (-1.0, -1.1, -0.7),
                (-0.2, -1.5, 1.3),  // r ≈ 3.7: above the clip
                (-0.2, -1.5, -1.3), // above the clip, negative advantage
                (-2.5, -0.5, 0.4),  // r ≈ 0.14: below the clip
                (-2.5, -0.5, -0.4),
            ] {
                let x = TokenInputs {
                    weight: 0.75,
                    sampling_logprob: q,
                    advantage: a,
                };
                let (_, g) = token_loss(loss, lp, &x);
                let fd =
                    (token_loss(loss, lp + h, &x).0 - token_loss(loss, lp - h, &x).0) / (2.0 * h);
                let want = if matches!(loss, TokenLoss::Cispo { .. }) {
                    // CISPO stops the gradient through its clipped ratio: only logp·A moves.
                    let c = (lp - q).exp().clamp(CLIP_LOW, CLIP_HIGH);
                    -0.75 * c * a
                } else {
                    fd
                };
                assert!(
                    (g - want).abs() < 1e-6 * (1.0 + want.abs()),
                    "{loss} at logp {lp}, q {q}, A {a}: {g} vs {want}"
                );
            }
        }
    }

    /// PPO takes the pessimistic term: with a positive advantage a ratio above the range is
    /// clipped (no gradient), one below it is not; with a negative advantage the reverse.
    #[test]
    fn ppo_clips_the_way_the_advantage_points() {
        let ppo = TokenLoss::named("ppo").unwrap();
        let x = |a| TokenInputs {
            weight: 1.0,
            sampling_logprob: 0.0,
            advantage: a,
        };
        let high = 1.5f64.ln();
        let low = 0.5f64.ln();
        assert_eq!(token_loss(ppo, high, &x(1.0)), (-1.2, 0.0));
        assert!((token_loss(ppo, low, &x(1.0)).1 + 0.5).abs() < 1e-12);
        assert!((token_loss(ppo, high, &x(-1.0)).1 - 1.5).abs() < 1e-12);
        assert_eq!(token_loss(ppo, low, &x(-1.0)).1, 0.0);
    }
}
