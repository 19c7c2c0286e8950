//! Agent sessions (`online::sessions`) in the rollout log: one row each, its turns the
//! completions of its episode; rewarding writes every turn's return and the session's state in
//! one transaction.

use super::SqliteLog;
use crate::online::sessions::{
    judge_reward, returns_bytes, returns_of, AgentSession, SessionRefusal, SessionReward,
    SessionState, SessionView,
};
use crate::online::store::records::{Accepting, FeedbackError, LogError};
use crate::online::store::SessionLookup;
use crate::util::now_secs;
use rusqlite::{params, OptionalExtension, TransactionBehavior};

/// The columns `view` reads, with the turns' count and last activity.
const VIEW: &str = "SELECT s.id, s.key_hash, s.owner, s.adapter, s.group_name, s.gamma,
        s.max_turns, s.idle_secs, s.idle_reward, s.created, s.state, s.returns, s.episode,
        (SELECT count(*) FROM completions c WHERE c.episode = s.episode),
        (SELECT max(c.created) FROM completions c WHERE c.episode = s.episode)
    FROM agent_sessions s";

fn view(r: &rusqlite::Row) -> rusqlite::Result<SessionView> {
    let created: f64 = r.get(9)?;
    Ok(SessionView {
        session: AgentSession {
            id: r.get(0)?,
            key_hash: r.get(1)?,
            owner: r.get(2)?,
            adapter: r.get(3)?,
            group: r.get(4)?,
            gamma: r.get(5)?,
            max_turns: r.get(6)?,
            idle_secs: r.get(7)?,
            idle_reward: r.get(8)?,
            created,
            state: SessionState::parse(&r.get::<_, String>(10)?),
            returns: r.get::<_, Option<Vec<u8>>>(11)?.map(|b| returns_of(&b)),
            episode: r.get(12)?,
        },
        turns: r.get(13)?,
        last_active: r.get::<_, Option<f64>>(14)?.unwrap_or(created).max(created),
    })
}

impl SqliteLog {
    pub fn put_agent_session(&self, s: &AgentSession) -> Result<(), LogError> {
        self.conn()?.execute(
            "INSERT INTO agent_sessions (id, key_hash, owner, adapter, group_name, gamma,
               max_turns, idle_secs, idle_reward, created, state, returns, episode)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)",
            params![
                s.id,
                s.key_hash,
                s.owner,
                s.adapter,
                s.group,
                s.gamma,
                s.max_turns,
                s.idle_secs,
                s.idle_reward,
                s.created,
                s.state.as_str(),
                s.returns.as_deref().map(returns_bytes),
                s.episode
            ],
        )?;
        Ok(())
    }

    pub fn agent_session(&self, by: SessionLookup) -> Result<Option<SessionView>, LogError> {
        let c = self.conn()?;
        let (sql, key) = match by {
            SessionLookup::Id(id) => (format!("{VIEW} WHERE s.id = ?1"), id),
            SessionLookup::KeyHash(h) => (format!("{VIEW} WHERE s.key_hash = ?1"), h),
        };
        let mut st = c.prepare_cached(&sql)?;
        Ok(st.query_row(params![key], view).optional()?)
    }

    pub fn open_agent_sessions(&self) -> Result<Vec<SessionView>, LogError> {
        let c = self.conn()?;
        let mut st = c.prepare_cached(&format!(
            "{VIEW} WHERE s.state = 'open' ORDER BY s.created, s.id"
        ))?;
        let rows = st.query_map([], view)?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    pub fn reward_agent_session(
        &self,
        id: &str,
        reward: &SessionReward,
        accepts: &Accepting,
    ) -> Result<bool, FeedbackError> {
        let mut c = self.conn()?;
        let tx = c.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let refused = |why| FeedbackError::Session {
            id: id.to_string(),
            why,
        };
        let v = tx
            .prepare_cached(&format!("{VIEW} WHERE s.id = ?1"))?
            .query_row(params![id], view)
            .optional()?
            .ok_or_else(|| refused(SessionRefusal::NotFound))?;
        let turns: Vec<(String, u32)> = {
            let mut st = tx.prepare_cached(
                "SELECT id, choice FROM completions WHERE episode = ?1
                 ORDER BY created, id, choice",
            )?;
            let rows = st.query_map(params![v.session.episode], |r| Ok((r.get(0)?, r.get(1)?)))?;
            rows.collect::<Result<_, _>>()?
        };
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
                "UPDATE completions SET reward = ?3, rewarded_at = ?4
                 WHERE id = ?1 AND choice = ?2 AND reward IS NULL",
                params![tid, choice, r, now],
            )?;
        }
        // A turn still being generated takes the last turn's return when it is logged.
        if let Some(last) = g.last() {
            tx.execute(
                "INSERT OR IGNORE INTO episode_rewards (episode, reward, rewarded_at)
                 VALUES (?1, ?2, ?3)",
                params![v.session.episode, last, now],
            )?;
        }
        tx.execute(
            "UPDATE agent_sessions SET state = 'rewarded', returns = ?2, ended = ?3 WHERE id = ?1",
            params![id, returns_bytes(&g), now],
        )?;
        tx.commit()?;
        Ok(true)
    }

    pub fn end_agent_session(&self, id: &str) -> Result<bool, LogError> {
        let mut c = self.conn()?;
        let tx = c.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let now = now_secs();
        let n = tx.execute(
            "UPDATE agent_sessions SET state = 'ended', ended = ?2 WHERE id = ?1 AND state = 'open'",
            params![id, now],
        )?;
        if n == 1 {
            tx.execute(
                "UPDATE completions SET dropped = 'session_ended'
                 WHERE episode = (SELECT episode FROM agent_sessions WHERE id = ?1)
                   AND consumed_step IS NULL AND dropped IS NULL",
                params![id],
            )?;
        }
        tx.commit()?;
        Ok(n == 1)
    }
}
