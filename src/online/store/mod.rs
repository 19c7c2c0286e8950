//! The rollout store: what the server and the trainer keep durably (completions served through a
//! learning adapter, their rewards, episodes, lineages and checkpoints), behind one trait with
//! two implementations and one test suite (`tests/rollout_store.rs`):
//! - `sqlite::SqliteLog`: one process, one file in the data directory; the default.
//! - `postgres::PgLog`: PostgreSQL, shared by serving replicas and a trainer on other machines
//!   (`--rollout-store postgres://...`).
//!
//! `records` is their shared vocabulary (what is logged, rewarded, trained; lineages and
//! checkpoints; the errors and the decisions every store makes the same way); `open` picks one
//! store from the configuration.
//!
//! The promises are the same: a method that returns Ok has committed; a batch of rewards is all
//! or none; a completion is rewarded only by the key that made it (or an admin); a repeated
//! reward is idempotent and a different one a conflict; a step's checkpoint and the members it
//! consumed commit together, and a member is consumed at most once.

pub mod open;
pub mod postgres;
pub mod records;
pub mod spans;
pub mod sqlite;

use crate::online::sessions::{AgentSession, SessionReward, SessionView};
use records::{
    Accepting, ChoiceInfo, CompletionRecord, EpisodeFeedback, FeedbackError, History, LogError,
    PendingGroup, Reward, Turn,
};
use records::{Checkpoint, Decision, Lineage, RunRecord, SessionRecord, StepRow};
use sqlite::SqliteLog;

/// How an agent session is looked up.
#[derive(Clone, Copy, Debug)]
pub enum SessionLookup<'a> {
    Id(&'a str),
    /// The hash of its key (`RolloutStore::key_hash`).
    KeyHash(&'a str),
}

/// What one process hears of another's work through a shared store (`RolloutStore::subscribe`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Announcement {
    /// A committed step (a new version): what serving replicas follow.
    Steps,
    /// A new reward recorded (by any replica): what the trainer trains on.
    Rewards,
}

/// Which completions' adapters take rewards now (the trainer's answer, as a value).
pub type Accepts<'a> = &'a Accepting;

pub trait RolloutStore: Send + Sync {
    /// "sqlite" or "postgres", for logs and `/v1/train/status`.
    fn kind(&self) -> &'static str;
    /// Ok while the store can be written (SQLite: the file is the one opened; PostgreSQL: the
    /// server answers).
    fn check(&self) -> Result<(), LogError>;
    /// A key's stored form (a salted hash; the salt is the store's own).
    fn key_hash(&self, key: &str) -> String;
    /// Log the choices of one request (one transaction).
    fn log_completions(&self, recs: &[CompletionRecord]) -> Result<(), LogError>;
    /// Record rewards, all or none; Ok(true) when at least one is new.
    fn post_rewards(
        &self,
        items: &[Reward],
        key: &str,
        admin: bool,
        accepts: Accepts,
    ) -> Result<bool, FeedbackError>;
    /// What is stored for each choice of completion `id` (with its owner's key hash).
    fn feedback(&self, id: &str) -> Result<Vec<(String, ChoiceInfo)>, LogError>;
    /// Every group of `adapter` with unconsumed, undropped members and at least one reward.
    fn pending_groups(&self, adapter: &str) -> Result<Vec<PendingGroup>, LogError>;
    /// Mark members as not to be trained on, with the reason.
    fn drop_members(&self, members: &[(String, u32)], reason: &str) -> Result<(), LogError>;
    /// Delete settled completions older than `max_age_secs`, and keep at most `max_rows`.
    fn prune(&self, max_age_secs: f64, max_rows: usize) -> Result<usize, LogError>;
    /// Reward every turn of episode `episode` of `key`; Ok(true) when new.
    fn post_episode_reward(
        &self,
        episode: &str,
        reward: f64,
        key: &str,
        accepts: Accepts,
    ) -> Result<bool, FeedbackError>;
    /// The last turn logged of an episode of `key`.
    fn last_turn(&self, episode: &str, key: &str) -> Result<Option<Turn>, LogError>;
    /// An episode's turns, in order, and its reward.
    fn episode_feedback(&self, episode: &str, key: &str) -> Result<EpisodeFeedback, LogError>;
    /// The lineage `adapter` learns in now, if any.
    fn active_lineage(&self, adapter: &str) -> Result<Option<Lineage>, LogError>;
    /// The highest version `adapter` ever had in this store; 0 if none.
    fn max_version(&self, adapter: &str) -> Result<u64, LogError>;
    /// Start a lineage of `adapter` at `first_version`, ending any still active.
    fn begin_lineage(&self, adapter: &str, first_version: u64) -> Result<Lineage, LogError>;
    /// End the active lineage of `adapter`.
    fn end_lineage(&self, adapter: &str) -> Result<(), LogError>;
    /// The checkpoints of `lineage`, newest first.
    fn checkpoints(&self, lineage: u64) -> Result<Vec<Checkpoint>, LogError>;
    /// The newest checkpoint of `lineage` and when it was committed (Unix seconds).
    fn newest_checkpoint(&self, lineage: u64) -> Result<Option<(Checkpoint, f64)>, LogError>;
    /// The newest step report of `lineage`, and `adapter`'s completions trained and dropped.
    fn history(&self, adapter: &str, lineage: u64) -> Result<History, LogError>;
    /// Record a checkpoint and the members its step consumed, in one transaction; a member
    /// consumed already (by another trainer) fails it whole with `LogError::Conflict`.
    fn commit_step(
        &self,
        adapter: &str,
        lineage: u64,
        cp: &Checkpoint,
        stats: &str,
        consumed: &[(String, u32)],
    ) -> Result<(), LogError>;
    /// Forget the checkpoints no longer needed; returns their relative paths.
    fn retire_checkpoints(&self, adapter: &str, keep: usize) -> Result<Vec<String>, LogError>;
    /// Record rollback `d` of `adapter` and forget the checkpoints of its lineage above
    /// `d.to_version`, in one transaction: their relative paths, to delete.
    fn rollback(&self, adapter: &str, d: &Decision) -> Result<Vec<String>, LogError>;
    /// Record decision `d` about `adapter`.
    fn record_decision(&self, adapter: &str, d: &Decision) -> Result<(), LogError>;
    /// The newest `limit` steps of `adapter`, oldest first (kept when checkpoints are retired;
    /// a rollback keeps the steps it undid).
    fn steps(&self, adapter: &str, limit: usize) -> Result<Vec<StepRow>, LogError>;
    /// The newest `limit` decisions about `adapter`, newest first.
    fn decisions(&self, adapter: &str, limit: usize) -> Result<Vec<Decision>, LogError>;
    /// Keep client session `s` (the Tinker API's), so that it outlives a restart.
    fn put_session(&self, s: &SessionRecord) -> Result<(), LogError>;
    /// Forget sessions `ids` (closed) and their runs, in one transaction: the runs' state
    /// folders, to delete.
    fn end_sessions(&self, ids: &[String]) -> Result<Vec<String>, LogError>;
    /// Keep run `r`; `LogError::Conflict` if a run has its id.
    fn put_run(&self, r: &RunRecord) -> Result<(), LogError>;
    /// Run `id`'s newest state is now folder `state` (after `step` optimizer steps), with no
    /// gradient summed since: the folder it replaces, to delete.
    fn set_run_state(&self, id: &str, state: &str, step: u64) -> Result<String, LogError>;
    /// Run `id` holds the summed gradients of `pending` datums its state does not include.
    fn set_run_pending(&self, id: &str, pending: u64) -> Result<(), LogError>;
    /// The sessions kept (oldest first) and their runs.
    fn open_sessions(&self) -> Result<(Vec<SessionRecord>, Vec<RunRecord>), LogError>;
    /// Keep agent session `s` (`online::sessions`).
    fn put_agent_session(&self, s: &AgentSession) -> Result<(), LogError>;
    /// The agent session with id `id`, or whose key has hash `key_hash`, as it is now.
    fn agent_session(&self, by: SessionLookup) -> Result<Option<SessionView>, LogError>;
    /// The agent sessions still open, as they are now.
    fn open_agent_sessions(&self) -> Result<Vec<SessionView>, LogError>;
    /// Reward agent session `id` (each turn its return, `sessions::judge_reward`) and mark it
    /// rewarded, in one transaction: Ok(true) when new, Ok(false) a repeat.
    fn reward_agent_session(
        &self,
        id: &str,
        reward: &SessionReward,
        accepts: Accepts,
    ) -> Result<bool, FeedbackError>;
    /// End open agent session `id` without a reward, dropping its untrained turns (reason
    /// `session_ended`), in one transaction; Ok(false) when it was not open.
    fn end_agent_session(&self, id: &str) -> Result<bool, LogError>;
    /// Call `wake` soon after any process makes `what` (PostgreSQL: LISTEN/NOTIFY, also once
    /// after each (re)connection, so a notification missed while disconnected only delays).
    /// SQLite has one process: nothing to hear (its trainer is told in-process).
    fn subscribe(&self, _what: Announcement, _wake: Box<dyn Fn() + Send + Sync>) {}
    /// Hold the right to train `adapter` (one trainer per adapter): taken at a learner's start
    /// and checked before each step; `LogError::Conflict` while another process holds it.
    /// PostgreSQL: a session advisory lock on a connection of its own, re-taken if that
    /// connection was lost (released when the process dies). SQLite: one process, nothing to
    /// hold.
    fn claim_trainer(&self, _adapter: &str) -> Result<(), LogError> {
        Ok(())
    }
}

/// A store URL with its password hidden, for messages.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let cred = &url[s + 3..at];
            match cred.find(':') {
                Some(c) => format!("{}{}:***{}", &url[..s + 3], &cred[..c], &url[at..]),
                None => url.to_string(),
            }
        }
        _ => url.to_string(),
    }
}

/// SQLite's implementation: the methods of `SqliteLog` (spread over `sqlite/mod.rs`,
/// `sqlite/episodes.rs` and `sqlite/lineage.rs` by subject).
impl RolloutStore for SqliteLog {
    fn kind(&self) -> &'static str {
        "sqlite"
    }
    fn check(&self) -> Result<(), LogError> {
        SqliteLog::check(self)
    }
    fn key_hash(&self, key: &str) -> String {
        SqliteLog::key_hash(self, key)
    }
    fn log_completions(&self, recs: &[CompletionRecord]) -> Result<(), LogError> {
        SqliteLog::log_completions(self, recs)
    }
    fn post_rewards(
        &self,
        items: &[Reward],
        key: &str,
        admin: bool,
        accepts: Accepts,
    ) -> Result<bool, FeedbackError> {
        SqliteLog::post_rewards(self, items, key, admin, accepts)
    }
    fn feedback(&self, id: &str) -> Result<Vec<(String, ChoiceInfo)>, LogError> {
        SqliteLog::feedback(self, id)
    }
    fn pending_groups(&self, adapter: &str) -> Result<Vec<PendingGroup>, LogError> {
        SqliteLog::pending_groups(self, adapter)
    }
    fn drop_members(&self, members: &[(String, u32)], reason: &str) -> Result<(), LogError> {
        SqliteLog::drop_members(self, members, reason)
    }
    fn prune(&self, max_age_secs: f64, max_rows: usize) -> Result<usize, LogError> {
        SqliteLog::prune(self, max_age_secs, max_rows)
    }
    fn post_episode_reward(
        &self,
        episode: &str,
        reward: f64,
        key: &str,
        accepts: Accepts,
    ) -> Result<bool, FeedbackError> {
        SqliteLog::post_episode_reward(self, episode, reward, key, accepts)
    }
    fn last_turn(&self, episode: &str, key: &str) -> Result<Option<Turn>, LogError> {
        SqliteLog::last_turn(self, episode, key)
    }
    fn episode_feedback(&self, episode: &str, key: &str) -> Result<EpisodeFeedback, LogError> {
        SqliteLog::episode_feedback(self, episode, key)
    }
    fn active_lineage(&self, adapter: &str) -> Result<Option<Lineage>, LogError> {
        SqliteLog::active_lineage(self, adapter)
    }
    fn max_version(&self, adapter: &str) -> Result<u64, LogError> {
        SqliteLog::max_version(self, adapter)
    }
    fn begin_lineage(&self, adapter: &str, first_version: u64) -> Result<Lineage, LogError> {
        SqliteLog::begin_lineage(self, adapter, first_version)
    }
    fn end_lineage(&self, adapter: &str) -> Result<(), LogError> {
        SqliteLog::end_lineage(self, adapter)
    }
    fn checkpoints(&self, lineage: u64) -> Result<Vec<Checkpoint>, LogError> {
        SqliteLog::checkpoints(self, lineage)
    }
    fn newest_checkpoint(&self, lineage: u64) -> Result<Option<(Checkpoint, f64)>, LogError> {
        SqliteLog::newest_checkpoint(self, lineage)
    }
    fn history(&self, adapter: &str, lineage: u64) -> Result<History, LogError> {
        SqliteLog::history(self, adapter, lineage)
    }
    fn commit_step(
        &self,
        adapter: &str,
        lineage: u64,
        cp: &Checkpoint,
        stats: &str,
        consumed: &[(String, u32)],
    ) -> Result<(), LogError> {
        SqliteLog::commit_step(self, adapter, lineage, cp, stats, consumed)
    }
    fn retire_checkpoints(&self, adapter: &str, keep: usize) -> Result<Vec<String>, LogError> {
        SqliteLog::retire_checkpoints(self, adapter, keep)
    }
    fn rollback(&self, adapter: &str, d: &Decision) -> Result<Vec<String>, LogError> {
        SqliteLog::rollback(self, adapter, d)
    }
    fn record_decision(&self, adapter: &str, d: &Decision) -> Result<(), LogError> {
        SqliteLog::record_decision(self, adapter, d)
    }
    fn decisions(&self, adapter: &str, limit: usize) -> Result<Vec<Decision>, LogError> {
        SqliteLog::decisions(self, adapter, limit)
    }
    fn steps(&self, adapter: &str, limit: usize) -> Result<Vec<StepRow>, LogError> {
        SqliteLog::steps(self, adapter, limit)
    }
    fn put_session(&self, s: &SessionRecord) -> Result<(), LogError> {
        SqliteLog::put_session(self, s)
    }
    fn end_sessions(&self, ids: &[String]) -> Result<Vec<String>, LogError> {
        SqliteLog::end_sessions(self, ids)
    }
    fn put_run(&self, r: &RunRecord) -> Result<(), LogError> {
        SqliteLog::put_run(self, r)
    }
    fn set_run_state(&self, id: &str, state: &str, step: u64) -> Result<String, LogError> {
        SqliteLog::set_run_state(self, id, state, step)
    }
    fn set_run_pending(&self, id: &str, pending: u64) -> Result<(), LogError> {
        SqliteLog::set_run_pending(self, id, pending)
    }
    fn open_sessions(&self) -> Result<(Vec<SessionRecord>, Vec<RunRecord>), LogError> {
        SqliteLog::open_sessions(self)
    }
    fn put_agent_session(&self, s: &AgentSession) -> Result<(), LogError> {
        SqliteLog::put_agent_session(self, s)
    }
    fn agent_session(&self, by: SessionLookup) -> Result<Option<SessionView>, LogError> {
        SqliteLog::agent_session(self, by)
    }
    fn open_agent_sessions(&self) -> Result<Vec<SessionView>, LogError> {
        SqliteLog::open_agent_sessions(self)
    }
    fn reward_agent_session(
        &self,
        id: &str,
        reward: &SessionReward,
        accepts: Accepts,
    ) -> Result<bool, FeedbackError> {
        SqliteLog::reward_agent_session(self, id, reward, accepts)
    }
    fn end_agent_session(&self, id: &str) -> Result<bool, LogError> {
        SqliteLog::end_agent_session(self, id)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn urls_are_shown_without_their_password() {
        assert_eq!(
            super::redact("postgres://fly:secret@db:5432/x"),
            "postgres://fly:***@db:5432/x"
        );
        assert_eq!(super::redact("postgres://db/x"), "postgres://db/x");
    }
}
