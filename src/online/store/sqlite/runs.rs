//! The sessions and training runs clients drive (the Tinker API), kept across restarts: each
//! session with its owner and what its client said of it, each run with what it was made with
//! and the folder of its newest state.

use super::SqliteLog;
use crate::online::store::records::{LogError, RunRecord, SessionRecord};
use rusqlite::{params, OptionalExtension, TransactionBehavior};

impl SqliteLog {
    pub fn put_session(&self, s: &SessionRecord) -> Result<(), LogError> {
        let c = self.conn()?;
        c.execute(
            "INSERT INTO client_sessions (id, owner, info, created) VALUES (?1, ?2, ?3, ?4)",
            params![s.id, s.owner, s.info, s.created],
        )?;
        Ok(())
    }

    pub fn end_sessions(&self, ids: &[String]) -> Result<Vec<String>, LogError> {
        let mut c = self.conn()?;
        let tx = c.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let mut states = Vec::new();
        for id in ids {
            let mut st = tx.prepare("SELECT state FROM client_runs WHERE session = ?1")?;
            let rows = st.query_map(params![id], |r| r.get::<_, String>(0))?;
            states.extend(rows.collect::<Result<Vec<_>, _>>()?);
            drop(st);
            tx.execute("DELETE FROM client_runs WHERE session = ?1", params![id])?;
            tx.execute("DELETE FROM client_sessions WHERE id = ?1", params![id])?;
        }
        tx.commit()?;
        Ok(states)
    }

    pub fn put_run(&self, r: &RunRecord) -> Result<(), LogError> {
        let c = self.conn()?;
        let n = c.execute(
            "INSERT OR IGNORE INTO client_runs (id, session, owner, info, state, step, pending)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
            params![
                r.id,
                r.session,
                r.owner,
                r.info,
                r.state,
                r.step as i64,
                r.pending as i64
            ],
        )?;
        if n == 0 {
            return Err(LogError::Conflict(format!("run '{}' exists", r.id)));
        }
        Ok(())
    }

    pub fn set_run_state(&self, id: &str, state: &str, step: u64) -> Result<String, LogError> {
        let mut c = self.conn()?;
        let tx = c.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let old: Option<String> = tx
            .query_row(
                "SELECT state FROM client_runs WHERE id = ?1",
                params![id],
                |r| r.get(0),
            )
            .optional()?;
        let old = old.ok_or_else(|| LogError::Conflict(format!("no run '{id}'")))?;
        tx.execute(
            "UPDATE client_runs SET state = ?2, step = ?3, pending = 0 WHERE id = ?1",
            params![id, state, step as i64],
        )?;
        tx.commit()?;
        Ok(old)
    }

    pub fn set_run_pending(&self, id: &str, pending: u64) -> Result<(), LogError> {
        let c = self.conn()?;
        c.execute(
            "UPDATE client_runs SET pending = ?2 WHERE id = ?1",
            params![id, pending as i64],
        )?;
        Ok(())
    }

    pub fn open_sessions(&self) -> Result<(Vec<SessionRecord>, Vec<RunRecord>), LogError> {
        let c = self.conn()?;
        let mut st =
            c.prepare("SELECT id, owner, info, created FROM client_sessions ORDER BY created, id")?;
        let sessions = st
            .query_map([], |r| {
                Ok(SessionRecord {
                    id: r.get(0)?,
                    owner: r.get(1)?,
                    info: r.get(2)?,
                    created: r.get(3)?,
                })
            })?
            .collect::<Result<Vec<_>, _>>()?;
        let mut st = c.prepare(
            "SELECT id, session, owner, info, state, step, pending FROM client_runs ORDER BY id",
        )?;
        let runs = st
            .query_map([], |r| {
                Ok(RunRecord {
                    id: r.get(0)?,
                    session: r.get(1)?,
                    owner: r.get(2)?,
                    info: r.get(3)?,
                    state: r.get(4)?,
                    step: r.get::<_, i64>(5)? as u64,
                    pending: r.get::<_, i64>(6)? as u64,
                })
            })?
            .collect::<Result<Vec<_>, _>>()?;
        Ok((sessions, runs))
    }
}
