//! Tool calls by constrained decoding, over real HTTP on tiny random models: a forced call is a
//! valid call in the template's format (Hermes, Llama 3's JSON) or the generic one, whatever the
//! model would say; templates without tools get the generic format, and a conversation's calls
//! and results go back through it.

mod common;

use common::server::*;
use serde_json::{json, Value};

fn weather_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "add", "parameters": {"type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                           "b": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["a", "b"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "weather", "parameters": {"type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}},
            "required": ["city"], "additionalProperties": false}}},
    ])
}

/// `args` (a call's JSON string) validate against `name`'s schema in `weather_tools`.
fn assert_valid_call(name: &str, args: &str) {
    let v: Value = serde_json::from_str(args).unwrap_or_else(|e| panic!("{e}: {args}"));
    let o = v.as_object().unwrap();
    match name {
        "add" => {
            assert_eq!(o.len(), 2, "{args}");
            for k in ["a", "b"] {
                assert!((0..=9).contains(&o[k].as_i64().unwrap()), "{args}");
            }
        }
        "weather" => {
            assert_eq!(o.len(), 1, "{args}");
            assert!(
                ["Paris", "Oslo"].contains(&o["city"].as_str().unwrap()),
                "{args}"
            );
        }
        other => panic!("unknown function {other}"),
    }
}

fn template_spec(file: &str) -> common::TinySpec {
    let template = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/templates")
            .join(file),
    )
    .unwrap();
    common::TinySpec {
        chat_template: Some(Box::leak(template.into_boxed_str())),
        ..wide()
    }
}

/// `tool_choice` "required" or named: a random model, with the family's format (Hermes for
/// Qwen, Llama 3's JSON) or the generic one (a template without tools), always answers with a
/// call whose arguments validate against the function's schema, streamed or not.
#[test]
fn forced_tool_calls_are_valid_calls_from_any_model() {
    for template in [
        Some("Qwen-Qwen2.5-7B-Instruct.jinja"),
        Some("meta-llama-Llama-3.2-3B-Instruct.jinja"),
        None,
    ] {
        let spec = template.map(template_spec).unwrap_or_else(wide);
        let (_dir, path) = common::write_tiny(&spec);
        let s = Server::start(&path, CONFIG, &[]);
        for (choice, want) in [
            (json!("required"), None),
            (
                json!({"type": "function", "function": {"name": "weather"}}),
                Some("weather"),
            ),
        ] {
            for seed in 0..3 {
                let b = chat(
                    "call something",
                    json!({"tools": weather_tools(), "tool_choice": choice, "seed": seed,
                           "temperature": 1.0, "max_tokens": 200, "parallel_tool_calls": false}),
                );
                let r = s.post("/v1/chat/completions", &b);
                assert_eq!(r.status, 200, "{template:?}: {}", r.body_text());
                let c = &r.json()["choices"][0];
                assert_eq!(c["finish_reason"], "tool_calls", "{template:?}: {c}");
                let calls = c["message"]["tool_calls"].as_array().unwrap();
                assert_eq!(calls.len(), 1, "{c}");
                let f = &calls[0]["function"];
                let name = f["name"].as_str().unwrap();
                if let Some(w) = want {
                    assert_eq!(name, w, "{template:?}");
                }
                assert_valid_call(name, f["arguments"].as_str().unwrap());
                let mut b = b.clone();
                b["stream"] = json!(true);
                let chunks = s.post("/v1/chat/completions", &b).sse_chunks();
                let deltas: Vec<&Value> = chunks
                    .iter()
                    .filter_map(|c| c["choices"][0]["delta"].get("tool_calls"))
                    .collect();
                assert_eq!(deltas.len(), 1, "{template:?}: {chunks:?}");
                assert_eq!(deltas[0][0]["function"]["name"], name);
                assert_eq!(deltas[0][0]["function"]["arguments"], f["arguments"]);
            }
        }
    }
}

/// A template that renders no tools gets the generic format: the tools in a system message
/// (`/tokenize` counts them), the answer a call or a response, calls and results of earlier
/// turns written back in that format.
#[test]
fn the_generic_format_serves_templates_without_tools() {
    let (_d, s) = start_wide();
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let plain = s.post("/tokenize", &json!({"messages": msgs})).json()["count"].clone();
    let with = s
        .post(
            "/tokenize",
            &json!({"messages": msgs, "tools": weather_tools()}),
        )
        .json();
    assert!(
        with["count"].as_u64().unwrap() > plain.as_u64().unwrap() + 20,
        "{with}"
    );
    let (mut calls, mut answers) = (0, 0);
    for seed in 0..8 {
        let r = s.post(
            "/v1/chat/completions",
            &chat(
                "hi",
                json!({"tools": weather_tools(), "seed": seed, "temperature": 1.0,
                       "max_tokens": 200}),
            ),
        );
        let c = &r.json()["choices"][0];
        match c["finish_reason"].as_str().unwrap() {
            "tool_calls" => {
                calls += 1;
                let f = &c["message"]["tool_calls"][0]["function"];
                assert_valid_call(
                    f["name"].as_str().unwrap(),
                    f["arguments"].as_str().unwrap(),
                );
                assert!(c["message"]["content"].is_null(), "{c}");
            }
            // A response: its text, not the JSON around it (unless it ran out of tokens).
            "stop" => {
                answers += 1;
                let t = c["message"]["content"].as_str().unwrap();
                assert!(!t.starts_with("{\"response\""), "{c}");
            }
            // Out of tokens: only inside a response's (unbounded) string.
            _ => {
                let t = c["message"]["content"].as_str().unwrap();
                assert!(t.starts_with("{\"response\": \""), "{c}");
            }
        }
    }
    assert!(calls >= 1, "{calls} calls, {answers} answers");
    // A conversation with a call and its result goes back through the template.
    let r = s.post(
        "/v1/chat/completions",
        &json!({"model": "tiny", "max_tokens": 5, "tools": weather_tools(), "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "cold"}]}),
    );
    assert_eq!(r.status, 200, "{}", r.body_text());
    // tool_choice "none" (an agent loop's last turn): the same conversation, rendered as for
    // the turns that could call (an episode's prompts keep extending each other), and the
    // answer is always a response, given as text.
    let auto_prompt = r.json()["usage"]["prompt_tokens"].clone();
    let convo = json!([
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "cold"}]);
    for seed in 0..6 {
        let r = s.post(
            "/v1/chat/completions",
            &json!({"model": "tiny", "max_tokens": 200, "tools": weather_tools(),
                    "tool_choice": "none", "temperature": 1.0, "seed": seed,
                    "messages": convo}),
        );
        assert_eq!(r.status, 200, "{}", r.body_text());
        let v = r.json();
        let c = &v["choices"][0];
        assert!(c["message"].get("tool_calls").is_none(), "{c}");
        assert_ne!(c["finish_reason"], "tool_calls", "{c}");
        let t = c["message"]["content"].as_str().unwrap();
        if c["finish_reason"] == "stop" {
            assert!(!t.starts_with("{\"response\""), "{c}");
        } else {
            assert!(t.starts_with("{\"response\": \""), "{c}");
        }
        assert_eq!(v["usage"]["prompt_tokens"], auto_prompt, "{v}");
    }
    // A follow-up turn that does not send the tools again: the history is still written in the
    // generic format, and `/tokenize` renders the prompt chat renders.
    let r = s.post(
        "/v1/chat/completions",
        &json!({"model": "tiny", "max_tokens": 1, "messages": convo}),
    );
    assert_eq!(r.status, 200, "{}", r.body_text());
    let t = s.post("/tokenize", &json!({"messages": convo})).json();
    assert_eq!(t["count"], r.json()["usage"]["prompt_tokens"], "{t}");
    let text = s
        .post("/detokenize", &json!({"tokens": t["tokens"]}))
        .json()["prompt"]
        .clone();
    assert!(
        text.as_str()
            .unwrap()
            .contains(r#"{"tool_response": {"tool": "weather""#),
        "{text}"
    );
    let r = s.post(
        "/v1/chat/completions",
        &chat("x", json!({"tools": weather_tools(), "tool_choice": {"type": "function", "function": {"name": "nope"}}})),
    );
    assert_error(&r, 400, Some("tool_choice"));
    let r = s.post(
        "/v1/chat/completions",
        &chat(
            "x",
            json!({"tools": weather_tools(), "response_format": {"type": "json_object"}}),
        ),
    );
    assert_error(&r, 400, Some("response_format"));
}
