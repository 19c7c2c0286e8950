//! The rollout log's unit tests: rewards, groups, checkpoints and a database gone under it.

use super::*;
use crate::online::lineage::Checkpoint;

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
fn rewards_are_checked_recorded_once_and_survive_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sub/log.db");
    let log = RolloutLog::open(&path).unwrap();
    log.log_completions(&[rec("c1", 0, "k1"), rec("c1", 1, "k1")])
        .unwrap();
    assert!(log
        .post_rewards(&[reward("c1", 0, 1.0)], "k1", false, &open)
        .unwrap());
    // A repeat of the same reward is not new; another value conflicts.
    assert!(!log
        .post_rewards(&[reward("c1", 0, 1.0)], "k1", false, &open)
        .unwrap());
    assert!(matches!(
        log.post_rewards(&[reward("c1", 0, 0.5)], "k1", false, &open),
        Err(FeedbackError::Conflict { .. })
    ));
    assert!(matches!(
        log.post_rewards(&[reward("c1", 1, 0.0)], "k2", false, &open),
        Err(FeedbackError::Forbidden { .. })
    ));
    // All or none: the unknown second item leaves the first unrecorded.
    assert!(matches!(
        log.post_rewards(
            &[reward("c1", 1, 0.0), reward("c9", 0, 1.0)],
            "k1",
            false,
            &open
        ),
        Err(FeedbackError::NotFound { index: 1, .. })
    ));
    assert_eq!(log.feedback("c1").unwrap()[1].1.reward, None);
    assert!(log
        .post_rewards(&[reward("c1", 1, 0.0)], "k2", true, &open)
        .unwrap());
    let groups = log.pending_groups("a").unwrap();
    assert_eq!(groups.len(), 1);
    let g = &groups[0];
    assert_eq!((g.group_id.as_str(), g.group_size), ("req:c1", 2));
    assert_eq!(g.members[1].completion, vec![4, 5]);
    assert_eq!(g.members[1].logprobs, vec![-0.5, -1.25]);
    assert_eq!(g.members[1].forced, vec![1]);
    let l = log.begin_lineage("a", 3).unwrap();
    let cp = Checkpoint {
        step: 1,
        version: 4,
        path: "adapters/a/v-00000004".into(),
    };
    log.commit_step("a", l.id, &cp, "{}", &[("c1".into(), 0), ("c1".into(), 1)])
        .unwrap();
    drop(log);
    let log = RolloutLog::open(&path).unwrap();
    assert!(log.pending_groups("a").unwrap().is_empty());
    assert_eq!(log.active_lineage("a").unwrap(), Some(l));
    assert_eq!(log.checkpoints(l.id).unwrap(), vec![cp]);
    assert_eq!(log.max_version("a").unwrap(), 4);
    let info = log.feedback("c1").unwrap();
    assert_eq!(info[0].1.reward, Some(1.0));
    assert_eq!(info[0].1.trained_step, Some(1));
    // The key is stored hashed, and the same key still owns its completions.
    assert_ne!(info[0].0, "k1");
    assert!(!log
        .post_rewards(&[reward("c1", 0, 1.0)], "k1", false, &open)
        .unwrap());
}

#[test]
fn a_refused_adapter_records_nothing_of_the_request() {
    let dir = tempfile::tempdir().unwrap();
    let log = RolloutLog::open(&dir.path().join("log.db")).unwrap();
    let mut other = rec("c2", 0, "k");
    other.adapter = "b".into();
    log.log_completions(&[rec("c1", 0, "k"), other]).unwrap();
    let only_a = |a: &str| {
        if a == "a" {
            Ok(())
        } else {
            Err(Refusal::Failed("broken".into()))
        }
    };
    let r = log.post_rewards(
        &[reward("c1", 0, 1.0), reward("c2", 0, 1.0)],
        "k",
        false,
        &only_a,
    );
    assert!(
        matches!(r, Err(FeedbackError::Refused { index: 1, .. })),
        "{r:?}"
    );
    assert_eq!(log.feedback("c1").unwrap()[0].1.reward, None);
}

#[test]
fn a_deleted_or_truncated_database_is_noticed_and_stays_unusable() {
    for how in ["delete", "truncate", "replace"] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log.db");
        let log = RolloutLog::open(&path).unwrap();
        log.log_completions(&[rec("c1", 0, "k")]).unwrap();
        match how {
            "delete" => std::fs::remove_file(&path).unwrap(),
            "truncate" => std::fs::File::create(&path).map(drop).unwrap(),
            _ => {
                std::fs::remove_file(&path).unwrap();
                drop(RolloutLog::open(&path).unwrap());
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
    let log = RolloutLog::open(&path).unwrap();
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

/// An episode's turns (completions tagged with it) take one reward at once, idempotently; a
/// turn logged after it takes it too; another key's episode of the same name is not found; a
/// turn is not rewarded on its own.
#[test]
fn an_episode_is_rewarded_once_for_all_its_turns() {
    let dir = tempfile::tempdir().unwrap();
    let log = RolloutLog::open(&dir.path().join("f.db")).unwrap();
    let turn = |id: &str, key: &str| CompletionRecord {
        episode: Some("task-1".into()),
        group_id: "key:x:g".into(),
        group_size: 0,
        ..rec(id, 0, key)
    };
    log.log_completions(&[turn("t1", "k")]).unwrap();
    log.log_completions(&[turn("t2", "k")]).unwrap();
    log.log_completions(&[turn("o1", "other")]).unwrap();
    assert!(matches!(
        log.post_rewards(&[reward("t1", 0, 1.0)], "k", false, &open),
        Err(FeedbackError::EpisodeTurn { .. })
    ));
    assert!(log.post_episode_reward("task-1", 0.5, "k", &open).unwrap());
    assert!(!log.post_episode_reward("task-1", 0.5, "k", &open).unwrap());
    assert!(matches!(
        log.post_episode_reward("task-1", 1.0, "k", &open),
        Err(FeedbackError::EpisodeConflict { .. })
    ));
    assert!(matches!(
        log.post_episode_reward("nope", 1.0, "k", &open),
        Err(FeedbackError::EpisodeNotFound { .. })
    ));
    // A late turn takes the stored reward.
    log.log_completions(&[turn("t3", "k")]).unwrap();
    let (turns, r) = log.episode_feedback("task-1", "k").unwrap();
    assert_eq!(r, Some(0.5));
    let ids: Vec<&str> = turns.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(ids, ["t1", "t2", "t3"]);
    assert!(turns.iter().all(|(_, c)| c.reward == Some(0.5)));
    // The other key's same-named episode is its own and still unrewarded.
    let (theirs, r) = log.episode_feedback("task-1", "other").unwrap();
    assert_eq!((theirs.len(), r), (1, None));
    let g = log.pending_groups("a").unwrap();
    let members: Vec<_> = g.iter().flat_map(|g| g.members.iter()).collect();
    assert!(members.iter().all(|m| m.episode.is_some()));
}
