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

use super::eval::EvalScore;
use serde::Serialize;
use serde_json::json;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Policy {
    Immediate,
    Gated,
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
}

impl Default for PromotionConfig {
    fn default() -> PromotionConfig {
        PromotionConfig {
            policy: Policy::Immediate,
            margin: 0.0,
            on_hold: OnHold::Incumbent,
        }
    }
}

impl PromotionConfig {
    /// Parse the written settings; the error names the key.
    pub fn parse(
        policy: Option<&str>,
        margin: Option<f64>,
        on_hold: Option<&str>,
    ) -> Result<PromotionConfig, (&'static str, String)> {
        let policy = match policy {
            None | Some("immediate") => Policy::Immediate,
            Some("gated") => Policy::Gated,
            Some("canary") => {
                return Err((
                    "promotion",
                    "'canary' is not available yet: immediate or gated".into(),
                ))
            }
            Some(o) => return Err(("promotion", format!("'{o}': immediate or gated"))),
        };
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
        })
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
        let c = PromotionConfig::parse(Some("gated"), Some(0.1), Some("candidate")).unwrap();
        assert_eq!(
            (c.policy, c.on_hold, c.margin),
            (Policy::Gated, OnHold::Candidate, 0.1)
        );
        assert_eq!(
            PromotionConfig::parse(None, None, None).unwrap(),
            PromotionConfig::default()
        );
        assert_eq!(
            PromotionConfig::parse(Some("yolo"), None, None)
                .unwrap_err()
                .0,
            "promotion"
        );
        assert_eq!(
            PromotionConfig::parse(None, Some(2.0), None).unwrap_err().0,
            "promotion_margin"
        );
        assert_eq!(
            PromotionConfig::parse(None, None, Some("x")).unwrap_err().0,
            "on_hold"
        );
    }
}
