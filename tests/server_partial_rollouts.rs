//! Partial rollouts over HTTP on a tiny generated model: a learning adapter with
//! `version_policy = "latest"` moves a long streamed generation to the version its trainer
//! publishes meanwhile. The response and the rollout log say which version computed which
//! tokens. Recomputing the K/V at the switch (the default), each version's tokens are exactly
//! what that version computes for the whole sequence (scored again under each, to the bit), and
//! the trainer checks its own version's tokens to the bit while the older ones train as
//! off-policy tokens with their own behaviour log-probs. Keeping the K/V, the tokens after the
//! switch are marked inexact: no single version computes them, and the trainer compares none.

mod common;

use common::online::*;
use common::server::Client;
use common::write_tiny;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// The prompt, as token ids (so that scoring it again needs no tokenizer).
const PROMPT: [u64; 5] = [40, 41, 42, 43, 44];

/// One streamed choice: its prompt ids, token ids, log-probs and version spans.
struct Streamed {
    id: String,
    prompt: Vec<u64>,
    tokens: Vec<u64>,
    logprobs: Vec<f64>,
    spans: Vec<(usize, u64, bool)>,
    admitted: u64,
}

fn spans_of(v: &Value) -> Vec<(usize, u64, bool)> {
    v.as_array()
        .map(|a| {
            a.iter()
                .map(|s| {
                    (
                        s["from_token"].as_u64().unwrap() as usize,
                        s["version"].as_u64().unwrap(),
                        s["exact"].as_bool().unwrap(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// A long streamed completion of two choices; each choice's tokens, log-probs and spans.
fn stream_long(c: &Client, model: &str, max_tokens: usize) -> Vec<Streamed> {
    let body = json!({"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "n": 2,
                      "temperature": 1.0, "seed": 5, "ignore_eos": true, "stream": true,
                      "logprobs": 0, "return_token_ids": true});
    let r = call(c, "POST", "/v1/completions", Some(&body), USER);
    assert_eq!(r.status, 200, "{}", r.body_text());
    let chunks = r.sse_chunks();
    assert!(chunks.iter().all(|c| c.get("error").is_none()));
    let prompt = PROMPT.to_vec();
    let admitted = chunks[0]["adapter_version"].as_u64().unwrap();
    // Every chunk says the version the request was admitted with; the spans say the rest.
    assert!(chunks.iter().all(|c| c["adapter_version"] == admitted));
    (0..2)
        .map(|i| {
            let mut s = Streamed {
                id: chunks[0]["id"].as_str().unwrap().to_string(),
                prompt: prompt.clone(),
                tokens: Vec::new(),
                logprobs: Vec::new(),
                spans: Vec::new(),
                admitted,
            };
            for ch in chunks.iter().flat_map(|c| c["choices"].as_array().unwrap()) {
                if ch["index"] != i {
                    continue;
                }
                for t in ch["token_ids"].as_array().into_iter().flatten() {
                    s.tokens.push(t.as_u64().unwrap());
                }
                if let Some(lp) = ch["logprobs"]["token_logprobs"].as_array() {
                    s.logprobs.extend(lp.iter().map(|v| v.as_f64().unwrap()));
                }
                if ch["finish_reason"].is_string() {
                    s.spans = spans_of(&ch["adapter_versions"]);
                }
            }
            assert_eq!(s.tokens.len(), max_tokens);
            assert_eq!(s.logprobs.len(), max_tokens);
            s
        })
        .collect()
}

/// The log-prob the current version gives each token of `s`'s completion (prompt scoring).
fn scored(c: &Client, model: &str, s: &Streamed) -> Vec<f64> {
    let ids: Vec<u64> = s.prompt.iter().chain(&s.tokens).copied().collect();
    let body = json!({"model": model, "prompt": ids, "max_tokens": 1, "temperature": 1.0,
                      "prompt_logprobs": 0});
    let r = call(c, "POST", "/v1/completions", Some(&body), USER);
    assert_eq!(r.status, 200, "{}", r.body_text());
    let pl = r.json()["choices"][0]["prompt_logprobs"].clone();
    let pl = pl.as_array().unwrap();
    (0..s.tokens.len())
        .map(|j| {
            let pos = s.prompt.len() + j;
            let entry = &pl[pos];
            entry[s.tokens[j].to_string()]["logprob"].as_f64().unwrap()
        })
        .collect()
}

/// The completion positions version `v` computed (exactly or not).
fn positions(s: &Streamed, v: u64) -> Vec<usize> {
    let ends: Vec<usize> = s.spans[1..]
        .iter()
        .map(|x| x.0)
        .chain([s.tokens.len()])
        .collect();
    s.spans
        .iter()
        .zip(ends)
        .filter(|(x, _)| x.1 == v)
        .flat_map(|(x, end)| x.0..end)
        .collect()
}

/// A server learning `name` (its `[[learn]]` settings `extra`) and a pinned adapter.
fn server(extra: &str) -> (tempfile::TempDir, common::server::Server) {
    let (dir, path) = write_tiny(&common::TinySpec {
        ctx: 4096,
        ..common::TinySpec::small()
    });
    let learn = format!(
        "[[learn]]\nname = \"latest\"\nversion_policy = \"latest\"\nlr = 0.05\n{extra}\
         [[learn]]\nname = \"pinned\"\n"
    );
    let cfg = format!(
        "{}\n{learn}",
        config("max_off_policy_steps = 1000").replace("kv_cache_mb = 16", "kv_cache_mb = 64")
    );
    let s = start_learning(&path, &dir.path().join("data"), &cfg, &[]);
    (dir, s)
}

/// One step (so that the version the long generation starts on, v, has a checkpoint), then a
/// long streamed generation of two choices during which a second step publishes v2: the
/// choices, v and v2. Each choice moved once, from v to v2.
fn generation_across_a_publish(c: &Client) -> (Vec<Streamed>, u64, u64) {
    sample_and_reward(c, "latest", 2);
    let v = wait_status(c, "latest", 60, |st| st["steps"] == 1)["version"]
        .as_u64()
        .unwrap();
    // A group sampled now, rewarded while the long generation runs: the next step.
    let next = sample(c, "latest", 2, 3, USER)["id"]
        .as_str()
        .unwrap()
        .to_string();
    let client = c.clone();
    let long = std::thread::spawn(move || stream_long(&client, "latest", 2500));
    let deadline = Instant::now() + Duration::from_secs(30);
    while c.metric("flywheel_num_requests_running") < 1.0 {
        assert!(Instant::now() < deadline, "the long generation never ran");
        std::thread::sleep(Duration::from_millis(2));
    }
    reward(c, &next, 2, 202);
    let v2 = wait_status(c, "latest", 60, |st| st["steps"] == 2)["version"]
        .as_u64()
        .unwrap();
    assert!(v2 > v);
    let choices = long.join().unwrap();
    for ch in &choices {
        assert_eq!(ch.admitted, v);
        assert_eq!(ch.spans.len(), 2, "one switch: {:?}", ch.spans);
        assert_eq!(ch.spans[0], (0, v, true));
        assert_eq!(ch.spans[1].1, v2);
        assert!(
            ch.spans[1].0 > 0 && ch.spans[1].0 < ch.tokens.len(),
            "{:?}",
            ch.spans
        );
    }
    assert!(c.metric("flywheel_version_switches_total") >= 2.0);
    // The log keeps the spans.
    let id = &choices[0].id;
    let r = call(c, "GET", &format!("/v1/feedback/{id}"), None, USER);
    assert_eq!(r.status, 200, "{}", r.body_text());
    for (i, ch) in choices.iter().enumerate() {
        let info = &r.json()["choices"][i];
        assert_eq!(info["adapter_version"], v, "{info}");
        assert_eq!(spans_of(&info["adapter_versions"]), ch.spans, "{info}");
    }
    (choices, v, v2)
}

#[test]
fn a_long_generation_moves_to_the_version_published_while_it_runs() {
    let (_dir, s) = server("");
    let c = &s.client;
    for (body, param) in [
        (json!({"version_policy": "newest"}), "version_policy"),
        (json!({"version_switch": "keep"}), "version_switch"),
        (
            json!({"version_policy": "latest", "version_switch": "drop"}),
            "version_switch",
        ),
    ] {
        let r = call(c, "POST", "/v1/adapters/x/train", Some(&body), ADMIN);
        assert_eq!(r.status, 400, "{}", r.body_text());
        assert_eq!(r.json()["error"]["param"], param, "{}", r.body_text());
    }
    assert_eq!(status(c, "latest")["config"]["version_policy"], "latest");
    assert_eq!(status(c, "latest")["config"]["version_switch"], "recompute");
    assert_eq!(status(c, "pinned")["config"]["version_policy"], "pinned");

    let (choices, v, v2) = generation_across_a_publish(c);
    assert!(choices.iter().all(|ch| ch.spans[1].2), "recomputed: exact");
    assert!(c.metric("flywheel_version_switch_recomputed_tokens_total") > 0.0);

    // Served = scored under the version that computed each token, to the bit.
    for ch in &choices {
        let now = scored(c, "latest", ch);
        for j in positions(ch, v2) {
            assert_eq!(ch.logprobs[j], now[j], "token {j} of {:?}", ch.spans);
        }
    }

    // The trainer trains them (rewarded 1 and 0) from the version that computed their tails:
    // its forward reproduces that version's tokens to the bit (the older tokens, off-policy,
    // are not compared; they differ).
    reward(c, &choices[0].id, 2, 202);
    let st = wait_status(c, "latest", 60, |st| st["steps"] == 3);
    assert_eq!(st["last"]["sequences"], 2, "{st}");
    assert_eq!(st["last"]["logprob_diff_max"], 0.0, "{st}");
    assert_eq!(st["last"]["staleness_max"], 1, "{st}");
    // Per token: the older version's head is one behind, the tail none.
    let head: usize = choices.iter().map(|ch| ch.spans[1].0).sum();
    let all: usize = choices.iter().map(|ch| ch.tokens.len()).sum();
    let mean = st["last"]["staleness_token_mean"].as_f64().unwrap();
    assert!((mean - head as f64 / all as f64).abs() < 1e-9, "{st}");

    // Version v again (rolled back to): the tokens it computed score as served, to the bit; the
    // later version's do not all.
    let r = call(
        c,
        "POST",
        "/v1/adapters/latest/rollback",
        Some(&json!({"version": v})),
        ADMIN,
    );
    assert_eq!(r.status, 200, "{}", r.body_text());
    for ch in &choices {
        let then = scored(c, "latest", ch);
        for j in positions(ch, v) {
            assert_eq!(ch.logprobs[j], then[j], "token {j} of {:?}", ch.spans);
        }
        assert!(
            positions(ch, v2).iter().any(|&j| ch.logprobs[j] != then[j]),
            "the two versions computed the same log-probs"
        );
    }

    // A pinned adapter's generation stays on its version.
    let body = json!({"model": "pinned", "prompt": PROMPT, "max_tokens": 8, "ignore_eos": true});
    let r = call(c, "POST", "/v1/completions", Some(&body), USER);
    assert_eq!(r.status, 200, "{}", r.body_text());
    assert!(r.json()["choices"][0].get("adapter_versions").is_none());
}

/// `version_switch = "keep"`: the switch recomputes nothing; the tokens after it attend to the
/// older version's K/V, are logged inexact, differ from what the new version computes alone,
/// and the trainer compares none of them.
#[test]
fn a_switch_that_keeps_the_kv_marks_its_tokens_inexact() {
    let (_dir, s) = server("version_switch = \"keep\"\n");
    let c = &s.client;
    assert_eq!(status(c, "latest")["config"]["version_switch"], "keep");
    let (choices, _, v2) = generation_across_a_publish(c);
    assert!(choices.iter().all(|ch| !ch.spans[1].2), "kept: inexact");
    assert_eq!(
        c.metric("flywheel_version_switch_recomputed_tokens_total"),
        0.0
    );
    for ch in &choices {
        let alone = scored(c, "latest", ch);
        let tail = positions(ch, v2);
        let differ = tail.iter().filter(|&&j| ch.logprobs[j] != alone[j]).count();
        assert!(differ > 0, "kept K/V changed nothing");
    }
    reward(c, &choices[0].id, 2, 202);
    let st = wait_status(c, "latest", 60, |st| st["steps"] == 3);
    assert_eq!(st["last"]["sequences"], 2, "{st}");
    assert!(st["last"]["logprob_diff_max"].is_null(), "{st}");
}
