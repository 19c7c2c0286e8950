//! The rollout store's promises, run against both implementations: SQLite (the default, one
//! file) and PostgreSQL (several replicas and a trainer; a throwaway server per test, skipped with
//! a message where PostgreSQL is not installed). Rewards checked, recorded once, all or none;
//! episodes; lineages and checkpoints; racing writers; and, on PostgreSQL, replicas migrating
//! together, notifications and a database restart (rollbacks, step history and the sessions and
//! runs clients drive: tests/rollout_store_training.rs). Whole servers on PostgreSQL:
//! tests/replicas.rs.

mod common;

use common::pg::Pg;
use common::stores::on_both;
use flywheel::online::store::postgres::PgLog;
use flywheel::online::store::records::{
    Accepting, CompletionRecord, FeedbackError, LogError, Reward,
};
use flywheel::online::store::records::{Checkpoint, VersionSpan};
use flywheel::online::store::sqlite::SqliteLog;
use flywheel::online::store::{Announcement, RolloutStore};
use std::sync::Arc;

/// Every adapter these tests log completions of learns.
fn running() -> Accepting {
    Accepting::running(["a", "b"])
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
        sampling: vec![],
        reward: None,
        switches: vec![],
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
    on_both(|kind, place| {
        let log = place.open();
        assert_eq!(log.kind(), kind);
        log.log_completions(&[rec("c1", 0, "k1"), rec("c1", 1, "k1")])
            .unwrap();
        assert!(log
            .post_rewards(&[reward("c1", 0, 1.0)], "k1", false, &running())
            .unwrap());
        // A repeat of the same reward is not new; another value conflicts.
        assert!(!log
            .post_rewards(&[reward("c1", 0, 1.0)], "k1", false, &running())
            .unwrap());
        assert!(matches!(
            log.post_rewards(&[reward("c1", 0, 0.5)], "k1", false, &running()),
            Err(FeedbackError::Conflict { .. })
        ));
        assert!(matches!(
            log.post_rewards(&[reward("c1", 1, 0.0)], "k2", false, &running()),
            Err(FeedbackError::Forbidden { .. })
        ));
        // All or none: the unknown second item leaves the first unrecorded.
        assert!(matches!(
            log.post_rewards(
                &[reward("c1", 1, 0.0), reward("c9", 0, 1.0)],
                "k1",
                false,
                &running()
            ),
            Err(FeedbackError::NotFound { index: 1, .. })
        ));
        assert_eq!(log.feedback("c1").unwrap()[1].1.reward, None);
        assert!(log
            .post_rewards(&[reward("c1", 1, 0.0)], "k2", true, &running())
            .unwrap());
        let groups = log.pending_groups("a").unwrap();
        assert_eq!(groups.len(), 1, "{kind}");
        let g = &groups[0];
        assert_eq!((g.group_id.as_str(), g.group_size), ("req:c1", 2));
        assert_eq!(g.members[1].prompt, vec![1, 2, 3]);
        assert_eq!(g.members[1].completion, vec![4, 5]);
        assert_eq!(g.members[1].logprobs, vec![-0.5, -1.25]);
        assert_eq!(g.members[1].forced, vec![1]);
        assert_eq!(g.members[0].reward, Some(1.0));
        let l = log.begin_lineage("a", 3).unwrap();
        let cp = Checkpoint {
            step: 1,
            version: 4,
            path: "adapters/a/v-00000004".into(),
        };
        log.commit_step("a", l.id, &cp, "{}", &[("c1".into(), 0), ("c1".into(), 1)])
            .unwrap();
        drop(log);
        let log = place.open();
        assert!(log.pending_groups("a").unwrap().is_empty(), "{kind}");
        assert_eq!(log.active_lineage("a").unwrap(), Some(l));
        assert_eq!(log.checkpoints(l.id).unwrap(), vec![cp.clone()]);
        assert_eq!(log.max_version("a").unwrap(), 4);
        let info = log.feedback("c1").unwrap();
        assert_eq!(info[0].1.reward, Some(1.0));
        assert_eq!(info[0].1.trained_step, Some(1));
        // The key is stored hashed, and the same key still owns its completions.
        assert_ne!(info[0].0, "k1");
        assert!(!log
            .post_rewards(&[reward("c1", 0, 1.0)], "k1", false, &running())
            .unwrap());
        // A step that would consume a member twice is refused whole: no checkpoint recorded.
        let cp2 = Checkpoint {
            step: 2,
            version: 5,
            path: "adapters/a/v-00000005".into(),
        };
        let r = log.commit_step("a", l.id, &cp2, "{}", &[("c1".into(), 0)]);
        assert!(matches!(r, Err(LogError::Conflict(_))), "{kind}: {r:?}");
        assert_eq!(log.checkpoints(l.id).unwrap(), vec![cp]);
        // Lineages: a new one ends the old, whose checkpoints retire.
        let l2 = log.begin_lineage("a", 10).unwrap();
        assert_ne!(l2.id, l.id);
        assert_eq!(log.active_lineage("a").unwrap(), Some(l2));
        assert_eq!(log.max_version("a").unwrap(), 10);
        assert_eq!(
            log.retire_checkpoints("a", 2).unwrap(),
            vec!["adapters/a/v-00000004".to_string()]
        );
        log.end_lineage("a").unwrap();
        assert_eq!(log.active_lineage("a").unwrap(), None);
        // Settled rows are pruned; unsettled ones stay.
        log.log_completions(&[rec("c2", 0, "k1")]).unwrap();
        assert_eq!(log.prune(-1.0, 1_000).unwrap(), 2, "{kind}");
        assert_eq!(log.feedback("c2").unwrap().len(), 1);
        assert!(log.check().is_ok());
    });
}

#[test]
fn a_refused_adapter_records_nothing_of_the_request() {
    on_both(|kind, place| {
        let log = place.open();
        let mut other = rec("c2", 0, "k");
        other.adapter = "b".into();
        log.log_completions(&[rec("c1", 0, "k"), other]).unwrap();
        let only_a = Accepting::new([("a".into(), Ok(())), ("b".into(), Err("broken".into()))]);
        let r = log.post_rewards(
            &[reward("c1", 0, 1.0), reward("c2", 0, 1.0)],
            "k",
            false,
            &only_a,
        );
        assert!(
            matches!(r, Err(FeedbackError::Refused { index: 1, .. })),
            "{kind}: {r:?}"
        );
        assert_eq!(log.feedback("c1").unwrap()[0].1.reward, None);
        // Dropped members are not pending.
        log.post_rewards(&[reward("c1", 0, 1.0)], "k", false, &running())
            .unwrap();
        assert_eq!(log.pending_groups("a").unwrap().len(), 1);
        log.drop_members(&[("c1".into(), 0)], "stale").unwrap();
        assert!(log.pending_groups("a").unwrap().is_empty());
        assert_eq!(
            log.feedback("c1").unwrap()[0].1.dropped.as_deref(),
            Some("stale")
        );
    });
}

/// An episode's turns (completions tagged with it) take one reward at once, idempotently; a
/// turn logged after it takes it too; another key's episode of the same name is not found; a
/// turn is not rewarded on its own.
#[test]
fn an_episode_is_rewarded_once_for_all_its_turns() {
    on_both(|kind, place| {
        let log = place.open();
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
            log.post_rewards(&[reward("t1", 0, 1.0)], "k", false, &running()),
            Err(FeedbackError::EpisodeTurn { .. })
        ));
        assert!(log
            .post_episode_reward("task-1", 0.5, "k", &running())
            .unwrap());
        assert!(!log
            .post_episode_reward("task-1", 0.5, "k", &running())
            .unwrap());
        assert!(matches!(
            log.post_episode_reward("task-1", 1.0, "k", &running()),
            Err(FeedbackError::EpisodeConflict { .. })
        ));
        assert!(matches!(
            log.post_episode_reward("nope", 1.0, "k", &running()),
            Err(FeedbackError::EpisodeNotFound { .. })
        ));
        // A late turn takes the stored reward.
        log.log_completions(&[turn("t3", "k")]).unwrap();
        let (turns, r) = log.episode_feedback("task-1", "k").unwrap();
        assert_eq!(r, Some(0.5));
        let ids: Vec<&str> = turns.iter().map(|(id, _)| id.as_str()).collect();
        assert_eq!(ids, ["t1", "t2", "t3"], "{kind}");
        assert!(turns.iter().all(|(_, c)| c.reward == Some(0.5)));
        assert_eq!(
            log.last_turn("task-1", "k").unwrap(),
            Some((vec![1, 2, 3], vec![4, 5]))
        );
        // The other key's same-named episode is its own and still unrewarded.
        let (theirs, r) = log.episode_feedback("task-1", "other").unwrap();
        assert_eq!((theirs.len(), r), (1, None));
        let g = log.pending_groups("a").unwrap();
        let members: Vec<_> = g.iter().flat_map(|g| g.members.iter()).collect();
        // The group (one client group of both keys) holds every turn.
        assert_eq!(members.len(), 4, "{kind}");
        assert!(members.iter().all(|m| m.episode.is_some()));
        // Trained: a turn logged after that is dropped, its reward not used again.
        let l = log.begin_lineage("a", 1).unwrap();
        let cp = Checkpoint {
            step: 1,
            version: 2,
            path: "adapters/a/v-00000002".into(),
        };
        let consumed: Vec<(String, u32)> = ["t1", "t2", "t3"]
            .iter()
            .map(|t| (t.to_string(), 0))
            .collect();
        log.commit_step("a", l.id, &cp, "{}", &consumed).unwrap();
        log.log_completions(&[turn("t4", "k")]).unwrap();
        let (turns, _) = log.episode_feedback("task-1", "k").unwrap();
        let t4 = &turns.last().unwrap().1;
        assert_eq!(t4.dropped.as_deref(), Some("episode_trained"), "{kind}");
        let g = log.pending_groups("a").unwrap();
        assert!(
            g.iter().flat_map(|g| &g.members).all(|m| m.id != "t4"),
            "{kind}"
        );
    });
}

/// Writers racing through separate handles (two replicas; two trainers): for each completion
/// exactly one of two different rewards wins and the other is a conflict; of two steps consuming
/// the same members exactly one is recorded; turns logged while their episode is rewarded all
/// end up rewarded.
#[test]
fn racing_writers_record_each_thing_once() {
    on_both(|kind, place| {
        let (a, b) = (place.open(), place.open());
        let n = 24;
        let recs: Vec<_> = (0..n).map(|i| rec(&format!("r{i}"), 0, "k")).collect();
        a.log_completions(&recs).unwrap();
        let post = |log: Arc<dyn RolloutStore>, value: f64| {
            std::thread::spawn(move || {
                (0..n)
                    .map(|i| {
                        log.post_rewards(
                            &[reward(&format!("r{i}"), 0, value)],
                            "k",
                            false,
                            &running(),
                        )
                    })
                    .map(|r| match r {
                        Ok(new) => Ok(new),
                        Err(FeedbackError::Conflict { .. }) => Err(()),
                        Err(e) => panic!("{e}"),
                    })
                    .collect::<Vec<_>>()
            })
        };
        let (ra, rb) = (post(a.clone(), 1.0), post(b.clone(), 0.0));
        let (ra, rb) = (ra.join().unwrap(), rb.join().unwrap());
        for i in 0..n {
            assert!(
                matches!((&ra[i], &rb[i]), (Ok(true), Err(())) | (Err(()), Ok(true))),
                "{kind}: r{i}: {:?} {:?}",
                ra[i],
                rb[i]
            );
            let stored = a.feedback(&format!("r{i}")).unwrap()[0].1.reward;
            assert_eq!(stored, Some(if ra[i].is_ok() { 1.0 } else { 0.0 }));
        }
        // Two trainers commit steps consuming the same members: one is recorded.
        let l = a.begin_lineage("a", 3).unwrap();
        let members: Vec<(String, u32)> = (0..n).map(|i| (format!("r{i}"), 0)).collect();
        let commit = |log: Arc<dyn RolloutStore>, version: u64, members: Vec<(String, u32)>| {
            std::thread::spawn(move || {
                let cp = Checkpoint {
                    step: version,
                    version,
                    path: format!("adapters/a/v-{version}"),
                };
                log.commit_step("a", l.id, &cp, "{}", &members)
            })
        };
        let (ca, cb) = (
            commit(a.clone(), 4, members.clone()),
            commit(b.clone(), 5, members.into_iter().rev().collect()),
        );
        let (ca, cb) = (ca.join().unwrap(), cb.join().unwrap());
        assert!(
            ca.is_ok() != cb.is_ok(),
            "{kind}: exactly one step records: {ca:?} {cb:?}"
        );
        assert_eq!(a.checkpoints(l.id).unwrap().len(), 1);
        // Turns logged while their episode is rewarded: every one ends up with the reward.
        let turns = |log: Arc<dyn RolloutStore>| {
            std::thread::spawn(move || {
                for i in 0..n {
                    log.log_completions(&[CompletionRecord {
                        episode: Some("race".into()),
                        ..rec(&format!("e{i}"), 0, "k")
                    }])
                    .unwrap();
                }
            })
        };
        a.log_completions(&[CompletionRecord {
            episode: Some("race".into()),
            ..rec("e-first", 0, "k")
        }])
        .unwrap();
        let t = turns(a.clone());
        assert!(b
            .post_episode_reward("race", 0.25, "k", &running())
            .unwrap());
        t.join().unwrap();
        let (all, r) = a.episode_feedback("race", "k").unwrap();
        assert_eq!((all.len(), r), (n + 1, Some(0.25)), "{kind}");
        assert!(all.iter().all(|(_, c)| c.reward == Some(0.25)), "{kind}");
    });
}

/// Replicas starting together on an empty database migrate it once and share its key salt; a
/// committed step is heard by a listener; a restart of PostgreSQL fails the calls made while it
/// is down (nothing acknowledged), the next ones reconnect, and the listener reconnects and
/// catches up.
#[test]
fn postgres_replicas_migrate_together_and_survive_a_restart() {
    let Some(mut pg) = Pg::start() else { return };
    let url = pg.fresh_db();
    let opened: Vec<_> = (0..6)
        .map(|_| {
            let url = url.clone();
            std::thread::spawn(move || PgLog::connect(&url).map_err(|e| e.to_string()))
        })
        .collect();
    let logs: Vec<PgLog> = opened
        .into_iter()
        .map(|t| t.join().unwrap().unwrap())
        .collect();
    let h = logs[0].key_hash("k");
    assert!(logs.iter().all(|l| l.key_hash("k") == h));
    // A listener hears a step committed through another handle (LISTEN/NOTIFY).
    let heard = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let h2 = heard.clone();
    logs[1].subscribe(
        Announcement::Steps,
        Box::new(move || {
            h2.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }),
    );
    // And one that hears rewards recorded through another handle (what wakes a trainer).
    let rewards_heard = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let r2 = rewards_heard.clone();
    logs[2].subscribe(
        Announcement::Rewards,
        Box::new(move || {
            r2.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }),
    );
    let heard_now = || heard.load(std::sync::atomic::Ordering::SeqCst);
    let wait_heard = |more_than: usize| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while heard_now() <= more_than {
            assert!(std::time::Instant::now() < deadline, "not heard");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    };
    wait_heard(0); // the catch-up call once listening
    let before = heard_now();
    let l = logs[2].begin_lineage("a", 1).unwrap();
    logs[2].log_completions(&[rec("s1", 0, "k")]).unwrap();
    let cp = Checkpoint {
        step: 1,
        version: 2,
        path: "adapters/a/v2".into(),
    };
    logs[2]
        .commit_step("a", l.id, &cp, "{}", &[("s1".into(), 0)])
        .unwrap();
    wait_heard(before);
    let log = &logs[0];
    log.log_completions(&[rec("c1", 0, "k"), rec("c1", 1, "k")])
        .unwrap();
    let rewards_now = || rewards_heard.load(std::sync::atomic::Ordering::SeqCst);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while rewards_now() == 0 {
        assert!(std::time::Instant::now() < deadline, "no catch-up call");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let before = rewards_now();
    assert!(log
        .post_rewards(&[reward("c1", 0, 1.0)], "k", false, &running())
        .unwrap());
    while rewards_now() <= before {
        assert!(
            std::time::Instant::now() < deadline,
            "the reward was not announced"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    pg.stop();
    let r = log.post_rewards(&[reward("c1", 1, 0.0)], "k", false, &running());
    assert!(
        matches!(r, Err(FeedbackError::Log(LogError::Pg(_)))),
        "{r:?}"
    );
    assert!(log.check().is_err());
    let before_restart = heard_now();
    pg.restart();
    // The listener reconnects and calls once to catch up on what it may have missed.
    wait_heard(before_restart);
    // The pooled connections died with the server: the next calls reconnect.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while log.check().is_err() {
        assert!(std::time::Instant::now() < deadline, "no reconnect");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(log
        .post_rewards(&[reward("c1", 1, 0.0)], "k", false, &running())
        .unwrap());
    let info = logs[1].feedback("c1").unwrap();
    assert_eq!(
        info.iter().map(|(_, c)| c.reward).collect::<Vec<_>>(),
        vec![Some(1.0), Some(0.0)]
    );
}

/// SQLite only: its file deleted, truncated or replaced under the open log is noticed, and the
/// log stays unusable (nothing acknowledged into a file nobody reads).
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
        let r = log.post_rewards(&[reward("c1", 0, 1.0)], "k", false, &running());
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

/// A completion logged with its reward (a distilling adapter's) is rewarded at once: pending
/// for the trainer with it, and a client's other reward for it is a conflict.
#[test]
fn a_completion_logged_rewarded_is_pending_with_its_reward() {
    on_both(|kind, place| {
        let log = place.open();
        let r = CompletionRecord {
            reward: Some(0.0),
            ..rec("d1", 0, "k")
        };
        log.log_completions(&[r]).unwrap();
        let g = log.pending_groups("a").unwrap();
        assert_eq!(g.len(), 1, "{kind}");
        assert_eq!(g[0].members[0].reward, Some(0.0), "{kind}");
        assert!(g[0].members[0].rewarded_at.is_some(), "{kind}");
        let again = log.post_rewards(&[reward("d1", 0, 1.0)], "k", false, &running());
        assert!(
            matches!(again, Err(FeedbackError::Conflict { .. })),
            "{kind}"
        );
    });
}

/// A partial rollout's version switches are stored with it: the trainer reads them back with the
/// member, and the feedback route shows every span; a completion of one version shows none.
#[test]
fn a_partial_rollouts_version_spans_are_kept() {
    on_both(|kind, place| {
        let log = place.open();
        let spans = vec![
            VersionSpan {
                from_token: 1,
                version: 4,
                exact: true,
            },
            // A switch that kept the K/V: version 6's tokens are not exactly version 6's.
            VersionSpan {
                from_token: 2,
                version: 6,
                exact: false,
            },
        ];
        let r = CompletionRecord {
            switches: spans.clone(),
            completion: vec![4, 5, 6],
            logprobs: vec![-0.5, -1.25, -2.0],
            ..rec("p1", 0, "k")
        };
        log.log_completions(&[r, rec("p1", 1, "k")]).unwrap();
        assert!(log
            .post_rewards(&[reward("p1", 0, 1.0)], "k", false, &running())
            .unwrap());
        let g = log.pending_groups("a").unwrap();
        assert_eq!(g[0].members[0].version, 3, "{kind}");
        assert_eq!(g[0].members[0].switches, spans, "{kind}");
        assert!(g[0].members[1].switches.is_empty(), "{kind}");
        let info = log.feedback("p1").unwrap();
        let shown: Vec<(u32, u64, bool)> = info[0]
            .1
            .adapter_versions
            .iter()
            .flatten()
            .map(|s| (s.from_token, s.version, s.exact))
            .collect();
        assert_eq!(
            shown,
            vec![(0, 3, true), (1, 4, true), (2, 6, false)],
            "{kind}"
        );
        assert_eq!(info[1].1.adapter_versions, None, "{kind}");
        // The positions each version computed exactly, for the trainer's train = serve check.
        let m = &g[0].members[0];
        let of = |v| VersionSpan::positions_of(m.version, &m.switches, 3, v);
        assert_eq!(of(3), vec![0..1]);
        assert_eq!(of(4), vec![1..2]);
        assert!(of(6).is_empty());
        assert!(of(5).is_empty());
    });
}
