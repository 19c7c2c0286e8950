//! Structured outputs by constrained decoding, over real HTTP on tiny random models: whatever a
//! random model would say, the answer follows the grammar (a JSON Schema, a regex, a choice, a
//! Lark grammar), compact, and finishes; the openai SDK parses it. (Tool calls under a grammar:
//! `server_tools.rs`.)

mod common;

use common::server::*;
use serde_json::{json, Value};

/// A schema whose every value is bounded, so that a random model's answer ends in the budget.
fn pet_schema() -> Value {
    json!({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}},
        "required": ["name", "kind", "age", "ok", "tags"], "additionalProperties": false})
}

/// `text` is a compact JSON object valid against `pet_schema`.
fn assert_pet(text: &str) {
    assert!(
        !text.contains('\n') && !text.contains("  "),
        "not compact: {text:?}"
    );
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
    let o = v.as_object().unwrap();
    assert_eq!(o.len(), 5, "{text}");
    assert!(o["name"].as_str().unwrap().chars().count() <= 6, "{text}");
    assert!(
        ["cat", "dog"].contains(&o["kind"].as_str().unwrap()),
        "{text}"
    );
    assert!((0..=99).contains(&o["age"].as_i64().unwrap()), "{text}");
    assert!(o["ok"].is_boolean(), "{text}");
    let tags = o["tags"].as_array().unwrap();
    assert!(tags.len() <= 2, "{text}");
    assert!(
        tags.iter()
            .all(|t| t.as_str().unwrap().chars().count() <= 3),
        "{text}"
    );
}

#[test]
fn json_schemas_are_followed_whatever_the_model_says() {
    let (_d, s) = start_wide();
    for seed in 0..4 {
        for body in [
            json!({"response_format": {"type": "json_schema",
                   "json_schema": {"name": "pet", "schema": pet_schema(), "strict": true}}}),
            json!({"structured_outputs": {"json": pet_schema()}}),
            json!({"guided_json": pet_schema().to_string()}),
        ] {
            let mut b = chat("a pet", body);
            b["n"] = json!(3);
            b["seed"] = json!(seed);
            b["temperature"] = json!(1.0);
            b["max_tokens"] = json!(300);
            let r = s.post("/v1/chat/completions", &b);
            assert_eq!(r.status, 200, "{}", r.body_text());
            for c in r.json()["choices"].as_array().unwrap() {
                assert_eq!(c["finish_reason"], "stop", "{c}");
                assert_pet(c["message"]["content"].as_str().unwrap());
            }
            // Streamed, the same draws.
            b["stream"] = json!(true);
            let chunks = s.post("/v1/chat/completions", &b).sse_chunks();
            let mut texts = vec![String::new(); 3];
            for ch in &chunks {
                for c in ch["choices"].as_array().unwrap() {
                    let i = c["index"].as_u64().unwrap() as usize;
                    texts[i].push_str(c["delta"]["content"].as_str().unwrap_or(""));
                }
            }
            let plain: Vec<String> = r.json()["choices"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| c["message"]["content"].as_str().unwrap().to_string())
                .collect();
            assert_eq!(texts, plain, "seed {seed}");
        }
    }
    // json_object: any object.
    let r = s.post(
        "/v1/chat/completions",
        &chat(
            "x",
            json!({"response_format": {"type": "json_object"}, "max_tokens": 200, "seed": 1,
                   "structured_outputs": null}),
        ),
    );
    let c = &r.json()["choices"][0];
    if c["finish_reason"] == "stop" {
        let v: Value = serde_json::from_str(c["message"]["content"].as_str().unwrap()).unwrap();
        assert!(v.is_object(), "{c}");
    } else {
        assert!(c["message"]["content"].as_str().unwrap().starts_with('{'));
    }
}

#[test]
fn regexes_choices_and_grammars_on_every_route() {
    let (_d, s) = start_wide();
    let is_code = |t: &str| {
        let b = t.as_bytes();
        b.len() == 6
            && b[..3].iter().all(u8::is_ascii_digit)
            && b[3] == b'-'
            && b[4..].iter().all(u8::is_ascii_lowercase)
    };
    let choices = ["yes", "no", "maybe so"];
    for seed in 0..3 {
        let base = json!({"model": "tiny", "prompt": "q", "n": 4, "seed": seed,
                          "temperature": 1.0, "max_tokens": 40});
        let with = |extra: Value| {
            let mut b = base.clone();
            for (k, v) in extra.as_object().unwrap() {
                b[k] = v.clone();
            }
            let r = s.post("/v1/completions", &b);
            assert_eq!(r.status, 200, "{}", r.body_text());
            r.json()["choices"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| {
                    assert_eq!(c["finish_reason"], "stop", "{c}");
                    c["text"].as_str().unwrap().to_string()
                })
                .collect::<Vec<_>>()
        };
        for t in with(json!({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}})) {
            assert!(is_code(&t), "{t:?}");
        }
        for t in with(json!({"guided_regex": "[0-9]{3}-[a-z]{2}"})) {
            assert!(is_code(&t), "{t:?}");
        }
        for t in with(json!({"structured_outputs": {"choice": choices}})) {
            assert!(choices.contains(&t.as_str()), "{t:?}");
        }
        for t in with(json!({"guided_grammar": "start: \"a\" b\nb: \"x\" | \"yz\"\n"})) {
            assert!(t == "ax" || t == "ayz", "{t:?}");
        }
        // A batch of prompts, each constrained.
        let mut b = base.clone();
        b["prompt"] = json!(["p", "q"]);
        b["guided_choice"] = json!(choices);
        for c in s.post("/v1/completions", &b).json()["choices"]
            .as_array()
            .unwrap()
        {
            assert!(choices.contains(&c["text"].as_str().unwrap()), "{c}");
        }
        // The token-in route: vLLM's sampling_params.structured_outputs.
        let r = s.post(
            "/inference/v1/generate",
            &json!({"model": "tiny", "token_ids": [5, 6, 7], "sampling_params": {
                "seed": seed, "n": 2, "max_tokens": 20, "temperature": 1.0,
                "structured_outputs": {"choice": choices}}}),
        );
        assert_eq!(r.status, 200, "{}", r.body_text());
        for c in r.json()["choices"].as_array().unwrap() {
            let ids: Vec<u32> = c["token_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            let text = s.post("/detokenize", &json!({"tokens": ids})).json()["prompt"].clone();
            let text = text.as_str().unwrap().trim_end_matches("<|im_end|>");
            assert!(choices.contains(&text), "{text:?}");
        }
    }
}

#[test]
fn bad_or_unsupported_constraints_are_refused_by_name() {
    let (_d, s) = start_wide();
    let schema_bad = json!({"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["a"]});
    for (extra, param) in [
        (
            json!({"response_format": {"type": "bogus"}}),
            "response_format",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema_bad}}}),
            "response_format",
        ),
        (
            json!({"structured_outputs": {"regex": "(["}}),
            "structured_outputs.regex",
        ),
        (
            json!({"structured_outputs": {"grammar": "start: ??"}}),
            "structured_outputs.grammar",
        ),
        (
            json!({"structured_outputs": {"whitespace_pattern": "\\s*", "json": {}}}),
            "structured_outputs.whitespace_pattern",
        ),
        (json!({"guided_choice": []}), "guided_choice"),
        (
            json!({"guided_regex": "a", "response_format": {"type": "json_object"}}),
            "guided_regex",
        ),
        (
            json!({"guided_regex": "a", "ignore_eos": true}),
            "ignore_eos",
        ),
    ] {
        let r = s.post("/v1/chat/completions", &chat("x", extra.clone()));
        assert_error(&r, 400, Some(param));
    }
    let r = s.post(
        "/inference/v1/generate",
        &json!({"model": "tiny", "token_ids": [5], "sampling_params": {"structured_outputs": {"regex": "(["}}}),
    );
    assert_error(&r, 400, Some("sampling_params.structured_outputs.regex"));
}

/// Through the official openai SDK (skipped without it): `chat.completions.parse` with pydantic
/// models returns a valid object from a random model, and a forced call's arguments parse into
/// the tool's model.
#[test]
fn the_openai_sdk_parses_structured_outputs_and_forced_calls() {
    let (_d, s) = start_wide();
    let script = r#"
import json, sys
try:
    import openai, pydantic
    from typing import List, Literal
except ImportError:
    print("null"); sys.exit(0)
from pydantic import BaseModel, Field
c = openai.OpenAI(base_url=f"http://{sys.argv[1]}/v1", api_key="none")
class Pet(BaseModel):
    name: str = Field(max_length=6)
    kind: Literal["cat", "dog"]
    age: int = Field(ge=0, le=99)
    tags: List[str] = Field(max_length=2)
class Owner(BaseModel):
    pet: Pet
    home: bool
class Weather(BaseModel):
    city: Literal["Paris", "Oslo"]
out = {"parsed": [], "calls": []}
for seed in range(4):
    r = c.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "a pet"}],
                                 response_format=Owner, seed=seed, max_tokens=300)
    p = r.choices[0].message.parsed
    out["parsed"].append(None if p is None else p.model_dump())
    r = c.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "weather"}],
                                 tools=[openai.pydantic_function_tool(Weather)],
                                 tool_choice="required", seed=seed, max_tokens=100)
    t = r.choices[0].message.tool_calls[0]
    out["calls"].append([t.function.name, t.function.parsed_arguments.model_dump()])
print(json.dumps(out))
"#;
    let Some(v) = common::python_json::<Value>(script, &[&s.addr]) else {
        eprintln!("skipped: the openai SDK is not installed");
        return;
    };
    for p in v["parsed"].as_array().unwrap() {
        assert!(p["pet"]["age"].as_i64().is_some(), "{v}");
        assert!(p["home"].is_boolean(), "{v}");
    }
    for c in v["calls"].as_array().unwrap() {
        assert_eq!(c[0], "Weather", "{v}");
        assert!(
            ["Paris", "Oslo"].contains(&c[1]["city"].as_str().unwrap()),
            "{v}"
        );
    }
}

/// Schemas as people write them: a tool's parameters and a structured-output schema (nested
/// objects, as pydantic writes them through `$defs`) that list properties but say nothing of
/// `additionalProperties`. Generated output admits only the listed properties (as llama.cpp's and
/// vLLM's converters do), so a random model's forced call or object closes within its budget
/// instead of writing keys until `max_tokens`; a schema that says `additionalProperties: true`
/// keeps its objects open.
#[test]
fn objects_that_list_properties_close_without_additional_properties_false() {
    let (_d, s) = start_wide();
    let tools = json!([{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city"]}}}]);
    let schema = json!({"$defs": {"Pet": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 5}, "age": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["name", "age"], "title": "Pet"}},
        "type": "object", "properties": {"owner": {"type": "string", "maxLength": 5},
                                         "pet": {"$ref": "#/$defs/Pet"}},
        "required": ["owner", "pet"], "title": "Owner"});
    for seed in 0..4 {
        let b = chat(
            "weather?",
            json!({"tools": tools, "tool_choice": "required", "seed": seed, "temperature": 1.0,
                   "max_tokens": 120, "parallel_tool_calls": false}),
        );
        let r = s.post("/v1/chat/completions", &b);
        assert_eq!(r.status, 200, "{}", r.body_text());
        let c = &r.json()["choices"][0];
        assert_eq!(c["finish_reason"], "tool_calls", "{c}");
        let args = c["message"]["tool_calls"][0]["function"]["arguments"]
            .as_str()
            .unwrap()
            .to_string();
        let v: Value = serde_json::from_str(&args).unwrap();
        assert!(
            v.as_object()
                .unwrap()
                .keys()
                .all(|k| k == "city" || k == "days"),
            "{args}"
        );
        let b = chat(
            "a pet",
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "Owner", "schema": schema}},
                   "seed": seed, "temperature": 1.0, "max_tokens": 120}),
        );
        let r = s.post("/v1/chat/completions", &b);
        let c = &r.json()["choices"][0];
        assert_eq!(c["finish_reason"], "stop", "{c}");
        let v: Value = serde_json::from_str(c["message"]["content"].as_str().unwrap()).unwrap();
        let keys: Vec<&String> = v.as_object().unwrap().keys().collect();
        assert_eq!(keys, ["owner", "pet"], "{v}");
        let pet: Vec<&String> = v["pet"].as_object().unwrap().keys().collect();
        assert_eq!(pet, ["name", "age"], "{v}");
    }
    // Said open, it stays open: extra keys may follow the listed ones (one run long enough
    // to see any shows the grammar allows them: a random model takes one in a few tries).
    let open = json!({"type": "object", "properties": {"a": {"enum": [1]}}, "required": ["a"],
                      "additionalProperties": true});
    let mut extra = false;
    for seed in 0..8 {
        let b = chat(
            "x",
            json!({"response_format": {"type": "json_schema", "json_schema": {
            "name": "o", "schema": open}}, "seed": seed, "temperature": 1.0, "max_tokens": 40}),
        );
        extra |= !content_of(&s, &b).starts_with("{\"a\": 1}");
    }
    assert!(extra, "an open object never took another key");
    // vLLM's switch: true is what is done; false (open objects) is refused by name.
    let b = chat(
        "x",
        json!({"structured_outputs": {"json": schema, "disable_additional_properties": false}}),
    );
    assert_error(
        &s.post("/v1/chat/completions", &b),
        400,
        Some("structured_outputs.disable_additional_properties"),
    );
    let b = chat(
        "x",
        json!({"structured_outputs": {"json": schema, "disable_additional_properties": true}, "max_tokens": 120}),
    );
    assert_eq!(s.post("/v1/chat/completions", &b).status, 200);
}

/// An integer a schema leaves unbounded (a tool's `"limit": {"type": "integer"}`) closes within
/// 16 digits, as llama.cpp's converter bounds it: a model that keeps writing digits (a small
/// model greedy, a random one at temperature 1) otherwise runs to `max_tokens`.
#[test]
fn unbounded_integers_close_within_sixteen_digits() {
    let (_d, s) = start_wide();
    let schema = json!({"type": "object", "properties": {"n": {"type": "integer"}},
                        "required": ["n"]});
    for seed in 0..8 {
        let b = chat(
            "a number",
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
                   "seed": seed, "temperature": 1.0, "max_tokens": 60}),
        );
        let r = s.post("/v1/chat/completions", &b);
        let c = &r.json()["choices"][0];
        assert_eq!(c["finish_reason"], "stop", "{c}");
        let v: Value = serde_json::from_str(c["message"]["content"].as_str().unwrap()).unwrap();
        let n = v["n"].as_i64().unwrap_or_else(|| panic!("{v}"));
        assert!(n.unsigned_abs() < 1 << 53, "{n}");
    }
}
