//! How a learning adapter's requests run, as `[[learn]]` writes it: the repetition rule its
//! generations stop on, and which version a generation runs on after a publish.

use crate::engine::repetition::RepetitionRule;
use serde::Deserialize;

/// Which version a learning adapter's generation runs on after a publish.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum VersionPolicy {
    /// The version it was admitted with, to its end.
    #[default]
    Pinned,
    /// The newest: it moves to each version published while it runs (`VersionSwitch`), every
    /// token logged with the version that computed it.
    Latest,
}

/// What a switch to a newer version does with the K/V computed so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum VersionSwitch {
    /// Recomputed under the new version (a prefill of the sequence so far): the tokens after
    /// the switch are exactly what that version computes for the whole sequence.
    #[default]
    Recompute,
    /// Kept (PipelineRL's in-flight updates): no recompute; the tokens after the switch attend
    /// to older versions' K/V, so their log-probs are no single version's (logged `exact:
    /// false`, trained as off-policy tokens with those log-probs as behaviour).
    Keep,
}

/// `stop_on_repetition` as written: a switch or a rule.
#[derive(Clone, Debug, Deserialize, serde::Serialize)]
#[serde(untagged)]
pub enum RawRepetition {
    On(bool),
    Rule(RepetitionRule),
}

impl RawRepetition {
    /// The rule in force (None: off), checked.
    pub fn rule(self) -> Result<Option<RepetitionRule>, String> {
        let r = match self {
            RawRepetition::On(false) => None,
            RawRepetition::On(true) => Some(RepetitionRule::default()),
            RawRepetition::Rule(r) => Some(r),
        };
        r.as_ref().map(RepetitionRule::check).transpose()?;
        Ok(r)
    }
}
