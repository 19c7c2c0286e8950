//! End-to-end tests of `flywheel serve` over real HTTP on 127.0.0.1, on tiny generated models:
//! errors, auth, overload, cancellation, preemption and shutdown.

mod common;

use common::server::*;
use common::{write_tiny, TinySpec};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

#[test]
fn bad_requests_get_openai_errors_naming_the_field() {
    let (_d, s) = start(CONFIG, &[]);
    let cases: Vec<(Value, &str)> = vec![
        (json!({"temperature": "hot"}), "temperature"),
        (json!({"temperature": -0.5}), "temperature"),
        (json!({"top_p": 0}), "top_p"),
        (json!({"top_p": 1.5}), "top_p"),
        (json!({"n": 0}), "n"),
        (json!({"max_tokens": 0}), "max_tokens"),
        (json!({"max_tokens": 600}), "max_tokens"),
        (json!({"stop": 5}), "stop"),
        (json!({"top_logprobs": 3}), "top_logprobs"),
        (
            json!({"logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
        (json!({"messages": []}), "messages"),
        (
            json!({"messages": [{"role": "wizard", "content": "x"}]}),
            "messages[0]",
        ),
        (json!({"stop_token_ids": [99999]}), "stop_token_ids"),
    ];
    for (extra, param) in cases {
        let r = s.post("/v1/chat/completions", &chat("x", extra.clone()));
        assert_error(&r, 400, Some(param));
    }
    // Unknown fields are ignored.
    let r = s.post(
        "/v1/chat/completions",
        &chat("x", json!({"made_up_field": 1})),
    );
    assert_eq!(r.status, 200);
    // A prompt longer than the context.
    let long = "a ".repeat(600);
    let r = s.post("/v1/completions", &json!({"model": "tiny", "prompt": long}));
    assert_error(&r, 400, Some("prompt"));
    let r = s.post(
        "/v1/completions",
        &json!({"model": "tiny", "prompt": [1, 2, 70000]}),
    );
    assert_error(&r, 400, Some("prompt"));
    // Not JSON, unknown model, unknown route.
    let r = s
        .try_request("POST", "/v1/chat/completions", Some("{not json"), &[])
        .unwrap();
    assert_error(&r, 400, None);
    let mut b = chat("x", json!({}));
    b["model"] = json!("gpt-9");
    assert_error(&s.post("/v1/chat/completions", &b), 404, Some("model"));
    assert_error(&s.get("/v1/nothing"), 404, None);
}

#[test]
fn api_key_is_required_when_set() {
    let (_d, s) = start(CONFIG, &["--api-key", "sekrit"]);
    let body = chat("x", json!({})).to_string();
    for h in [
        vec![],
        vec![("Authorization", "Bearer wrong")],
        vec![("Authorization", "sekrit")],
    ] {
        let r = s
            .try_request("POST", "/v1/chat/completions", Some(&body), &h)
            .unwrap();
        assert_error(&r, 401, None);
        assert_eq!(r.header("www-authenticate"), Some("Bearer"));
    }
    assert_error(&s.get("/v1/models"), 401, None);
    let ok = s
        .try_request(
            "POST",
            "/v1/chat/completions",
            Some(&body),
            &[("Authorization", "Bearer sekrit")],
        )
        .unwrap();
    assert_eq!(ok.status, 200);
    // The Tinker SDK's header carries the key as well.
    let ok = s
        .try_request(
            "POST",
            "/v1/chat/completions",
            Some(&body),
            &[("X-API-Key", "sekrit")],
        )
        .unwrap();
    assert_eq!(ok.status, 200);
    let r = s
        .try_request("GET", "/v1/models", None, &[("X-API-Key", "wrong")])
        .unwrap();
    assert_error(&r, 401, None);
    assert_eq!(s.get("/health").status, 200, "health stays open");
}

#[test]
fn a_flood_gets_429_with_retry_after() {
    let config = format!("{CONFIG}\n");
    let config = config.replace(
        "[server]\n",
        "[server]\nmax_pending_requests = 2\nretry_after_secs = 3\n",
    );
    let (_d, s) = start_long(&config);
    let addr = s.addr.clone();
    let handles: Vec<_> = (0..12)
        .map(|_| {
            let c = common::server::Server::client_for(&addr);
            std::thread::spawn(move || {
                let r = c.post(
                    "/v1/completions",
                    &json!({"model": "tiny", "prompt": "flood", "max_tokens": 4000, "ignore_eos": true}),
                );
                (r.status, r.header("retry-after").map(str::to_string), r.body_text())
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let ok = results.iter().filter(|r| r.0 == 200).count();
    let limited: Vec<_> = results.iter().filter(|r| r.0 == 429).collect();
    assert!(ok >= 1, "{results:?}");
    assert!(
        !limited.is_empty(),
        "no 429 among {:?}",
        results.iter().map(|r| r.0).collect::<Vec<_>>()
    );
    assert_eq!(ok + limited.len(), 12);
    for (_, retry, body) in limited {
        assert_eq!(retry.as_deref(), Some("3"));
        let v: Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["type"], "rate_limit_error");
    }
}

#[test]
fn a_client_that_disconnects_mid_stream_frees_its_blocks() {
    let (_d, s) = start_long(CONFIG);
    let body = json!({"model": "tiny", "prompt": "go on", "max_tokens": 8000, "ignore_eos": true,
                      "stream": true})
    .to_string();
    let mut sock = s
        .connect("POST", "/v1/completions", Some(&body), &[])
        .unwrap();
    let mut buf = [0u8; 2048];
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !String::from_utf8_lossy(&got).contains("data: ") {
        use std::io::Read;
        let n = sock.read(&mut buf).unwrap();
        assert!(n > 0 && Instant::now() < deadline, "stream ended early");
        got.extend_from_slice(&buf[..n]);
    }
    drop(sock);
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.metric("flywheel_request_success_total{finished_reason=\"abort\"}") < 1.0 {
        assert!(Instant::now() < deadline, "the request was not aborted");
        std::thread::sleep(Duration::from_millis(5));
    }
    // Blocks are freed in the step that notices the disconnect; the gauge follows that step.
    wait_for_no_blocks(&s);
    assert_eq!(s.metric("flywheel_num_requests_running"), 0.0);
    assert!(s.metric("flywheel_generation_tokens_total") < 8000.0);
}

#[test]
fn preemption_under_memory_pressure_still_completes_every_request() {
    // 8 layers: 8 * 16 tokens * 32 kv dims * 8 bytes = 32 KiB per block, so 1 MiB holds 32
    // blocks = 512 tokens, one full context. The 4 choices of one request run together and need
    // 4 * ~405 tokens: they must take turns through preemption.
    let (_d, path) = write_tiny(&TinySpec {
        ctx: 512,
        layers: 8,
        ..TinySpec::small()
    });
    let config = "[server]\nserved_model_name = \"tiny\"\n[engine]\nkv_cache_mb = 1\n";
    let s = Server::start(&path, config, &[]);
    let v = s
        .post(
            "/v1/completions",
            &json!({"model": "tiny", "prompt": "pressure", "max_tokens": 400, "n": 4,
                    "ignore_eos": true, "seed": 9, "return_token_ids": true}),
        )
        .json();
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    for c in choices {
        assert_eq!(c["token_ids"].as_array().unwrap().len(), 400, "{c}");
    }
    assert!(s.metric("flywheel_num_preemptions_total") > 0.0);
    wait_for_no_blocks(&s);
    // Recomputation after preemption changes nothing: the same request on a server with room to
    // spare gives the same tokens.
    let roomy = Server::start(&path, CONFIG, &[]);
    let w = roomy
        .post(
            "/v1/completions",
            &json!({"model": "tiny", "prompt": "pressure", "max_tokens": 400, "n": 4,
                    "ignore_eos": true, "seed": 9, "return_token_ids": true}),
        )
        .json();
    assert_eq!(roomy.metric("flywheel_num_preemptions_total"), 0.0);
    for (a, b) in choices.iter().zip(w["choices"].as_array().unwrap()) {
        assert_eq!(a["token_ids"], b["token_ids"]);
    }
}

#[test]
fn sigterm_lets_running_requests_finish_then_exits() {
    let (_d, mut s) = start_long(CONFIG);
    let addr = s.addr.clone();
    let c = common::server::Server::client_for(&addr);
    let h = std::thread::spawn(move || {
        c.post(
            "/v1/completions",
            &json!({"model": "tiny", "prompt": "finish me", "max_tokens": 4000, "ignore_eos": true}),
        )
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.metric("flywheel_num_requests_running") < 1.0 {
        assert!(Instant::now() < deadline, "request never started");
        std::thread::sleep(Duration::from_millis(2));
    }
    s.terminate();
    let r = h.join().unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["usage"]["completion_tokens"], 4000);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(st) = s.child.try_wait().unwrap() {
            assert!(st.success(), "{}", s.stderr());
            break;
        }
        assert!(Instant::now() < deadline, "server did not exit");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn sigterm_exits_after_the_shutdown_timeout_even_with_work_left() {
    let config = CONFIG.replace("[server]\n", "[server]\nshutdown_timeout_secs = 0.3\n");
    let (_d, mut s) = start_long(&config);
    let c = common::server::Server::client_for(&s.addr);
    let h = std::thread::spawn(move || {
        c.try_request(
            "POST",
            "/v1/completions",
            Some(
                &json!({"model": "tiny", "prompt": "never done", "max_tokens": 8000, "n": 8,
                        "ignore_eos": true, "stream": true})
                .to_string(),
            ),
            &[],
        )
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.metric("flywheel_num_requests_running") < 1.0 {
        assert!(Instant::now() < deadline, "request never started");
        std::thread::sleep(Duration::from_millis(2));
    }
    let t = Instant::now();
    s.terminate();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if s.child.try_wait().unwrap().is_some() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "server did not exit after its timeout"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        t.elapsed() >= Duration::from_millis(300),
        "exited before the timeout"
    );
    // The stream was cut: no [DONE].
    if let Ok(r) = h.join().unwrap() {
        assert!(!r.body_text().contains("[DONE]"));
    }
}

fn post_as(c: &Client, key: &str, path: &str, body: &Value) -> common::server::Response {
    let auth = format!("Bearer {key}");
    c.try_request(
        "POST",
        path,
        Some(&body.to_string()),
        &[("Authorization", &auth)],
    )
    .expect("request")
}

/// `max_pending_requests` counts requests, not prompts: a completions request of 60 prompts is
/// one of the 4, and three one-line chats beside it are all served. A request of more sequences
/// (prompts × n) than one may hold is a 400 naming `n` — retrying could never succeed — not a 429.
#[test]
fn a_request_of_many_prompts_counts_once_and_one_too_large_is_a_400() {
    let config = CONFIG.replace(
        "[server]\n",
        "[server]\nmax_pending_requests = 4\nmax_sequences_per_request = 64\n",
    );
    let (_d, s) = start_long(&config);
    let c = s.client.clone();
    let big = std::thread::spawn(move || {
        let prompts: Vec<String> = (0..60).map(|i| format!("prompt {i}")).collect();
        c.post(
            "/v1/completions",
            &json!({"model": "tiny", "prompt": prompts, "max_tokens": 300, "ignore_eos": true}),
        )
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    while s.metric("flywheel_num_requests_running") < 8.0 {
        assert!(Instant::now() < deadline, "the big request never ran");
        std::thread::sleep(Duration::from_millis(5));
    }
    let chats: Vec<_> = (0..3)
        .map(|i| {
            let c = s.client.clone();
            std::thread::spawn(move || {
                c.post(
                    "/v1/chat/completions",
                    &chat(&format!("hi {i}"), json!({"max_tokens": 4})),
                )
            })
        })
        .collect();
    for h in chats {
        let r = h.join().unwrap();
        assert_eq!(r.status, 200, "{}", r.body_text());
    }
    let r = big.join().unwrap();
    assert_eq!(r.status, 200, "{}", r.body_text());
    assert_eq!(r.json()["choices"].as_array().unwrap().len(), 60);
    let prompts: Vec<String> = (0..20).map(|i| format!("p{i}")).collect();
    let r = s.post(
        "/v1/completions",
        &json!({"model": "tiny", "prompt": prompts, "n": 4, "max_tokens": 2}),
    );
    let e = assert_error(&r, 400, Some("n"));
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("at most 64"),
        "{e}"
    );
}

/// One client floods (8 requests of n = 16 × 3,000 tokens at once: 128 sequences, eight times
/// what the engine runs at a time) while another sends one-line chats. The flood's requests past
/// its share (6 of the 8 the server admits) get 429; the other client is never refused, and
/// each of its chats is served within a bound: it takes a slot from the flood at the next step
/// (the flood's newest sequence is preempted), so it waits for a few steps, not for the flood's
/// sequences to finish. Stated bound: a 4-token chat ends within 1/4 of the time the flood has
/// been running by then (and 5 s).
#[test]
fn a_flooding_client_does_not_lock_out_another() {
    let config = CONFIG.replace("[server]\n", "[server]\nmax_pending_requests = 8\n")
        + "max_num_seqs = 16\n";
    let (_d, s) = start_long(&config);
    let t0 = Instant::now();
    let body = json!({"model": "tiny", "prompt": "flood", "n": 16, "max_tokens": 3000,
                      "ignore_eos": true})
    .to_string();
    let mut flood = Vec::new();
    let mut refused = 0;
    for _ in 0..8 {
        let mut sock = s
            .connect(
                "POST",
                "/v1/completions",
                Some(&body),
                &[("Authorization", "Bearer flood")],
            )
            .unwrap();
        // Admission is decided before the response starts: a refusal comes back at once.
        sock.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        let mut head = [0u8; 12];
        use std::io::Read;
        match sock.read(&mut head) {
            Ok(n) if n > 0 => {
                assert!(
                    head.starts_with(b"HTTP/1.1 429"),
                    "{:?}",
                    String::from_utf8_lossy(&head)
                );
                refused += 1;
            }
            _ => flood.push(sock),
        }
    }
    assert_eq!((flood.len(), refused), (6, 2));
    let deadline = Instant::now() + Duration::from_secs(30);
    while s.metric("flywheel_num_requests_running") < 16.0 {
        assert!(Instant::now() < deadline, "the flood never ran");
        std::thread::sleep(Duration::from_millis(5));
    }
    for i in 0..3 {
        let t = Instant::now();
        let r = post_as(
            &s.client,
            "chat",
            "/v1/chat/completions",
            &chat(
                &format!("hello {i}"),
                json!({"max_tokens": 4, "ignore_eos": true}),
            ),
        );
        let took = t.elapsed();
        assert_eq!(r.status, 200, "{}", r.body_text());
        let flooding = t0.elapsed();
        eprintln!("chat {i}: {took:?} after {flooding:?} of flood");
        assert!(
            took < Duration::from_secs(5) && took * 4 < flooding,
            "chat {i} took {took:?} while the flood ran {flooding:?}"
        );
    }
    // The flood is still running: the chats did not just wait for it to end.
    assert!(s.metric("flywheel_num_requests_waiting") > 0.0);
    drop(flood);
}

/// Readiness means ready: when `/health` first answers 200, the engine's KV cache (768 MB here)
/// is allocated and every page of it touched (it was touched after readiness, for seconds under
/// load, while requests were already admitted).
#[test]
fn health_is_ready_only_once_the_kv_cache_is_in_memory() {
    let config = CONFIG.replace("kv_cache_mb = 16", "kv_cache_mb = 768");
    let (_d, s) = start(&config, &[]);
    let status = std::fs::read_to_string(format!("/proc/{}/status", s.child.id())).unwrap();
    let rss_kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap();
    assert!(rss_kb > 700 << 10, "RSS {rss_kb} kB at readiness");
}
