//! Agent sessions on PostgreSQL: the SQLite log's table and promises
//! (`sqlite/agent_sessions.rs`). Rewarding locks the session's row (ending it waits) and its
//! episode (a turn logged meanwhile gets its return either way).

use super::{lock_episodes, PgLog};
use crate::online::sessions::{
    judge_reward, returns_bytes, returns_of, AgentSession, SessionRefusal, SessionReward,
    SessionState, SessionView,
};
use crate::online::store::records::{Accepting, FeedbackError, LogError};
use crate::online::store::SessionLookup;
use crate::util::now_secs;
use postgres::Row;

/// The columns `view` reads, with the turns' count and last activity.
const VIEW: &str = "SELECT s.id, s.key_hash, s.owner, s.adapter, s.group_name, s.gamma,
        s.max_turns, s.idle_secs, s.idle_reward, s.created, s.state, s.returns, s.episode,
        (SELECT count(*) FROM completions c WHERE c.episode = s.episode),
        (SELECT max(c.created) FROM completions c WHERE c.episode = s.episode)
    FROM agent_sessions s";

fn view(r: &Row) -> SessionView {
    let created: f64 = r.get(9);
    SessionView {
        session: AgentSession {
            id: r.get(0),
            key_hash: r.get(1),
            owner: r.get(2),
            adapter: r.get(3),
            group: r.get(4),
            gamma: r.get(5),
            max_turns: r.get::<_, Option<i64>>(6).map(|t| t as u32),
            idle_secs: r.get(7),
            idle_reward: r.get(8),
            created,
            state: SessionState::parse(r.get(10)),
            returns: r.get::<_, Option<Vec<u8>>>(11).map(|b| returns_of(&b)),
            episode: r.get(12),
        },
        turns: r.get::<_, i64>(13) as u32,
        last_active: r.get::<_, Option<f64>>(14).unwrap_or(created).max(created),
    }
}

impl PgLog {
    pub(super) fn put_agent_session(&self, s: &AgentSession) -> Result<(), LogError> {
        self.conn()?.execute(
            "INSERT INTO agent_sessions (id, key_hash, owner, adapter, group_name, gamma,
               max_turns, idle_secs, idle_reward, created, state, returns, episode)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)",
            &[
                &s.id,
                &s.key_hash,
                &s.owner,
                &s.adapter,
                &s.group,
                &s.gamma,
                &s.max_turns.map(i64::from),
                &s.idle_secs,
                &s.idle_reward,
                &s.created,
                &s.state.as_str(),
                &s.returns.as_deref().map(returns_bytes),
                &s.episode,
            ],
        )?;
        Ok(())
    }

    pub(super) fn agent_session(&self, by: SessionLookup) -> Result<Option<SessionView>, LogError> {
        let (sql, key) = match by {
            SessionLookup::Id(id) => (format!("{VIEW} WHERE s.id = $1"), id),
            SessionLookup::KeyHash(h) => (format!("{VIEW} WHERE s.key_hash = $1"), h),
        };
        Ok(self.conn()?.query_opt(&sql, &[&key])?.map(|r| view(&r)))
    }

    pub(super) fn open_agent_sessions(&self) -> Result<Vec<SessionView>, LogError> {
        let rows = self.conn()?.query(
            &format!("{VIEW} WHERE s.state = 'open' ORDER BY s.created, s.id"),
            &[],
        )?;
        Ok(rows.iter().map(view).collect())
    }

    pub(super) fn reward_agent_session(
        &self,
        id: &str,
        reward: &SessionReward,
        accepts: &Accepting,
    ) -> Result<bool, FeedbackError> {
        let refused = |why| FeedbackError::Session {
            id: id.to_string(),
            why,
        };
        let mut c = self.conn()?;
        let mut tx = c.transaction()?;
        let episode: String = tx
            .query_opt(
                "SELECT episode FROM agent_sessions WHERE id = $1 FOR UPDATE",
                &[&id],
            )?
            .map(|r| r.get(0))
            .ok_or_else(|| refused(SessionRefusal::NotFound))?;
        lock_episodes(&mut tx, &mut vec![episode.clone()])?;
        let v = tx
            .query_opt(&format!("{VIEW} WHERE s.id = $1"), &[&id])?
            .map(|r| view(&r))
            .ok_or_else(|| refused(SessionRefusal::NotFound))?;
        let turns: Vec<(String, i32)> = tx
            .query(
                "SELECT id, choice FROM completions WHERE episode = $1
                 ORDER BY created, id, choice",
                &[&episode],
            )?
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        let Some(g) = judge_reward(&v.session, reward, turns.len()).map_err(refused)? else {
            return Ok(false);
        };
        if !turns.is_empty() {
            if let Err(why) = accepts.check(&v.session.adapter) {
                return Err(FeedbackError::Refused {
                    index: 0,
                    id: id.to_string(),
                    adapter: v.session.adapter,
                    why,
                });
            }
        }
        let now = now_secs();
        for ((tid, choice), r) in turns.iter().zip(&g) {
            tx.execute(
                "UPDATE completions SET reward = $3, rewarded_at = $4
                 WHERE id = $1 AND choice = $2 AND reward IS NULL",
                &[tid, choice, r, &now],
            )?;
        }
        if let Some(last) = g.last() {
            tx.execute(
                "INSERT INTO episode_rewards (episode, reward, rewarded_at) VALUES ($1, $2, $3)
                 ON CONFLICT (episode) DO NOTHING",
                &[&episode, last, &now],
            )?;
        }
        tx.execute(
            "UPDATE agent_sessions SET state = 'rewarded', returns = $2, ended = $3 WHERE id = $1",
            &[&id, &returns_bytes(&g), &now],
        )?;
        super::announce_rewards(&mut tx)?;
        tx.commit()?;
        Ok(true)
    }

    pub(super) fn end_agent_session(&self, id: &str) -> Result<bool, LogError> {
        let mut c = self.conn()?;
        let mut tx = c.transaction()?;
        let now = now_secs();
        let n = tx.execute(
            "UPDATE agent_sessions SET state = 'ended', ended = $2 WHERE id = $1 AND state = 'open'",
            &[&id, &now],
        )?;
        if n == 1 {
            tx.execute(
                "UPDATE completions SET dropped = 'session_ended'
                 WHERE episode = (SELECT episode FROM agent_sessions WHERE id = $1)
                   AND consumed_step IS NULL AND dropped IS NULL",
                &[&id],
            )?;
        }
        tx.commit()?;
        Ok(n == 1)
    }
}
