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

use super::records::{
    bytes_f32, bytes_u32, f32s, judge_episode_reward, judge_reward, salted_key_hash, u32s,
    RewardRow, CHOICE_INFO, EPISODE_TRAINED,
};
use super::records::{
    Accepting, ChoiceInfo, CompletionRecord, EpisodeFeedback, FeedbackError, LogError, Member,
    PendingGroup, Reward, Turn, VersionSpan,
};
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
    // 5: the sessions and training runs clients drive (the Tinker API), kept across restarts.
    "CREATE TABLE client_sessions (
        id TEXT PRIMARY KEY, owner TEXT NOT NULL, info TEXT NOT NULL, created REAL NOT NULL);
     CREATE TABLE client_runs (
        id TEXT PRIMARY KEY, session TEXT NOT NULL, owner TEXT NOT NULL, info TEXT NOT NULL,
        state TEXT NOT NULL, step INTEGER NOT NULL, pending INTEGER NOT NULL);
     CREATE INDEX client_runs_session ON client_runs (session);",
    // 6: decisions about a learning adapter's versions (rollbacks, resumes), with their evidence.
    "CREATE TABLE decisions (
        id INTEGER PRIMARY KEY AUTOINCREMENT, adapter TEXT NOT NULL, lineage INTEGER NOT NULL,
        decision TEXT NOT NULL, reason TEXT NOT NULL, from_version INTEGER NOT NULL,
        to_version INTEGER NOT NULL, evidence TEXT NOT NULL, paused INTEGER NOT NULL,
        created REAL NOT NULL);
     CREATE INDEX decisions_adapter ON decisions (adapter, id);",
    // 7: every step's report, kept when its checkpoint is retired (the dashboard's history).
    "CREATE TABLE steps (
        adapter TEXT NOT NULL, lineage INTEGER NOT NULL, version INTEGER NOT NULL,
        created REAL NOT NULL, stats TEXT NOT NULL, PRIMARY KEY (adapter, version));",
    // 8: agent sessions (`online::sessions`): their turns are the completions of `episode`.
    "CREATE TABLE agent_sessions (
        id TEXT PRIMARY KEY, key_hash TEXT NOT NULL UNIQUE, owner TEXT NOT NULL,
        adapter TEXT NOT NULL, group_name TEXT NOT NULL, gamma REAL NOT NULL,
        max_turns INTEGER, idle_secs REAL NOT NULL, idle_reward REAL, created REAL NOT NULL,
        state TEXT NOT NULL, returns BLOB, episode TEXT NOT NULL, ended REAL);
     CREATE INDEX agent_sessions_state ON agent_sessions (state);",
    // 9: each token's log-prob under the distribution it was drawn from, where it differs from
    // the model's (f32 LE; empty: it does not): μ for off-policy corrections.
    "ALTER TABLE completions ADD COLUMN sampling BLOB NOT NULL DEFAULT x'';",
    // 10: where a newer version took over a generation (`VersionSpan::encode`; empty: none).
    "ALTER TABLE completions ADD COLUMN switches BLOB NOT NULL DEFAULT x'';",
];

pub struct SqliteLog {
    conn: Mutex<Connection>,
    salt: String,
    path: PathBuf,
    /// (device, inode) of the file opened.
    identity: (u64, u64),
    broken: OnceLock<String>,
}

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
        adapter_versions: ChoiceInfo::spans(
            r.get::<_, i64>(at + 2)? as u64,
            &r.get::<_, Vec<u8>>(at + 8)?,
        ),
    })
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
        conn.busy_timeout(std::time::Duration::from_secs(10))?;
        // Switching a new file to WAL takes it whole and does not wait on the busy handler:
        // another process opening it at the same moment makes it fail at once; try again.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while let Err(e) = conn.pragma_update(None, "journal_mode", "WAL") {
            let busy = e.sqlite_error_code() == Some(rusqlite::ErrorCode::DatabaseBusy);
            if !busy || std::time::Instant::now() > deadline {
                return Err(e.into());
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        conn.pragma_update(None, "synchronous", "FULL")?;
        // Each migration in an immediate (write-locked) transaction that reads the version
        // again: two processes opening one new database (a trainer and a replica, or tests
        // sharing a directory) migrate it once between them, never twice.
        loop {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let done: usize = tx.query_row("PRAGMA user_version", [], |r| r.get(0))?;
            anyhow::ensure!(
                done <= MIGRATIONS.len(),
                "{}: schema version {done} is newer than this build ({})",
                path.display(),
                MIGRATIONS.len()
            );
            if done == MIGRATIONS.len() {
                break;
            }
            tx.execute_batch(MIGRATIONS[done])?;
            tx.pragma_update(None, "user_version", done + 1)?;
            tx.commit()?;
        }
        // The salt: the first opener's (a second one's insert is ignored, then both read it).
        conn.execute(
            "INSERT OR IGNORE INTO meta (key, value) VALUES ('key_salt', ?1)",
            params![format!(
                "{:016x}{:016x}",
                crate::util::random_u64(),
                crate::util::random_u64(),
            )],
        )?;
        let salt: String =
            conn.query_row("SELECT value FROM meta WHERE key = 'key_salt'", [], |r| {
                r.get(0)
            })?;
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
                   finish_reason, key_hash, created, episode, forced, sampling, reward,
                   rewarded_at, switches)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16,
                         ?17, ?18, ?19, ?20, ?21)",
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
                    bytes_f32(&r.sampling),
                    r.reward,
                    r.reward.map(|_| now),
                    VersionSpan::encode(&r.switches),
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
            // ... but once some turn of the episode was trained, the reward has been used: a late
            // turn is dropped with that reason rather than trained on it again later.
            tx.execute(
                &format!(
                    "UPDATE completions SET dropped = '{EPISODE_TRAINED}'
                     WHERE id = ?1 AND episode IS NOT NULL AND dropped IS NULL
                       AND consumed_step IS NULL
                       AND EXISTS (SELECT 1 FROM completions t
                                   WHERE t.episode = completions.episode
                                     AND t.consumed_step IS NOT NULL)"
                ),
                params![first.id],
            )?;
        }
        Ok(tx.commit()?)
    }

    /// Record rewards, all or none (one transaction, committed before this returns). `key` is
    /// the caller's bearer key; `admin` callers may reward any completion; `accepts` says
    /// which completions' adapters take rewards now (the trainer's answer, a value). Ok(true) when at least one reward is
    /// new, Ok(false) when every one repeats a stored reward.
    pub fn post_rewards(
        &self,
        items: &[Reward],
        key: &str,
        admin: bool,
        accepts: &Accepting,
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
                    temperature, policy_sampled, reward, rewarded_at, created, episode, forced,
                    finish_reason, sampling, switches
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
                    finish_reason: r.get(15)?,
                    sampling: f32s(&r.get::<_, Vec<u8>>(16)?),
                    switches: VersionSpan::decode(&r.get::<_, Vec<u8>>(17)?),
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

mod agent_sessions;
mod episodes;
mod lineage;
mod runs;

#[cfg(test)]
mod tests;
