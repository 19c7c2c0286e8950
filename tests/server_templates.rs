//! What a model's file does not bring, set by the user: a chat template for a base model's GGUF
//! (`--chat-template`, per request `chat_template`), the template's variables
//! (`chat_template_kwargs`), `add_generation_prompt` and `continue_final_message`; and a context
//! longer than the KV cache holds, fitted with a warning (or `--max-model-len`).

mod common;

use common::server::*;
use common::{write_tiny, TinySpec};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// The tiny model as a base model's file: no `tokenizer.chat_template`.
fn base() -> TinySpec {
    TinySpec {
        chat_template: Some(""),
        ..spec()
    }
}

/// `/tokenize` of `body` (messages and render fields), decoded back to text by `/detokenize`.
fn rendered(s: &Server, body: Value) -> Result<String, Response> {
    let r = s.post("/tokenize", &body);
    if r.status != 200 {
        return Err(r);
    }
    let tokens = r.json()["tokens"].clone();
    let d = s.post("/detokenize", &json!({ "tokens": tokens }));
    assert_eq!(d.status, 200, "{}", d.body_text());
    Ok(d.json()["prompt"].as_str().unwrap().to_string())
}

fn convo() -> Value {
    json!([
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "The colour is"},
    ])
}

#[test]
fn a_base_models_file_refuses_chat_until_it_is_given_a_template() {
    let (_d, path) = write_tiny(&base());
    let s = Server::start(&path, CONFIG, &[]);
    assert!(
        s.stderr().contains("the model has no chat template"),
        "{}",
        s.stderr()
    );
    let r = s.post("/v1/chat/completions", &chat("hi", json!({})));
    let e = assert_error(&r, 400, Some("messages"));
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(msg.contains("--chat-template"), "{msg}");
    assert_eq!(msg.matches("chat template").count(), 2, "{msg}");
    assert!(!msg.contains("chat template: chat template"), "{msg}");
    // Completions need no template.
    let r = s.post(
        "/v1/completions",
        &json!({"model": "tiny", "prompt": "abc", "max_tokens": 3}),
    );
    assert_eq!(r.status, 200, "{}", r.body_text());
    // A request may bring its own.
    let tmpl = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}\
                {% if add_generation_prompt %}[assistant] {% endif %}";
    let r = s.post(
        "/v1/chat/completions",
        &chat("hi", json!({"chat_template": tmpl})),
    );
    assert_eq!(r.status, 200, "{}", r.body_text());
    assert_eq!(
        rendered(
            &s,
            json!({"messages": [{"role": "user", "content": "hi"}], "chat_template": tmpl})
        )
        .unwrap(),
        "[user] hi\n[assistant] "
    );
    drop(s);

    // Started with a built-in name, a file, or the text itself: chat works, and /tokenizer_info
    // gives the template in use.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("t.jinja");
    std::fs::write(&file, tmpl).unwrap();
    let chatml = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n";
    for (arg, want) in [
        ("chatml", chatml),
        (file.to_str().unwrap(), "[user] hi\n[assistant] "),
        (tmpl, "[user] hi\n[assistant] "),
    ] {
        let s = Server::start(&path, CONFIG, &["--chat-template", arg]);
        let one = json!({"messages": [{"role": "user", "content": "hi"}]});
        assert_eq!(rendered(&s, one).unwrap(), want, "{arg}");
        let r = s.post("/v1/chat/completions", &chat("hi", json!({})));
        assert_eq!(r.status, 200, "{arg}: {}", r.body_text());
        let info = s.get("/tokenizer_info").json();
        assert!(info["chat_template"].as_str().is_some(), "{info}");
    }
    // A name that is none of these does not start.
    let err = refused_start(&path, &["--chat-template", "chatmll"]);
    assert!(
        err.contains("chatmll") && err.contains("chatml, llama3"),
        "{err}"
    );
}

/// The same with what users bring: GGUF files written by llama.cpp's own `convert_hf_to_gguf.py`
/// from transformers models (tests/fixtures/hf, one per family; a converted base model has no
/// `tokenizer.chat_template`), served with the default f16 KV cache.
#[test]
fn files_from_llama_cpps_converter_chat_once_given_a_template() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf");
    for family in ["llama3", "qwen2", "qwen3", "qwen3moe", "gemma3"] {
        let path = root.join(family).join("model.gguf");
        let s = Server::start(&path, CONFIG, &[]);
        let model = s.get("/v1/models").json()["data"][0]["id"].clone();
        let body = json!({"model": model, "max_tokens": 3, "ignore_eos": true,
                          "messages": [{"role": "user", "content": "hi"}]});
        let r = s.post("/v1/chat/completions", &body);
        let e = assert_error(&r, 400, Some("messages"));
        assert!(
            e["error"]["message"]
                .as_str()
                .unwrap()
                .contains("--chat-template"),
            "{family}: {e}"
        );
        drop(s);
        let s = Server::start(&path, CONFIG, &["--chat-template", "chatml"]);
        let r = s.post("/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{family}: {}", r.body_text());
        assert_eq!(r.json()["usage"]["completion_tokens"], 3, "{family}");
    }
}

#[test]
fn the_template_replaces_the_files_and_continues_the_final_message() {
    let (_d, s) = start(CONFIG, &["--chat-template", "zephyr"]);
    let user = json!([{"role": "user", "content": "hi"}]);
    assert_eq!(
        rendered(&s, json!({"messages": user})).unwrap(),
        "<|user|>\nhi<|im_end|>\n<|assistant|>\n"
    );
    assert_eq!(
        rendered(
            &s,
            json!({"messages": user, "add_generation_prompt": false})
        )
        .unwrap(),
        "<|user|>\nhi<|im_end|>\n"
    );
    // The final message left open: cut where its content ends, as transformers cuts it.
    let cont = json!({"messages": convo(), "continue_final_message": true,
                      "add_generation_prompt": false});
    assert_eq!(
        rendered(&s, cont.clone()).unwrap(),
        "<|user|>\nName a colour.<|im_end|>\n<|assistant|>\nThe colour is"
    );
    // Both at once are refused, as vLLM refuses them.
    let both = json!({"messages": convo(), "continue_final_message": true});
    assert_error(
        &rendered(&s, both).unwrap_err(),
        400,
        Some("continue_final_message"),
    );
    // Through chat: the prompt is the open message, so the completion continues it.
    let mut body = chat("x", cont);
    body["max_tokens"] = json!(4);
    body["return_token_ids"] = json!(true);
    let r = s.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body_text());
    let prompt_ids = r.json()["prompt_token_ids"].clone();
    let d = s.post("/detokenize", &json!({ "tokens": prompt_ids }));
    assert!(
        d.json()["prompt"]
            .as_str()
            .unwrap()
            .ends_with("<|assistant|>\nThe colour is"),
        "{}",
        d.body_text()
    );
    // A template that drops the final message's content cannot continue it: a 400.
    let drops = "{% for m in messages %}{{ m.role }}{% endfor %}";
    let r = rendered(
        &s,
        json!({"messages": convo(), "continue_final_message": true,
               "add_generation_prompt": false, "chat_template": drops}),
    )
    .unwrap_err();
    assert_error(&r, 400, Some("chat_template"));
}

#[test]
fn template_variables_come_from_the_request_and_bad_templates_are_400s() {
    let (_d, s) = start(CONFIG, &[]);
    let tmpl = "{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}\
                {{ greeting | default('hello') }} {{ messages[0].content }}";
    let one = |extra: Value| {
        let mut b = json!({"messages": [{"role": "user", "content": "hi"}], "chat_template": tmpl});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        rendered(&s, b)
    };
    assert_eq!(one(json!({})).unwrap(), "hello hi");
    assert_eq!(
        one(json!({"chat_template_kwargs": {"greeting": "hey", "enable_thinking": false}}))
            .unwrap(),
        "/no_think hey hi"
    );
    // What the template is always given cannot be replaced; kwargs must be an object.
    for kw in [
        json!({"messages": []}),
        json!({"add_generation_prompt": true}),
        json!([1]),
    ] {
        let r = one(json!({ "chat_template_kwargs": kw })).unwrap_err();
        assert_error(&r, 400, Some("chat_template_kwargs"));
    }
    // Syntax errors, raise_exception, a loop that never ends in time: 400s naming the field,
    // quickly, and the server serves on.
    for bad in [
        "{% for m in messages %}",
        "{{ raise_exception('no system role here') }}",
        "{% for i in range(10000) %}{% for j in range(10000) %}{{ i }}{% endfor %}{% endfor %}",
        "",
    ] {
        let t0 = Instant::now();
        let r = s.post(
            "/v1/chat/completions",
            &chat("hi", json!({ "chat_template": bad })),
        );
        let e = assert_error(&r, 400, Some("chat_template"));
        assert!(t0.elapsed() < Duration::from_secs(20), "{bad}");
        if bad.contains("raise_exception") {
            let msg = e["error"]["message"].as_str().unwrap();
            assert!(msg.contains("no system role here"), "{msg}");
        }
    }
    let r = s.post("/v1/chat/completions", &chat("hi", json!({})));
    assert_eq!(r.status, 200, "{}", r.body_text());
    // Chat's `echo` stays refused by name.
    let r = s.post("/v1/chat/completions", &chat("hi", json!({"echo": true})));
    assert_error(&r, 400, Some("echo"));
}

#[test]
fn a_context_longer_than_the_cache_is_fitted_with_a_warning_unless_it_is_set() {
    // A 32k-context file; 1 MiB of f16 KV cache holds 256 blocks of 16 (2 layers, kv_dim 32,
    // 4 KiB a block). Before, it refused to start ("one sequence of max_model_len 32768 needs
    // 2048", in f32).
    let (_d, path) = write_tiny(&TinySpec {
        ctx: 32768,
        ..TinySpec::small()
    });
    let small = "[engine]\nkv_cache_mb = 1\nmax_num_batched_tokens = 64\n";
    let s = Server::start(&path, small, &[]);
    let err = s.stderr();
    assert!(
        err.contains("the model's context of 32768 tokens")
            && err.contains("max_model_len is 4096"),
        "{err}"
    );
    let card = s.get("/v1/models").json();
    assert_eq!(card["data"][0]["max_model_len"], 4096, "{card}");
    // A prompt over the fitted context is refused as any too-long prompt is.
    let r = s.post(
        "/v1/completions",
        &json!({"model": "tiny", "prompt": vec![5; 4100], "max_tokens": 1}),
    );
    assert_eq!(r.status, 400, "{}", r.body_text());
    drop(s);
    // --max-model-len chooses (within the cache) ...
    let s = Server::start(&path, small, &["--max-model-len", "300"]);
    assert_eq!(s.get("/v1/models").json()["data"][0]["max_model_len"], 300);
    drop(s);
    // ... and one beyond it does not start, saying what it needs.
    let cfg = tempfile::tempdir().unwrap();
    let toml = cfg.path().join("serve.toml");
    std::fs::write(&toml, small).unwrap();
    let err = refused_start(
        &path,
        &[
            "--config",
            toml.to_str().unwrap(),
            "--max-model-len",
            "8192",
        ],
    );
    assert!(
        err.contains("kv_cache_mb") && err.contains("max_model_len 8192"),
        "{err}"
    );
}

/// A reasoning model's template (it writes `<think>` or `</think>`): the thinking comes back as
/// `reasoning_content`, the answer as `content`, streamed or not; a template that opens the
/// thinking in the prompt (DeepSeek-R1's) makes the completion start inside it. Other templates
/// leave the text whole.
#[test]
fn a_reasoning_models_thinking_is_returned_apart_from_its_answer() {
    const QWEN3ISH: &str = "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n'}}{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\\n'}}{% if enable_thinking is defined and not enable_thinking %}{{'<think>\\n\\n</think>\\n\\n'}}{% endif %}{% endif %}";
    const R1ISH: &str = "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n'}}{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\\n<think>\\n'}}{% endif %}";
    let (_d, path) = write_tiny(&TinySpec {
        extra_tokens: &["<think>", "</think>"],
        chat_template: Some(QWEN3ISH),
        ..spec()
    });
    let s = Server::start(&path, CONFIG, &[]);
    let ask = |template: Option<&str>, regex: &str, stream: bool| -> (Value, Value) {
        let mut b = chat(
            "hi",
            json!({"structured_outputs": {"regex": regex}, "temperature": 1.0, "seed": 5,
                   "max_tokens": 40, "stream": stream}),
        );
        if let Some(t) = template {
            b["chat_template"] = json!(t);
        }
        let r = s.post("/v1/chat/completions", &b);
        assert_eq!(r.status, 200, "{}", r.body_text());
        if !stream {
            let m = r.json()["choices"][0]["message"].clone();
            return (m["reasoning_content"].clone(), m["content"].clone());
        }
        let (mut t, mut c) = (String::new(), String::new());
        for ch in r.sse_chunks() {
            let d = &ch["choices"][0]["delta"];
            t.push_str(d["reasoning_content"].as_str().unwrap_or(""));
            c.push_str(d["content"].as_str().unwrap_or(""));
        }
        let t = if t.is_empty() { Value::Null } else { json!(t) };
        (t, json!(c))
    };
    let think = "<think>[a-z]{2,6}</think>[a-z]{2,6}";
    let plain = |v: &Value| {
        v.as_str()
            .is_some_and(|s| !s.is_empty() && s.chars().all(|c| c.is_ascii_lowercase()))
    };
    for stream in [false, true] {
        let (t, c) = ask(None, think, stream);
        assert!(plain(&t) && plain(&c), "{t} {c} (stream {stream})");
        assert_eq!((t, c), ask(None, think, !stream), "streamed = whole");
        // Opened by the prompt: everything up to </think> is thinking.
        let (t, c) = ask(Some(R1ISH), "[a-z]{2,6}</think>[a-z]{2,6}", stream);
        assert!(plain(&t) && plain(&c), "{t} {c}");
        // No thinking written: all answer.
        let (t, c) = ask(None, "[a-z]{2,6}", stream);
        assert!(t.is_null() && plain(&c), "{t} {c}");
    }
    // A template that is not a reasoning model's: the text comes back whole.
    let chatml = "{% for m in messages %}{{ m['content'] }}{% endfor %}";
    let (t, c) = ask(Some(chatml), think, false);
    assert!(t.is_null(), "{t}");
    assert!(c.as_str().unwrap().starts_with("<think>"), "{c}");
}
