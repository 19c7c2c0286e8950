//! The SQLite log's own tests: migrations from older schemas (what every store promises, and a
//! SQLite file gone under the log, are tested by tests/rollout_store.rs).

use super::*;

#[test]
fn a_database_of_the_first_schema_migrates_to_lineages_and_relative_paths() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("flywheel.db");
    {
        // What the first schema's server left: checkpoints under absolute paths.
        let c = Connection::open(&path).unwrap();
        c.execute_batch(MIGRATIONS[0]).unwrap();
        c.pragma_update(None, "user_version", 1).unwrap();
        for (step, version) in [(1, 2), (2, 3)] {
            c.execute(
                "INSERT INTO checkpoints (adapter, step, version, path, created, stats)
                 VALUES ('a', ?1, ?2, ?3, 0, '{}')",
                params![
                    step,
                    version,
                    format!("/somewhere/else/data/adapters/a/step-{step:08}")
                ],
            )
            .unwrap();
        }
    }
    let log = SqliteLog::open(&path).unwrap();
    let l = log
        .active_lineage("a")
        .unwrap()
        .expect("a lineage for the old checkpoints");
    let cps = log.checkpoints(l.id).unwrap();
    let got: Vec<(u64, u64, &str)> = cps
        .iter()
        .map(|c| (c.version, c.step, c.path.as_str()))
        .collect();
    assert_eq!(
        got,
        vec![
            (3, 2, "adapters/a/step-00000002"),
            (2, 1, "adapters/a/step-00000001")
        ]
    );
    assert_eq!(log.max_version("a").unwrap(), 3);
    assert!(log.active_lineage("b").unwrap().is_none());
}

/// Several openers of one new database at once (a trainer and a replica, or servers sharing a
/// data directory) migrate it once between them and share one key salt.
#[test]
fn openers_of_one_new_database_at_once_migrate_it_once_and_share_the_salt() {
    for _ in 0..5 {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("flywheel.db");
        let barrier = std::sync::Barrier::new(6);
        let salts: Vec<String> = std::thread::scope(|s| {
            let opened: Vec<_> = (0..6)
                .map(|_| {
                    s.spawn(|| {
                        barrier.wait();
                        SqliteLog::open(&path).map(|l| l.salt.clone())
                    })
                })
                .collect();
            opened
                .into_iter()
                .map(|h| h.join().unwrap().expect("every opener opens"))
                .collect()
        });
        assert!(salts.iter().all(|s| s == &salts[0]), "{salts:?}");
        let c = Connection::open(&path).unwrap();
        let v: usize = c
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(v, MIGRATIONS.len());
    }
}
