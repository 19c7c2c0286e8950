//! The rollout log: every completion served through a learning adapter (token ids, the sampler's
//! log-probs, its adapter version and group), the rewards posted for it, and the trainer's
//! checkpoints, in one SQLite database (bundled, WAL, `synchronous = FULL`: a committed write
//! survives a kill or a crash). A reward is acknowledged only after its transaction commits; a
//! checkpoint and the groups it consumed are recorded in one transaction.
//!
//! Groups: a request's `n` choices form one group (`req:<id>`); a client may group single
//! completions across requests with `"group": "ID"`, scoped to its key (`key:<hash>:<ID>`).
//!
//! The database under a running server: every transaction first checks that the file is still
//! the one opened (same device and inode, an SQLite header). A deleted, replaced or truncated
//! file makes the log `Broken` for good: nothing more is acknowledged into an unlinked file.

use crate::util::now_secs;
use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

/// Schema migrations, applied in order; `PRAGMA user_version` is how many ran.
const MIGRATIONS: &[&str] = &[
    // 1: completions, rewards, checkpoints.
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
     CREATE TABLE completions (
        id TEXT NOT NULL, choice INTEGER NOT NULL,
        adapter TEXT NOT NULL, version INTEGER NOT NULL,
        group_id TEXT NOT NULL, group_size INTEGER NOT NULL,
        prompt BLOB NOT NULL, completion BLOB NOT NULL, logprobs BLOB NOT NULL,
        temperature REAL NOT NULL, policy_sampled INTEGER NOT NULL, params TEXT NOT NULL,
        finish_reason TEXT NOT NULL, key_hash TEXT NOT NULL, created REAL NOT NULL,
        reward REAL, rewarded_at REAL, consumed_step INTEGER, dropped TEXT,
        PRIMARY KEY (id, choice));
     CREATE INDEX completions_pending ON completions (adapter, consumed_step, dropped, group_id);
     CREATE INDEX completions_created ON completions (created);
     CREATE TABLE checkpoints (
        adapter TEXT NOT NULL, step INTEGER NOT NULL, version INTEGER NOT NULL,
        path TEXT NOT NULL, created REAL NOT NULL, stats TEXT NOT NULL,
        PRIMARY KEY (adapter, step));",
    // 2: lineages (a learning adapter's life from creation to deletion); checkpoints keyed by
    // version, in their lineage, at paths relative to the data directory.
    "CREATE TABLE lineages (
        id INTEGER PRIMARY KEY AUTOINCREMENT, adapter TEXT NOT NULL,
        first_version INTEGER NOT NULL, created REAL NOT NULL, ended REAL);
     CREATE INDEX lineages_adapter ON lineages (adapter, ended);
     INSERT INTO lineages (adapter, first_version, created)
        SELECT adapter, 1, min(created) FROM checkpoints GROUP BY adapter;
     CREATE TABLE checkpoints2 (
        adapter TEXT NOT NULL, version INTEGER NOT NULL, lineage INTEGER NOT NULL,
        step INTEGER NOT NULL, path TEXT NOT NULL, created REAL NOT NULL, stats TEXT NOT NULL,
        PRIMARY KEY (adapter, version));
     INSERT INTO checkpoints2 (adapter, version, lineage, step, path, created, stats)
        SELECT c.adapter, c.version, l.id, c.step,
               'adapters/' || c.adapter || '/step-' || printf('%08d', c.step), c.created, c.stats
        FROM checkpoints c JOIN lineages l ON l.adapter = c.adapter;
     DROP TABLE checkpoints;
     ALTER TABLE checkpoints2 RENAME TO checkpoints;",
    // 3: episodes (multi-turn tasks rewarded once): each completion's episode (scoped to the
    // key that made it), and each episode's reward.
    "ALTER TABLE completions ADD COLUMN episode TEXT;
     CREATE INDEX completions_episode ON completions (episode);
     CREATE TABLE episode_rewards (
        episode TEXT PRIMARY KEY, reward REAL NOT NULL, rewarded_at REAL NOT NULL);",
    // 4: constrained decoding: the completion positions a grammar forced (u32 LE; empty: none).
    "ALTER TABLE completions ADD COLUMN forced BLOB NOT NULL DEFAULT x'';",
];

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

/// One served completion (a choice of a request) to log.
#[derive(Clone, Debug)]
pub struct CompletionRecord {
    pub id: String,
    pub choice: u32,
    pub adapter: String,
    pub version: u64,
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
    /// The sampling parameters as sent (JSON).
    pub params: String,
    pub finish_reason: String,
    /// The bearer key that made it ("" without one), stored hashed.
    pub key: String,
    /// The client's episode (a multi-turn task rewarded once), scoped to `key` when stored.
    pub episode: Option<String>,
    /// Completion positions a grammar forced (constrained decoding): left out of the loss.
    pub forced: Vec<u32>,
}

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
    accepts: &dyn Fn(&str) -> Result<(), Refusal>,
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
        None => match accepts(&adapter) {
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
    accepts: &dyn Fn(&str) -> Result<(), Refusal>,
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
        if let Err(why) = accepts(&adapter) {
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
}

/// A group's pending members.
#[derive(Clone, Debug)]
pub struct PendingGroup {
    pub group_id: String,
    pub group_size: u32,
    pub members: Vec<Member>,
}

pub struct SqliteLog {
    conn: Mutex<Connection>,
    salt: String,
    path: PathBuf,
    /// (device, inode) of the file opened.
    identity: (u64, u64),
    broken: OnceLock<String>,
}

/// The columns a `ChoiceInfo` is read from (`choice_info`), in order.
pub(super) const CHOICE_INFO: &str =
    "choice, adapter, version, group_id, finish_reason, reward, consumed_step, dropped";

/// A `ChoiceInfo` from the `CHOICE_INFO` columns of `r`, the first at index `at`.
fn choice_info(r: &rusqlite::Row, at: usize) -> rusqlite::Result<ChoiceInfo> {
    Ok(ChoiceInfo {
        choice: r.get(at)?,
        adapter: r.get(at + 1)?,
        adapter_version: r.get::<_, i64>(at + 2)? as u64,
        group: r.get(at + 3)?,
        finish_reason: r.get(at + 4)?,
        reward: r.get(at + 5)?,
        trained_step: r.get::<_, Option<i64>>(at + 6)?.map(|s| s as u64),
        dropped: r.get(at + 7)?,
    })
}

/// A 128-bit FNV-1a of `salt`, a zero byte and `key`.
pub(super) fn salted_key_hash(salt: &str, key: &str) -> String {
    let mut h: u128 = 0x6c62272e07bb014262b821756295c58d;
    for b in salt.bytes().chain([0u8]).chain(key.bytes()) {
        h ^= b as u128;
        h = h.wrapping_mul(0x0000000001000000000000000000013B);
    }
    format!("{h:032x}")
}

pub(super) fn u32s(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

pub(super) fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

pub(super) fn bytes_u32(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub(super) fn bytes_f32(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

impl SqliteLog {
    /// Open (creating it and its folder if needed) and migrate.
    pub fn open(path: &Path) -> anyhow::Result<SqliteLog> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", dir.display()))?;
        }
        let mut conn = Connection::open(path)
            .map_err(|e| anyhow::anyhow!("cannot open {}: {e}", path.display()))?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "FULL")?;
        conn.busy_timeout(std::time::Duration::from_secs(10))?;
        let done: usize = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
        anyhow::ensure!(
            done <= MIGRATIONS.len(),
            "{}: schema version {done} is newer than this build ({})",
            path.display(),
            MIGRATIONS.len()
        );
        for (i, m) in MIGRATIONS.iter().enumerate().skip(done) {
            let tx = conn.transaction()?;
            tx.execute_batch(m)?;
            tx.pragma_update(None, "user_version", i + 1)?;
            tx.commit()?;
        }
        let salt: Option<String> = conn
            .query_row("SELECT value FROM meta WHERE key = 'key_salt'", [], |r| {
                r.get(0)
            })
            .optional()?;
        let salt = match salt {
            Some(s) => s,
            None => {
                let s = format!(
                    "{:016x}{:016x}",
                    crate::util::random_u64(),
                    crate::util::random_u64(),
                );
                conn.execute(
                    "INSERT INTO meta (key, value) VALUES ('key_salt', ?1)",
                    params![s],
                )?;
                s
            }
        };
        let meta = std::fs::metadata(path)?;
        Ok(SqliteLog {
            conn: Mutex::new(conn),
            salt,
            path: path.to_path_buf(),
            identity: (meta.dev(), meta.ino()),
            broken: OnceLock::new(),
        })
    }

    /// Ok while the file is the one opened and still an SQLite database; once not, never again.
    pub fn check(&self) -> Result<(), LogError> {
        if let Some(why) = self.broken.get() {
            return Err(LogError::Broken(why.clone()));
        }
        let p = self.path.display();
        let why = match std::fs::metadata(&self.path) {
            Err(e) => Some(format!("{p} is gone ({e})")),
            Ok(m) if (m.dev(), m.ino()) != self.identity => {
                Some(format!("{p} was replaced by another file"))
            }
            Ok(_) => {
                let mut head = [0u8; 16];
                let ok = std::fs::File::open(&self.path)
                    .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut head))
                    .is_ok();
                (!ok || &head != b"SQLite format 3\0")
                    .then(|| format!("{p} was truncated or overwritten"))
            }
        };
        match why {
            None => Ok(()),
            Some(w) => {
                tracing::error!(path = %p, reason = %w, "the rollout log is unusable");
                let w = self.broken.get_or_init(|| w).clone();
                Err(LogError::Broken(w))
            }
        }
    }

    /// The connection, after `check`.
    pub(super) fn conn(&self) -> Result<std::sync::MutexGuard<'_, Connection>, LogError> {
        self.check()?;
        Ok(self.conn.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// A key's stored form: a 128-bit FNV-1a of a secret per-database salt and the key (keys are
    /// compared, never shown; the salt keeps equal keys of two databases apart).
    pub fn key_hash(&self, key: &str) -> String {
        salted_key_hash(&self.salt, key)
    }

    /// Log the choices of one request (one transaction).
    pub fn log_completions(&self, recs: &[CompletionRecord]) -> Result<(), LogError> {
        let mut c = self.conn()?;
        let tx = c.transaction()?;
        {
            let mut st = tx.prepare_cached(
                "INSERT INTO completions (id, choice, adapter, version, group_id, group_size,
                   prompt, completion, logprobs, temperature, policy_sampled, params,
                   finish_reason, key_hash, created, episode, forced)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16,
                         ?17)",
            )?;
            let now = now_secs();
            for r in recs {
                let kh = self.key_hash(&r.key);
                let episode = r.episode.as_ref().map(|e| self.episode_key(&kh, e));
                st.execute(params![
                    r.id,
                    r.choice,
                    r.adapter,
                    r.version as i64,
                    r.group_id,
                    r.group_size,
                    bytes_u32(&r.prompt),
                    bytes_u32(&r.completion),
                    bytes_f32(&r.logprobs),
                    r.temperature as f64,
                    r.policy_sampled,
                    r.params,
                    r.finish_reason,
                    kh,
                    now,
                    episode,
                    bytes_u32(&r.forced),
                ])?;
            }
        }
        // A turn logged after its episode was rewarded takes the episode's reward.
        if let Some(first) = recs
            .first()
            .filter(|_| recs.iter().any(|r| r.episode.is_some()))
        {
            tx.execute(
                "UPDATE completions SET
                    reward = (SELECT reward FROM episode_rewards e
                              WHERE e.episode = completions.episode),
                    rewarded_at = (SELECT rewarded_at FROM episode_rewards e
                                   WHERE e.episode = completions.episode)
                 WHERE reward IS NULL AND episode IS NOT NULL
                   AND episode IN (SELECT episode FROM episode_rewards)
                   AND id = ?1",
                params![first.id],
            )?;
        }
        Ok(tx.commit()?)
    }

    /// Record rewards, all or none (one transaction, committed before this returns). `key` is
    /// the caller's bearer key; `admin` callers may reward any completion; `accepts` says
    /// whether a completion's adapter takes rewards now. Ok(true) when at least one reward is
    /// new, Ok(false) when every one repeats a stored reward.
    pub fn post_rewards(
        &self,
        items: &[Reward],
        key: &str,
        admin: bool,
        accepts: &dyn Fn(&str) -> Result<(), Refusal>,
    ) -> Result<bool, FeedbackError> {
        let kh = self.key_hash(key);
        let mut c = self.conn()?;
        let tx = c.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let mut any_new = false;
        let now = now_secs();
        for (index, it) in items.iter().enumerate() {
            let row: Option<RewardRow> = tx
                .query_row(
                    "SELECT key_hash, reward, adapter, episode FROM completions
                     WHERE id = ?1 AND choice = ?2",
                    params![it.id, it.choice],
                    |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
                )
                .optional()?;
            if judge_reward(index, it, row, &kh, admin, accepts)? {
                tx.execute(
                    "UPDATE completions SET reward = ?3, rewarded_at = ?4
                     WHERE id = ?1 AND choice = ?2",
                    params![it.id, it.choice, it.reward, now],
                )?;
                any_new = true;
            }
        }
        tx.commit()?;
        Ok(any_new)
    }

    /// What is stored for each choice of completion `id` (empty: unknown id).
    pub fn feedback(&self, id: &str) -> Result<Vec<(String, ChoiceInfo)>, LogError> {
        let c = self.conn()?;
        let mut st = c.prepare_cached(&format!(
            "SELECT key_hash, {CHOICE_INFO} FROM completions WHERE id = ?1 ORDER BY choice"
        ))?;
        let rows = st.query_map(params![id], |r| {
            Ok((r.get::<_, String>(0)?, choice_info(r, 1)?))
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// Every group of `adapter` with unconsumed, undropped members that has at least one reward.
    pub fn pending_groups(&self, adapter: &str) -> Result<Vec<PendingGroup>, LogError> {
        let c = self.conn()?;
        let mut st = c.prepare_cached(
            "SELECT group_id, group_size, id, choice, version, prompt, completion, logprobs,
                    temperature, policy_sampled, reward, rewarded_at, created, episode, forced
             FROM completions
             WHERE adapter = ?1 AND consumed_step IS NULL AND dropped IS NULL
               AND group_id IN (SELECT group_id FROM completions
                                WHERE adapter = ?1 AND consumed_step IS NULL
                                  AND dropped IS NULL AND reward IS NOT NULL)
             ORDER BY created, id, choice",
        )?;
        let mut out: Vec<PendingGroup> = Vec::new();
        let rows = st.query_map(params![adapter], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, u32>(1)?,
                Member {
                    id: r.get(2)?,
                    choice: r.get(3)?,
                    version: r.get::<_, i64>(4)? as u64,
                    prompt: u32s(&r.get::<_, Vec<u8>>(5)?),
                    completion: u32s(&r.get::<_, Vec<u8>>(6)?),
                    logprobs: f32s(&r.get::<_, Vec<u8>>(7)?),
                    temperature: r.get::<_, f64>(8)? as f32,
                    policy_sampled: r.get(9)?,
                    reward: r.get(10)?,
                    rewarded_at: r.get(11)?,
                    created: r.get(12)?,
                    episode: r.get(13)?,
                    forced: u32s(&r.get::<_, Vec<u8>>(14)?),
                },
            ))
        })?;
        for row in rows {
            let (g, size, m) = row?;
            match out.iter_mut().find(|p| p.group_id == g) {
                Some(p) => p.members.push(m),
                None => out.push(PendingGroup {
                    group_id: g,
                    group_size: size,
                    members: vec![m],
                }),
            }
        }
        Ok(out)
    }

    /// Mark members as not to be trained on, with the reason.
    pub fn drop_members(&self, members: &[(String, u32)], reason: &str) -> Result<(), LogError> {
        let mut c = self.conn()?;
        let tx = c.transaction()?;
        for (id, choice) in members {
            tx.execute(
                "UPDATE completions SET dropped = ?3 WHERE id = ?1 AND choice = ?2",
                params![id, choice, reason],
            )?;
        }
        Ok(tx.commit()?)
    }

    /// Delete completions older than `max_age_secs` that are consumed or dropped, and at most
    /// keep `max_rows` rows (oldest settled ones go first). Returns the rows deleted.
    pub fn prune(&self, max_age_secs: f64, max_rows: usize) -> Result<usize, LogError> {
        let c = self.conn()?;
        let settled = "(consumed_step IS NOT NULL OR dropped IS NOT NULL)";
        let mut n = c.execute(
            &format!("DELETE FROM completions WHERE created < ?1 AND {settled}"),
            params![now_secs() - max_age_secs],
        )?;
        let total: i64 = c.query_row("SELECT count(*) FROM completions", [], |r| r.get(0))?;
        if total as usize > max_rows {
            n += c.execute(
                &format!(
                    "DELETE FROM completions WHERE rowid IN (SELECT rowid FROM completions
                     WHERE {settled} ORDER BY created LIMIT ?1)"
                ),
                params![total - max_rows as i64],
            )?;
        }
        Ok(n)
    }
}

#[path = "log_episodes.rs"]
mod episodes;

#[cfg(test)]
#[path = "log_tests.rs"]
mod tests;
