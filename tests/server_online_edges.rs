//! The learning server at its edges, through the public interface: adapter sizes bounded before
//! allocation; names, keys, ids and error codes; a streamed completion recorded once its last
//! choice finishes; a 16-stream learning run without server errors; orchestrator-style names
//! that never become raw paths. (Faults: tests/server_online_faults.rs.)

mod common;

use common::online::*;
use common::server::*;
use common::write_tiny;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

#[test]
fn adapter_sizes_are_bounded_before_anything_is_allocated() {
    let (dir, path) = write_tiny(&spec());
    let s = start_learning(&path, &dir.path().join("data"), &learning_config(), &[]);
    let t0 = Instant::now();
    let r = call(
        &s,
        "POST",
        "/v1/adapters/huge/train",
        Some(&json!({"method": "lora", "lora_r": 100000})),
        ADMIN,
    );
    assert_error(&r, 400, Some("lora_r"));
    for (body, param) in [
        (json!({"name": "x", "kind": "lora", "r": 100000}), "r"),
        (
            json!({"name": "x", "kind": "oft", "oft_block_size": 4096}),
            "oft_block_size",
        ),
    ] {
        let r = call(&s, "POST", "/v1/adapters", Some(&body), ADMIN);
        assert_error(&r, 400, Some(param));
    }
    // A 3 GiB (sparse) weights file is refused by its size, before it is read.
    let peft = dir.path().join("big");
    std::fs::create_dir(&peft).unwrap();
    std::fs::write(
        peft.join("adapter_config.json"),
        json!({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]})
            .to_string(),
    )
    .unwrap();
    let f = std::fs::File::create(peft.join("adapter_model.safetensors")).unwrap();
    f.set_len(3 << 30).unwrap();
    let r = call(
        &s,
        "POST",
        "/v1/load_lora_adapter",
        Some(&json!({"lora_name": "big", "lora_path": peft.to_str().unwrap()})),
        ADMIN,
    );
    let e = assert_error(&r, 400, Some("lora_path"));
    assert!(
        e["error"]["message"].as_str().unwrap().contains("limit"),
        "{e}"
    );
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert_eq!(s.get("/health").status, 200);
}

/// Creating an adapter named `name` is a 400 naming the parameter.
fn refuses_adapter_name(s: &Server, name: &str) {
    let body = json!({"name": name, "kind": "oft"});
    let r = call(s, "POST", "/v1/adapters", Some(&body), ADMIN);
    assert_error(&r, 400, Some("name"));
}

#[test]
fn names_keys_ids_and_codes_at_the_edge() {
    let (dir, path) = write_tiny(&spec());
    let s = start_learning(&path, &dir.path().join("data"), &learning_config(), &["l"]);
    for name in [".", "..", ".hidden"] {
        refuses_adapter_name(&s, name);
    }
    let r = call(&s, "POST", "/v1/adapters/../train", Some(&json!({})), ADMIN);
    assert_ne!(r.status / 100, 2, "{}", r.body_text());
    // The scheme is case-insensitive.
    let r = s
        .try_request(
            "GET",
            "/v1/train/status",
            None,
            &[("Authorization", &format!("bearer {USER}"))],
        )
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.body_text());
    // A huge unknown id is not echoed whole.
    let long = "x".repeat(100_000);
    let r = call(
        &s,
        "POST",
        "/v1/feedback",
        Some(&json!({"id": long, "reward": 1})),
        USER,
    );
    assert_eq!(r.status, 404);
    assert!(r.body.len() < 1000, "{} bytes", r.body.len());
    // Another key's completion: 403 saying so.
    let theirs = sample(&s, "l", 1, 2, ADMIN)["id"]
        .as_str()
        .unwrap()
        .to_string();
    let r = call(
        &s,
        "POST",
        "/v1/feedback",
        Some(&json!({"id": theirs, "reward": 1})),
        USER,
    );
    assert_eq!(
        assert_error(&r, 403, Some("id"))["error"]["code"],
        "not_owner"
    );
}

/// Read SSE from `sock` until `done` holds for the `data:` objects seen; all the text read.
fn read_sse_until(sock: &mut std::net::TcpStream, done: impl Fn(&[Value]) -> bool) -> String {
    let mut seen = String::new();
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let chunks: Vec<Value> = seen
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        if done(&chunks) {
            return seen;
        }
        assert!(Instant::now() < deadline, "{seen}");
        let n = std::io::Read::read(sock, &mut buf).unwrap();
        assert!(n > 0, "the stream ended early: {seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
}

#[test]
fn a_streamed_completion_is_recorded_when_its_last_choice_finishes() {
    // A long generation, so that it outlasts the reward posted after its first chunk.
    let long = common::TinySpec {
        ctx: 8192,
        ..common::TinySpec::small()
    };
    let (dir, path) = write_tiny(&long);
    let s = start_learning(&path, &dir.path().join("data"), &learning_config(), &["l"]);
    let body = json!({
        "model": "l", "messages": [{"role": "user", "content": "go"}],
        "n": 2, "max_tokens": 4000, "temperature": 1.0, "ignore_eos": true, "stream": true,
    });
    let auth = format!("Bearer {USER}");
    let mut sock = s
        .connect(
            "POST",
            "/v1/chat/completions",
            Some(&body.to_string()),
            &[("Authorization", &auth)],
        )
        .unwrap();
    // While it streams, the id is known but nothing is recorded yet: 404 saying when it will be.
    let seen = read_sse_until(&mut sock, |c| !c.is_empty());
    let first: Value =
        serde_json::from_str(seen.lines().find_map(|l| l.strip_prefix("data: ")).unwrap()).unwrap();
    let id = first["id"].as_str().unwrap().to_string();
    let e = assert_error(&reward(&s, &id, 2, 404), 404, Some("[0].id"));
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("finishes the last one"),
        "{e}"
    );
    // Once the chunk finishing the last choice has arrived, the reward is taken (read no
    // further first).
    let finished = |c: &[Value]| {
        c.iter()
            .filter(|v| v["choices"][0]["finish_reason"].is_string())
            .count()
            == 2
    };
    read_sse_until(&mut sock, finished);
    reward(&s, &id, 2, 202);
}

#[test]
fn a_16_stream_learning_run_counts_no_server_error() {
    let (dir, path) = write_tiny(&spec());
    let s = start_learning(&path, &dir.path().join("data"), &learning_config(), &["l"]);
    let workers: Vec<_> = (0..16)
        .map(|_| {
            let c = s.client.clone();
            std::thread::spawn(move || {
                for _ in 0..3 {
                    let body = json!({
                        "model": "l", "messages": [{"role": "user", "content": "go"}],
                        "n": 2, "max_tokens": 4, "temperature": 1.0, "ignore_eos": true,
                        "stream": true,
                    });
                    let r = call(&c, "POST", "/v1/chat/completions", Some(&body), USER);
                    assert_eq!(r.status, 200);
                    let id = r.sse_chunks()[0]["id"].as_str().unwrap().to_string();
                    reward(&c, &id, 2, 202);
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    wait_status(&s, "l", 60, |st| st["steps"].as_u64() >= Some(1));
    // The start-up's health polls (503 while loading) are probes, not API errors.
    let text = s.get("/metrics").body_text();
    let errors: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("flywheel_http_requests_total") && l.contains("status=\"5"))
        .collect();
    assert!(errors.is_empty(), "{errors:?}");
    assert!(!text.contains("route=\"/health\""), "probes counted");
}

/// Names as orchestrators write them (ART's `agent-001@3`, `org/model` paths): created, served,
/// trained online, checkpointed under one percent-encoded directory (never a raw path), and
/// reached by admin routes with the '/' percent-encoded; names that could escape stay refused.
#[test]
fn orchestrator_style_names_are_served_and_never_become_raw_paths() {
    let (dir, path) = write_tiny(&spec());
    let data = dir.path().join("data");
    let s = start_learning(&path, &data, &learning_config(), &["agent-001@3"]);
    // Serving and learning under the '@' name.
    let id = sample_and_reward(&s, "agent-001@3", 2);
    assert!(
        id.starts_with("cmpl-") || id.starts_with("chatcmpl-"),
        "{id}"
    );
    let st = wait_status(&s, "agent-001@3", 60, |st| st["steps"].as_u64() >= Some(1));
    let v = st["version"].as_u64().unwrap();
    assert!(data
        .join(format!("adapters/agent-001%403/v-{v:08}"))
        .is_dir());
    assert!(!data.join("adapters/agent-001@3").exists());
    // A '/' name through the admin API: one encoded directory component, never nested folders.
    let r = call(
        &s,
        "POST",
        "/v1/adapters",
        Some(&json!({"name": "org/tiny-lora", "kind": "lora"})),
        ADMIN,
    );
    assert_eq!(r.status / 100, 2, "{}", r.body_text());
    let r = call(
        &s,
        "POST",
        "/v1/chat/completions",
        Some(&chat(
            "hi",
            json!({"model": "org/tiny-lora", "max_tokens": 2}),
        )),
        USER,
    );
    assert_eq!(r.status, 200, "{}", r.body_text());
    assert_eq!(r.json()["adapter"], "org/tiny-lora");
    let r = call(&s, "GET", "/v1/adapters/org%2Ftiny-lora", None, USER);
    assert_eq!(r.status, 200, "{}", r.body_text());
    let r = call(&s, "GET", "/v1/models/org/tiny-lora", None, USER);
    assert_eq!(r.status, 200, "{}", r.body_text());
    for name in [
        "/abs",
        "a//b",
        "a/",
        "../x",
        "a b",
        "a\\b",
        &"x".repeat(129),
    ] {
        refuses_adapter_name(&s, name);
    }
}

/// The split of the cores with serving is a policy a user sets and sees: configured, read back,
/// replaced by the admin only (a bad field named), in force in the metrics, shown in the status;
/// what it measures (steps per minute, the fraction of rewarded completions trained) follows a
/// real step.
#[test]
fn the_share_policy_is_set_seen_and_measured() {
    let (dir, path) = write_tiny(&spec());
    let cfg = config(
        "max_off_policy_steps = 1000\ntrain_target_steps_per_minute = 6\ntrain_itl_budget = 1.5",
    );
    let s = start_learning(&path, &dir.path().join("data"), &cfg, &["p"]);
    let v = call(&s, "GET", "/v1/train/policy", None, USER).json();
    assert_eq!(v["object"], "train.policy");
    assert_eq!(v["policy"]["target_steps_per_minute"], 6.0);
    assert_eq!(v["policy"]["itl_budget"], 1.5);
    assert_eq!(
        (v["steered"].clone(), v["train_share"].clone()),
        (json!(true), json!(0.25))
    );
    // Only the admin replaces it; a bad or unknown field is named.
    let body = json!({"train_share": 0.5, "max_stale_fraction": 0.2});
    assert_eq!(
        call(&s, "PUT", "/v1/train/policy", Some(&body), USER).status,
        401
    );
    let bad = json!({"itl_budget": 0.5});
    assert_error(
        &call(&s, "PUT", "/v1/train/policy", Some(&bad), ADMIN),
        400,
        Some("itl_budget"),
    );
    let r = call(
        &s,
        "PUT",
        "/v1/train/policy",
        Some(&json!({"share": 1})),
        ADMIN,
    );
    assert_eq!(r.status, 400);
    assert!(r.body_text().contains("share"), "{}", r.body_text());
    let r = call(&s, "PUT", "/v1/train/policy", Some(&body), ADMIN);
    assert_eq!(r.status, 200, "{}", r.body_text());
    let v = r.json();
    assert_eq!(v["train_share"], 0.5);
    assert_eq!(v["policy"]["max_stale_fraction"], 0.2);
    // Replaced as a whole: the target and budget not given are gone.
    assert_eq!(v["policy"]["target_steps_per_minute"], Value::Null);
    assert_eq!(s.metric("flywheel_train_share"), 0.5);
    let st = call(&s, "GET", "/v1/train/status", None, USER).json();
    assert_eq!(st["policy"]["train_share"], 0.5);
    // One group trains; the policy's next period counts its step and its two completions.
    let id = sample(&s, "p", 2, 4, USER)["id"]
        .as_str()
        .unwrap()
        .to_string();
    reward(&s, &id, 2, 202);
    wait_status(&s, "p", 60, |st| st["steps"].as_u64() >= Some(1));
    assert_eq!(
        s.metric("flywheel_train_samples_trained_total{adapter=\"p\"}"),
        2.0
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let v = loop {
        let v = call(&s, "GET", "/v1/train/policy", None, USER).json();
        if v["trained_fraction"].is_number() || Instant::now() > deadline {
            break v;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(v["trained_fraction"], 1.0, "{v}");
    assert!(v["steps_per_minute"].as_f64().unwrap() > 0.0, "{v}");
    assert!(s.metric("flywheel_train_steps_per_minute") > 0.0);
}

/// A rewarded group larger than `max_step_tokens` (16 completions of 40 tokens against a bound of
/// 64) is trained whole, in passes that each hold at most the bound: one step, every member
/// trained, the status saying how many passes and the largest. (It was taken whole into one
/// pass: a 9,600-token step on a 135M model needed 3.8 GB, and under a memory limit the server
/// died on every restart while the group stayed pending.)
#[test]
fn a_group_over_the_step_bound_is_trained_in_passes_within_it() {
    let (dir, path) = write_tiny(&spec());
    let s = start_learning(
        &path,
        &dir.path().join("data"),
        &config("max_off_policy_steps = 1000\nmax_step_tokens = 64"),
        &["l"],
    );
    let r = sample(&s, "l", 16, 40, USER);
    let id = r["id"].as_str().unwrap();
    let tokens = r["usage"]["prompt_tokens"].as_u64().unwrap() + 40;
    assert!(tokens * 16 > 4 * 64, "{tokens} tokens a member");
    let items: Vec<Value> = (0..16)
        .map(|i| json!({"id": id, "choice": i, "reward": (i % 3) as f64}))
        .collect();
    let f = call(&s, "POST", "/v1/feedback", Some(&Value::Array(items)), USER);
    assert_eq!(f.status, 202, "{}", f.body_text());
    let st = wait_status(&s, "l", 60, |st| st["steps"] == 1);
    assert_eq!(st["trained"], 16, "{st}");
    let last = &st["last"];
    assert_eq!(last["sequences"], 16, "{st}");
    assert!(last["micro_batches"].as_u64().unwrap() >= 4, "{st}");
    let most = last["max_micro_batch_tokens"].as_u64().unwrap();
    assert!(most <= 64 || most == tokens, "{st}");
    assert!(last["loss"].as_f64().unwrap().is_finite(), "{st}");
}
