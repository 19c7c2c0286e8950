//! Repeat detection over HTTP on a tiny generated model: a planted loop ends with
//! `finish_reason: "repetition"` where the rule says, a normal answer runs to its length; the
//! setting comes from the learning adapter or the request; a looped sample trains with the
//! adapter's `repetition_reward` whatever was posted for it.

mod common;

use common::online::*;
use common::write_tiny;
use serde_json::{json, Value};

/// A completion through `model` with `extra` fields; (finish_reason, completion tokens, id).
fn complete(c: &common::server::Client, model: &str, extra: Value) -> (String, u64, String) {
    let mut body = json!({"model": model, "prompt": "hello", "max_tokens": 100,
                          "temperature": 1.0, "seed": 3});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    let r = call(c, "POST", "/v1/completions", Some(&body), USER);
    assert_eq!(r.status, 200, "{}", r.body_text());
    let v = r.json();
    (
        v["choices"][0]["finish_reason"]
            .as_str()
            .unwrap()
            .to_string(),
        v["usage"]["completion_tokens"].as_u64().unwrap(),
        v["id"].as_str().unwrap().to_string(),
    )
}

#[test]
fn a_planted_loop_ends_as_repetition_and_trains_with_the_repetition_reward() {
    let (dir, path) = write_tiny(&common::TinySpec {
        ctx: 512,
        ..common::TinySpec::small()
    });
    let cfg = format!(
        "{}\n[[learn]]\nname = \"l\"\nstop_on_repetition = true\nrepetition_reward = -1.0\n",
        config(
            "reward_min = -1.0\nreward_max = 1.0\nmax_off_policy_steps = 1000\n\
             group_timeout_secs = 0.5\ntrain_off_policy_samples = true"
        )
    );
    let s = start_learning(&path, &dir.path().join("data"), &cfg, &[]);
    let base = call(&s, "GET", "/v1/models", None, USER).json()["data"][0]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let planted = json!({"allowed_token_ids": [7], "group": "g"});
    // The adapter's default rule: one token repeated ends at min_tokens (32).
    let (finish, n, looped) = complete(&s, "l", planted.clone());
    assert_eq!((finish.as_str(), n), ("repetition", 32));
    // A sampled answer is not a loop: it runs to max_tokens.
    let (finish, n, normal) = complete(&s, "l", json!({"group": "g", "ignore_eos": true}));
    assert_eq!((finish.as_str(), n), ("length", 100));
    // The base model has no rule unless the request gives one; a request overrides the adapter.
    let (finish, n, _) = complete(&s, &base, json!({"allowed_token_ids": [7]}));
    assert_eq!((finish.as_str(), n), ("length", 100));
    let rule = json!({"max_period": 4, "min_repeats": 3, "min_tokens": 8});
    let (finish, n, _) = complete(
        &s,
        &base,
        json!({"allowed_token_ids": [7], "stop_on_repetition": rule}),
    );
    assert_eq!((finish.as_str(), n), ("repetition", 8));
    let (finish, n, _) = complete(
        &s,
        "l",
        json!({"allowed_token_ids": [7], "stop_on_repetition": false}),
    );
    assert_eq!((finish.as_str(), n), ("length", 100));
    for bad in [json!({"max_period": 0}), json!("yes"), json!({"period": 3})] {
        let body = json!({"model": "l", "prompt": "x", "stop_on_repetition": bad});
        let r = call(&s, "POST", "/v1/completions", Some(&body), USER);
        assert_eq!(r.status, 400, "{}", r.body_text());
        assert_eq!(r.json()["error"]["param"], "stop_on_repetition");
    }
    // Streamed, the last chunk says why.
    let body = json!({"model": "l", "prompt": "hello", "max_tokens": 100, "stream": true,
                      "allowed_token_ids": [7], "stop_on_repetition": rule});
    let r = call(&s, "POST", "/v1/completions", Some(&body), USER);
    let chunks = r.sse_chunks();
    let last = chunks
        .iter()
        .rev()
        .find(|c| !c["choices"][0]["finish_reason"].is_null())
        .unwrap();
    assert_eq!(
        last["choices"][0]["finish_reason"], "repetition",
        "{chunks:?}"
    );
    // Both of group g rewarded 1: the looped one trains with -1, so the group has a signal
    // (without the shaping it would be dropped: every reward equal).
    for id in [&looped, &normal] {
        let r = call(
            &s,
            "POST",
            "/v1/feedback",
            Some(&json!({"id": id, "reward": 1.0})),
            USER,
        );
        assert_eq!(r.status, 202, "{}", r.body_text());
    }
    let st = wait_status(&s, "l", 60, |st| st["steps"].as_u64() >= Some(1));
    assert_eq!(st["last"]["sequences"], 2, "{st}");
    assert_eq!(st["last"]["logprob_diff_max"], 0.0, "{st}");
    assert_eq!(st["config"]["repetition_reward"], -1.0, "{st}");
    // The log keeps what was posted.
    let r = call(&s, "GET", &format!("/v1/feedback/{looped}"), None, USER);
    let c = &r.json()["choices"][0];
    assert_eq!(
        (&c["reward"], &c["finish_reason"]),
        (&json!(1.0), &json!("repetition"))
    );
}
