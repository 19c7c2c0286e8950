//! Learning you can leave on, over HTTP on a tiny model: the reward guard catches rewards that
//! collapse and rolls back with nobody watching (serving returns to the last good version, the
//! trainer's optimizer with it, training paused), every decision explained in the status, the
//! metrics and the store; what rolled-back versions sampled never trains; a restart keeps the
//! decision and the pause; a manual rollback checks its version, and a resume is recorded.

mod common;

use common::online::*;
use common::server::*;
use common::write_tiny;
use serde_json::{json, Value};

/// Adapter `g` (LoRA r=4) with a reward guard of window 2, rewards in [0, 1], any staleness.
fn guarded() -> String {
    let learn = "[[learn]]\nname = \"g\"\nmethod = \"lora\"\nlr = 0.01\nlora_r = 4\n\
                 guard_window = 2\n";
    format!(
        "{}\n{learn}",
        config("reward_min = 0.0\nreward_max = 1.0\nmax_off_policy_steps = 1000")
    )
}

/// Reward the 4 choices of completion `id` with `rewards`.
fn reward_group(c: &Client, id: &str, rewards: [f64; 4]) {
    let items: Vec<Value> = rewards
        .iter()
        .enumerate()
        .map(|(i, &x)| json!({"id": id, "choice": i, "reward": x}))
        .collect();
    let f = call(c, "POST", "/v1/feedback", Some(&Value::Array(items)), USER);
    assert_eq!(f.status, 202, "{}", f.body_text());
}

/// Sample a group of 4 through `g`, reward it `rewards`, wait for the step that trains it (or
/// a new decision): the status after.
fn step(c: &Client, rewards: [f64; 4]) -> Value {
    let before = status(c, "g");
    let r = sample(c, "g", 4, 3, USER);
    reward_group(c, r["id"].as_str().unwrap(), rewards);
    wait_status(c, "g", 60, |s| {
        s["steps"] != before["steps"] || s["last_decision"] != before["last_decision"]
    })
}

#[test]
fn a_collapsing_reward_is_rolled_back_explained_and_kept_across_a_restart() {
    let (dir, path) = write_tiny(&spec());
    let data = dir.path().join("data");
    let s = start_learning(&path, &data, &guarded(), &[]);
    let c = &s.client;
    let first = status(c, "g")["version"].as_u64().unwrap();
    let good = [0.8, 1.0, 0.9, 1.0];
    let bad = [0.0, 0.1, 0.2, 0.0];
    let mut versions = vec![first];
    for _ in 0..2 {
        let st = step(c, good);
        versions.push(st["version"].as_u64().unwrap());
        assert!(st["last_decision"].is_null(), "{st}");
    }
    // The reward collapses: the first bad window's step keeps (one window of evidence)...
    let st = step(c, bad);
    assert!(st["last_decision"].is_null(), "{st}");
    let bad_version = st["version"].as_u64().unwrap();
    // A group sampled by that version, rewarded only later: it never trains.
    let late = sample(c, "g", 4, 3, USER);
    assert_eq!(late["adapter_version"], bad_version);
    // ... the second completes it: rolled back to the newest version whose samples were
    // rewarded well (the first bad step trained on samples of the version before it).
    let st = step(c, bad);
    let d = &st["last_decision"];
    assert_eq!(d["decision"], "rollback", "{st}");
    assert_eq!(d["reason"], "reward_drop", "{st}");
    assert_eq!(d["to_version"], versions[1], "{st}");
    assert!(d["from_version"].as_u64().unwrap() > bad_version, "{st}");
    assert_eq!(d["paused"], true);
    let evidence: Value = serde_json::from_str(d["evidence"].as_str().unwrap()).unwrap();
    assert!(
        evidence["drop"].as_f64().unwrap() > evidence["threshold"].as_f64().unwrap(),
        "{evidence}"
    );
    assert_eq!(st["state"], "paused");
    assert_eq!(st["version"], versions[1]);
    let rolled_from = d["from_version"].as_u64().unwrap();
    // Serving is back on that version: every response names it.
    let r = sample(c, "g", 2, 2, USER);
    assert_eq!(r["adapter_version"], versions[1], "{r}");
    assert_eq!(
        s.metric(
            r#"flywheel_promotion_decisions_total{adapter="g",decision="rollback",reason="reward_drop"}"#
        ),
        1.0
    );
    // A manual rollback names what it cannot do.
    for (body, code) in [
        (json!({"version": versions[2]}), 400),
        (json!({"version": 999}), 400),
        (json!({"versions": 1}), 400),
    ] {
        let r = call(c, "POST", "/v1/adapters/g/rollback", Some(&body), ADMIN);
        let param = match body.get("versions") {
            Some(_) => "versions",
            None => "version",
        };
        assert_error(&r, code, Some(param));
    }
    let r = call(
        c,
        "POST",
        "/v1/adapters/g/rollback",
        Some(&json!({"version": versions[1]})),
        USER,
    );
    assert!(r.status == 401 || r.status == 403, "{}", r.body_text());

    // A restart keeps the decision and the pause, and serves the weights rolled back to (under
    // a new number: numbers are never reused).
    let mut s = s;
    s.child.kill().unwrap();
    s.child.wait().unwrap();
    let s = start_learning(&path, &data, &guarded(), &[]);
    let c = &s.client;
    let st = status(c, "g");
    assert_eq!(st["state"], "paused", "{st}");
    assert_eq!(st["last_decision"]["reason"], "reward_drop", "{st}");
    let v = st["version"].as_u64().unwrap();
    assert!(v > rolled_from, "{st}");
    // Resumed: a decision; training goes on with what the rolled-back versions sampled never
    // trained; then a manual rollback to the version the guard went back to (its checkpoint is
    // numbered as it was first served).
    let r = call(c, "POST", "/v1/train/g/resume", None, ADMIN);
    assert_eq!(r.status, 200, "{}", r.body_text());
    assert_eq!(r.json()["status"]["last_decision"]["decision"], "resume");
    reward_group(c, late["id"].as_str().unwrap(), good);
    let st = step(c, good);
    let after = st["version"].as_u64().unwrap();
    assert!(after > v, "{st}");
    assert_eq!(st["dropped"]["rolled_back"], 4, "{st}");
    let r = call(
        c,
        "POST",
        "/v1/adapters/g/rollback",
        Some(&json!({"version": versions[1]})),
        ADMIN,
    );
    assert_eq!(r.status, 200, "{}", r.body_text());
    let st = &r.json()["status"];
    assert_eq!(
        (&st["version"], &st["state"], &st["last_decision"]["reason"]),
        (&json!(versions[1]), &json!("running"), &json!("manual")),
        "{st}"
    );
    assert_eq!(sample(c, "g", 2, 2, USER)["adapter_version"], versions[1]);
    // Training goes on from it under a new number.
    let st = step(c, good);
    assert!(st["version"].as_u64().unwrap() > after, "{st}");
}
