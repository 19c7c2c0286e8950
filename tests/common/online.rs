//! Helpers for the online-learning HTTP tests: a server with learning adapters on a data
//! directory, keyed requests, and reward posting.

use super::server::{Client, Response, Server};
use serde_json::{json, Value};
use std::path::Path;
use std::time::{Duration, Instant};

pub const USER: &str = "user-key";

/// The HTTP tests' server config (`server::CONFIG`) with these `[online]` settings.
pub fn config(online: &str) -> String {
    format!("{}[online]\n{online}\n", super::server::CONFIG)
}

pub const ADMIN: &str = "admin-key";

/// A server on `model` learning `learn` (names), its rollout log and checkpoints in `data`.
pub fn start_learning(model: &Path, data: &Path, config: &str, learn: &[&str]) -> Server {
    start_learning_with(model, data, config, learn, &[])
}

/// `start_learning` with more flags (`--rollout-store URL`).
pub fn start_learning_with(
    model: &Path,
    data: &Path,
    config: &str,
    learn: &[&str],
    extra: &[&str],
) -> Server {
    let mut args = vec![
        "--data-dir".to_string(),
        data.to_str().unwrap().to_string(),
        "--api-key".into(),
        USER.into(),
        "--admin-key".into(),
        ADMIN.into(),
    ];
    for l in learn {
        args.push("--learn".into());
        args.push(l.to_string());
    }
    args.extend(extra.iter().map(|a| a.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Server::start(model, config, &args)
}

pub fn call(c: &Client, method: &str, path: &str, body: Option<&Value>, key: &str) -> Response {
    let auth = format!("Bearer {key}");
    let text = body.map(Value::to_string);
    c.try_request(method, path, text.as_deref(), &[("Authorization", &auth)])
        .expect("request")
}

/// Chat with `n` choices through `model`; the response.
pub fn sample(c: &Client, model: &str, n: usize, max_tokens: usize, key: &str) -> Value {
    let body = json!({
        "model": model,
        "messages": [{"role": "user", "content": "say something"}],
        "n": n, "max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": true,
        "return_token_ids": true,
    });
    let r = call(c, "POST", "/v1/chat/completions", Some(&body), key);
    assert_eq!(r.status, 200, "{}", r.body_text());
    r.json()
}

pub fn status(c: &Client, adapter: &str) -> Value {
    let r = call(c, "GET", "/v1/train/status", None, USER);
    assert_eq!(r.status, 200, "{}", r.body_text());
    r.json()["adapters"][adapter].clone()
}

/// Wait (bounded) until `pred` holds for the adapter's status.
pub fn wait_status(c: &Client, adapter: &str, secs: u64, pred: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let s = status(c, adapter);
        if pred(&s) {
            return s;
        }
        assert!(Instant::now() < deadline, "status never satisfied: {s}");
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// One streamed chat through `model`: it completes (no error chunk) and reports one adapter
/// version from its first chunk to its last; that version.
pub fn stream_one_version(c: &Client, model: &str, content: &str) -> u64 {
    let body = json!({
        "model": model, "stream": true, "max_tokens": 24, "ignore_eos": true,
        "messages": [{"role": "user", "content": content}],
    });
    let r = call(c, "POST", "/v1/chat/completions", Some(&body), USER);
    assert_eq!(r.status, 200, "{}", r.body_text());
    let chunks = r.sse_chunks();
    assert!(
        chunks.iter().all(|c| c.get("error").is_none()),
        "{chunks:?}"
    );
    let v = chunks[0]["adapter_version"].as_u64().unwrap();
    assert!(
        chunks.iter().all(|c| c["adapter_version"] == v),
        "{chunks:?}"
    );
    v
}

/// Sample a group of `n` through `model` and reward its choices 0, 1, 0, 1, ...; the id.
pub fn sample_and_reward(c: &Client, model: &str, n: usize) -> String {
    let id = sample(c, model, n, 3, USER)["id"]
        .as_str()
        .unwrap()
        .to_string();
    reward(c, &id, n, 202);
    id
}

/// Reward the `n` choices of `id` 0, 1, 0, ...; assert the status.
pub fn reward(c: &Client, id: &str, n: usize, status: u16) -> Response {
    let items: Vec<Value> = (0..n)
        .map(|i| json!({"id": id, "choice": i, "reward": (i % 2) as f64}))
        .collect();
    let r = call(c, "POST", "/v1/feedback", Some(&Value::Array(items)), USER);
    assert_eq!(r.status, status, "{}", r.body_text());
    r
}

/// `config` with no staleness limit to speak of (groups train whatever their version).
pub fn learning_config() -> String {
    config("max_off_policy_steps = 1000")
}

/// Rewards in [-1, 1]; nothing sampled by an older version trains (unless a test says so).
pub fn signed_rewards(max_off_policy_steps: u64) -> String {
    config(&format!(
        "reward_min = -1.0\nreward_max = 1.0\nmax_off_policy_steps = {max_off_policy_steps}"
    ))
}
