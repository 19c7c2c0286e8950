//! Opening the rollout store the configuration names (`online.rollout_store`).

use super::postgres::PgLog;
use super::sqlite::SqliteLog;
use super::{redact, RolloutStore};
use std::path::Path;
use std::sync::Arc;

/// The store `spec` names: a `postgres://` or `postgresql://` URL, or None for SQLite at
/// `data_dir/flywheel.db`.
pub fn open_store(spec: Option<&str>, data_dir: &Path) -> anyhow::Result<Arc<dyn RolloutStore>> {
    match spec {
        Some(url) if url.starts_with("postgres://") || url.starts_with("postgresql://") => {
            Ok(Arc::new(PgLog::connect(url)?))
        }
        Some(other) => anyhow::bail!(
            "rollout store '{}': expected a postgres:// URL (or none, for SQLite in the data \
             directory)",
            redact(other)
        ),
        None => Ok(Arc::new(SqliteLog::open(&data_dir.join("flywheel.db"))?)),
    }
}
