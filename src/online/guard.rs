//! Guards: rules that judge a learning adapter's steps as they are taken, with no evaluation set,
//! and say when to roll back (pure: the learner feeds them its steps and carries out the verdict).
//!
//! - **Reward drop** (on by default): the mean reward of the last `window` steps against the
//!   `window` steps before them. It fires when the drop is larger than `reward_z` standard errors
//!   of the difference (each window's error from its steps' reward spreads and sizes) *and*
//!   larger than `reward_min_drop` times the earlier window's spread (a drop that matters, not
//!   only one that is certain). The target is the newest version whose samples were not judged
//!   bad: the first recent step whose mean fell below the earlier mean by the threshold was
//!   trained on samples of the version the step before it published (a step's batch is sampled
//!   by the version serving then), so the rollback goes to the version published before that
//!   one. It needs `2 × window` steps since the lineage's start or its last rollback.
//! - **KL** (off unless `max_kl` is set): a step whose KL estimate exceeds the bound rolls back to
//!   the version before it.
//! - **Entropy collapse** (off unless `min_entropy` is set): a step whose samples' mean entropy per
//!   token fell below the bound rolls back to the version before it.

use serde_json::json;

/// A learning adapter's guards (`[[learn]]`'s `guard_*` keys and `after_rollback`, under which
/// names they are shown).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct GuardConfig {
    /// Steps per window of the reward guard; 0 turns it off.
    #[serde(rename = "guard_window")]
    pub window: usize,
    #[serde(rename = "guard_reward_z")]
    pub reward_z: f64,
    #[serde(rename = "guard_reward_min_drop")]
    pub reward_min_drop: f64,
    #[serde(rename = "guard_max_kl")]
    pub max_kl: Option<f64>,
    #[serde(rename = "guard_min_entropy")]
    pub min_entropy: Option<f64>,
    /// After an automatic rollback: pause training (the default) or go on from the version
    /// rolled back to.
    pub after_rollback: AfterRollback,
}

/// What training does after a guard rolls back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AfterRollback {
    Pause,
    Continue,
}

impl Default for GuardConfig {
    fn default() -> GuardConfig {
        GuardConfig {
            window: 4,
            reward_z: 3.0,
            reward_min_drop: 0.5,
            max_kl: None,
            min_entropy: None,
            after_rollback: AfterRollback::Pause,
        }
    }
}

/// What the guards read of one step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepPoint {
    /// The version the step published.
    pub version: u64,
    pub reward_mean: f64,
    pub reward_std: f64,
    /// Rewarded sequences in the step.
    pub n: usize,
    pub kl: f64,
    pub entropy: f64,
}

/// A guard's verdict on the steps so far.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    Keep,
    Rollback {
        to: u64,
        reason: &'static str,
        evidence: serde_json::Value,
    },
}

/// Judge `steps` (in order, since the lineage started or last rolled back from version
/// `first`, the version serving before the first of them).
pub fn judge(steps: &[StepPoint], first: u64, cfg: &GuardConfig) -> Verdict {
    let Some(last) = steps.last() else {
        return Verdict::Keep;
    };
    let before_last = match steps.len() {
        1 => first,
        n => steps[n - 2].version,
    };
    if let Some(bound) = cfg.max_kl {
        if last.kl > bound {
            return Verdict::Rollback {
                to: before_last,
                reason: "kl",
                evidence: json!({"version": last.version, "kl": last.kl, "max_kl": bound}),
            };
        }
    }
    if let Some(bound) = cfg.min_entropy {
        if last.entropy < bound {
            return Verdict::Rollback {
                to: before_last,
                reason: "entropy",
                evidence: json!({"version": last.version, "entropy": last.entropy,
                                 "min_entropy": bound}),
            };
        }
    }
    let w = cfg.window;
    if w == 0 || steps.len() < 2 * w {
        return Verdict::Keep;
    }
    let (earlier, recent) = steps[steps.len() - 2 * w..].split_at(w);
    let (m0, se0, spread0) = window_stats(earlier);
    let (m1, se1, _) = window_stats(recent);
    let drop = m0 - m1;
    let se = (se0 * se0 + se1 * se1).sqrt();
    let needed = (cfg.reward_z * se).max(cfg.reward_min_drop * spread0);
    if drop > needed && drop > 0.0 {
        // The first recent step below the line (the window's mean is, so one is), its index in
        // `steps`; its samples came from the version of the step before it.
        let first_bad = recent
            .iter()
            .position(|s| s.reward_mean < m0 - needed)
            .unwrap_or(0)
            + steps.len()
            - w;
        let to = match first_bad {
            0 | 1 => first,
            i => steps[i - 2].version,
        };
        return Verdict::Rollback {
            to,
            reason: "reward_drop",
            evidence: json!({
                "window": w,
                "earlier_versions": [earlier[0].version, earlier[w - 1].version],
                "recent_versions": [recent[0].version, recent[w - 1].version],
                "earlier_mean": m0, "recent_mean": m1, "drop": drop,
                "first_bad_step_version": steps[first_bad].version,
                "standard_error": se, "earlier_spread": spread0,
                "reward_z": cfg.reward_z, "reward_min_drop": cfg.reward_min_drop,
                "threshold": needed,
            }),
        };
    }
    Verdict::Keep
}

/// A window's mean reward (weighted by sequences), the standard error of that mean, and the
/// rewards' pooled spread (within steps).
fn window_stats(steps: &[StepPoint]) -> (f64, f64, f64) {
    let n: f64 = steps.iter().map(|s| s.n.max(1) as f64).sum();
    let mean = steps
        .iter()
        .map(|s| s.reward_mean * s.n.max(1) as f64)
        .sum::<f64>()
        / n;
    let var_sum: f64 = steps
        .iter()
        .map(|s| s.reward_std * s.reward_std * s.n.max(1) as f64)
        .sum();
    let spread = (var_sum / n).sqrt();
    (mean, spread / n.sqrt(), spread)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(version: u64, mean: f64, std: f64) -> StepPoint {
        StepPoint {
            version,
            reward_mean: mean,
            reward_std: std,
            n: 8,
            kl: 0.01,
            entropy: 1.0,
        }
    }

    /// A reward that falls by much more than its noise rolls back to the version before the one
    /// that sampled the first bad step; the same fall inside the noise, a small fall, a rise, or
    /// too few steps keep.
    #[test]
    fn the_reward_guard_fires_on_a_real_drop_only() {
        let cfg = GuardConfig::default();
        let good: Vec<StepPoint> = (0..4).map(|i| step(11 + i, 0.9, 0.2)).collect();
        let bad: Vec<StepPoint> = (0..4).map(|i| step(15 + i, 0.3, 0.2)).collect();
        let steps: Vec<StepPoint> = good.iter().chain(&bad).copied().collect();
        match judge(&steps, 10, &cfg) {
            Verdict::Rollback {
                to,
                reason,
                evidence,
            } => {
                // Step 15 was the first bad one, on samples of version 14: back to 13.
                assert_eq!((to, reason), (13, "reward_drop"));
                assert!((evidence["drop"].as_f64().unwrap() - 0.6).abs() < 1e-9);
            }
            v => panic!("{v:?}"),
        }
        assert_eq!(judge(&steps[..7], 10, &cfg), Verdict::Keep, "too few steps");
        // One bad step after seven good ones: caught at once, back to the version before the
        // one that sampled it.
        let one_bad: Vec<StepPoint> = (0..7)
            .map(|i| step(11 + i, 0.9, 0.02))
            .chain([step(18, 0.1, 0.02)])
            .collect();
        assert!(matches!(
            judge(&one_bad, 10, &cfg),
            Verdict::Rollback { to: 16, .. }
        ));
        // The same means with rewards so noisy that the drop is within 3 standard errors.
        let noisy: Vec<StepPoint> = steps
            .iter()
            .map(|s| StepPoint {
                reward_std: 3.0,
                ..*s
            })
            .collect();
        assert_eq!(judge(&noisy, 10, &cfg), Verdict::Keep, "within the noise");
        // Certain but small: a drop of 0.05 with spread 0.2 (under half a spread).
        let small: Vec<StepPoint> = good
            .iter()
            .copied()
            .chain((0..4).map(|i| step(15 + i, 0.85, 0.2)))
            .map(|s| StepPoint { n: 10_000, ..s })
            .collect();
        assert_eq!(
            judge(&small, 10, &cfg),
            Verdict::Keep,
            "too small to matter"
        );
        let rise: Vec<StepPoint> = bad.iter().chain(&good).copied().collect();
        assert_eq!(judge(&rise, 10, &cfg), Verdict::Keep, "a rise");
        let off = GuardConfig {
            window: 0,
            ..GuardConfig::default()
        };
        assert_eq!(judge(&steps, 10, &off), Verdict::Keep, "turned off");
    }

    /// KL and entropy bounds are off by default; set, a step past them rolls back to the version
    /// before it (the lineage's first when it is the first step).
    #[test]
    fn kl_and_entropy_bounds_roll_back_one_step() {
        let mut s = vec![step(5, 0.5, 0.1), step(6, 0.5, 0.1)];
        s[1].kl = 2.0;
        s[1].entropy = 0.01;
        assert_eq!(judge(&s, 4, &GuardConfig::default()), Verdict::Keep);
        let kl = GuardConfig {
            max_kl: Some(0.5),
            ..GuardConfig::default()
        };
        assert!(matches!(
            judge(&s, 4, &kl),
            Verdict::Rollback {
                to: 5,
                reason: "kl",
                ..
            }
        ));
        let ent = GuardConfig {
            min_entropy: Some(0.1),
            ..GuardConfig::default()
        };
        assert!(matches!(
            judge(&s, 4, &ent),
            Verdict::Rollback {
                to: 5,
                reason: "entropy",
                ..
            }
        ));
        assert!(matches!(
            judge(&s[1..], 4, &ent),
            Verdict::Rollback { to: 4, .. }
        ));
    }
}
