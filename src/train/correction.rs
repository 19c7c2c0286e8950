//! Off-policy corrections, pure: a sample drawn by another distribution μ than the trainer's π
//! (an older version: stale; a grammar, penalties, a bias or top-p: constrained or penalized)
//! trains with an importance weight instead of being dropped.
//!
//! Decoupled form (AReaL, verl's rollout IS): π_old is the trainer's policy at the step, detached
//! (the forward's own log-probs); the objective's ratio is r_t = π/π_old (clipped as the loss
//! says) and each token's term is multiplied by a weight w_t of the behaviour ratio
//! ρ_t = π_old(o_t)/μ(o_t), μ being the distribution the token was actually drawn from:
//! - `tis` (truncated IS): w = min(ρ, cap);
//! - `mis` (masked IS): w = ρ inside [low, high], 0 outside (the token or sequence is left out);
//! - `icepop` (IcePop's band masking): `mis` at token level with the band [0.5, 2];
//!
//! at `token` level (ρ_t per token), `sequence` level (ρ = Π_t ρ_t, one weight for every token
//! of the sequence) or `geometric` (ρ = exp(mean_t log ρ_t)).

/// What a weight does with ρ.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Rule {
    /// min(ρ, cap).
    Truncate { cap: f32 },
    /// ρ inside [low, high], else 0.
    Mask { low: f32, high: f32 },
}

/// Which ρ a weight is of.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Level {
    Token,
    Sequence,
    Geometric,
}

impl std::str::FromStr for Level {
    type Err = String;
    fn from_str(s: &str) -> Result<Level, String> {
        match s {
            "token" => Ok(Level::Token),
            "sequence" => Ok(Level::Sequence),
            "geometric" => Ok(Level::Geometric),
            other => Err(format!("'{other}': token, sequence or geometric")),
        }
    }
}

/// An off-policy correction.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Correction {
    pub rule: Rule,
    pub level: Level,
}

impl Correction {
    /// A named correction with its defaults (`tis`: cap 2, token; `mis`: [0.5, 2], token;
    /// `icepop`: [0.5, 2], token), then the settings given.
    pub fn named(
        name: &str,
        level: Option<Level>,
        cap: Option<f32>,
        band: (Option<f32>, Option<f32>),
    ) -> Result<Correction, (&'static str, String)> {
        let rule = match name {
            "tis" => {
                if band.0.is_some() || band.1.is_some() {
                    return Err(("correction_low", "a band is for mis and icepop".into()));
                }
                Rule::Truncate {
                    cap: cap.unwrap_or(2.0),
                }
            }
            "mis" | "icepop" => {
                if cap.is_some() {
                    return Err(("correction_cap", "a cap is for tis".into()));
                }
                Rule::Mask {
                    low: band.0.unwrap_or(0.5),
                    high: band.1.unwrap_or(2.0),
                }
            }
            other => return Err(("correction", format!("'{other}': none, tis, mis or icepop"))),
        };
        if name == "icepop" && level.is_some_and(|l| l != Level::Token) {
            return Err(("correction_level", "icepop masks tokens".into()));
        }
        let c = Correction {
            rule,
            level: level.unwrap_or(Level::Token),
        };
        match c.rule {
            Rule::Truncate { cap } if !(cap > 0.0 && cap.is_finite()) => {
                Err(("correction_cap", "must be a finite number > 0".into()))
            }
            Rule::Mask { low, high } if !(low >= 0.0 && low < high && high.is_finite()) => Err((
                "correction_high",
                "the band needs 0 <= correction_low < correction_high".into(),
            )),
            _ => Ok(c),
        }
    }

    /// The weight of each token of a sequence (`old`: π_old's log-probs, `mu`: μ's) and how many
    /// of its tokens it masks, in f64.
    pub fn weights(&self, old: &[f32], mu: &[f32]) -> (Vec<f64>, usize) {
        let n = old.len();
        let log_rho: Vec<f64> = (0..n).map(|t| old[t] as f64 - mu[t] as f64).collect();
        let apply = |log_r: f64| -> f64 {
            let r = log_r.exp();
            match self.rule {
                Rule::Truncate { cap } => r.min(cap as f64),
                Rule::Mask { low, high } if r >= low as f64 && r <= high as f64 => r,
                Rule::Mask { .. } => 0.0,
            }
        };
        let w: Vec<f64> = match self.level {
            Level::Token => log_rho.iter().map(|&l| apply(l)).collect(),
            Level::Sequence => vec![apply(log_rho.iter().sum()); n],
            Level::Geometric => vec![apply(log_rho.iter().sum::<f64>() / n.max(1) as f64); n],
        };
        let masked = match self.rule {
            Rule::Mask { .. } => w.iter().filter(|&&x| x == 0.0).count(),
            Rule::Truncate { .. } => 0,
        };
        (w, masked)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(name: &str, level: Level) -> Correction {
        Correction::named(name, Some(level), None, (None, None)).unwrap()
    }

    #[test]
    fn weights_follow_each_rule_and_level() {
        // ρ_t = e^{0.5}, e^{-1}, e^{1.2}.
        let old = [-1.0f32, -2.0, -0.3];
        let mu = [-1.5f32, -1.0, -1.5];
        let rho: Vec<f64> = (0..3)
            .map(|t| (old[t] as f64 - mu[t] as f64).exp())
            .collect();
        let (w, m) = named("tis", Level::Token).weights(&old, &mu);
        assert_eq!(w, vec![rho[0], rho[1], 2.0]);
        assert_eq!(m, 0);
        // Masked to [0.5, 2]: e^{-1} ≈ 0.37 and e^{1.2} ≈ 3.3 are out.
        let (w, m) = named("mis", Level::Token).weights(&old, &mu);
        assert_eq!((w, m), (vec![rho[0], 0.0, 0.0], 2));
        assert_eq!(
            named("icepop", Level::Token).weights(&old, &mu),
            named("mis", Level::Token).weights(&old, &mu)
        );
        // Sequence: Π ρ = e^{0.7} ≈ 2.01: truncated at 2 (tis), masked (mis); geometric:
        // e^{0.7/3} ≈ 1.26 for every token.
        let (w, _) = named("tis", Level::Sequence).weights(&old, &mu);
        assert_eq!(w, vec![2.0; 3]);
        let (w, m) = named("mis", Level::Sequence).weights(&old, &mu);
        assert_eq!((w, m), (vec![0.0; 3], 3));
        let g = ((0.5f64 - 1.0 + 1.2) / 3.0).exp();
        let (w, _) = named("mis", Level::Geometric).weights(&old, &mu);
        for x in w {
            assert!((x - g).abs() < 1e-6);
        }
    }

    #[test]
    fn settings_are_checked_naming_the_key() {
        let e = |n, l, c, b| Correction::named(n, l, c, b).unwrap_err().0;
        assert_eq!(e("ppo", None, None, (None, None)), "correction");
        assert_eq!(e("tis", None, Some(0.0), (None, None)), "correction_cap");
        assert_eq!(e("tis", None, None, (Some(0.1), None)), "correction_low");
        assert_eq!(e("mis", None, Some(2.0), (None, None)), "correction_cap");
        assert_eq!(e("mis", None, None, (Some(3.0), None)), "correction_high");
        assert_eq!(
            e("icepop", Some(Level::Sequence), None, (None, None)),
            "correction_level"
        );
        let c = Correction::named("mis", None, None, (Some(0.25), Some(4.0))).unwrap();
        assert_eq!(
            c.rule,
            Rule::Mask {
                low: 0.25,
                high: 4.0
            }
        );
    }
}
