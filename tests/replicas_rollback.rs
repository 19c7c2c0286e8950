//! A rollback on the trainer reaches the serving replicas (one PostgreSQL, one shared data
//! directory; skipped with a message where PostgreSQL is not installed): the replica follows the
//! trainer back to the version it rolled back to and serves it, then forward again when the
//! trainer publishes a new version (a number above every one served).

mod common;

use common::online::*;
use common::replicas::{reward_group, Shared};
use serde_json::json;

#[test]
fn a_replica_follows_the_trainer_back_and_forward() {
    let Some(sh) = Shared::new("max_off_policy_steps = 1000") else {
        return;
    };
    let trainer = sh.start("train");
    let replica = sh.start("serve");
    let mut versions = vec![status(&trainer, "l")["version"].as_u64().unwrap()];
    for _ in 0..2 {
        let before = versions[versions.len() - 1];
        reward_group(&replica, &trainer);
        let st = wait_status(&trainer, "l", 60, |s| {
            s["version"].as_u64().unwrap() > before
        });
        versions.push(st["version"].as_u64().unwrap());
    }
    let newest = versions[2];
    wait_status(&replica, "l", 30, |s| s["version"] == newest);
    let r = call(
        &trainer,
        "POST",
        "/v1/adapters/l/rollback",
        Some(&json!({"version": versions[1]})),
        ADMIN,
    );
    assert_eq!(r.status, 200, "{}", r.body_text());
    let back = versions[1];
    wait_status(&replica, "l", 30, |s| s["version"] == back);
    assert_eq!(sample(&replica, "l", 2, 2, USER)["adapter_version"], back);
    // Forward again: the trainer's next version is above every number served.
    reward_group(&replica, &trainer);
    let st = wait_status(&trainer, "l", 60, |s| {
        s["version"].as_u64().unwrap() > newest
    });
    let next = st["version"].as_u64().unwrap();
    wait_status(&replica, "l", 30, |s| s["version"] == next);
    assert_eq!(sample(&replica, "l", 2, 2, USER)["adapter_version"], next);
}
