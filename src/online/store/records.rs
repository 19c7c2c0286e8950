//! The rollout store's vocabulary, shared by its implementations (`sqlite`, `postgres`) and their
//! callers: what is logged (`CompletionRecord`), rewarded (`Reward`, judged against `Accepting`),
//! shown (`ChoiceInfo`) and trained (`Member`, `PendingGroup`); the record of training
//! (`Lineage`, `Checkpoint`, `Decision`); the sessions and runs clients drive (`SessionRecord`,
//! `RunRecord`); the errors; the decisions every store makes the same way (`judge_reward`,
//! `judge_episode_reward`); and how token ids and log-probs are stored (little-endian bytes).

use std::collections::BTreeMap;

/// A lineage of a learning adapter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lineage {
    pub id: u64,
    /// Its first version: completions sampled below it belong to an earlier lineage.
    pub first_version: u64,
}

/// A checkpoint of a lineage.
#[derive(Clone, Debug, PartialEq)]
pub struct Checkpoint {
    pub version: u64,
    /// The optimizer's step count.
    pub step: u64,
    /// Relative to the data directory.
    pub path: String,
}

/// A decision about a learning adapter's versions (a guard's rollback, a manual one, a resume),
/// kept with its reason and the evidence it read.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Decision {
    pub lineage: u64,
    /// "rollback", "resume", "promote", "hold", "pin" or "unpin".
    pub decision: String,
    /// Why: the guard that fired ("reward_drop", "kl", "entropy"), "eval" (the promotion gate),
    /// or "manual".
    pub reason: String,
    /// The version serving when it was made (a promotion's or hold's: the candidate).
    pub from_version: u64,
    /// The version serving after it (a rollback's target, a pin's version).
    pub to_version: u64,
    /// What the rule read and its thresholds (JSON).
    pub evidence: String,
    /// Whether training paused with it.
    pub paused: bool,
    /// Unix seconds (the store's clock when recorded).
    pub created: f64,
}

/// One step of a learning adapter as the store keeps it: (lineage, version published, Unix
/// seconds, its report as JSON).
pub type StepRow = (u64, u64, f64, String);

/// A client's training session (the Tinker API's), kept so that it outlives a restart.
#[derive(Clone, Debug, PartialEq)]
pub struct SessionRecord {
    pub id: String,
    /// Who opened it (a hash of the key: `api::tinker`'s).
    pub owner: String,
    /// What its client said of it (JSON: tags, metadata, SDK version, ...).
    pub info: String,
    pub created: f64,
}

/// A training run a client drives (the Tinker API's), kept so that it outlives a restart: what it
/// was made with, where its newest state is, and whether gradients were summed since.
#[derive(Clone, Debug, PartialEq)]
pub struct RunRecord {
    pub id: String,
    pub session: String,
    pub owner: String,
    /// What it was made with (JSON: rank, seed, targets, metadata).
    pub info: String,
    /// Its newest state's folder (adapter and optimizer), relative to the data directory.
    pub state: String,
    /// The optimizer steps that state has taken.
    pub step: u64,
    /// Datums whose gradients were summed after that state (lost if the process dies).
    pub pending: u64,
}

/// A step that would consume a member twice (or one that is gone): the whole step is refused.
pub(crate) fn already_consumed(id: &str, choice: u32) -> LogError {
    LogError::Conflict(format!(
        "completion '{id}' choice {choice} is consumed already (or gone): the step is not recorded"
    ))
}

/// Why the log cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// The database file was deleted, replaced or truncated under the server: permanent until a
    /// restart (which then reads whatever is at the path).
    #[error("the rollout log is unusable: {0}")]
    Broken(String),
    #[error("rollout log: {0}")]
    Db(#[from] rusqlite::Error),
    /// PostgreSQL: connection-level failures (unreachable, restarted, timed out) are transient.
    #[error("rollout log (PostgreSQL): {0}")]
    Pg(#[from] postgres::Error),
    /// The write contradicts what is stored (a member another trainer consumed already).
    #[error("rollout log: {0}")]
    Conflict(String),
}

/// Why a reward for a completion of `adapter` is not taken (the caller decides per adapter).
#[derive(Clone, Debug)]
pub enum Refusal {
    /// The adapter's trainer has failed: the reward would not be trained on.
    Failed(String),
    /// The adapter no longer learns (deleted, or its lineage ended).
    NotLearning,
}

/// Which adapters take rewards now, as a value: the trainer's answer taken before a store's
/// transaction, so a store never calls back into the trainer from inside one.
#[derive(Clone, Debug)]
pub struct Accepting {
    /// Why every adapter refuses (the trainer thread has stopped), if so.
    stopped: Option<String>,
    /// The learning adapters: Ok, or why a failed one refuses. Others: `Refusal::NotLearning`.
    adapters: BTreeMap<String, Result<(), String>>,
}

impl Accepting {
    /// `adapters` learn: each Ok, or failed with the reason.
    pub fn new(adapters: impl IntoIterator<Item = (String, Result<(), String>)>) -> Accepting {
        Accepting {
            stopped: None,
            adapters: adapters.into_iter().collect(),
        }
    }

    /// Each of `names` learns and takes rewards.
    pub fn running<S: AsRef<str>>(names: impl IntoIterator<Item = S>) -> Accepting {
        Accepting::new(names.into_iter().map(|n| (n.as_ref().to_string(), Ok(()))))
    }

    /// None does: `why`.
    pub fn stopped(why: impl Into<String>) -> Accepting {
        Accepting {
            stopped: Some(why.into()),
            adapters: BTreeMap::new(),
        }
    }

    /// Whether rewards for completions of `adapter` are taken.
    pub fn check(&self, adapter: &str) -> Result<(), Refusal> {
        if let Some(why) = &self.stopped {
            return Err(Refusal::Failed(why.clone()));
        }
        match self.adapters.get(adapter) {
            None => Err(Refusal::NotLearning),
            Some(Err(why)) => Err(Refusal::Failed(why.clone())),
            Some(Ok(())) => Ok(()),
        }
    }
}

/// Which group a completion trains in: the rewards of a group are compared with each other.
/// Stored as text (`Display`: `key:HASH:GROUP`, `ep:HASH:EPISODE`, `req:ID` or `req:ID/PART`);
/// the encoding is persistent (a restart reads it back), so it never changes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GroupKey<'a> {
    /// A client's `group`, scoped to its key (by the key's hash).
    Client { key_hash: &'a str, group: &'a str },
    /// An episode without a group: a group of its own, scoped to its key.
    Episode { key_hash: &'a str, episode: &'a str },
    /// A request's choices (its `n`), per prompt (`part`) when it has several.
    Request { id: &'a str, part: Option<usize> },
}

impl std::fmt::Display for GroupKey<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GroupKey::Client { key_hash, group } => write!(f, "key:{key_hash}:{group}"),
            GroupKey::Episode { key_hash, episode } => write!(f, "ep:{key_hash}:{episode}"),
            GroupKey::Request { id, part: None } => write!(f, "req:{id}"),
            GroupKey::Request { id, part: Some(k) } => write!(f, "req:{id}/{k}"),
        }
    }
}

/// The sampling parameters a completion was drawn with, as logged (stored as JSON text: a
/// record of what was asked, not read back by the trainer).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct LoggedParams {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: usize,
    pub min_p: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub repetition_penalty: f32,
    /// How many tokens the request biased.
    pub logit_bias: usize,
    pub constrained: bool,
    pub seed: Option<u64>,
    pub max_tokens: Option<usize>,
    pub n: usize,
}

impl LoggedParams {
    /// The stored text.
    pub fn encode(&self) -> String {
        serde_json::to_string(self).expect("plain fields serialize")
    }
}

/// One served completion (a choice of a request) to log.
#[derive(Clone, Debug)]
pub struct CompletionRecord {
    pub id: String,
    pub choice: u32,
    pub adapter: String,
    pub version: u64,
    /// `GroupKey`'s encoding.
    pub group_id: String,
    /// Members the group will have (the request's `n`); 0 when unknown (client groups).
    pub group_size: u32,
    pub prompt: Vec<u32>,
    pub completion: Vec<u32>,
    /// The sampler's log-softmax(logits / T) of each completion token.
    pub logprobs: Vec<f32>,
    pub temperature: f32,
    /// Drawn from exactly that distribution (no truncation, penalty or bias).
    pub policy_sampled: bool,
    /// The sampling parameters as sent (`LoggedParams::encode`).
    pub params: String,
    pub finish_reason: String,
    /// The bearer key that made it ("" without one), stored hashed.
    pub key: String,
    /// The client's episode (a multi-turn task rewarded once), scoped to `key` when stored.
    pub episode: Option<String>,
    /// Completion positions a grammar forced (constrained decoding): left out of the loss.
    pub forced: Vec<u32>,
    /// Each token's log-prob under the distribution it was drawn from, where it differs from
    /// `logprobs` (empty: it does not): μ for off-policy corrections.
    pub sampling: Vec<f32>,
    /// A reward recorded with it (a distilling adapter's completions need none from a client:
    /// 0, at once); None: rewarded later, by its client.
    pub reward: Option<f64>,
    /// Where a newer version took over the generation (partial rollouts), in order; empty: one
    /// version (`version`, always the first and oldest) computed every token.
    pub switches: Vec<VersionSpan>,
}

pub use super::spans::VersionSpan;

/// A stored choice, as `GET /v1/feedback/{id}` shows it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ChoiceInfo {
    pub choice: u32,
    pub adapter: String,
    pub adapter_version: u64,
    pub group: String,
    pub finish_reason: String,
    pub reward: Option<f64>,
    pub trained_step: Option<u64>,
    pub dropped: Option<String>,
    /// Every version span, when a newer version took over the generation (partial rollouts).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub adapter_versions: Option<Vec<VersionSpan>>,
}

impl ChoiceInfo {
    /// `adapter_versions` from the stored switches (none: one version).
    pub fn spans(version: u64, switches: &[u8]) -> Option<Vec<VersionSpan>> {
        let s = VersionSpan::decode(switches);
        (!s.is_empty()).then(|| VersionSpan::all(version, &s))
    }
}

/// One reward to record.
#[derive(Clone, Debug)]
pub struct Reward {
    pub id: String,
    pub choice: u32,
    pub reward: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum FeedbackError {
    #[error("no completion '{id}' choice {choice}")]
    NotFound {
        index: usize,
        id: String,
        choice: u32,
    },
    #[error("completion '{id}' was made with another key")]
    Forbidden { index: usize, id: String },
    #[error("completion '{id}' choice {choice} already has reward {old}")]
    Conflict {
        index: usize,
        id: String,
        choice: u32,
        old: f64,
    },
    #[error("completion '{id}' belongs to '{adapter}', which does not take rewards now")]
    Refused {
        index: usize,
        id: String,
        adapter: String,
        why: Refusal,
    },
    /// A turn of an episode is rewarded through its episode.
    #[error("completion '{id}' is a turn of an episode: reward the episode")]
    EpisodeTurn { index: usize, id: String },
    #[error("no episode '{episode}' of this key")]
    EpisodeNotFound { episode: String },
    #[error("episode '{episode}' already has reward {old}")]
    EpisodeConflict { episode: String, old: f64 },
    /// An agent session's reward refused.
    #[error("session '{id}': {why}")]
    Session {
        id: String,
        why: crate::online::sessions::SessionRefusal,
    },
    #[error(transparent)]
    Log(#[from] LogError),
}

impl From<rusqlite::Error> for FeedbackError {
    fn from(e: rusqlite::Error) -> FeedbackError {
        FeedbackError::Log(LogError::Db(e))
    }
}

impl From<postgres::Error> for FeedbackError {
    fn from(e: postgres::Error) -> FeedbackError {
        FeedbackError::Log(LogError::Pg(e))
    }
}

/// A completion's row as a reward meets it: (owner's key hash, stored reward, adapter, episode).
pub type RewardRow = (String, Option<f64>, String, Option<String>);

/// What every store decides for reward `it` (the `index`-th of its batch) against its stored
/// `row` (None: no such completion), for the caller's key hash `kh`: Ok(true) to record it,
/// Ok(false) a repeat of the stored reward, or why it is refused (the batch then records
/// nothing).
pub fn judge_reward(
    index: usize,
    it: &Reward,
    row: Option<RewardRow>,
    kh: &str,
    admin: bool,
    accepts: &Accepting,
) -> Result<bool, FeedbackError> {
    let Some((owner, old, adapter, episode)) = row else {
        return Err(FeedbackError::NotFound {
            index,
            id: it.id.clone(),
            choice: it.choice,
        });
    };
    if !admin && owner != kh {
        return Err(FeedbackError::Forbidden {
            index,
            id: it.id.clone(),
        });
    }
    if episode.is_some() {
        return Err(FeedbackError::EpisodeTurn {
            index,
            id: it.id.clone(),
        });
    }
    match old {
        Some(o) if o == it.reward => Ok(false),
        Some(o) => Err(FeedbackError::Conflict {
            index,
            id: it.id.clone(),
            choice: it.choice,
            old: o,
        }),
        None => match accepts.check(&adapter) {
            Ok(()) => Ok(true),
            Err(why) => Err(FeedbackError::Refused {
                index,
                id: it.id.clone(),
                adapter,
                why,
            }),
        },
    }
}

/// What every store decides for an episode's reward: `adapters` those of its turns (empty: no
/// such episode of this key), `old` its stored reward. Ok(true) to record, Ok(false) a repeat.
pub fn judge_episode_reward(
    episode: &str,
    reward: f64,
    adapters: Vec<String>,
    old: Option<f64>,
    accepts: &Accepting,
) -> Result<bool, FeedbackError> {
    if adapters.is_empty() {
        return Err(FeedbackError::EpisodeNotFound {
            episode: episode.to_string(),
        });
    }
    match old {
        Some(o) if o == reward => return Ok(false),
        Some(o) => {
            return Err(FeedbackError::EpisodeConflict {
                episode: episode.to_string(),
                old: o,
            })
        }
        None => {}
    }
    for adapter in adapters {
        if let Err(why) = accepts.check(&adapter) {
            return Err(FeedbackError::Refused {
                index: 0,
                id: episode.to_string(),
                adapter,
                why,
            });
        }
    }
    Ok(true)
}

/// How every store writes an episode of the key with hash `key_hash` (the `episode` column of
/// completions and `episode_rewards`): scoped to its key.
pub fn episode_key(key_hash: &str, episode: &str) -> String {
    format!("{key_hash}:{episode}")
}

/// A served turn: its prompt and completion token ids.
pub type Turn = (Vec<u32>, Vec<u32>);

/// An episode's turns (completion id, what is stored) and its reward (None: not yet).
pub type EpisodeFeedback = (Vec<(String, ChoiceInfo)>, Option<f64>);

/// A pending (unconsumed) member of a group, for the trainer.
#[derive(Clone, Debug)]
pub struct Member {
    pub id: String,
    pub choice: u32,
    pub version: u64,
    pub prompt: Vec<u32>,
    pub completion: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub temperature: f32,
    pub policy_sampled: bool,
    pub reward: Option<f64>,
    pub rewarded_at: Option<f64>,
    pub created: f64,
    /// The episode it is a turn of (its turns share one reward and advantage).
    pub episode: Option<String>,
    /// Completion positions a grammar forced: left out of the loss.
    pub forced: Vec<u32>,
    /// Why it ended (`stop`, `length`, `repetition`, `tool_calls`).
    pub finish_reason: String,
    /// What `CompletionRecord::sampling` holds (empty: the same as `logprobs`).
    pub sampling: Vec<f32>,
    /// What `CompletionRecord::switches` holds (empty: `version` computed every token).
    pub switches: Vec<VersionSpan>,
}

/// A group's pending members.
#[derive(Clone, Debug)]
pub struct PendingGroup {
    pub group_id: String,
    pub group_size: u32,
    pub members: Vec<Member>,
}

/// The columns a `ChoiceInfo` is read from (`choice_info`), in order.
/// What the store remembers of an adapter's learning, shown again after a restart: the newest
/// step's report (JSON, as committed with its checkpoint) in a lineage, and the completions of the
/// adapter trained and dropped (by reason).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct History {
    pub last_stats: Option<String>,
    pub trained: u64,
    pub dropped: std::collections::BTreeMap<String, u64>,
}

/// The drop reason of a turn logged after its episode was trained: the episode's reward was
/// used once; the late turn does not train on it again.
pub const EPISODE_TRAINED: &str = "episode_trained";

pub const CHOICE_INFO: &str =
    "choice, adapter, version, group_id, finish_reason, reward, consumed_step, dropped, switches";

/// A 128-bit FNV-1a of `salt`, a zero byte and `key`.
pub fn salted_key_hash(salt: &str, key: &str) -> String {
    let mut h: u128 = 0x6c62272e07bb014262b821756295c58d;
    for b in salt.bytes().chain([0u8]).chain(key.bytes()) {
        h ^= b as u128;
        h = h.wrapping_mul(0x0000000001000000000000000000013B);
    }
    format!("{h:032x}")
}

pub fn u32s(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

pub fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

pub fn bytes_u32(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn bytes_f32(v: &[f32]) -> Vec<u8> {
    crate::util::f32_le_bytes(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The stored encodings: a restart reads group keys back, so they never change.
    #[test]
    fn group_keys_and_params_keep_their_stored_encoding() {
        let (key_hash, id) = ("9f2c", "cmpl-abc");
        let keys = [
            GroupKey::Client {
                key_hash,
                group: "g1",
            },
            GroupKey::Episode {
                key_hash,
                episode: "e:7",
            },
            GroupKey::Request { id, part: None },
            GroupKey::Request { id, part: Some(2) },
        ];
        let text: Vec<String> = keys.iter().map(ToString::to_string).collect();
        assert_eq!(
            text,
            [
                "key:9f2c:g1",
                "ep:9f2c:e:7",
                "req:cmpl-abc",
                "req:cmpl-abc/2"
            ]
        );
        let p = LoggedParams {
            temperature: 0.7,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.5,
            repetition_penalty: 1.0,
            logit_bias: 2,
            constrained: false,
            seed: Some(3),
            max_tokens: None,
            n: 4,
        };
        assert_eq!(
            p.encode(),
            r#"{"temperature":0.7,"top_p":1.0,"top_k":0,"min_p":0.0,"presence_penalty":0.0,"frequency_penalty":0.5,"repetition_penalty":1.0,"logit_bias":2,"constrained":false,"seed":3,"max_tokens":null,"n":4}"#
        );
    }
}
