//! Decisions about a learning adapter's versions, its steps' history and retired checkpoints,
//! on PostgreSQL: the SQLite log's tables and promises (`sqlite/lineage.rs`).

use super::PgLog;
use crate::online::store::records::{Decision, LogError, StepRow};
use crate::util::now_secs;
use postgres::GenericClient;

fn insert(c: &mut impl GenericClient, adapter: &str, d: &Decision) -> Result<(), LogError> {
    c.execute(
        "INSERT INTO decisions (adapter, lineage, decision, reason, from_version, to_version,
                                evidence, paused, created)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
        &[
            &adapter,
            &(d.lineage as i64),
            &d.decision,
            &d.reason,
            &(d.from_version as i64),
            &(d.to_version as i64),
            &d.evidence,
            &d.paused,
            &now_secs(),
        ],
    )?;
    Ok(())
}

impl PgLog {
    pub(super) fn rollback(&self, adapter: &str, d: &Decision) -> Result<Vec<String>, LogError> {
        let mut c = self.conn()?;
        let mut tx = c.transaction()?;
        insert(&mut tx, adapter, d)?;
        let paths = tx
            .query(
                "DELETE FROM checkpoints WHERE adapter = $1 AND lineage = $2 AND version > $3
                 RETURNING path",
                &[&adapter, &(d.lineage as i64), &(d.to_version as i64)],
            )?
            .iter()
            .map(|r| r.get(0))
            .collect();
        tx.commit()?;
        Ok(paths)
    }

    pub(super) fn record_decision(&self, adapter: &str, d: &Decision) -> Result<(), LogError> {
        let mut c = self.conn()?;
        insert(&mut *c, adapter, d)
    }

    pub(super) fn steps(&self, adapter: &str, limit: usize) -> Result<Vec<StepRow>, LogError> {
        let rows = self.conn()?.query(
            "SELECT lineage, version, created, stats FROM steps WHERE adapter = $1
             ORDER BY created DESC, version DESC LIMIT $2",
            &[&adapter, &(limit as i64)],
        )?;
        let mut v: Vec<StepRow> = rows
            .iter()
            .map(|r| {
                (
                    r.get::<_, i64>(0) as u64,
                    r.get::<_, i64>(1) as u64,
                    r.get(2),
                    r.get(3),
                )
            })
            .collect();
        v.reverse();
        Ok(v)
    }

    pub(super) fn decisions(&self, adapter: &str, limit: usize) -> Result<Vec<Decision>, LogError> {
        let rows = self.conn()?.query(
            "SELECT lineage, decision, reason, from_version, to_version, evidence, paused, created
             FROM decisions WHERE adapter = $1 ORDER BY id DESC LIMIT $2",
            &[&adapter, &(limit as i64)],
        )?;
        Ok(rows
            .iter()
            .map(|r| Decision {
                lineage: r.get::<_, i64>(0) as u64,
                decision: r.get(1),
                reason: r.get(2),
                from_version: r.get::<_, i64>(3) as u64,
                to_version: r.get::<_, i64>(4) as u64,
                evidence: r.get(5),
                paused: r.get(6),
                created: r.get(7),
            })
            .collect())
    }

    pub(super) fn retire_checkpoints(
        &self,
        adapter: &str,
        keep: usize,
    ) -> Result<Vec<String>, LogError> {
        let mut c = self.conn()?;
        let mut tx = c.transaction()?;
        let rows = tx.query(
            "DELETE FROM checkpoints c USING lineages l
             WHERE l.id = c.lineage AND c.adapter = $1 AND (l.ended IS NOT NULL OR c.version
                NOT IN (SELECT version FROM checkpoints WHERE adapter = $1 AND lineage = l.id
                        ORDER BY version DESC LIMIT $2))
             RETURNING c.path",
            &[&adapter, &(keep as i64)],
        )?;
        tx.commit()?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }
}
