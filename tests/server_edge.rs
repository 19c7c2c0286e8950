//! The HTTP edge under hostile input (defects found by fuzzing): integers out of range, logit
//! biases, body limits and media types, method errors, slow clients and the connection cap.

mod common;

use common::server::*;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

const EDGE: &str = r#"
[server]
served_model_name = "tiny"
max_body_mb = 0.01
header_read_timeout_secs = 1.0
body_read_timeout_secs = 1.0
max_connections = 6
[engine]
kv_cache_mb = 16
max_num_batched_tokens = 64
"#;

fn completion(extra: Value) -> Value {
    let mut b = json!({"model": "tiny", "prompt": "hello", "max_tokens": 4});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

#[test]
fn integers_out_of_range_are_400s_quoting_the_value_and_whole_floats_count() {
    let (_d, s) = start(EDGE, &[]);
    for (field, raw) in [
        ("max_tokens", "9223372036854775808"),
        ("max_completion_tokens", "18446744073709551615"),
        ("top_k", "18446744073709551615"),
        ("n", "1e30"),
        ("top_logprobs", "-9223372036854775809"),
        ("seed", "18446744073709551616"),
    ] {
        let mut b = chat("x", json!({}));
        b.as_object_mut().unwrap().remove("max_tokens");
        if field == "top_logprobs" {
            b["logprobs"] = json!(true);
        }
        let text = b
            .to_string()
            .replacen('{', &format!("{{\"{field}\": {raw},"), 1);
        let r = s
            .try_request("POST", "/v1/chat/completions", Some(&text), &[])
            .unwrap();
        let e = assert_error(&r, 400, Some(field));
        let msg = e["error"]["message"].as_str().unwrap();
        // Quoted as sent (beyond 64 bits JSON numbers are read as doubles).
        if raw.parse::<u64>().is_ok() {
            assert!(msg.contains(raw), "{field}: {msg}");
        }
    }
    let text =
        completion(json!({}))
            .to_string()
            .replacen('{', "{\"logprobs\": 18446744073709551615,", 1);
    let r = s
        .try_request("POST", "/v1/completions", Some(&text), &[])
        .unwrap();
    assert_error(&r, 400, Some("logprobs"));
    // Whole-number floats are integers (JSON Schema); fractions are not.
    let r = s.post(
        "/v1/chat/completions",
        &chat("x", json!({"max_tokens": 4.0})),
    );
    assert_eq!(r.status, 200, "{}", r.body_text());
    assert!(r.json()["usage"]["completion_tokens"].as_u64().unwrap() <= 4);
    let r = s.post(
        "/v1/chat/completions",
        &chat("x", json!({"max_tokens": 4.5})),
    );
    assert_error(&r, 400, Some("max_tokens"));
    // The largest 64-bit seed is a seed.
    let r = s.post(
        "/v1/completions",
        &completion(json!({"seed": 18446744073709551615u64})),
    );
    assert_eq!(r.status, 200, "{}", r.body_text());
}

#[test]
fn every_present_field_is_validated() {
    let (_d, s) = start(EDGE, &[]);
    let both = json!({"max_tokens": "abc", "max_completion_tokens": 3});
    let r = s.post("/v1/chat/completions", &chat("x", both.clone()));
    assert_error(&r, 400, Some("max_tokens"));
    let r = s.post("/v1/completions", &completion(both));
    assert_error(&r, 400, Some("max_tokens"));
}

#[test]
fn logit_bias_is_applied_and_bad_values_are_400s() {
    let (_d, s) = start(EDGE, &[]);
    for bad in [
        json!("x"),
        json!([1, 2]),
        json!({"abc": 5}),
        json!({"5": "x"}),
        json!({"5": 1e308}),
        json!({"5": -100.5}),
        json!({"99999999": 1}),
        Value::Object((0..301).map(|i| (i.to_string(), json!(1))).collect()),
    ] {
        let r = s.post(
            "/v1/completions",
            &completion(json!({"logit_bias": bad.clone()})),
        );
        assert_error(&r, 400, Some("logit_bias"));
    }
    // NaN is not JSON: the body is refused as a whole.
    let text = completion(json!({}))
        .to_string()
        .replacen('{', "{\"logit_bias\": {\"5\": NaN},", 1);
    let r = s
        .try_request("POST", "/v1/completions", Some(&text), &[])
        .unwrap();
    assert_error(&r, 400, None);
    // Greedy: the first token is T; with T at −100 it is something else; +100 forces a token.
    let first = |extra: Value| -> u64 {
        let r = s.post(
            "/v1/completions",
            &completion(json!({"temperature": 0, "return_token_ids": true, "max_tokens": 1}))
                .as_object()
                .unwrap()
                .clone()
                .into_iter()
                .chain(extra.as_object().unwrap().clone())
                .collect::<serde_json::Map<_, _>>()
                .into(),
        );
        assert_eq!(r.status, 200, "{}", r.body_text());
        r.json()["choices"][0]["token_ids"][0].as_u64().unwrap()
    };
    let t = first(json!({}));
    let other = first(json!({"logit_bias": {t.to_string(): -100}}));
    assert_ne!(other, t, "a −100 bias must keep token {t} out");
    let forced = (t + 7) % 200 + 3;
    assert_eq!(
        first(json!({"logit_bias": {forced.to_string(): 100}})),
        forced
    );
}

/// A temperature of 1e-45 (found by fuzzing: every log-prob came back null) is greedy: the
/// same tokens and log-probs as temperature 0, all of them numbers.
#[test]
fn a_tiny_temperature_is_greedy_and_its_logprobs_are_numbers() {
    let (_d, s) = start(EDGE, &[]);
    let run = |t: f64| -> Value {
        let body = completion(json!({"temperature": t, "logprobs": 3, "return_token_ids": true}));
        let r = s.post("/v1/completions", &body);
        assert_eq!(r.status, 200, "{}", r.body_text());
        r.json()["choices"][0].clone()
    };
    let (tiny, zero) = (run(1e-45), run(0.0));
    let lp = &tiny["logprobs"];
    let numbers = |v: &Value| v.as_array().unwrap().iter().all(Value::is_f64);
    assert!(numbers(&lp["token_logprobs"]), "{lp}");
    for top in lp["top_logprobs"].as_array().unwrap() {
        assert!(
            top.as_object().unwrap().values().all(Value::is_f64),
            "{top}"
        );
    }
    assert_eq!(tiny["token_ids"], zero["token_ids"]);
    assert_eq!(lp["token_logprobs"], zero["logprobs"]["token_logprobs"]);
}

#[test]
fn bodies_media_types_and_methods_get_the_right_status_in_openai_shape() {
    let (_d, s) = start(EDGE, &[]);
    // Over the (configured) 10 KiB limit: declared, and chunked without a length.
    let big = chat(&"a".repeat(20_000), json!({})).to_string();
    let r = s
        .try_request("POST", "/v1/chat/completions", Some(&big), &[])
        .unwrap();
    let e = assert_error(&r, 413, None);
    assert!(e["error"]["message"].as_str().unwrap().contains("10485"));
    let mut raw = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n",
        big.len()
    )
    .into_bytes();
    raw.extend_from_slice(big.as_bytes());
    raw.extend_from_slice(b"\r\n0\r\n\r\n");
    assert_error(&s.raw(&raw).unwrap(), 413, None);
    // Media types and encodings.
    let body = chat("x", json!({})).to_string();
    let post = |ct: &str, enc: Option<&str>, body: &str| {
        let mut req = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: {ct}\r\nContent-Length: {}\r\n",
            body.len()
        );
        if let Some(e) = enc {
            req.push_str(&format!("Content-Encoding: {e}\r\n"));
        }
        req.push_str("\r\n");
        req.push_str(body);
        s.raw(req.as_bytes()).unwrap()
    };
    for (ct, enc) in [("text/plain", None), ("application/json", Some("gzip"))] {
        assert_error(&post(ct, enc, &body), 415, None);
    }
    // curl -d sends a form type: a JSON body is taken (as llama-server does), a form is not.
    let form = "application/x-www-form-urlencoded";
    assert_eq!(post(form, None, &body).status, 200);
    assert_error(&post(form, None, "a=1&b=2"), 415, None);
    let ok = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json; charset=utf-8\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    assert_eq!(s.raw(ok.as_bytes()).unwrap().status, 200);
    // A wrong method: 405 with the JSON error body.
    let r = s.get("/v1/chat/completions");
    assert_error(&r, 405, None);
    assert!(r
        .header("content-type")
        .is_some_and(|c| c.starts_with("application/json")));
}

/// Bytes read until the server closes the connection (bounded by `limit`).
fn closed_within(mut c: TcpStream, limit: Duration) -> Option<(Duration, Vec<u8>)> {
    let t0 = Instant::now();
    c.set_read_timeout(Some(limit)).unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match c.read(&mut buf) {
            Ok(0) => return Some((t0.elapsed(), out)),
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(_) => return None,
        }
    }
}

#[test]
fn slow_clients_are_closed_and_cannot_exhaust_the_connections() {
    let (_d, s) = start(EDGE, &[]);
    // Half-sent heads fill every connection slot (6).
    let stalled: Vec<TcpStream> = (0..6)
        .map(|_| {
            let mut c = TcpStream::connect(&s.addr).unwrap();
            c.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
                .unwrap();
            c
        })
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    // A normal request waits for a slot, and gets one once the stalled heads time out (1 s).
    let t0 = Instant::now();
    let r = s.post("/v1/chat/completions", &chat("x", json!({"max_tokens": 2})));
    assert_eq!(r.status, 200, "{}", r.body_text());
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    for c in stalled {
        let (after, _) =
            closed_within(c, Duration::from_secs(10)).expect("stalled head not closed");
        assert!(after < Duration::from_secs(10));
    }
    // A body that stops midway is answered 408 after the body timeout.
    let mut c = TcpStream::connect(&s.addr).unwrap();
    c.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\"",
    )
    .unwrap();
    let (_, raw) = closed_within(c, Duration::from_secs(10)).expect("stalled body not answered");
    assert_error(&Response::parse(&raw), 408, None);
    let r = s.post("/v1/chat/completions", &chat("x", json!({"max_tokens": 2})));
    assert_eq!(r.status, 200);
}

/// A browser's call (it sends `Origin`): from an origin `--allowed-origins` lists, preflights get
/// 204 with CORS headers and responses (streams too) carry them; from any other origin it is a
/// 403 before anything runs — a page elsewhere cannot create an adapter on a loopback server
/// whose admin routes are open, even with a form-typed body no preflight guards.
#[test]
fn browsers_get_cors_from_allowed_origins_and_403_from_others() {
    let app = "https://app.example";
    let (_d, s) = start(
        EDGE,
        &["--allowed-origins", &format!("{app},http://x.test")],
    );
    let pre = s
        .try_request(
            "OPTIONS",
            "/v1/chat/completions",
            None,
            &[
                ("Origin", app),
                ("Access-Control-Request-Method", "POST"),
                (
                    "Access-Control-Request-Headers",
                    "authorization, content-type",
                ),
            ],
        )
        .unwrap();
    assert_eq!(pre.status, 204, "{}", pre.body_text());
    assert_eq!(pre.header("access-control-allow-origin"), Some(app));
    assert!(pre
        .header("access-control-allow-methods")
        .is_some_and(|m| m.contains("POST")));
    assert_eq!(
        pre.header("access-control-allow-headers"),
        Some("authorization, content-type")
    );
    let body = completion(json!({})).to_string();
    for stream in [false, true] {
        let mut b: Value = serde_json::from_str(&body).unwrap();
        b["stream"] = json!(stream);
        let r = s
            .try_request(
                "POST",
                "/v1/completions",
                Some(&b.to_string()),
                &[("Origin", app)],
            )
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.body_text());
        assert_eq!(r.header("access-control-allow-origin"), Some(app));
    }
    // Errors carry the header too, so that the page can read them.
    let r = s
        .try_request("POST", "/v1/completions", Some("{}"), &[("Origin", app)])
        .unwrap();
    assert_eq!(r.status, 400);
    assert_eq!(r.header("access-control-allow-origin"), Some(app));
    // Another origin: 403, for preflights, reads and writes alike.
    let evil = [("Origin", "https://evil.example")];
    for (method, path, body) in [
        ("OPTIONS", "/v1/chat/completions", None),
        ("GET", "/v1/models", None),
        ("POST", "/v1/adapters", Some(r#"{"name": "planted"}"#)),
    ] {
        let r = s.try_request(method, path, body, &evil).unwrap();
        let e = assert_error(&r, 403, None);
        assert_eq!(e["error"]["code"], "origin_not_allowed");
        assert!(r.header("access-control-allow-origin").is_none());
    }
    assert_eq!(s.get("/v1/adapters/planted").status, 404);
    // The server's own origin and clients that send none (SDKs, curl) are served as before.
    let own = format!("http://{}", s.addr);
    let r = s
        .try_request("GET", "/v1/models", None, &[("Origin", &own)])
        .unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(s.get("/v1/models").status, 200);
    assert!(s
        .get("/v1/models")
        .header("access-control-allow-origin")
        .is_none());
    let r = s.try_request("OPTIONS", "/v1/models", None, &[]).unwrap();
    assert_eq!(r.status, 204);
    assert!(r.header("allow").is_some_and(|a| a.contains("GET")));
}

#[test]
fn any_origin_when_allowed_and_bad_origins_do_not_start() {
    let (_d, s) = start(EDGE, &["--allowed-origins", "*"]);
    let r = s
        .try_request(
            "GET",
            "/v1/models",
            None,
            &[("Origin", "https://a.example")],
        )
        .unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.header("access-control-allow-origin"), Some("*"));
    let (_d2, path) = common::write_tiny(&spec());
    let err = refused_start(&path, &["--allowed-origins", "app.example"]);
    assert!(err.contains("server.allowed_origins"), "{err}");
}
