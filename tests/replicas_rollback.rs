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

/// The trainer's canary runs on the replicas too (its candidate to their requests), and its
/// promotion reaches them under the trainer's number.
#[test]
fn a_replica_runs_the_trainers_canary_and_follows_its_promotion() {
    let Some(sh) = Shared::new("max_off_policy_steps = 1000") else {
        return;
    };
    let trainer = sh.start("train");
    let replica = sh.start("serve");
    let first = status(&trainer, "l")["version"].as_u64().unwrap();
    let body = json!({"method": "lora", "lora_r": 4, "lr": 0.01, "promotion": "canary",
                      "canary_fraction": 0.5, "canary_window": 2});
    let r = call(&trainer, "POST", "/v1/adapters/l/train", Some(&body), ADMIN);
    assert_eq!(r.status, 200, "{}", r.body_text());
    reward_group(&replica, &trainer);
    let cv = wait_status(&trainer, "l", 60, |s| s["canary_version"].is_u64())["canary_version"]
        .as_u64()
        .unwrap();
    wait_status(&replica, "l", 30, |s| s["canary_version"] == cv);
    // The replica's requests reach both arms; one group of each, rewarded alike.
    let (mut got_c, mut got_i) = (false, false);
    for _ in 0..200 {
        let r = sample(&replica, "l", 2, 3, USER);
        let v = r["adapter_version"].as_u64().unwrap();
        let id = r["id"].as_str().unwrap();
        let mine = (v == cv && !got_c) || (v == first && !got_i);
        if mine {
            let items = json!([{"id": id, "choice": 0, "reward": 1},
                               {"id": id, "choice": 1, "reward": 0}]);
            assert_eq!(
                call(&trainer, "POST", "/v1/feedback", Some(&items), USER).status,
                202
            );
            got_c |= v == cv;
            got_i |= v == first;
        }
        if got_c && got_i {
            break;
        }
    }
    assert!(got_c && got_i, "both arms: {got_c} {got_i}");
    wait_status(&trainer, "l", 60, |s| s["version"] == cv);
    wait_status(&replica, "l", 30, |s| s["version"] == cv);
    let r = call(&replica, "GET", "/v1/adapters/l", None, USER);
    assert_eq!(r.json()["version"], cv, "{}", r.body_text());
}
