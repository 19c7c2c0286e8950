//! The sessions and training runs clients drive (the Tinker API) on PostgreSQL: the SQLite
//! log's tables and promises (`sqlite/runs.rs`).

use super::PgLog;
use crate::online::store::records::{LogError, RunRecord, SessionRecord};

impl PgLog {
    pub(super) fn put_session(&self, s: &SessionRecord) -> Result<(), LogError> {
        self.conn()?.execute(
            "INSERT INTO client_sessions (id, owner, info, created) VALUES ($1, $2, $3, $4)",
            &[&s.id, &s.owner, &s.info, &s.created],
        )?;
        Ok(())
    }

    pub(super) fn end_sessions(&self, ids: &[String]) -> Result<Vec<String>, LogError> {
        let mut c = self.conn()?;
        let mut tx = c.transaction()?;
        let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
        let states = tx
            .query(
                "DELETE FROM client_runs WHERE session = ANY($1) RETURNING state",
                &[&ids],
            )?
            .iter()
            .map(|r| r.get(0))
            .collect();
        tx.execute("DELETE FROM client_sessions WHERE id = ANY($1)", &[&ids])?;
        tx.commit()?;
        Ok(states)
    }

    pub(super) fn put_run(&self, r: &RunRecord) -> Result<(), LogError> {
        let n = self.conn()?.execute(
            "INSERT INTO client_runs (id, session, owner, info, state, step, pending)
             VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (id) DO NOTHING",
            &[
                &r.id,
                &r.session,
                &r.owner,
                &r.info,
                &r.state,
                &(r.step as i64),
                &(r.pending as i64),
            ],
        )?;
        if n == 0 {
            return Err(LogError::Conflict(format!("run '{}' exists", r.id)));
        }
        Ok(())
    }

    pub(super) fn set_run_state(
        &self,
        id: &str,
        state: &str,
        step: u64,
    ) -> Result<String, LogError> {
        let mut c = self.conn()?;
        let mut tx = c.transaction()?;
        let old: String = tx
            .query_opt(
                "SELECT state FROM client_runs WHERE id = $1 FOR UPDATE",
                &[&id],
            )?
            .ok_or_else(|| LogError::Conflict(format!("no run '{id}'")))?
            .get(0);
        tx.execute(
            "UPDATE client_runs SET state = $2, step = $3, pending = 0 WHERE id = $1",
            &[&id, &state, &(step as i64)],
        )?;
        tx.commit()?;
        Ok(old)
    }

    pub(super) fn set_run_pending(&self, id: &str, pending: u64) -> Result<(), LogError> {
        self.conn()?.execute(
            "UPDATE client_runs SET pending = $2 WHERE id = $1",
            &[&id, &(pending as i64)],
        )?;
        Ok(())
    }

    pub(super) fn open_sessions(&self) -> Result<(Vec<SessionRecord>, Vec<RunRecord>), LogError> {
        let mut c = self.conn()?;
        let sessions = c
            .query(
                "SELECT id, owner, info, created FROM client_sessions ORDER BY created, id",
                &[],
            )?
            .iter()
            .map(|r| SessionRecord {
                id: r.get(0),
                owner: r.get(1),
                info: r.get(2),
                created: r.get(3),
            })
            .collect();
        let runs = c
            .query(
                "SELECT id, session, owner, info, state, step, pending FROM client_runs
                 ORDER BY id",
                &[],
            )?
            .iter()
            .map(|r| RunRecord {
                id: r.get(0),
                session: r.get(1),
                owner: r.get(2),
                info: r.get(3),
                state: r.get(4),
                step: r.get::<_, i64>(5) as u64,
                pending: r.get::<_, i64>(6) as u64,
            })
            .collect();
        Ok((sessions, runs))
    }
}
