//! The rollout store's record of training decisions and of client-driven training, run against
//! both implementations (SQLite; PostgreSQL where installed): rollbacks (the checkpoints above
//! them forgotten in one transaction, their numbers still used), the steps' history, decisions;
//! the Tinker API's sessions and runs.

mod common;

use common::stores::on_both;
use flywheel::online::store::records::{Checkpoint, Decision, LogError, RunRecord, SessionRecord};

/// A rollback is recorded with the checkpoints above its target forgotten in one go (their
/// paths returned); the numbers it rolled back from still count as used; the steps' history
/// keeps every step; decisions read back newest first, across a reopen.
#[test]
fn a_rollback_forgets_the_checkpoints_above_it_and_keeps_its_numbers() {
    on_both(|kind, place| {
        let log = place.open();
        let l = log.begin_lineage("a", 1).unwrap();
        for v in 1..=4u64 {
            let cp = Checkpoint {
                version: v,
                step: v,
                path: format!("adapters/a/v-{v}"),
            };
            log.commit_step("a", l.id, &cp, "{}", &[]).unwrap();
        }
        let d = |decision: &str, from: u64, to: u64| Decision {
            lineage: l.id,
            decision: decision.into(),
            reason: "reward_drop".into(),
            from_version: from,
            to_version: to,
            evidence: "{\"drop\": 0.5}".into(),
            paused: true,
            created: 0.0,
        };
        let mut gone = log.rollback("a", &d("rollback", 9, 2)).unwrap();
        gone.sort();
        assert_eq!(gone, ["adapters/a/v-3", "adapters/a/v-4"], "{kind}");
        let left: Vec<u64> = log
            .checkpoints(l.id)
            .unwrap()
            .iter()
            .map(|c| c.version)
            .collect();
        assert_eq!(left, [2, 1], "{kind}");
        assert_eq!(log.max_version("a").unwrap(), 9, "{kind}");
        // The steps' history keeps the steps rolled back (the dashboard shows them).
        let steps: Vec<u64> = log.steps("a", 10).unwrap().iter().map(|s| s.1).collect();
        assert_eq!(steps, [1, 2, 3, 4], "{kind}");
        let newest: Vec<u64> = log.steps("a", 2).unwrap().iter().map(|s| s.1).collect();
        assert_eq!(newest, [3, 4], "{kind}");
        log.record_decision("a", &d("resume", 2, 2)).unwrap();
        let got = place.open().decisions("a", 10).unwrap();
        assert_eq!(
            got.iter().map(|x| x.decision.as_str()).collect::<Vec<_>>(),
            ["resume", "rollback"],
            "{kind}"
        );
        assert_eq!((got[1].from_version, got[1].to_version), (9, 2), "{kind}");
        assert!(got[1].created > 0.0, "{kind}");
        assert!(log.decisions("b", 10).unwrap().is_empty(), "{kind}");
    });
}

/// The sessions and runs clients drive (the Tinker API): kept across a reopen, a run's id taken
/// once, its state moved forward with the folder it replaces returned (and its pending count
/// cleared), and a session's end forgetting its runs in one go, returning their folders.
#[test]
fn client_sessions_and_runs_are_kept_moved_and_forgotten_together() {
    on_both(|kind, place| {
        let log = place.open();
        let session = |id: &str| SessionRecord {
            id: id.into(),
            owner: "o".into(),
            info: "{\"tags\":[]}".into(),
            created: 1.0,
        };
        let run = |id: &str, session: &str| RunRecord {
            id: id.into(),
            session: session.into(),
            owner: "o".into(),
            info: "{}".into(),
            state: format!("runs/{id}/s-0"),
            step: 0,
            pending: 0,
        };
        log.put_session(&session("s1")).unwrap();
        log.put_session(&session("s2")).unwrap();
        log.put_run(&run("s1:train:0", "s1")).unwrap();
        log.put_run(&run("s1:train:1", "s1")).unwrap();
        log.put_run(&run("s2:train:0", "s2")).unwrap();
        assert!(
            matches!(
                log.put_run(&run("s1:train:0", "s1")),
                Err(LogError::Conflict(_))
            ),
            "{kind}"
        );
        log.set_run_pending("s1:train:0", 3).unwrap();
        let log = place.open();
        let (sessions, runs) = log.open_sessions().unwrap();
        assert_eq!(sessions, [session("s1"), session("s2")], "{kind}");
        assert_eq!(runs.len(), 3, "{kind}");
        assert_eq!(runs[0].pending, 3, "{kind}");
        let old = log
            .set_run_state("s1:train:0", "runs/s1:train:0/s-1", 7)
            .unwrap();
        assert_eq!(old, "runs/s1:train:0/s-0", "{kind}");
        assert!(log.set_run_state("nobody", "x", 1).is_err(), "{kind}");
        let (_, runs) = log.open_sessions().unwrap();
        assert_eq!(
            (runs[0].state.as_str(), runs[0].step, runs[0].pending),
            ("runs/s1:train:0/s-1", 7, 0),
            "{kind}"
        );
        let mut gone = log.end_sessions(&["s1".to_string()]).unwrap();
        gone.sort();
        assert_eq!(
            gone,
            ["runs/s1:train:0/s-1", "runs/s1:train:1/s-0"],
            "{kind}"
        );
        let (sessions, runs) = place.open().open_sessions().unwrap();
        assert_eq!(sessions, [session("s2")], "{kind}");
        assert_eq!(runs, [run("s2:train:0", "s2")], "{kind}");
    });
}
