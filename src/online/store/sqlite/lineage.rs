//! The rollout log's record of training: lineages and checkpoints.
//!
//! A lineage is one life of a learning adapter, from its creation (or its first learning) to its
//! deletion: its versions start at `first_version`, above every version the name ever had, so a
//! name's version numbers are never reused. A checkpoint is one published step of a lineage:
//! adapter and optimizer in a folder under the data directory, recorded by its path relative to
//! that directory (a copied data directory is self-contained) in the same transaction as the
//! completions the step consumed.

use super::SqliteLog;
use crate::online::store::records::{
    already_consumed, Checkpoint, Decision, History, Lineage, LogError, StepRow,
};
use crate::util::now_secs;
use rusqlite::{params, OptionalExtension, TransactionBehavior};

impl SqliteLog {
    /// The lineage `adapter` learns in now, if any.
    pub fn active_lineage(&self, adapter: &str) -> Result<Option<Lineage>, LogError> {
        let c = self.conn()?;
        let l = c
            .query_row(
                "SELECT id, first_version FROM lineages WHERE adapter = ?1 AND ended IS NULL
                 ORDER BY id DESC LIMIT 1",
                params![adapter],
                |r| {
                    Ok(Lineage {
                        id: r.get::<_, i64>(0)? as u64,
                        first_version: r.get::<_, i64>(1)? as u64,
                    })
                },
            )
            .optional()?;
        Ok(l)
    }

    /// The highest version `adapter` ever had in this log (served, checkpointed, a lineage's
    /// first, or rolled back from); 0 if none.
    pub fn max_version(&self, adapter: &str) -> Result<u64, LogError> {
        let c = self.conn()?;
        let v: i64 = c.query_row(
            "SELECT max(
                (SELECT coalesce(max(version), 0) FROM completions WHERE adapter = ?1),
                (SELECT coalesce(max(version), 0) FROM checkpoints WHERE adapter = ?1),
                (SELECT coalesce(max(first_version), 0) FROM lineages WHERE adapter = ?1),
                (SELECT coalesce(max(from_version), 0) FROM decisions WHERE adapter = ?1))",
            params![adapter],
            |r| r.get(0),
        )?;
        Ok(v as u64)
    }

    /// Start a lineage of `adapter` at `first_version`, ending any still active.
    pub fn begin_lineage(&self, adapter: &str, first_version: u64) -> Result<Lineage, LogError> {
        let mut c = self.conn()?;
        let tx = c.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let now = now_secs();
        tx.execute(
            "UPDATE lineages SET ended = ?2 WHERE adapter = ?1 AND ended IS NULL",
            params![adapter, now],
        )?;
        tx.execute(
            "INSERT INTO lineages (adapter, first_version, created) VALUES (?1, ?2, ?3)",
            params![adapter, first_version as i64, now],
        )?;
        let id = tx.last_insert_rowid() as u64;
        tx.commit()?;
        Ok(Lineage { id, first_version })
    }

    /// End the active lineage of `adapter` (deleted): its checkpoints are never resumed.
    pub fn end_lineage(&self, adapter: &str) -> Result<(), LogError> {
        let c = self.conn()?;
        c.execute(
            "UPDATE lineages SET ended = ?2 WHERE adapter = ?1 AND ended IS NULL",
            params![adapter, now_secs()],
        )?;
        Ok(())
    }

    /// The checkpoints of `lineage`, newest first.
    pub fn checkpoints(&self, lineage: u64) -> Result<Vec<Checkpoint>, LogError> {
        let c = self.conn()?;
        let mut st = c.prepare_cached(
            "SELECT version, step, path FROM checkpoints WHERE lineage = ?1
             ORDER BY version DESC",
        )?;
        let rows = st.query_map(params![lineage as i64], |r| {
            Ok(Checkpoint {
                version: r.get::<_, i64>(0)? as u64,
                step: r.get::<_, i64>(1)? as u64,
                path: r.get(2)?,
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// The newest checkpoint of `lineage` and when it was committed.
    pub fn newest_checkpoint(&self, lineage: u64) -> Result<Option<(Checkpoint, f64)>, LogError> {
        let c = self.conn()?;
        Ok(c.query_row(
            "SELECT version, step, path, created FROM checkpoints WHERE lineage = ?1
             ORDER BY version DESC LIMIT 1",
            params![lineage as i64],
            |r| {
                Ok((
                    Checkpoint {
                        version: r.get::<_, i64>(0)? as u64,
                        step: r.get::<_, i64>(1)? as u64,
                        path: r.get(2)?,
                    },
                    r.get(3)?,
                ))
            },
        )
        .optional()?)
    }

    /// The newest step report of `lineage`, and `adapter`'s completions trained and dropped.
    pub fn history(&self, adapter: &str, lineage: u64) -> Result<History, LogError> {
        let c = self.conn()?;
        let last_stats = c
            .query_row(
                "SELECT stats FROM checkpoints WHERE lineage = ?1 ORDER BY version DESC LIMIT 1",
                params![lineage as i64],
                |r| r.get(0),
            )
            .optional()?;
        let trained: i64 = c.query_row(
            "SELECT count(*) FROM completions WHERE adapter = ?1 AND consumed_step IS NOT NULL",
            params![adapter],
            |r| r.get(0),
        )?;
        let mut st = c.prepare_cached(
            "SELECT dropped, count(*) FROM completions WHERE adapter = ?1 AND dropped IS NOT NULL
             GROUP BY dropped",
        )?;
        let dropped = st
            .query_map(params![adapter], |r| {
                Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)? as u64))
            })?
            .collect::<Result<_, _>>()?;
        Ok(History {
            last_stats,
            trained: trained as u64,
            dropped,
        })
    }

    /// Record a checkpoint of `lineage` and the members its step consumed, in one transaction.
    pub fn commit_step(
        &self,
        adapter: &str,
        lineage: u64,
        cp: &Checkpoint,
        stats: &str,
        consumed: &[(String, u32)],
    ) -> Result<(), LogError> {
        let mut c = self.conn()?;
        let tx = c.transaction_with_behavior(TransactionBehavior::Immediate)?;
        tx.execute(
            "INSERT INTO checkpoints (adapter, version, lineage, step, path, created, stats)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
            params![
                adapter,
                cp.version as i64,
                lineage as i64,
                cp.step as i64,
                cp.path,
                now_secs(),
                stats
            ],
        )?;
        tx.execute(
            "INSERT INTO steps (adapter, lineage, version, created, stats)
             VALUES (?1, ?2, ?3, ?4, ?5)",
            params![
                adapter,
                lineage as i64,
                cp.version as i64,
                now_secs(),
                stats
            ],
        )?;
        for (id, choice) in consumed {
            let n = tx.execute(
                "UPDATE completions SET consumed_step = ?3
                 WHERE id = ?1 AND choice = ?2 AND consumed_step IS NULL",
                params![id, choice, cp.step as i64],
            )?;
            if n != 1 {
                return Err(already_consumed(id, *choice));
            }
        }
        Ok(tx.commit()?)
    }

    /// Checkpoints of `adapter` no longer needed: those of ended lineages, and all but the newest
    /// `keep` of the active one. Their rows are forgotten; the relative paths are returned for
    /// the caller to remove.
    pub fn retire_checkpoints(&self, adapter: &str, keep: usize) -> Result<Vec<String>, LogError> {
        let mut c = self.conn()?;
        let tx = c.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let paths: Vec<(i64, String)> = {
            let mut st = tx.prepare_cached(
                "SELECT c.version, c.path FROM checkpoints c JOIN lineages l ON l.id = c.lineage
                 WHERE c.adapter = ?1 AND (l.ended IS NOT NULL OR c.version NOT IN (
                    SELECT version FROM checkpoints WHERE adapter = ?1 AND lineage = l.id
                    ORDER BY version DESC LIMIT ?2))",
            )?;
            let rows = st.query_map(params![adapter, keep as i64], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })?;
            rows.collect::<Result<_, _>>()?
        };
        for (v, _) in &paths {
            tx.execute(
                "DELETE FROM checkpoints WHERE adapter = ?1 AND version = ?2",
                params![adapter, v],
            )?;
        }
        tx.commit()?;
        Ok(paths.into_iter().map(|(_, p)| p).collect())
    }

    /// Record rollback `d` and forget the checkpoints of its lineage above its target.
    pub fn rollback(&self, adapter: &str, d: &Decision) -> Result<Vec<String>, LogError> {
        let mut c = self.conn()?;
        let tx = c.transaction_with_behavior(TransactionBehavior::Immediate)?;
        insert_decision(&tx, adapter, d)?;
        let paths: Vec<String> = {
            let mut st = tx.prepare_cached(
                "SELECT path FROM checkpoints WHERE adapter = ?1 AND lineage = ?2 AND version > ?3",
            )?;
            let rows = st.query_map(
                params![adapter, d.lineage as i64, d.to_version as i64],
                |r| r.get(0),
            )?;
            rows.collect::<Result<_, _>>()?
        };
        tx.execute(
            "DELETE FROM checkpoints WHERE adapter = ?1 AND lineage = ?2 AND version > ?3",
            params![adapter, d.lineage as i64, d.to_version as i64],
        )?;
        tx.commit()?;
        Ok(paths)
    }

    pub fn record_decision(&self, adapter: &str, d: &Decision) -> Result<(), LogError> {
        let c = self.conn()?;
        insert_decision(&c, adapter, d)
    }

    /// The newest `limit` steps of `adapter` (any lineage), oldest first: (lineage, version,
    /// Unix seconds, report JSON).
    pub fn steps(&self, adapter: &str, limit: usize) -> Result<Vec<StepRow>, LogError> {
        let c = self.conn()?;
        let mut st = c.prepare_cached(
            "SELECT lineage, version, created, stats FROM steps WHERE adapter = ?1
             ORDER BY created DESC, version DESC LIMIT ?2",
        )?;
        let rows = st.query_map(params![adapter, limit as i64], |r| {
            Ok((
                r.get::<_, i64>(0)? as u64,
                r.get::<_, i64>(1)? as u64,
                r.get(2)?,
                r.get(3)?,
            ))
        })?;
        let mut v: Vec<StepRow> = rows.collect::<Result<_, _>>()?;
        v.reverse();
        Ok(v)
    }

    pub fn decisions(&self, adapter: &str, limit: usize) -> Result<Vec<Decision>, LogError> {
        let c = self.conn()?;
        let mut st = c.prepare_cached(
            "SELECT lineage, decision, reason, from_version, to_version, evidence, paused, created
             FROM decisions WHERE adapter = ?1 ORDER BY id DESC LIMIT ?2",
        )?;
        let rows = st.query_map(params![adapter, limit as i64], |r| {
            Ok(Decision {
                lineage: r.get::<_, i64>(0)? as u64,
                decision: r.get(1)?,
                reason: r.get(2)?,
                from_version: r.get::<_, i64>(3)? as u64,
                to_version: r.get::<_, i64>(4)? as u64,
                evidence: r.get(5)?,
                paused: r.get(6)?,
                created: r.get(7)?,
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }
}

fn insert_decision(c: &rusqlite::Connection, adapter: &str, d: &Decision) -> Result<(), LogError> {
    c.execute(
        "INSERT INTO decisions (adapter, lineage, decision, reason, from_version, to_version,
                                evidence, paused, created)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
        params![
            adapter,
            d.lineage as i64,
            d.decision,
            d.reason,
            d.from_version as i64,
            d.to_version as i64,
            d.evidence,
            d.paused,
            now_secs()
        ],
    )?;
    Ok(())
}
