//! The rollout store's record of training decisions and of client-driven training, run against
//! both implementations (SQLite; PostgreSQL where installed): rollbacks (the checkpoints above
//! them forgotten in one transaction, their numbers still used), the steps' history, decisions;
//! the Tinker API's sessions and runs; agent sessions.

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

/// Agent sessions: found by id and by their key's hash across a reopen, with their turns (the
/// completions of their episode) and last activity; a reward writes every turn's return and the
/// state in one go (repeat: no-op; other rewards: refused); ending one drops its untrained turns
/// and refuses its reward; the open ones are listed.
#[test]
fn agent_sessions_keep_their_turns_and_are_rewarded_or_ended_once() {
    use flywheel::online::sessions::{
        principal, AgentSession, SessionRefusal, SessionReward, SessionState,
    };
    use flywheel::online::store::records::{
        episode_key, Accepting, CompletionRecord, FeedbackError,
    };
    use flywheel::online::store::SessionLookup;
    on_both(|kind, place| {
        let log = place.open();
        let new = |id: &str, gamma: f64| AgentSession {
            id: id.into(),
            key_hash: log.key_hash(&format!("fws_{id}")),
            owner: log.key_hash("owner"),
            adapter: "a".into(),
            group: "g".into(),
            gamma,
            max_turns: Some(5),
            idle_secs: 60.0,
            idle_reward: None,
            created: 100.0,
            state: SessionState::Open,
            returns: None,
            episode: episode_key(&log.key_hash(&principal(id)), id),
        };
        log.put_agent_session(&new("s1", 0.5)).unwrap();
        log.put_agent_session(&new("s2", 1.0)).unwrap();
        let turn = |id: &str, session: &str| CompletionRecord {
            id: id.into(),
            choice: 0,
            adapter: "a".into(),
            version: 1,
            group_id: "key:o:g".into(),
            group_size: 0,
            prompt: vec![1],
            completion: vec![2],
            logprobs: vec![-0.5],
            temperature: 1.0,
            policy_sampled: true,
            params: "{}".into(),
            finish_reason: "stop".into(),
            key: principal(session),
            episode: Some(session.into()),
            forced: vec![],
            sampling: vec![],
            reward: None,
            switches: vec![],
        };
        for (id, s) in [("t1", "s1"), ("t2", "s1"), ("u1", "s2")] {
            log.log_completions(&[turn(id, s)]).unwrap();
        }
        let log = place.open();
        let v = log
            .agent_session(SessionLookup::KeyHash(&log.key_hash("fws_s1")))
            .unwrap()
            .unwrap();
        assert_eq!((v.session.id.as_str(), v.turns), ("s1", 2), "{kind}");
        assert!(v.last_active > 100.0, "{kind}");
        assert_eq!(v.session.max_turns, Some(5), "{kind}");
        assert!(log
            .agent_session(SessionLookup::Id("nope"))
            .unwrap()
            .is_none());
        assert_eq!(log.open_agent_sessions().unwrap().len(), 2, "{kind}");
        let ok = Accepting::running(["a"]);
        let r = SessionReward::PerTurn(vec![0.0, 1.0]);
        assert!(log.reward_agent_session("s1", &r, &ok).unwrap(), "{kind}");
        assert!(!log.reward_agent_session("s1", &r, &ok).unwrap(), "{kind}");
        let refused = |r: Result<bool, FeedbackError>| match r {
            Err(FeedbackError::Session { why, .. }) => why,
            other => panic!("{kind}: {other:?}"),
        };
        // (A final reward with the same returns is the same reward: (0.5, 1) for γ = 0.5.)
        assert!(!log
            .reward_agent_session("s1", &SessionReward::Final(1.0), &ok)
            .unwrap());
        let bad = log.reward_agent_session("s1", &SessionReward::Final(0.5), &ok);
        assert_eq!(refused(bad), SessionRefusal::Conflict, "{kind}");
        let (turns, _) = log.episode_feedback("s1", &principal("s1")).unwrap();
        let rewards: Vec<Option<f64>> = turns.iter().map(|(_, c)| c.reward).collect();
        assert_eq!(rewards, [Some(0.5), Some(1.0)], "{kind}");
        let v = log.agent_session(SessionLookup::Id("s1")).unwrap().unwrap();
        assert_eq!(v.session.state, SessionState::Rewarded, "{kind}");
        assert_eq!(v.session.returns, Some(vec![0.5, 1.0]), "{kind}");
        // Ended: its turn dropped, its reward refused, ending again a no-op.
        assert!(log.end_agent_session("s2").unwrap(), "{kind}");
        assert!(!log.end_agent_session("s2").unwrap(), "{kind}");
        assert!(!log.end_agent_session("s1").unwrap(), "{kind}");
        let (turns, _) = log.episode_feedback("s2", &principal("s2")).unwrap();
        assert_eq!(
            turns[0].1.dropped.as_deref(),
            Some("session_ended"),
            "{kind}"
        );
        let r = log.reward_agent_session("s2", &SessionReward::Final(1.0), &ok);
        assert_eq!(refused(r), SessionRefusal::Ended, "{kind}");
        let r = log.reward_agent_session("s9", &SessionReward::Final(1.0), &ok);
        assert_eq!(refused(r), SessionRefusal::NotFound, "{kind}");
        assert!(log.open_agent_sessions().unwrap().is_empty(), "{kind}");
    });
}
