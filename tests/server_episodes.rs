//! Episodes over HTTP on tiny generated models: one reward for every turn of an episode, and the
//! next turn continuing with the very tokens sampled (token in, token out), tool calls in the
//! generic format included.

mod common;

use common::online::*;
use common::write_tiny;
use serde_json::{json, Value};

/// Multi-turn episodes with one reward: two episodes of a task (the same `group`), two turns
/// each; one reward per episode trains all four turns (each with its episode's advantage);
/// `GET /v1/feedback?episode=` shows them; a turn is not rewarded alone, `n` > 1 is refused
/// with `episode`, and another key's episode is not found.
#[test]
fn an_episodes_one_reward_trains_every_turn() {
    let (dir, path) = write_tiny(&common::TinySpec {
        ctx: 512,
        ..common::TinySpec::small()
    });
    // A task's episodes are a client group: it trains once its rewards are quiet this long.
    let cfg = config(
        "reward_min = -1.0\nreward_max = 1.0\nmax_off_policy_steps = 1000\ngroup_timeout_secs = 0.5",
    );
    let s = start_learning(&path, &dir.path().join("data"), &cfg, &["l"]);
    let turn = |episode: &str, content: &str| {
        let r = call(
            &s,
            "POST",
            "/v1/chat/completions",
            Some(
                &json!({"model": "l", "messages": [{"role": "user", "content": content}],
                         "max_tokens": 3, "episode": episode, "group": "task"}),
            ),
            USER,
        );
        assert_eq!(r.status, 200, "{}", r.body_text());
        r.json()["id"].as_str().unwrap().to_string()
    };
    let a1 = turn("ep-a", "first");
    turn("ep-a", "second");
    turn("ep-b", "first");
    turn("ep-b", "second");
    // A turn is rewarded through its episode.
    let r = call(
        &s,
        "POST",
        "/v1/feedback",
        Some(&json!({"id": a1, "reward": 1.0})),
        USER,
    );
    assert_eq!(r.status, 400, "{}", r.body_text());
    for (ep, reward) in [("ep-a", 1.0), ("ep-b", 0.0)] {
        let body = json!({"episode": ep, "reward": reward});
        let r = call(&s, "POST", "/v1/feedback", Some(&body), USER);
        assert_eq!(r.status, 202, "{}", r.body_text());
        // The same again is a no-op; another value a conflict.
        assert_eq!(
            call(&s, "POST", "/v1/feedback", Some(&body), USER).status,
            200
        );
    }
    let r = call(
        &s,
        "POST",
        "/v1/feedback",
        Some(&json!({"episode": "ep-a", "reward": 0.5})),
        USER,
    );
    assert_eq!(r.status, 409, "{}", r.body_text());
    let r = call(
        &s,
        "POST",
        "/v1/feedback",
        Some(&json!({"episode": "ep-a", "reward": 1.0})),
        ADMIN,
    );
    assert_eq!(r.status, 404, "another key's episode: {}", r.body_text());
    // Two episodes, two units: the trainer steps on all four turns.
    let st = wait_status(&s, "l", 60, |st| st["steps"].as_u64() >= Some(1));
    assert_eq!(st["state"], "running", "{st}");
    assert_eq!(st["last"]["sequences"], 4, "{st}");
    // Every turn is trained on exactly what was served: the log-probs recomputed equal them.
    assert_eq!(st["last"]["logprob_diff_max"], 0.0, "{st}");
    let r = call(&s, "GET", "/v1/feedback?episode=ep-a", None, USER);
    assert_eq!(r.status, 200, "{}", r.body_text());
    let v = r.json();
    assert_eq!(v["reward"], 1.0);
    let turns = v["turns"].as_array().unwrap();
    assert_eq!(turns.len(), 2);
    assert!(turns.iter().all(|t| t["reward"] == 1.0));
    assert_eq!(turns[0]["id"], a1.as_str());
    // A turn logged after its episode was trained: its reward is not used a second time.
    let late = turn("ep-a", "late");
    let v = call(&s, "GET", "/v1/feedback?episode=ep-a", None, USER).json();
    let t = v["turns"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(
        (t["id"].as_str(), &t["dropped"]),
        (Some(late.as_str()), &json!("episode_trained")),
        "{v}"
    );
    // Another episode's group rewarded after it: the late turn is not in the step.
    turn("ep-d", "first");
    turn("ep-e", "first");
    for (ep, reward) in [("ep-d", 1.0), ("ep-e", 0.0)] {
        let body = json!({"episode": ep, "reward": reward});
        assert_eq!(
            call(&s, "POST", "/v1/feedback", Some(&body), USER).status,
            202
        );
    }
    let st = wait_status(&s, "l", 60, |st| st["steps"].as_u64() >= Some(2));
    assert_eq!(st["last"]["sequences"], 2, "{st}");
    let r = call(
        &s,
        "POST",
        "/v1/chat/completions",
        Some(
            &json!({"model": "l", "messages": [{"role": "user", "content": "x"}],
                     "max_tokens": 2, "n": 2, "episode": "ep-c"}),
        ),
        USER,
    );
    assert_eq!(r.status, 400, "{}", r.body_text());
}

/// Token in, token out across an episode's turns: the next turn's prompt is the last turn's
/// prompt and sampled tokens, exactly, then the new messages' tokens — not a re-tokenization of
/// the text the client sent back.
#[test]
fn an_episodes_next_turn_continues_with_the_sampled_tokens() {
    let (dir, path) = write_tiny(&common::TinySpec {
        ctx: 512,
        ..common::TinySpec::small()
    });
    let s = start_learning(
        &path,
        &dir.path().join("data"),
        &signed_rewards(1000),
        &["l"],
    );
    let ask = |messages: Value, episode: &str| {
        let r = call(
            &s,
            "POST",
            "/v1/chat/completions",
            // A fixed seed: a random draw may end inside a character, whose text (U+FFFD)
            // cannot re-render the tokens, and then the turn is rightly re-tokenized instead.
            Some(
                &json!({"model": "l", "messages": messages, "max_tokens": 6, "seed": 5,
                         "ignore_eos": true, "episode": episode, "return_token_ids": true}),
            ),
            USER,
        );
        assert_eq!(r.status, 200, "{}", r.body_text());
        r.json()
    };
    let first = json!([{"role": "user", "content": "hello there"}]);
    let t1 = ask(first.clone(), "ep-1");
    let p1: Vec<u32> = serde_json::from_value(t1["prompt_token_ids"].clone()).unwrap();
    let c1: Vec<u32> = serde_json::from_value(t1["choices"][0]["token_ids"].clone()).unwrap();
    let said = t1["choices"][0]["message"]["content"].as_str().unwrap();
    let second = json!([{"role": "user", "content": "hello there"},
                        {"role": "assistant", "content": said},
                        {"role": "user", "content": "more"}]);
    let t2 = ask(second.clone(), "ep-1");
    let p2: Vec<u32> = serde_json::from_value(t2["prompt_token_ids"].clone()).unwrap();
    assert_eq!(
        &p2[..p1.len() + c1.len()],
        [p1.clone(), c1.clone()].concat()
    );
    assert!(p2.len() > p1.len() + c1.len());
    // Another episode (or none) renders the same conversation from its text.
    let t3 = ask(second, "ep-2");
    let p3: Vec<u32> = serde_json::from_value(t3["prompt_token_ids"].clone()).unwrap();
    let text = |ids: &[u32]| {
        call(
            &s,
            "POST",
            "/detokenize",
            Some(&json!({"tokens": ids})),
            USER,
        )
        .json()["prompt"]
            .clone()
    };
    assert_eq!(text(&p3), text(&p2));
    eprintln!(
        "spliced {} tokens, re-tokenized {}: equal {}",
        p2.len(),
        p3.len(),
        p2 == p3
    );
}

/// The same across a tool call in the generic format (a template without tools): the call the
/// client sends back re-renders, JSON spelled as the grammar spelled it, to the very tokens
/// sampled, so the next turn continues them.
#[test]
fn an_episodes_tool_call_in_the_generic_format_continues_with_the_sampled_tokens() {
    let (dir, path) = write_tiny(&common::TinySpec {
        ctx: 2048,
        ..common::TinySpec::small()
    });
    let s = start_learning(
        &path,
        &dir.path().join("data"),
        &signed_rewards(1000),
        &["l"],
    );
    let tools = json!([{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
        "b": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a", "b"],
        "additionalProperties": false}}}]);
    let ask = |messages: Value| {
        let r = call(
            &s,
            "POST",
            "/v1/chat/completions",
            Some(
                &json!({"model": "l", "messages": messages, "max_tokens": 200, "seed": 3,
                         "tools": tools, "tool_choice": "required", "episode": "ep-t",
                         "return_token_ids": true}),
            ),
            USER,
        );
        assert_eq!(r.status, 200, "{}", r.body_text());
        r.json()
    };
    let first = json!([{"role": "user", "content": "2+3?"}]);
    let t1 = ask(first);
    let p1: Vec<u32> = serde_json::from_value(t1["prompt_token_ids"].clone()).unwrap();
    let c1: Vec<u32> = serde_json::from_value(t1["choices"][0]["token_ids"].clone()).unwrap();
    let m = &t1["choices"][0]["message"];
    assert_eq!(t1["choices"][0]["finish_reason"], "tool_calls", "{t1}");
    let second = json!([{"role": "user", "content": "2+3?"}, m,
                        {"role": "tool", "tool_call_id": m["tool_calls"][0]["id"], "content": "5"}]);
    let t2 = ask(second);
    let p2: Vec<u32> = serde_json::from_value(t2["prompt_token_ids"].clone()).unwrap();
    assert_eq!(
        &p2[..p1.len() + c1.len()],
        [p1.clone(), c1.clone()].concat()
    );
    assert!(p2.len() > p1.len() + c1.len());
}
