//! End-to-end tests of `flywheel serve` over real HTTP on 127.0.0.1, on tiny generated models.

mod common;

use common::server::Server;
use common::{write_tiny, TinySpec};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const CONFIG: &str = r#"
[server]
served_model_name = "tiny"
[engine]
kv_cache_mb = 16
max_num_batched_tokens = 64
"#;

fn spec() -> TinySpec {
    TinySpec {
        ctx: 512,
        ..TinySpec::small()
    }
}

/// A long context, so that a generation can outlast what the test does meanwhile.
fn start_long(config: &str) -> (tempfile::TempDir, Server) {
    let (dir, path) = write_tiny(&TinySpec {
        ctx: 8192,
        ..TinySpec::small()
    });
    let s = Server::start(&path, config, &[]);
    (dir, s)
}

fn start(config: &str, args: &[&str]) -> (tempfile::TempDir, Server) {
    let (dir, path) = write_tiny(&spec());
    let s = Server::start(&path, config, args);
    (dir, s)
}

/// The KV gauge is updated after the engine step that sent the last tokens: poll it (bounded).
fn wait_for_no_blocks(s: &Server) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.metric("flywheel_kv_cache_blocks_used") > 0.0 {
        assert!(Instant::now() < deadline, "KV blocks still held");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn chat(content: &str, extra: Value) -> Value {
    let mut b = json!({
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 24,
    });
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

fn assert_error(r: &common::server::Response, status: u16, param: Option<&str>) -> Value {
    assert_eq!(r.status, status, "{}", r.body_text());
    let e = r.json();
    let err = &e["error"];
    for k in ["message", "type", "param", "code"] {
        assert!(err.get(k).is_some(), "error body lacks {k}: {e}");
    }
    assert!(err["message"].as_str().is_some_and(|m| !m.is_empty()));
    if let Some(p) = param {
        assert_eq!(err["param"], json!(p), "{e}");
    }
    e
}

#[test]
fn chat_and_completions_answer_in_openai_shape() {
    let (_d, s) = start(CONFIG, &[]);
    let r = s.post(
        "/v1/chat/completions",
        &chat(
            "hello there",
            json!({"temperature": 0, "logprobs": true, "top_logprobs": 3, "return_token_ids": true}),
        ),
    );
    assert_eq!(r.status, 200, "{}", r.body_text());
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "tiny");
    let id = v["id"].as_str().unwrap();
    assert!(id.starts_with("chatcmpl-") && id.len() == 9 + 32, "{id}");
    let c = &v["choices"][0];
    assert_eq!(c["message"]["role"], "assistant");
    let ids = c["token_ids"].as_array().unwrap();
    let lps = c["logprobs"]["content"].as_array().unwrap();
    assert_eq!(ids.len(), lps.len());
    assert_eq!(v["usage"]["completion_tokens"], json!(ids.len()));
    let prompt_ids = v["prompt_token_ids"].as_array().unwrap();
    assert_eq!(v["usage"]["prompt_tokens"], json!(prompt_ids.len()));
    for lp in lps {
        let top = lp["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        // Greedy: the chosen token is the most likely one, and its log-prob heads the list.
        assert_eq!(top[0]["logprob"], lp["logprob"]);
        assert!(lp["logprob"].as_f64().unwrap() <= 0.0);
    }
    let fr = c["finish_reason"].as_str().unwrap();
    assert!(fr == "length" && ids.len() == 24 || fr == "stop", "{fr}");
    // The text is the detokenized tokens: /detokenize agrees.
    let d = s.post(
        "/detokenize",
        &json!({"tokens": ids.iter().filter(|t| t.as_u64() != Some(2)).collect::<Vec<_>>()}),
    );
    assert_eq!(d.json()["prompt"], c["message"]["content"]);

    // Completions from token ids, with echo and legacy logprobs.
    let r = s.post(
        "/v1/completions",
        &json!({"model": "tiny", "prompt": [40, 41, 42], "max_tokens": 5, "echo": true,
                "logprobs": 2, "temperature": 0, "ignore_eos": true}),
    );
    assert_eq!(r.status, 200, "{}", r.body_text());
    let v = r.json();
    assert_eq!(v["object"], "text_completion");
    let c = &v["choices"][0];
    let echo = s
        .post("/detokenize", &json!({"tokens": [40, 41, 42]}))
        .json()["prompt"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(c["text"].as_str().unwrap().starts_with(&echo));
    assert_eq!(c["logprobs"]["tokens"].as_array().unwrap().len(), 5);
    assert_eq!(c["finish_reason"], "length");
    assert_eq!(v["usage"]["prompt_tokens"], 3);

    // Log-prob tokens as ids, for clients that must not re-tokenize text.
    let r = s
        .post(
            "/v1/chat/completions",
            &chat(
                "ids please",
                json!({"logprobs": true, "top_logprobs": 2, "return_tokens_as_token_ids": true,
                       "return_token_ids": true, "max_tokens": 6, "ignore_eos": true}),
            ),
        )
        .json();
    let c = &r["choices"][0];
    let want: Vec<String> = c["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| format!("token_id:{t}"))
        .collect();
    let got: Vec<String> = c["logprobs"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["token"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(got, want);

    // Models, tokenize.
    let m = s.get("/v1/models").json();
    assert_eq!(m["data"][0]["id"], "tiny");
    let t = s.post("/tokenize", &json!({"prompt": "hello"})).json();
    assert_eq!(t["count"], json!(t["tokens"].as_array().unwrap().len()));
    assert_eq!(t["max_model_len"], 512);
}

#[test]
fn streaming_matches_non_streaming_and_reports_usage() {
    let (_d, s) = start(CONFIG, &[]);
    let body = chat(
        "stream me",
        json!({"seed": 5, "temperature": 1.0, "return_token_ids": true, "ignore_eos": true}),
    );
    let full = s.post("/v1/chat/completions", &body).json();
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    sb["stream_options"] = json!({"include_usage": true});
    let r = s.post("/v1/chat/completions", &sb);
    assert_eq!(r.status, 200);
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    let data = r.sse_data();
    assert_eq!(data.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let mut text = String::new();
    let mut ids = Vec::new();
    let mut finish = None;
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["id"], chunks[0]["id"]);
        if let Some(ch) = c["choices"].as_array().unwrap().first() {
            text.push_str(ch["delta"]["content"].as_str().unwrap_or(""));
            ids.extend(ch["token_ids"].as_array().cloned().unwrap_or_default());
            if !ch["finish_reason"].is_null() {
                finish = Some(ch["finish_reason"].clone());
            }
        }
    }
    let usage = chunks.last().unwrap();
    assert!(usage["choices"].as_array().unwrap().is_empty());
    assert_eq!(usage["usage"]["completion_tokens"], 24);
    assert_eq!(
        text,
        full["choices"][0]["message"]["content"].as_str().unwrap()
    );
    assert_eq!(json!(ids), full["choices"][0]["token_ids"]);
    assert_eq!(finish, Some(json!("length")));
}

#[test]
fn n_choices_share_a_prefill_and_seeds_reproduce_whatever_the_batch() {
    let (_d, s) = start(CONFIG, &[]);
    let body = |n: usize, seed: u64| {
        chat(
            "tell me something",
            json!({"n": n, "seed": seed, "temperature": 1.0, "ignore_eos": true, "return_token_ids": true}),
        )
    };
    let alone = s.post("/v1/chat/completions", &body(1, 42)).json();
    let many = s.post("/v1/chat/completions", &body(3, 42)).json();
    let ch = many["choices"].as_array().unwrap();
    assert_eq!(ch.len(), 3);
    for (i, c) in ch.iter().enumerate() {
        assert_eq!(c["index"], json!(i));
        assert_eq!(c["token_ids"].as_array().unwrap().len(), 24);
    }
    // Choice 0 draws with the request's seed itself; the others differ.
    assert_eq!(ch[0]["token_ids"], alone["choices"][0]["token_ids"]);
    assert_ne!(ch[1]["token_ids"], ch[0]["token_ids"]);
    assert_ne!(ch[2]["token_ids"], ch[1]["token_ids"]);
    assert_eq!(many["usage"]["completion_tokens"], 72);

    // The same seeded request while other requests fill the batch gives the same tokens.
    let addr = s.addr.clone();
    let noise: Vec<_> = (0..4)
        .map(|i| {
            let s2 = common::server::Server::client_for(&addr);
            std::thread::spawn(move || {
                s2.post(
                    "/v1/chat/completions",
                    &chat(
                        &format!("other prompt {i} with more words in it"),
                        json!({"max_tokens": 40, "temperature": 1.0, "ignore_eos": true}),
                    ),
                )
                .status
            })
        })
        .collect();
    let mixed = s.post("/v1/chat/completions", &body(1, 42)).json();
    for h in noise {
        assert_eq!(h.join().unwrap(), 200);
    }
    assert_eq!(
        mixed["choices"][0]["token_ids"],
        alone["choices"][0]["token_ids"]
    );
}

#[test]
fn stop_strings_and_stop_tokens_end_generation() {
    let (_d, s) = start(CONFIG, &[]);
    let base = json!({"model": "tiny", "prompt": "hello world", "max_tokens": 40,
                      "temperature": 0, "ignore_eos": true, "return_token_ids": true});
    let full = s.post("/v1/completions", &base).json();
    let text = full["choices"][0]["text"].as_str().unwrap().to_string();
    let ids = full["choices"][0]["token_ids"].as_array().unwrap().clone();
    // A stop string taken from the middle of the greedy text.
    let chars: Vec<char> = text.chars().collect();
    let stop: String = (6..chars.len() - 2)
        .map(|i| chars[i..i + 2].iter().collect::<String>())
        .find(|cand| text.find(cand.as_str()).unwrap() >= 6 && !cand.contains('\u{fffd}'))
        .expect("a usable stop string");
    let at = text.find(&stop).unwrap();
    let mut b = base.clone();
    b["stop"] = json!([stop.clone(), "never-appears"]);
    let v = s.post("/v1/completions", &b).json();
    let c = &v["choices"][0];
    assert_eq!(c["text"].as_str().unwrap(), &text[..at]);
    assert_eq!(c["finish_reason"], "stop");
    assert_eq!(c["stop_reason"], json!(stop));
    // A stop token id: generation ends on it (it is the last token; no text for it).
    let tok = ids[10].as_u64().unwrap();
    let first = ids.iter().position(|t| t.as_u64() == Some(tok)).unwrap();
    let mut b = base.clone();
    b["stop_token_ids"] = json!([tok]);
    let v = s.post("/v1/completions", &b).json();
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "stop");
    assert_eq!(c["stop_reason"], json!(tok));
    assert_eq!(c["token_ids"].as_array().unwrap().len(), first + 1);
}

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
fn prefix_cache_hits_and_metrics_are_reported() {
    let (_d, s) = start(CONFIG, &[]);
    let body = json!({"model": "tiny", "prompt": "a shared prefix of many bytes, long enough for blocks",
                      "max_tokens": 4, "ignore_eos": true});
    let first = s.post("/v1/completions", &body).json();
    let second = s.post("/v1/completions", &body).json();
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached >= 32, "{second}");
    assert!(s.metric("flywheel_prefix_cache_hits_total") >= cached as f64);
    let m = s.get("/metrics").body_text();
    for name in [
        "flywheel_time_to_first_token_seconds_bucket",
        "flywheel_inter_token_latency_seconds_count",
        "flywheel_e2e_request_latency_seconds_sum",
        "flywheel_request_queue_time_seconds_count",
        "flywheel_num_requests_waiting",
        "flywheel_kv_cache_blocks_total",
        "flywheel_kv_cache_usage_perc",
        "flywheel_prompt_tokens_total",
        "flywheel_generation_tokens_total",
        "flywheel_num_preemptions_total",
    ] {
        assert!(m.contains(name), "{name} missing from /metrics");
    }
    assert_eq!(s.metric("flywheel_generation_tokens_total"), 8.0);
    assert_eq!(
        s.metric("flywheel_request_success_total{finished_reason=\"length\"}"),
        2.0
    );
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
