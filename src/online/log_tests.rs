//! The SQLite log's own tests: a database gone under it, and migrations from older schemas (what
//! every store promises is tested on both stores by tests/rollout_store.rs).

use super::*;

fn open(_: &str) -> Result<(), Refusal> {
    Ok(())
}

fn rec(id: &str, choice: u32, key: &str) -> CompletionRecord {
    CompletionRecord {
        id: id.into(),
        choice,
        adapter: "a".into(),
        version: 3,
        group_id: format!("req:{id}"),
        group_size: 2,
        prompt: vec![1, 2, 3],
        completion: vec![4, 5],
        logprobs: vec![-0.5, -1.25],
        temperature: 1.0,
        policy_sampled: true,
        params: "{}".into(),
        finish_reason: "stop".into(),
        key: key.into(),
        episode: None,
        forced: vec![1],
    }
}

fn reward(id: &str, choice: u32, r: f64) -> Reward {
    Reward {
        id: id.into(),
        choice,
        reward: r,
    }
}

#[test]
fn a_deleted_or_truncated_database_is_noticed_and_stays_unusable() {
    for how in ["delete", "truncate", "replace"] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log.db");
        let log = SqliteLog::open(&path).unwrap();
        log.log_completions(&[rec("c1", 0, "k")]).unwrap();
        match how {
            "delete" => std::fs::remove_file(&path).unwrap(),
            "truncate" => std::fs::File::create(&path).map(drop).unwrap(),
            _ => {
                std::fs::remove_file(&path).unwrap();
                drop(SqliteLog::open(&path).unwrap());
            }
        }
        let r = log.post_rewards(&[reward("c1", 0, 1.0)], "k", false, &open);
        assert!(
            matches!(r, Err(FeedbackError::Log(LogError::Broken(_)))),
            "{how}: {r:?}"
        );
        assert!(matches!(
            log.log_completions(&[rec("c3", 0, "k")]),
            Err(LogError::Broken(_))
        ));
        assert!(log.check().is_err(), "{how}");
    }
}

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
