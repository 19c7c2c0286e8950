//! What a learner reports: its state, its errors (by kind, as `/v1/train/status` and
//! `flywheel_train_errors_total` show them), its last step and its status.

use super::LearnConfig;
use crate::online::store::records::{Decision, LogError};
use crate::train::offline::StepStats;
use crate::util::now_secs;
use std::collections::BTreeMap;

/// running: trains when batches are ready; paused: by an operator; failed: stopped after an
/// error it could not recover from (feedback for it is refused until it is resumed).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    Running,
    Paused,
    Failed,
}

/// What went wrong, by where.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The rollout log (SQLite, or its file gone).
    Database,
    /// Writing the checkpoint (disk full, read-only, ...).
    Checkpoint,
    /// The forward, backward or optimizer.
    Step,
    /// Publishing the version.
    Publish,
    /// A panic in the trainer, caught.
    Panic,
    /// Starting the learner (reading its checkpoint, creating its lineage).
    Start,
    /// Rolling back (the version asked for has no checkpoint, or it would not load).
    Rollback,
    /// Evaluating a version (its requests failed, or the server does not serve yet).
    Eval,
}

impl ErrorKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Database => "database",
            ErrorKind::Checkpoint => "checkpoint",
            ErrorKind::Step => "step",
            ErrorKind::Publish => "publish",
            ErrorKind::Panic => "panic",
            ErrorKind::Start => "start",
            ErrorKind::Rollback => "rollback",
            ErrorKind::Eval => "eval",
        }
    }
}

/// A trainer error, as `/v1/train/status` shows it.
#[derive(Clone, Debug, serde::Serialize, thiserror::Error)]
#[error("{} error: {message}", kind.as_str())]
pub struct TrainError {
    pub kind: ErrorKind,
    pub message: String,
    /// Unix seconds.
    pub at: f64,
}

impl TrainError {
    pub fn new(kind: ErrorKind, message: impl std::fmt::Display) -> TrainError {
        TrainError {
            kind,
            message: message.to_string(),
            at: now_secs(),
        }
    }
}

impl From<LogError> for TrainError {
    fn from(e: LogError) -> TrainError {
        TrainError::new(ErrorKind::Database, e)
    }
}

/// A published step: its statistics and where it sits.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct StepReport {
    #[serde(flatten)]
    pub stats: StepStats,
    pub version: u64,
    pub groups: usize,
    pub staleness_max: u64,
    /// The mean over the step's completion tokens of how many versions behind the serving one
    /// the version that computed each was (a partial rollout's tokens each count their own).
    #[serde(default)]
    pub staleness_token_mean: f64,
    /// The version's evaluation, when the adapter has an evaluation set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval: Option<crate::online::eval::EvalScore>,
    /// Held, not served (`online::promotion`; a pin).
    #[serde(default)]
    pub held: bool,
}

/// What `GET /v1/train/status` shows of a learning adapter.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Status {
    pub state: State,
    pub version: u64,
    pub lineage: u64,
    pub steps: u64,
    pub pending_groups: usize,
    pub dropped: BTreeMap<String, u64>,
    /// Completions of this adapter trained on, and dropped by reason (as the store counted them
    /// at start, plus since).
    pub trained: u64,
    pub last: Option<StepReport>,
    pub last_error: Option<TrainError>,
    /// Failures since the last success (the learner fails after `MAX_FAILURES`).
    pub consecutive_failures: u32,
    /// Unix seconds of the next try after a failure.
    pub retry_at: Option<f64>,
    pub config: LearnConfig,
    /// The newest decision about its versions (a rollback and why, a resume, a hold), if any.
    pub last_decision: Option<Decision>,
    /// Evaluation scores of recent versions (served and candidates).
    pub eval_scores: BTreeMap<u64, f64>,
    /// The held version training goes on from while serving stays on `version` (a gated
    /// candidate kept, or steps taken while pinned).
    pub held_version: Option<u64>,
    /// The version serving is pinned to (training goes on; nothing it makes serves).
    pub pinned_version: Option<u64>,
    /// The candidate a canary serves to a fraction of requests (training waits for its verdict).
    pub canary_version: Option<u64>,
}
