//! Rollout stores for tests: the same test on a fresh SQLite file and on a fresh PostgreSQL
//! database (when installed), each reopened at will (a restart of the process that holds it).

use super::pg::Pg;
use flywheel::online::store::postgres::PgLog;
use flywheel::online::store::sqlite::SqliteLog;
use flywheel::online::store::RolloutStore;
use std::sync::Arc;

/// Where a store lives: `open()` opens it again (a restart of the process that holds it).
pub enum Place {
    Sqlite(tempfile::TempDir),
    Postgres(String),
}

impl Place {
    pub fn open(&self) -> Arc<dyn RolloutStore> {
        match self {
            Place::Sqlite(d) => Arc::new(SqliteLog::open(&d.path().join("flywheel.db")).unwrap()),
            Place::Postgres(url) => Arc::new(PgLog::connect(url).unwrap()),
        }
    }
}

/// Run `test` on a fresh SQLite store and on a fresh PostgreSQL database (when installed).
pub fn on_both(test: impl Fn(&str, &Place)) {
    test("sqlite", &Place::Sqlite(tempfile::tempdir().unwrap()));
    if let Some(pg) = Pg::start() {
        test("postgres", &Place::Postgres(pg.fresh_db()));
    }
}
