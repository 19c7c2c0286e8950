//! The rollout store on PostgreSQL (`--rollout-store postgres://...`): the SQLite log's schema
//! and promises (`online::store`), for several serving replicas and a trainer sharing one log.
//!
//! - Schema: versioned migrations in `flywheel_meta`, applied under a transaction-scoped
//!   advisory lock, so replicas starting together apply each exactly once.
//! - Concurrency (READ COMMITTED): a reward locks its completion row (`FOR UPDATE`), so two
//!   replicas posting for one completion serialize (the second sees the first's reward:
//!   idempotent or a 409); an episode's reward and the logging of its turns take the episode's
//!   advisory lock, so a turn logged while its episode is rewarded gets the reward either way;
//!   a step consumes its members only where `consumed_step IS NULL` and fails whole otherwise,
//!   so no group trains twice even with two trainers racing.
//! - Connections: a few pooled blocking clients (rust-postgres); a broken one is dropped and the
//!   next call reconnects, so a restarted database costs the calls made while it was down
//!   (their errors are 503s: nothing was acknowledged). Called from blocking threads only.

use super::records::{
    already_consumed, episode_key, Checkpoint, Decision, Lineage, RunRecord, SessionRecord, StepRow,
};
use super::records::{
    bytes_f32, bytes_u32, f32s, judge_episode_reward, judge_reward, salted_key_hash, u32s,
    ChoiceInfo, CompletionRecord, EpisodeFeedback, FeedbackError, History, LogError, Member,
    PendingGroup, Reward, Turn, VersionSpan, CHOICE_INFO, EPISODE_TRAINED,
};
use super::{redact, Accepts, Announcement, RolloutStore, SessionLookup};
use crate::online::sessions::{AgentSession, SessionReward, SessionView};
use crate::util::now_secs;
use postgres::fallible_iterator::FallibleIterator;
use postgres::{Client, NoTls, Row, Transaction};
use std::sync::Mutex;
use std::time::Duration;

pub struct PgLog {
    config: postgres::Config,
    /// The URL without its password, for messages.
    shown: String,
    idle: Mutex<Vec<Client>>,
    salt: String,
    /// The connections holding this process's trainer claims (session advisory locks), by
    /// adapter.
    claims: Mutex<std::collections::BTreeMap<String, Client>>,
}

/// Take the advisory lock of each episode key (sorted, so two transactions never deadlock).
fn lock_episodes(tx: &mut Transaction, keys: &mut Vec<String>) -> Result<(), postgres::Error> {
    keys.sort();
    keys.dedup();
    for k in keys.iter() {
        tx.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))",
            &[k],
        )?;
    }
    Ok(())
}

impl RolloutStore for PgLog {
    fn kind(&self) -> &'static str {
        "postgres"
    }

    /// A connection that answers: a pooled one is validated on checkout, a new one connected.
    fn check(&self) -> Result<(), LogError> {
        self.conn().map(drop)
    }

    fn key_hash(&self, key: &str) -> String {
        salted_key_hash(&self.salt, key)
    }

    fn log_completions(&self, recs: &[CompletionRecord]) -> Result<(), LogError> {
        let mut c = self.conn()?;
        let mut tx = c.transaction()?;
        let now = now_secs();
        let mut episodes = Vec::new();
        let rows: Vec<_> = recs
            .iter()
            .map(|r| {
                let kh = self.key_hash(&r.key);
                let ep = r.episode.as_ref().map(|e| episode_key(&kh, e));
                episodes.extend(ep.clone());
                (kh, ep)
            })
            .collect();
        lock_episodes(&mut tx, &mut episodes)?;
        let st = tx.prepare(
            "INSERT INTO completions (id, choice, adapter, version, group_id, group_size,
               prompt, completion, logprobs, temperature, policy_sampled, params,
               finish_reason, key_hash, created, episode, forced, sampling, reward, rewarded_at,
               switches)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17,
                     $18, $19, $20, $21)",
        )?;
        for (r, (kh, ep)) in recs.iter().zip(&rows) {
            tx.execute(
                &st,
                &[
                    &r.id,
                    &(r.choice as i32),
                    &r.adapter,
                    &(r.version as i64),
                    &r.group_id,
                    &(r.group_size as i64),
                    &bytes_u32(&r.prompt),
                    &bytes_u32(&r.completion),
                    &bytes_f32(&r.logprobs),
                    &(r.temperature as f64),
                    &r.policy_sampled,
                    &r.params,
                    &r.finish_reason,
                    kh,
                    &now,
                    ep,
                    &bytes_u32(&r.forced),
                    &bytes_f32(&r.sampling),
                    &r.reward,
                    &r.reward.map(|_| now),
                    &VersionSpan::encode(&r.switches),
                ],
            )?;
        }
        // Completions logged rewarded (a distilling adapter's): the trainer hears of them.
        if recs.iter().any(|r| r.reward.is_some()) {
            announce_rewards(&mut tx)?;
        }
        // A turn logged after its episode was rewarded takes the episode's reward.
        if !episodes.is_empty() {
            tx.execute(
                "UPDATE completions c SET reward = e.reward, rewarded_at = e.rewarded_at
                 FROM episode_rewards e
                 WHERE c.episode = e.episode AND c.reward IS NULL AND c.id = $1",
                &[&recs[0].id],
            )?;
            // ... but not to train again once the episode was trained (see the SQLite log).
            tx.execute(
                &format!(
                    "UPDATE completions c SET dropped = '{EPISODE_TRAINED}'
                     WHERE c.id = $1 AND c.episode IS NOT NULL AND c.dropped IS NULL
                       AND c.consumed_step IS NULL
                       AND EXISTS (SELECT 1 FROM completions t
                                   WHERE t.episode = c.episode AND t.consumed_step IS NOT NULL)"
                ),
                &[&recs[0].id],
            )?;
        }
        Ok(tx.commit()?)
    }

    fn post_rewards(
        &self,
        items: &[Reward],
        key: &str,
        admin: bool,
        accepts: Accepts,
    ) -> Result<bool, FeedbackError> {
        let kh = self.key_hash(key);
        let mut c = self.conn()?;
        let mut tx = c.transaction()?;
        let mut any_new = false;
        let now = now_secs();
        for (index, it) in items.iter().enumerate() {
            let row = tx
                .query_opt(
                    "SELECT key_hash, reward, adapter, episode FROM completions
                     WHERE id = $1 AND choice = $2 FOR UPDATE",
                    &[&it.id, &(it.choice as i32)],
                )?
                .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)));
            if judge_reward(index, it, row, &kh, admin, accepts)? {
                tx.execute(
                    "UPDATE completions SET reward = $3, rewarded_at = $4
                     WHERE id = $1 AND choice = $2",
                    &[&it.id, &(it.choice as i32), &it.reward, &now],
                )?;
                any_new = true;
            }
        }
        if any_new {
            announce_rewards(&mut tx)?;
        }
        tx.commit()?;
        Ok(any_new)
    }

    fn feedback(&self, id: &str) -> Result<Vec<(String, ChoiceInfo)>, LogError> {
        let rows = self.conn()?.query(
            &format!(
                "SELECT key_hash, {CHOICE_INFO} FROM completions WHERE id = $1 ORDER BY choice"
            ),
            &[&id],
        )?;
        Ok(rows.iter().map(|r| (r.get(0), choice_info(r, 1))).collect())
    }

    fn pending_groups(&self, adapter: &str) -> Result<Vec<PendingGroup>, LogError> {
        let rows = self.conn()?.query(
            "SELECT group_id, group_size, id, choice, version, prompt, completion, logprobs,
                    temperature, policy_sampled, reward, rewarded_at, created, episode, forced,
                    finish_reason, sampling, switches
             FROM completions
             WHERE adapter = $1 AND consumed_step IS NULL AND dropped IS NULL
               AND group_id IN (SELECT group_id FROM completions
                                WHERE adapter = $1 AND consumed_step IS NULL
                                  AND dropped IS NULL AND reward IS NOT NULL)
             ORDER BY created, id, choice",
            &[&adapter],
        )?;
        let mut out: Vec<PendingGroup> = Vec::new();
        for r in &rows {
            let g: String = r.get(0);
            let m = Member {
                id: r.get(2),
                choice: r.get::<_, i32>(3) as u32,
                version: r.get::<_, i64>(4) as u64,
                prompt: u32s(r.get(5)),
                completion: u32s(r.get(6)),
                logprobs: f32s(r.get(7)),
                temperature: r.get::<_, f64>(8) as f32,
                policy_sampled: r.get(9),
                reward: r.get(10),
                rewarded_at: r.get(11),
                created: r.get(12),
                episode: r.get(13),
                forced: u32s(r.get(14)),
                finish_reason: r.get(15),
                sampling: f32s(r.get(16)),
                switches: VersionSpan::decode(r.get(17)),
            };
            match out.iter_mut().find(|p| p.group_id == g) {
                Some(p) => p.members.push(m),
                None => out.push(PendingGroup {
                    group_id: g,
                    group_size: r.get::<_, i64>(1) as u32,
                    members: vec![m],
                }),
            }
        }
        Ok(out)
    }

    fn drop_members(&self, members: &[(String, u32)], reason: &str) -> Result<(), LogError> {
        let mut c = self.conn()?;
        let mut tx = c.transaction()?;
        for (id, choice) in members {
            tx.execute(
                "UPDATE completions SET dropped = $3 WHERE id = $1 AND choice = $2",
                &[id, &(*choice as i32), &reason],
            )?;
        }
        Ok(tx.commit()?)
    }

    fn prune(&self, max_age_secs: f64, max_rows: usize) -> Result<usize, LogError> {
        let mut c = self.conn()?;
        let settled = "(consumed_step IS NOT NULL OR dropped IS NOT NULL)";
        let mut n = c.execute(
            &format!("DELETE FROM completions WHERE created < $1 AND {settled}"),
            &[&(now_secs() - max_age_secs)],
        )?;
        let total: i64 = c.query_one("SELECT count(*) FROM completions", &[])?.get(0);
        if total as usize > max_rows {
            n += c.execute(
                &format!(
                    "DELETE FROM completions WHERE (id, choice) IN (SELECT id, choice
                     FROM completions WHERE {settled} ORDER BY created LIMIT $1)"
                ),
                &[&(total - max_rows as i64)],
            )?;
        }
        Ok(n as usize)
    }

    fn post_episode_reward(
        &self,
        episode: &str,
        reward: f64,
        key: &str,
        accepts: Accepts,
    ) -> Result<bool, FeedbackError> {
        let ep = episode_key(&self.key_hash(key), episode);
        let mut c = self.conn()?;
        let mut tx = c.transaction()?;
        lock_episodes(&mut tx, &mut vec![ep.clone()])?;
        let adapters: Vec<String> = tx
            .query(
                "SELECT DISTINCT adapter FROM completions WHERE episode = $1 ORDER BY adapter",
                &[&ep],
            )?
            .iter()
            .map(|r| r.get(0))
            .collect();
        let old: Option<f64> = tx
            .query_opt(
                "SELECT reward FROM episode_rewards WHERE episode = $1",
                &[&ep],
            )?
            .map(|r| r.get(0));
        if !judge_episode_reward(episode, reward, adapters, old, accepts)? {
            return Ok(false);
        }
        let now = now_secs();
        tx.execute(
            "INSERT INTO episode_rewards (episode, reward, rewarded_at) VALUES ($1, $2, $3)",
            &[&ep, &reward, &now],
        )?;
        tx.execute(
            "UPDATE completions SET reward = $2, rewarded_at = $3
             WHERE episode = $1 AND reward IS NULL",
            &[&ep, &reward, &now],
        )?;
        announce_rewards(&mut tx)?;
        tx.commit()?;
        Ok(true)
    }

    fn last_turn(&self, episode: &str, key: &str) -> Result<Option<Turn>, LogError> {
        let ep = episode_key(&self.key_hash(key), episode);
        let row = self.conn()?.query_opt(
            "SELECT prompt, completion FROM completions WHERE episode = $1
             ORDER BY created DESC, id DESC, choice DESC LIMIT 1",
            &[&ep],
        )?;
        Ok(row.map(|r| (u32s(r.get(0)), u32s(r.get(1)))))
    }

    fn episode_feedback(&self, episode: &str, key: &str) -> Result<EpisodeFeedback, LogError> {
        let ep = episode_key(&self.key_hash(key), episode);
        let mut c = self.conn()?;
        let turns = c
            .query(
                &format!(
                    "SELECT id, {CHOICE_INFO} FROM completions WHERE episode = $1
                     ORDER BY created, id, choice"
                ),
                &[&ep],
            )?
            .iter()
            .map(|r| (r.get(0), choice_info(r, 1)))
            .collect();
        let reward = c
            .query_opt(
                "SELECT reward FROM episode_rewards WHERE episode = $1",
                &[&ep],
            )?
            .map(|r| r.get(0));
        Ok((turns, reward))
    }

    fn active_lineage(&self, adapter: &str) -> Result<Option<Lineage>, LogError> {
        let row = self.conn()?.query_opt(
            "SELECT id, first_version FROM lineages WHERE adapter = $1 AND ended IS NULL
             ORDER BY id DESC LIMIT 1",
            &[&adapter],
        )?;
        Ok(row.map(|r| Lineage {
            id: r.get::<_, i64>(0) as u64,
            first_version: r.get::<_, i64>(1) as u64,
        }))
    }

    fn max_version(&self, adapter: &str) -> Result<u64, LogError> {
        let v: i64 = self
            .conn()?
            .query_one(
                "SELECT GREATEST(
                    (SELECT coalesce(max(version), 0) FROM completions WHERE adapter = $1),
                    (SELECT coalesce(max(version), 0) FROM checkpoints WHERE adapter = $1),
                    (SELECT coalesce(max(first_version), 0) FROM lineages WHERE adapter = $1),
                    (SELECT coalesce(max(from_version), 0) FROM decisions WHERE adapter = $1))",
                &[&adapter],
            )?
            .get(0);
        Ok(v as u64)
    }

    fn begin_lineage(&self, adapter: &str, first_version: u64) -> Result<Lineage, LogError> {
        let mut c = self.conn()?;
        let mut tx = c.transaction()?;
        let now = now_secs();
        tx.execute(
            "UPDATE lineages SET ended = $2 WHERE adapter = $1 AND ended IS NULL",
            &[&adapter, &now],
        )?;
        let id: i64 = tx
            .query_one(
                "INSERT INTO lineages (adapter, first_version, created) VALUES ($1, $2, $3)
                 RETURNING id",
                &[&adapter, &(first_version as i64), &now],
            )?
            .get(0);
        tx.commit()?;
        Ok(Lineage {
            id: id as u64,
            first_version,
        })
    }

    fn end_lineage(&self, adapter: &str) -> Result<(), LogError> {
        self.conn()?.execute(
            "UPDATE lineages SET ended = $2 WHERE adapter = $1 AND ended IS NULL",
            &[&adapter, &now_secs()],
        )?;
        Ok(())
    }

    fn checkpoints(&self, lineage: u64) -> Result<Vec<Checkpoint>, LogError> {
        let rows = self.conn()?.query(
            "SELECT version, step, path FROM checkpoints WHERE lineage = $1
             ORDER BY version DESC",
            &[&(lineage as i64)],
        )?;
        Ok(rows
            .iter()
            .map(|r| Checkpoint {
                version: r.get::<_, i64>(0) as u64,
                step: r.get::<_, i64>(1) as u64,
                path: r.get(2),
            })
            .collect())
    }

    fn newest_checkpoint(&self, lineage: u64) -> Result<Option<(Checkpoint, f64)>, LogError> {
        let row = self.conn()?.query_opt(
            "SELECT version, step, path, created FROM checkpoints WHERE lineage = $1
             ORDER BY version DESC LIMIT 1",
            &[&(lineage as i64)],
        )?;
        Ok(row.map(|r| {
            (
                Checkpoint {
                    version: r.get::<_, i64>(0) as u64,
                    step: r.get::<_, i64>(1) as u64,
                    path: r.get(2),
                },
                r.get(3),
            )
        }))
    }

    fn history(&self, adapter: &str, lineage: u64) -> Result<History, LogError> {
        let mut c = self.conn()?;
        let last_stats = c
            .query_opt(
                "SELECT stats FROM checkpoints WHERE lineage = $1 ORDER BY version DESC LIMIT 1",
                &[&(lineage as i64)],
            )?
            .map(|r| r.get(0));
        let trained: i64 = c
            .query_one(
                "SELECT count(*) FROM completions WHERE adapter = $1 AND consumed_step IS NOT NULL",
                &[&adapter],
            )?
            .get(0);
        let dropped = c
            .query(
                "SELECT dropped, count(*) FROM completions WHERE adapter = $1 AND dropped IS NOT NULL
                 GROUP BY dropped",
                &[&adapter],
            )?
            .iter()
            .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1) as u64))
            .collect();
        Ok(History {
            last_stats,
            trained: trained as u64,
            dropped,
        })
    }

    fn commit_step(
        &self,
        adapter: &str,
        lineage: u64,
        cp: &Checkpoint,
        stats: &str,
        consumed: &[(String, u32)],
    ) -> Result<(), LogError> {
        let mut c = self.conn()?;
        let mut tx = c.transaction()?;
        tx.execute(
            "INSERT INTO checkpoints (adapter, version, lineage, step, path, created, stats)
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
            &[
                &adapter,
                &(cp.version as i64),
                &(lineage as i64),
                &(cp.step as i64),
                &cp.path,
                &now_secs(),
                &stats,
            ],
        )?;
        tx.execute(
            "INSERT INTO steps (adapter, lineage, version, created, stats)
             VALUES ($1, $2, $3, $4, $5)",
            &[
                &adapter,
                &(lineage as i64),
                &(cp.version as i64),
                &now_secs(),
                &stats,
            ],
        )?;
        for (id, choice) in consumed {
            let n = tx.execute(
                "UPDATE completions SET consumed_step = $3
                 WHERE id = $1 AND choice = $2 AND consumed_step IS NULL",
                &[id, &(*choice as i32), &(cp.step as i64)],
            )?;
            if n != 1 {
                return Err(already_consumed(id, *choice));
            }
        }
        // Delivered to the listeners when (and only if) the step commits.
        tx.execute(
            "SELECT pg_notify($1, $2)",
            &[&STEPS_CHANNEL, &format!("{adapter}:{}", cp.version)],
        )?;
        Ok(tx.commit()?)
    }

    fn retire_checkpoints(&self, adapter: &str, keep: usize) -> Result<Vec<String>, LogError> {
        PgLog::retire_checkpoints(self, adapter, keep)
    }
    fn rollback(&self, adapter: &str, d: &Decision) -> Result<Vec<String>, LogError> {
        PgLog::rollback(self, adapter, d)
    }
    fn record_decision(&self, adapter: &str, d: &Decision) -> Result<(), LogError> {
        PgLog::record_decision(self, adapter, d)
    }
    fn decisions(&self, adapter: &str, limit: usize) -> Result<Vec<Decision>, LogError> {
        PgLog::decisions(self, adapter, limit)
    }
    fn steps(&self, adapter: &str, limit: usize) -> Result<Vec<StepRow>, LogError> {
        PgLog::steps(self, adapter, limit)
    }
    fn put_session(&self, s: &SessionRecord) -> Result<(), LogError> {
        PgLog::put_session(self, s)
    }
    fn end_sessions(&self, ids: &[String]) -> Result<Vec<String>, LogError> {
        PgLog::end_sessions(self, ids)
    }
    fn put_run(&self, r: &RunRecord) -> Result<(), LogError> {
        PgLog::put_run(self, r)
    }
    fn set_run_state(&self, id: &str, state: &str, step: u64) -> Result<String, LogError> {
        PgLog::set_run_state(self, id, state, step)
    }
    fn set_run_pending(&self, id: &str, pending: u64) -> Result<(), LogError> {
        PgLog::set_run_pending(self, id, pending)
    }
    fn open_sessions(&self) -> Result<(Vec<SessionRecord>, Vec<RunRecord>), LogError> {
        PgLog::open_sessions(self)
    }
    fn put_agent_session(&self, s: &AgentSession) -> Result<(), LogError> {
        PgLog::put_agent_session(self, s)
    }
    fn agent_session(&self, by: SessionLookup) -> Result<Option<SessionView>, LogError> {
        PgLog::agent_session(self, by)
    }
    fn open_agent_sessions(&self) -> Result<Vec<SessionView>, LogError> {
        PgLog::open_agent_sessions(self)
    }
    fn reward_agent_session(
        &self,
        id: &str,
        r: &SessionReward,
        a: Accepts,
    ) -> Result<bool, FeedbackError> {
        PgLog::reward_agent_session(self, id, r, a)
    }
    fn end_agent_session(&self, id: &str) -> Result<bool, LogError> {
        PgLog::end_agent_session(self, id)
    }
    fn claim_trainer(&self, adapter: &str) -> Result<(), LogError> {
        self.take_claim(adapter)
    }

    fn subscribe(&self, what: Announcement, wake: Box<dyn Fn() + Send + Sync>) {
        self.listen(channel(what), wake)
    }
}

mod agent_sessions;
mod conn;
use conn::{announce_rewards, channel, choice_info, STEPS_CHANNEL};
mod decisions;
mod runs;
