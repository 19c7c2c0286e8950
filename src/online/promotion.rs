//! Promotion: whether a learning adapter's new version (the candidate) serves (pure; the learner
//! carries the decision out, `learner::promote`).
//!
//! - `immediate` (the default): every step's version serves at once (the guards may roll it
//!   back; an evaluation set, if any, is scored and shown but decides nothing).
//! - `gated`: the candidate serves only if its evaluation score is not below the incumbent's (the
//!   version serving) by more than `promotion_margin`; else it is held: it never serves, and the
//!   trainer goes on from the incumbent (`on_hold = "incumbent"`, the default: the held step's
//!   samples are dropped as `held`, its optimizer state discarded) or from the candidate
//!   (`on_hold = "candidate"`: the held version is kept as a checkpoint and the next steps build on
//!   it, each judged against the incumbent again, so a dip that later recovers can still serve).
//! - `canary`: the candidate takes `canary_fraction` of the adapter's new requests while training
//!   waits; once each arm (candidate, incumbent) has `canary_window` rewarded samples, the
//!   candidate is rejected if its mean reward is below the incumbent's by more than
//!   `promotion_margin` with `canary_z` standard errors of confidence (Welch: the difference's
//!   error from each arm's spread and size), i.e. `mean_c - mean_i + margin < -z * se`, and
//!   promoted otherwise. After `canary_max_secs` it is decided on what there is (rejected with
//!   fewer than 2 samples in an arm). A rejected candidate is rolled back (`on_hold =
//!   "incumbent"`: its samples are not trained on, the optimizer returns to the incumbent's) or
//!   held and trained from (`"candidate"`).

use super::eval::EvalScore;
use serde::Serialize;
use serde_json::json;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Policy {
    Immediate,
    Gated,
    Canary,
}

/// Where a gated trainer goes on from after holding a candidate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OnHold {
    Incumbent,
    Candidate,
}

/// A learning adapter's promotion settings (`[[learn]]`'s `promotion`, `promotion_margin`,
/// `on_hold`, under which names they are shown).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PromotionConfig {
    #[serde(rename = "promotion")]
    pub policy: Policy,
    #[serde(rename = "promotion_margin")]
    pub margin: f64,
    pub on_hold: OnHold,
    #[serde(flatten)]
    pub canary: CanaryConfig,
}

/// A canary's settings (`canary_fraction`, `canary_window`, `canary_z`, `canary_max_secs`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CanaryConfig {
    #[serde(rename = "canary_fraction")]
    pub fraction: f64,
    #[serde(rename = "canary_window")]
    pub window: usize,
    #[serde(rename = "canary_z")]
    pub z: f64,
    #[serde(rename = "canary_max_secs")]
    pub max_secs: Option<f64>,
}

impl Default for CanaryConfig {
    fn default() -> CanaryConfig {
        CanaryConfig {
            fraction: 0.2,
            window: 16,
            z: 2.0,
            max_secs: None,
        }
    }
}

impl Default for PromotionConfig {
    fn default() -> PromotionConfig {
        PromotionConfig {
            policy: Policy::Immediate,
            margin: 0.0,
            on_hold: OnHold::Incumbent,
            canary: CanaryConfig::default(),
        }
    }
}

/// The written promotion settings (`[[learn]]`'s keys).
#[derive(Clone, Debug, Default)]
pub struct RawPromotion<'a> {
    pub policy: Option<&'a str>,
    pub margin: Option<f64>,
    pub on_hold: Option<&'a str>,
    pub canary_fraction: Option<f64>,
    pub canary_window: Option<usize>,
    pub canary_z: Option<f64>,
    pub canary_max_secs: Option<f64>,
}

impl PromotionConfig {
    /// Parse the written settings; the error names the key.
    pub fn parse(r: RawPromotion) -> Result<PromotionConfig, (&'static str, String)> {
        let policy = match r.policy {
            None | Some("immediate") => Policy::Immediate,
            Some("gated") => Policy::Gated,
            Some("canary") => Policy::Canary,
            Some(o) => return Err(("promotion", format!("'{o}': immediate, gated or canary"))),
        };
        let d = CanaryConfig::default();
        let canary = CanaryConfig {
            fraction: r.canary_fraction.unwrap_or(d.fraction),
            window: r.canary_window.unwrap_or(d.window),
            z: r.canary_z.unwrap_or(d.z),
            max_secs: r.canary_max_secs,
        };
        if !(canary.fraction > 0.0 && canary.fraction < 1.0) {
            return Err(("canary_fraction", "must be in (0, 1)".into()));
        }
        if !(1..=100_000).contains(&canary.window) {
            return Err(("canary_window", "must be in 1..=100000".into()));
        }
        if !(canary.z >= 0.0 && canary.z.is_finite()) {
            return Err(("canary_z", "must be a finite number >= 0".into()));
        }
        if canary.max_secs.is_some_and(|s| !(s > 0.0 && s.is_finite())) {
            return Err(("canary_max_secs", "must be > 0".into()));
        }
        let (margin, on_hold) = (r.margin, r.on_hold);
        let on_hold = match on_hold {
            None | Some("incumbent") => OnHold::Incumbent,
            Some("candidate") => OnHold::Candidate,
            Some(o) => return Err(("on_hold", format!("'{o}': incumbent or candidate"))),
        };
        let margin = margin.unwrap_or(0.0);
        if !(0.0..=1.0).contains(&margin) {
            return Err(("promotion_margin", "must be in [0, 1]".into()));
        }
        Ok(PromotionConfig {
            policy,
            margin,
            on_hold,
            canary,
        })
    }
}

/// One arm of a canary: its rewarded samples' count, mean and variance.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Arm {
    pub n: usize,
    pub mean: f64,
    pub var: f64,
}

impl Arm {
    pub fn of(rewards: &[f64]) -> Arm {
        let n = rewards.len();
        if n == 0 {
            return Arm::default();
        }
        let mean = rewards.iter().sum::<f64>() / n as f64;
        let var = match n {
            1 => 0.0,
            _ => rewards.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / (n - 1) as f64,
        };
        Arm { n, mean, var }
    }
}

/// A canary's verdict.
#[derive(Clone, Debug, PartialEq)]
pub enum CanaryVerdict {
    /// Not enough samples yet.
    Wait,
    Promote(serde_json::Value),
    Reject(serde_json::Value),
}

/// Judge a canary: `cand` and `inc` arms, `timed_out` when `canary_max_secs` has passed.
pub fn canary(
    cand: &Arm,
    inc: &Arm,
    margin: f64,
    c: &CanaryConfig,
    timed_out: bool,
) -> CanaryVerdict {
    let full = cand.n >= c.window && inc.n >= c.window;
    if !full && !timed_out {
        return CanaryVerdict::Wait;
    }
    let diff = cand.mean - inc.mean;
    let se = (cand.var / cand.n.max(1) as f64 + inc.var / inc.n.max(1) as f64).sqrt();
    let evidence = json!({
        "candidate": {"n": cand.n, "mean": cand.mean, "variance": cand.var},
        "incumbent": {"n": inc.n, "mean": inc.mean, "variance": inc.var},
        "difference": diff, "standard_error": se, "margin": margin, "z": c.z,
        "window": c.window, "timed_out": timed_out && !full,
    });
    if cand.n < 2 || inc.n < 2 || diff + margin < -c.z * se {
        CanaryVerdict::Reject(evidence)
    } else {
        CanaryVerdict::Promote(evidence)
    }
}

/// The gate's verdict, with what it read.
#[derive(Clone, Debug, PartialEq)]
pub struct Gate {
    pub promote: bool,
    pub evidence: serde_json::Value,
}

/// Whether `candidate` may replace `incumbent`: its score is not below the incumbent's by more
/// than `margin`.
pub fn gate(candidate: &EvalScore, incumbent: &EvalScore, margin: f64) -> Gate {
    let line = incumbent.score - margin;
    Gate {
        // A hair of float noise is not a drop.
        promote: candidate.score >= line - 1e-12,
        evidence: json!({
            "candidate_version": candidate.version, "candidate_score": candidate.score,
            "incumbent_version": incumbent.version, "incumbent_score": incumbent.score,
            "margin": margin, "line": line,
            "candidate_items": candidate.items, "incumbent_items": incumbent.items,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(version: u64, score: f64) -> EvalScore {
        EvalScore {
            version,
            score,
            items: vec![score],
            seconds: 0.0,
        }
    }

    #[test]
    fn the_gate_holds_a_candidate_below_the_incumbent_by_more_than_the_margin() {
        assert!(gate(&s(5, 0.8), &s(4, 0.8), 0.0).promote, "equal");
        assert!(gate(&s(5, 0.9), &s(4, 0.8), 0.0).promote, "better");
        assert!(
            !gate(&s(5, 0.7), &s(4, 0.8), 0.05).promote,
            "worse beyond the margin"
        );
        assert!(
            gate(&s(5, 0.76), &s(4, 0.8), 0.05).promote,
            "within the margin"
        );
        let g = gate(&s(5, 0.7), &s(4, 0.8), 0.05);
        assert_eq!(g.evidence["incumbent_version"], 4);
        assert!((g.evidence["line"].as_f64().unwrap() - 0.75).abs() < 1e-12);
    }

    #[test]
    fn settings_are_parsed_with_their_key_named() {
        let raw = |policy, margin, on_hold| RawPromotion {
            policy,
            margin,
            on_hold,
            ..RawPromotion::default()
        };
        let c = PromotionConfig::parse(raw(Some("gated"), Some(0.1), Some("candidate"))).unwrap();
        assert_eq!(
            (c.policy, c.on_hold, c.margin),
            (Policy::Gated, OnHold::Candidate, 0.1)
        );
        let d = PromotionConfig::parse(raw(None, None, None)).unwrap();
        assert_eq!(d, PromotionConfig::default());
        let e = |r| PromotionConfig::parse(r).unwrap_err().0;
        assert_eq!(e(raw(Some("yolo"), None, None)), "promotion");
        assert_eq!(e(raw(None, Some(2.0), None)), "promotion_margin");
        assert_eq!(e(raw(None, None, Some("x"))), "on_hold");
        let none = raw(None, None, None);
        for (r, key) in [
            (
                RawPromotion {
                    canary_fraction: Some(1.0),
                    ..none.clone()
                },
                "canary_fraction",
            ),
            (
                RawPromotion {
                    canary_window: Some(0),
                    ..none.clone()
                },
                "canary_window",
            ),
            (
                RawPromotion {
                    canary_z: Some(-1.0),
                    ..none.clone()
                },
                "canary_z",
            ),
            (
                RawPromotion {
                    canary_max_secs: Some(0.0),
                    ..none.clone()
                },
                "canary_max_secs",
            ),
        ] {
            assert_eq!(e(r), key);
        }
    }

    /// The canary waits for its window, then rejects a candidate clearly worse than the
    /// incumbent by more than the margin, and promotes one that is not (equal, better, or worse
    /// within the noise or the margin); at its time limit it decides on what there is.
    #[test]
    fn the_canary_rejects_only_a_clear_regression() {
        let c = CanaryConfig {
            window: 4,
            ..CanaryConfig::default()
        };
        let good = Arm::of(&[1.0, 0.9, 1.0, 0.9]);
        let bad = Arm::of(&[0.0, 0.1, 0.0, 0.1]);
        assert!((good.mean - 0.95).abs() < 1e-12 && (good.var - 1.0 / 300.0).abs() < 1e-12);
        let few = Arm::of(&[0.0, 0.1]);
        assert_eq!(canary(&few, &good, 0.0, &c, false), CanaryVerdict::Wait);
        assert!(matches!(
            canary(&bad, &good, 0.0, &c, false),
            CanaryVerdict::Reject(_)
        ));
        assert!(matches!(
            canary(&good, &bad, 0.0, &c, false),
            CanaryVerdict::Promote(_)
        ));
        assert!(matches!(
            canary(&good, &good, 0.0, &c, false),
            CanaryVerdict::Promote(_)
        ));
        // Worse by 0.1 with spreads of 0.5: within two standard errors.
        let noisy_a = Arm::of(&[0.0, 1.0, 0.0, 1.0]);
        let noisy_b = Arm::of(&[0.1, 1.1, 0.1, 1.1]);
        assert!(matches!(
            canary(&noisy_a, &noisy_b, 0.0, &c, false),
            CanaryVerdict::Promote(_)
        ));
        // Worse by 0.9 but the margin allows 1.
        assert!(matches!(
            canary(&bad, &good, 1.0, &c, false),
            CanaryVerdict::Promote(_)
        ));
        // Timed out: decided on what there is; too few samples is a rejection.
        let few2 = Arm::of(&[0.0, 0.1]);
        assert!(matches!(
            canary(&few, &few2, 0.0, &c, true),
            CanaryVerdict::Promote(_)
        ));
        match canary(&Arm::of(&[1.0]), &good, 0.0, &c, true) {
            CanaryVerdict::Reject(e) => assert_eq!(e["timed_out"], true),
            v => panic!("{v:?}"),
        }
    }
}
