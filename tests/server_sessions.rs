//! Agent sessions over HTTP on tiny generated models: a session key makes every call a turn of
//! the session's episode with no field of ours in the body (or the owner's key and the session
//! header); per-turn rewards become γ-discounted returns that train every turn; sessions outlive
//! a restart; idle ones end by their timeout (dropped, or rewarded by their idle reward); only
//! the owner rewards, reads and ends them.

mod common;

use common::online::*;
use common::server::{Client, Response};
use common::write_tiny;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// A turn as an agent framework makes it: `model` is whatever the agent was written with.
fn turn(c: &Client, key: &str, content: &str, extra: &[(&str, &str)]) -> Response {
    let auth = format!("Bearer {key}");
    let mut headers = vec![("Authorization", auth.as_str())];
    headers.extend_from_slice(extra);
    let body = json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": content}],
                      "max_tokens": 3, "temperature": 1.0});
    c.try_request(
        "POST",
        "/v1/chat/completions",
        Some(&body.to_string()),
        &headers,
    )
    .expect("request")
}

fn create(c: &Client, key: &str, body: Value) -> (String, String) {
    let r = call(c, "POST", "/v1/sessions", Some(&body), key);
    assert_eq!(r.status, 201, "{}", r.body_text());
    let v = r.json();
    assert_eq!(v["state"], "open", "{v}");
    (
        v["id"].as_str().unwrap().to_string(),
        v["key"].as_str().unwrap().to_string(),
    )
}

fn session(c: &Client, id: &str) -> Value {
    let r = call(c, "GET", &format!("/v1/sessions/{id}"), None, USER);
    assert_eq!(r.status, 200, "{}", r.body_text());
    r.json()
}

fn wait_session(c: &Client, id: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let t0 = Instant::now();
    loop {
        let v = session(c, id);
        if pred(&v) {
            return v;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "{v}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn session_turns_train_with_discounted_returns_and_outlive_a_restart() {
    let (dir, path) = write_tiny(&common::TinySpec {
        ctx: 512,
        ..common::TinySpec::small()
    });
    let cfg = config(
        "reward_min = -1.0\nreward_max = 1.0\nmax_off_policy_steps = 1000\ngroup_timeout_secs = 0.5",
    );
    let data = dir.path().join("data");
    let s = start_learning(&path, &data, &cfg, &["l"]);
    // Options are checked, naming the field.
    for (body, param) in [
        (json!({"gamma": 1.5}), "gamma"),
        (json!({"adapter": "nope"}), "adapter"),
        (json!({"turns": 3}), "turns"),
        (json!({"idle_reward": 7.0}), "idle_reward"),
    ] {
        let r = call(&s, "POST", "/v1/sessions", Some(&body), USER);
        assert_eq!(r.status, 400, "{}", r.body_text());
        assert_eq!(r.json()["error"]["param"], param, "{}", r.body_text());
    }
    let (a, a_key) = create(&s, USER, json!({"gamma": 0.5, "group": "task"}));
    let (b, b_key) = create(&s, USER, json!({"group": "task"}));
    assert!(a_key.starts_with("fws_") && a.starts_with("sess_") && a_key.len() > 30);
    // Turn 1 by the session key: the session's adapter serves, whatever `model` says.
    let r = turn(&s, &a_key, "first", &[]);
    assert_eq!(r.status, 200, "{}", r.body_text());
    let v = r.json();
    assert_eq!(v["model"], "l", "{v}");
    assert_eq!(v["adapter_version"], 1, "{v}");
    // Our fields are refused in a session's turn, and so is n > 1.
    for (extra, param) in [
        (json!({"episode": "x"}), "episode"),
        (json!({"group": "x"}), "group"),
        (json!({"n": 2}), "n"),
    ] {
        let mut body = json!({"model": "l", "messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 2});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let r = call(&s, "POST", "/v1/chat/completions", Some(&body), &a_key);
        assert_eq!(r.status, 400, "{}", r.body_text());
        assert_eq!(r.json()["error"]["param"], param);
    }
    // Turn 2 by the owner's key and the session header (clients that cannot change keys).
    let r = turn(&s, USER, "second", &[("X-Flywheel-Session", &a)]);
    assert_eq!(r.status, 200, "{}", r.body_text());
    // Another key cannot make turns of it, read it, reward it or end it; the session key
    // itself does not reward or end it; an unknown session key is refused.
    let r = turn(&s, ADMIN, "x", &[("X-Flywheel-Session", &a)]);
    assert_eq!(r.status, 404, "{}", r.body_text());
    let r = call(
        &s,
        "POST",
        &format!("/v1/sessions/{a}/reward"),
        Some(&json!({"reward": 1.0})),
        &a_key,
    );
    assert_eq!(r.status, 403, "{}", r.body_text());
    let (other, _) = create(&s, ADMIN, json!({}));
    let r = call(&s, "GET", &format!("/v1/sessions/{other}"), None, USER);
    assert_eq!(r.status, 404, "{}", r.body_text());
    assert_eq!(turn(&s, "fws_not_a_session", "x", &[]).status, 401);
    // A restart: the session, its key and its turns are kept; the next turn continues.
    drop(s);
    let s = start_learning(&path, &data, &cfg, &["l"]);
    assert_eq!(session(&s, &a)["turns"], 2);
    let r = turn(&s, &a_key, "third", &[]);
    assert_eq!(r.status, 200, "{}", r.body_text());
    let r = turn(&s, &b_key, "only", &[]);
    assert_eq!(r.status, 200, "{}", r.body_text());
    // Per-turn rewards that do not fit are refused; then a's three turns get their returns
    // (γ = 0.5: r = (0, 1, 0) → G = (0.5, 1, 0)), b's one turn its final reward.
    let url = |id: &str| format!("/v1/sessions/{id}/reward");
    let r = call(&s, "POST", &url(&a), Some(&json!({"rewards": [1.0]})), USER);
    assert_eq!(r.status, 400, "{}", r.body_text());
    assert_eq!(r.json()["error"]["param"], "rewards");
    let body = json!({"rewards": [0.0, 1.0, 0.0]});
    let r = call(&s, "POST", &url(&a), Some(&body), USER);
    assert_eq!(r.status, 202, "{}", r.body_text());
    assert_eq!(r.json()["returns"], json!([0.5, 1.0, 0.0]));
    assert_eq!(call(&s, "POST", &url(&a), Some(&body), USER).status, 200);
    let r = call(&s, "POST", &url(&a), Some(&json!({"reward": 1.0})), USER);
    assert_eq!(r.status, 409, "{}", r.body_text());
    let r = call(&s, "POST", &url(&b), Some(&json!({"reward": -1.0})), USER);
    assert_eq!(r.status, 202, "{}", r.body_text());
    // A rewarded session takes no more turns.
    let r = turn(&s, &a_key, "late", &[]);
    assert_eq!(r.status, 409, "{}", r.body_text());
    assert_eq!(r.json()["error"]["code"], "session_ended");
    // Two sessions of one group: all four turns train, each on exactly what was served.
    let st = wait_status(&s, "l", 60, |st| st["steps"].as_u64() >= Some(1));
    assert_eq!(st["last"]["sequences"], 4, "{st}");
    assert_eq!(st["last"]["logprob_diff_max"], 0.0, "{st}");
    let v = session(&s, &a);
    assert_eq!(v["state"], "rewarded", "{v}");
    let turns = v["completions"].as_array().unwrap();
    let rewards: Vec<&Value> = turns.iter().map(|t| &t["reward"]).collect();
    assert_eq!(rewards, [&json!(0.5), &json!(1.0), &json!(0.0)], "{v}");
    assert!(turns.iter().all(|t| t["trained_step"] == 1), "{v}");
}

#[test]
fn idle_sessions_end_by_their_timeout_and_max_turns_bounds_a_session() {
    let (dir, path) = write_tiny(&common::TinySpec::small());
    let cfg = config("reward_min = -1.0\nreward_max = 1.0");
    let s = start_learning(&path, &dir.path().join("data"), &cfg, &["l"]);
    let (dropped, dk) = create(&s, USER, json!({"idle_timeout": 1}));
    let (paid, pk) = create(&s, USER, json!({"idle_timeout": 1, "idle_reward": 0.25}));
    let (capped, ck) = create(&s, USER, json!({"max_turns": 1}));
    for k in [&dk, &pk, &ck] {
        assert_eq!(turn(&s, k, "hello", &[]).status, 200);
    }
    let r = turn(&s, &ck, "again", &[]);
    assert_eq!(r.status, 409, "{}", r.body_text());
    assert_eq!(r.json()["error"]["code"], "session_max_turns");
    // Its key still reaches the routes that make no turn.
    assert_eq!(call(&s, "GET", "/v1/models", None, &ck).status, 200);
    // Idle: one ends with its turn dropped, the other is rewarded with its idle reward.
    let v = wait_session(&s, &dropped, |v| v["state"] != "open");
    assert_eq!(v["state"], "ended", "{v}");
    assert_eq!(v["completions"][0]["dropped"], "session_ended", "{v}");
    let v = wait_session(&s, &paid, |v| v["state"] != "open");
    assert_eq!(v["state"], "rewarded", "{v}");
    assert_eq!(v["returns"], json!([0.25]), "{v}");
    assert_eq!(v["completions"][0]["reward"], 0.25, "{v}");
    assert_eq!(turn(&s, &dk, "more", &[]).status, 409);
    // DELETE ends a session without a reward; it is then refused a reward.
    let r = call(&s, "DELETE", &format!("/v1/sessions/{capped}"), None, USER);
    assert_eq!(r.status, 200, "{}", r.body_text());
    assert_eq!(r.json()["state"], "ended");
    let r = call(
        &s,
        "POST",
        &format!("/v1/sessions/{capped}/reward"),
        Some(&json!({"reward": 1.0})),
        USER,
    );
    assert_eq!(r.status, 409, "{}", r.body_text());
    assert_eq!(r.json()["error"]["code"], "session_ended");
}
