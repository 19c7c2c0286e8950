//! The routes RL orchestrators and evaluation harnesses call, over real HTTP on tiny models:
//! vLLM's token-in `/inference/v1/generate` (the `verifiers` train client's shape), one model's
//! card, `/tokenizer_info` and `/tokenize` as lm-eval's remote tokenizer uses them.

mod common;

use common::server::*;
use serde_json::{json, Value};

#[test]
fn generate_takes_token_ids_and_returns_token_ids_with_their_logprobs() {
    let (_d, s) = start(CONFIG, &[]);
    let prompt = [5u32, 6, 7, 8, 9];
    // As verifiers' renderer client sends it.
    let r = s.post(
        "/inference/v1/generate",
        &json!({"model": "tiny", "token_ids": prompt, "sampling_params": {
            "max_tokens": 6, "temperature": 1.0, "seed": 3, "logprobs": 1, "ignore_eos": true,
            "stop_token_ids": [2], "skip_special_tokens": false, "n": 2,
            "extra_args": {"prl_compact_logprobs": true}, "flat_logprobs": true}}),
    );
    assert_eq!(r.status, 200, "{}", r.body_text());
    let v = r.json();
    assert!(v["request_id"].as_str().unwrap().starts_with("gen-"));
    assert_eq!(v["usage"]["prompt_tokens"], 5);
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        let ids = c["token_ids"].as_array().unwrap();
        assert_eq!(ids.len(), 6);
        let content = c["logprobs"]["content"].as_array().unwrap();
        assert_eq!(content.len(), ids.len());
        for (id, lp) in ids.iter().zip(content) {
            assert_eq!(lp["token"], format!("token_id:{id}"));
            let x = lp["logprob"].as_f64().unwrap();
            assert!(x.is_finite() && x <= 0.0);
            let top = lp["top_logprobs"].as_array().unwrap();
            assert_eq!(top.len(), 1);
            assert!(top[0]["token"].as_str().unwrap().starts_with("token_id:"));
        }
        assert_eq!(c["finish_reason"], "length");
    }
    // The same request through chat-free completions with the same seed samples the same tokens
    // with the same log-probs (one engine, one sampler).
    let r2 = s.post(
        "/v1/completions",
        &json!({"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 1.0,
                "seed": 3, "logprobs": 0, "ignore_eos": true, "n": 2, "return_token_ids": true}),
    );
    assert_eq!(r2.status, 200, "{}", r2.body_text());
    let c2 = &r2.json()["choices"][0];
    assert_eq!(c2["token_ids"], choices[0]["token_ids"]);
    let lp2: Vec<f64> = c2["logprobs"]["token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    let lp1: Vec<f64> = choices[0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["logprob"].as_f64().unwrap())
        .collect();
    assert_eq!(lp1, lp2);
    // Without logprobs: none; prompt_token_ids when asked.
    let r = s.post(
        "/inference/v1/generate",
        &json!({"model": "tiny", "token_ids": prompt, "return_token_ids": true,
                "sampling_params": {"max_tokens": 2, "temperature": 0}}),
    );
    let v = r.json();
    assert_eq!(v["choices"][0]["logprobs"], Value::Null);
    assert_eq!(v["prompt_token_ids"], json!(prompt));
}

#[test]
fn generate_refuses_what_it_does_not_implement_by_name() {
    let (_d, s) = start(CONFIG, &[]);
    let bad = |body: Value, param: &str| {
        let r = s.post("/inference/v1/generate", &body);
        assert_error(&r, 400, Some(param));
    };
    let tp = |sp: Value| json!({"model": "tiny", "token_ids": [5, 6], "sampling_params": sp});
    bad(
        tp(json!({"repetition_penalty": 0})),
        "sampling_params.repetition_penalty",
    );
    bad(tp(json!({"min_tokens": 4})), "sampling_params.min_tokens");
    bad(
        tp(json!({"structured_outputs": {"regex": 5}})),
        "sampling_params.structured_outputs.regex",
    );
    bad(
        tp(json!({"extra_args": {"my_processor": 1}})),
        "sampling_params.extra_args",
    );
    bad(
        tp(json!({"temperature": -1})),
        "sampling_params.temperature",
    );
    bad(tp(json!({"logprobs": 50})), "sampling_params.logprobs");
    bad(
        json!({"model": "tiny", "token_ids": [5, 6], "stream": true}),
        "stream",
    );
    bad(
        json!({"model": "tiny", "token_ids": [5, 6], "priority": 3}),
        "priority",
    );
    bad(
        json!({"model": "tiny", "token_ids": [5, 6], "cache_salt": "x"}),
        "cache_salt",
    );
    bad(json!({"model": "tiny", "token_ids": []}), "token_ids");
    bad(
        json!({"model": "tiny", "token_ids": [5, 999999]}),
        "token_ids",
    );
    bad(json!({"model": "tiny"}), "token_ids");
    // Neutral values of unimplemented parameters are fine.
    let r = s.post(
        "/inference/v1/generate",
        &tp(json!({"repetition_penalty": 1.0, "min_tokens": 0, "max_tokens": 1})),
    );
    assert_eq!(r.status, 200, "{}", r.body_text());
}

#[test]
fn one_models_card_and_the_tokenizer_info_a_remote_tokenizer_needs() {
    let (_d, s) = start(CONFIG, &[]);
    let r = s.get("/v1/models/tiny");
    assert_eq!(r.status, 200, "{}", r.body_text());
    let card = r.json();
    assert_eq!(card["id"], "tiny");
    assert_eq!(card["object"], "model");
    assert_eq!(card["max_model_len"], 512);
    assert_eq!(card, s.get("/v1/models").json()["data"][0]);
    let e = assert_error(&s.get("/v1/models/org/nope"), 404, Some("model"));
    assert_eq!(e["error"]["code"], "model_not_found");
    // lm-eval's remote tokenizer: /tokenizer_info for the special tokens and the template, then
    // the EOS id as the first id of tokenizing the EOS text without special tokens.
    let info = s.get("/tokenizer_info").json();
    assert_eq!(info["eos_token"], "<|im_end|>");
    assert_eq!(info["max_model_len"], 512);
    assert!(info["chat_template"].as_str().unwrap().contains("im_start"));
    let r = s.post(
        "/tokenize",
        &json!({"prompt": info["eos_token"], "add_special_tokens": false}),
    );
    assert_eq!(r.json()["tokens"], json!([info["eos_token_id"]]));
}

/// The Qwen2.5 template: its tools branch is rendered (the prompt grows by the tools' schemas),
/// an assistant's tool calls and the tool's result come back through the template, and what the
/// server does not implement is refused by name.
#[test]
fn tools_reach_the_prompt_through_the_models_template() {
    let template = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/templates/Qwen-Qwen2.5-7B-Instruct.jinja"),
    )
    .unwrap();
    let (dir, path) = common::write_tiny(&common::TinySpec {
        chat_template: Some(Box::leak(template.into_boxed_str())),
        // A byte-level tiny vocabulary makes the Qwen system prompt with tools long.
        ctx: 2048,
        ..spec()
    });
    let s = common::server::Server::start(&path, CONFIG, &[]);
    let tools = json!([{"type": "function", "function": {"name": "add",
        "description": "Add two numbers", "parameters": {"type": "object",
        "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}]);
    let msgs = json!([{"role": "user", "content": "2+3?"}]);
    let count = |body: Value| {
        let r = s.post("/tokenize", &body);
        assert_eq!(r.status, 200, "{}", r.body_text());
        r.json()["count"].as_u64().unwrap()
    };
    let plain = count(json!({"messages": msgs}));
    let with_tools = count(json!({"messages": msgs, "tools": tools}));
    assert!(with_tools > plain + 20, "{plain} -> {with_tools}");
    // The legacy `functions` render the same.
    let legacy = count(json!({"messages": msgs, "functions": [tools[0]["function"]]}));
    assert_eq!(legacy, with_tools);
    // A tool-use history: the call (arguments as OpenAI sends them, a JSON string) and the result.
    let history = json!([
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 3}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}]);
    let r = s.post(
        "/tokenize",
        &json!({"messages": history, "tools": tools, "add_special_tokens": false}),
    );
    let ids: Vec<u32> = serde_json::from_value(r.json()["tokens"].clone()).unwrap();
    let text = s.post("/detokenize", &json!({"tokens": ids})).json()["prompt"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        text.contains(
            "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 2, \"b\": 3}}\n</tool_call>"
        ),
        "{text}"
    );
    assert!(
        text.contains("<tool_response>\n5\n</tool_response>"),
        "{text}"
    );
    // A chat with tools is served (tool_choice auto); forcing a call is refused by name until
    // constrained decoding exists, as are structured outputs and bad or unimplemented sampling
    // knobs (min_tokens past max_tokens).
    let r = s.post(
        "/v1/chat/completions",
        &chat(
            "2+3?",
            json!({"tools": tools, "tool_choice": "auto", "max_tokens": 3}),
        ),
    );
    assert_eq!(r.status, 200, "{}", r.body_text());
    for (extra, param) in [
        (
            json!({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "sub"}}}),
            "tool_choice",
        ),
        (json!({"tool_choice": "auto"}), "tool_choice"),
        (json!({"tools": [{"type": "retrieval"}]}), "tools[0]"),
        (
            json!({"response_format": {"type": "bogus"}}),
            "response_format",
        ),
        (json!({"guided_json": 3}), "guided_json"),
        (
            json!({"structured_outputs": {"regex": "a+", "choice": ["a"]}}),
            "structured_outputs",
        ),
        (json!({"repetition_penalty": -1}), "repetition_penalty"),
        (json!({"best_of": 3}), "best_of"),
        (json!({"min_tokens": 30}), "min_tokens"),
    ] {
        let r = s.post("/v1/chat/completions", &chat("hi", extra.clone()));
        assert_error(&r, 400, Some(param));
    }
    let r = s.post(
        "/v1/chat/completions",
        &chat(
            "hi",
            json!({"response_format": {"type": "text"}, "repetition_penalty": 1.3}),
        ),
    );
    assert_eq!(r.status, 200, "{}", r.body_text());
    drop(dir);
}

/// A batch of prompts in one completions request (lm-eval with --batch_size, LangChain's
/// .batch(), TRL's client): strings and token-id lists, choices numbered prompt × n + i, each
/// equal to the same prompt sent alone with the same seed, each with its own prompt ids.
#[test]
fn completions_take_a_batch_of_prompts() {
    let (_d, s) = start(CONFIG, &[]);
    let body = |prompt: Value| {
        json!({"model": "tiny", "prompt": prompt, "max_tokens": 4, "n": 2, "seed": 9,
               "temperature": 0.8, "ignore_eos": true, "logprobs": 1, "return_token_ids": true})
    };
    let r = s.post(
        "/v1/completions",
        &body(json!(["hello", "the world", [5, 6, 7]])),
    );
    assert_eq!(r.status, 200, "{}", r.body_text());
    let v = r.json();
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 6);
    let mut prompt_tokens = 0;
    for (p, prompt) in [json!("hello"), json!("the world"), json!([5, 6, 7])]
        .into_iter()
        .enumerate()
    {
        let alone = s.post("/v1/completions", &body(prompt)).json();
        prompt_tokens += alone["usage"]["prompt_tokens"].as_u64().unwrap();
        for i in 0..2 {
            let c = &choices[p * 2 + i];
            assert_eq!(c["index"], p * 2 + i);
            let a = &alone["choices"][i];
            assert_eq!(c["text"], a["text"]);
            assert_eq!(c["token_ids"], a["token_ids"]);
            assert_eq!(
                c["logprobs"]["token_logprobs"],
                a["logprobs"]["token_logprobs"]
            );
            assert_eq!(c["prompt_token_ids"], alone["prompt_token_ids"]);
        }
    }
    assert_eq!(v["usage"]["prompt_tokens"], prompt_tokens);
    assert_eq!(v["usage"]["completion_tokens"], 6 * 4);
    // Scoring a batch (lm-eval's log-likelihoods): echo with max_tokens 0.
    let r = s.post(
        "/v1/completions",
        &json!({"model": "tiny", "prompt": ["hello there", "the world"], "max_tokens": 0,
                "echo": true, "logprobs": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.body_text());
    let v = r.json();
    assert_eq!(v["choices"][1]["text"], "the world");
    assert!(v["choices"][0]["logprobs"]["token_logprobs"][0].is_null());
    // Streamed: every prompt's chunks as they come, one id, choices numbered as above; each
    // choice's streamed text and tokens are the non-streamed ones; the usage of all at the end.
    let mut b = body(json!(["hello", "the world", [5, 6, 7]]));
    b["stream"] = json!(true);
    b["stream_options"] = json!({"include_usage": true});
    let r = s.post("/v1/completions", &b);
    assert_eq!(r.status, 200, "{}", r.body_text());
    assert_eq!(r.sse_data().last().map(String::as_str), Some("[DONE]"));
    let chunks = r.sse_chunks();
    let id = chunks[0]["id"].clone();
    let (mut text, mut ids) = (vec![String::new(); 6], vec![Vec::new(); 6]);
    let mut finished = vec![0; 6];
    for c in &chunks {
        assert_eq!(c["id"], id);
        for ch in c["choices"].as_array().unwrap() {
            let k = ch["index"].as_u64().unwrap() as usize;
            text[k].push_str(ch["text"].as_str().unwrap_or(""));
            ids[k].extend(ch["token_ids"].as_array().into_iter().flatten().cloned());
            finished[k] += ch["finish_reason"].is_string() as usize;
        }
    }
    assert_eq!(finished, vec![1; 6]);
    for (k, c) in choices.iter().enumerate() {
        assert_eq!(json!(text[k]), c["text"], "choice {k}");
        assert_eq!(json!(ids[k]), c["token_ids"], "choice {k}");
    }
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], 6 * 4);
    assert_eq!(usage["prompt_tokens"], prompt_tokens);
    // What a batch cannot do is refused by name.
    let many: Vec<&str> = vec!["x"; 300];
    assert_error(
        &s.post("/v1/completions", &json!({"model": "tiny", "prompt": many})),
        400,
        Some("prompt"),
    );
    assert_error(
        &s.post(
            "/v1/completions",
            &json!({"model": "tiny", "prompt": ["a", []]}),
        ),
        400,
        Some("prompt"),
    );
}

const HERMES_CALL: &str =
    "I will add.<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 2, \"b\": 3}}\n</tool_call>";
const LLAMA_CALL: &str = "{\"name\": \"add\", \"parameters\": {\"a\": 2, \"b\": 3}}\n#";

/// A tiny model with the family's template whose vocabulary holds `call` as one token: a logit
/// bias makes it answer with that call (the model is random; the format is what is tested).
fn tool_model(template_file: &str, call: &'static str) -> (tempfile::TempDir, Server, u32) {
    let template = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/templates")
            .join(template_file),
    )
    .unwrap();
    let spec = common::TinySpec {
        chat_template: Some(Box::leak(template.into_boxed_str())),
        ctx: 2048,
        extra_tokens: Box::leak(vec![call].into_boxed_slice()),
        ..spec()
    };
    let vocab = common::tiny_model(&spec).vocab_size as u32;
    let (dir, path) = common::write_tiny(&spec);
    let s = Server::start(&path, CONFIG, &[]);
    (dir, s, vocab - 1)
}

fn add_tool() -> Value {
    json!([{"type": "function", "function": {"name": "add", "description": "Add",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"},
        "b": {"type": "number"}}}}}])
}

/// The streamed chunks of a chat, assembled as the openai SDK does: content appended,
/// tool-call deltas merged by index (id, name, arguments concatenated).
fn assemble(chunks: &[Value]) -> (String, Vec<(String, String, String)>, String) {
    let (mut content, mut calls, mut finish) = (String::new(), Vec::new(), String::new());
    for c in chunks {
        let ch = &c["choices"][0];
        let d = &ch["delta"];
        if let Some(t) = d["content"].as_str() {
            content.push_str(t);
        }
        for tc in d["tool_calls"].as_array().into_iter().flatten() {
            let i = tc["index"].as_u64().unwrap() as usize;
            if calls.len() <= i {
                calls.resize(i + 1, (String::new(), String::new(), String::new()));
            }
            let e = &mut calls[i];
            e.0.push_str(tc["id"].as_str().unwrap_or(""));
            e.1.push_str(tc["function"]["name"].as_str().unwrap_or(""));
            e.2.push_str(tc["function"]["arguments"].as_str().unwrap_or(""));
        }
        if let Some(f) = ch["finish_reason"].as_str() {
            finish = f.to_string();
        }
    }
    (content, calls, finish)
}

#[test]
fn tool_calls_come_back_in_openai_shape_streamed_or_not() {
    for (template, call, stop, content) in [
        (
            "Qwen-Qwen2.5-7B-Instruct.jinja",
            HERMES_CALL,
            json!(["</tool_call>"]),
            Some("I will add."),
        ),
        (
            "meta-llama-Llama-3.2-3B-Instruct.jinja",
            LLAMA_CALL,
            json!(["#"]),
            None,
        ),
    ] {
        let (_d, s, call_token) = tool_model(template, call);
        let body = |stream: bool| {
            chat(
                "2+3?",
                json!({"tools": add_tool(), "logit_bias": {call_token.to_string(): 100},
                       "stop": stop, "max_tokens": 3, "stream": stream, "temperature": 0}),
            )
        };
        let r = s.post("/v1/chat/completions", &body(false));
        assert_eq!(r.status, 200, "{}", r.body_text());
        let c = &r.json()["choices"][0];
        let m = &c["message"];
        let calls = m["tool_calls"]
            .as_array()
            .unwrap_or_else(|| panic!("{template}: {m}"));
        assert_eq!(calls.len(), 1, "{template}: {m}");
        assert_eq!(calls[0]["type"], "function");
        assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"));
        assert_eq!(calls[0]["function"]["name"], "add");
        let args: Value =
            serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(args, json!({"a": 2, "b": 3}));
        assert_eq!(c["finish_reason"], "tool_calls", "{template}");
        assert_eq!(m["content"].as_str(), content, "{template}: {m}");
        // Streamed: the content passes, the call arrives as deltas the SDK assembles.
        let r = s.post("/v1/chat/completions", &body(true));
        assert_eq!(r.status, 200);
        let (text, scalls, finish) = assemble(&r.sse_chunks());
        assert_eq!(text, content.unwrap_or(""), "{template}");
        assert_eq!(scalls.len(), 1, "{template}");
        assert_eq!(scalls[0].1, "add");
        assert_eq!(
            scalls[0].2,
            calls[0]["function"]["arguments"].as_str().unwrap()
        );
        assert_eq!(finish, c["finish_reason"].as_str().unwrap());
        // The legacy `functions` API: one `function_call`, finish_reason "function_call".
        let mut b = body(false);
        b["functions"] = json!([add_tool()[0]["function"]]);
        b.as_object_mut().unwrap().remove("tools");
        let c = s.post("/v1/chat/completions", &b).json()["choices"][0].clone();
        assert_eq!(c["finish_reason"], "function_call", "{c}");
        assert_eq!(c["message"]["function_call"]["name"], "add", "{c}");
        assert!(c["message"].get("tool_calls").is_none(), "{c}");
        b["stream"] = json!(true);
        let chunks = s.post("/v1/chat/completions", &b).sse_chunks();
        let fc: Vec<&Value> = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"].get("function_call"))
            .collect();
        assert_eq!(fc.len(), 1, "{chunks:?}");
        assert_eq!(
            fc[0]["arguments"],
            c["message"]["function_call"]["arguments"]
        );
        // tool_choice "none": the same answer is text.
        let mut b = body(false);
        b["tool_choice"] = json!("none");
        let m = s.post("/v1/chat/completions", &b).json()["choices"][0]["message"].clone();
        assert!(m.get("tool_calls").is_none(), "{m}");
        assert!(m["content"].as_str().unwrap().contains("add"), "{m}");
    }
}

/// Through the official openai SDK (a test dependency; skipped without it): a tool call comes
/// back parsed, and a streamed one assembles in the SDK's own stream helper.
#[test]
fn the_openai_sdk_reads_tool_calls_streamed_or_not() {
    let (_d, s, call_token) = tool_model("Qwen-Qwen2.5-7B-Instruct.jinja", HERMES_CALL);
    let script = r#"
import json, sys
try:
    import openai
except ImportError:
    print("null"); sys.exit(0)
base, token = sys.argv[1], sys.argv[2]
c = openai.OpenAI(base_url=f"http://{base}/v1", api_key="none")
tools = [{"type": "function", "function": {"name": "add", "description": "Add",
          "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                         "b": {"type": "number"}}}}}]
kw = dict(model="tiny", messages=[{"role": "user", "content": "2+3?"}], tools=tools,
          logit_bias={token: 100}, stop=["</tool_call>"], max_tokens=3, temperature=0)
r = c.chat.completions.create(**kw)
m = r.choices[0].message
out = {"finish": r.choices[0].finish_reason, "content": m.content,
       "calls": [[t.function.name, json.loads(t.function.arguments)] for t in m.tool_calls]}
with c.chat.completions.stream(**kw) as st:
    final = st.get_final_completion()
fm = final.choices[0].message
out["stream_calls"] = [[t.function.name, json.loads(t.function.arguments)] for t in fm.tool_calls]
out["stream_content"] = fm.content
# The call goes back into the conversation, with the tool's result, as an agent loop does.
msgs = kw["messages"] + [m.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "5"}]
r2 = c.chat.completions.create(model="tiny", messages=msgs, tools=tools, max_tokens=2)
out["second_turn"] = r2.choices[0].finish_reason is not None
print(json.dumps(out))
"#;
    let Some(v) = common::python_json::<Value>(script, &[&s.addr, &call_token.to_string()]) else {
        eprintln!("skipped: the openai SDK is not installed");
        return;
    };
    assert_eq!(v["finish"], "tool_calls", "{v}");
    assert_eq!(v["content"], "I will add.", "{v}");
    assert_eq!(v["calls"], json!([["add", {"a": 2, "b": 3}]]), "{v}");
    assert_eq!(v["stream_calls"], v["calls"], "{v}");
    assert_eq!(v["stream_content"], "I will add.", "{v}");
    assert_eq!(v["second_turn"], true, "{v}");
}
