//! Prompt scoring over HTTP: `echo` + `logprobs` (+ `max_tokens: 0`) and vLLM's
//! `prompt_logprobs` score the prompt with the sampler's own arithmetic, so a completion scored
//! as a prompt gets, to the bit, the log-probs it was sampled with (base and adapter).

mod common;

use common::adapters::{lora, random_peft};
use common::server::*;
use serde_json::{json, Value};

/// Sample a completion of `prompt` through `model`; score prompt + completion with echo and
/// max_tokens 0; the scores of the completion's tokens equal its sampled log-probs exactly.
fn check_scores_equal_sampling(s: &Server, model: &str, prompt: &[u32], temperature: f64) {
    let r = s.post(
        "/v1/completions",
        &json!({"model": model, "prompt": prompt, "max_tokens": 8, "seed": 3, "ignore_eos": true,
                "temperature": temperature, "logprobs": 0, "return_token_ids": true}),
    );
    assert_eq!(r.status, 200, "{}", r.body_text());
    let g = r.json();
    let ids: Vec<u64> = g["choices"][0]["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    let sampled = g["choices"][0]["logprobs"]["token_logprobs"].clone();
    let whole: Vec<u64> = prompt
        .iter()
        .map(|&t| t as u64)
        .chain(ids.clone())
        .collect();
    let r = s.post(
        "/v1/completions",
        &json!({"model": model, "prompt": whole, "max_tokens": 0, "echo": true, "logprobs": 2,
                "temperature": temperature}),
    );
    assert_eq!(r.status, 200, "{}", r.body_text());
    let e = r.json();
    let ch = &e["choices"][0];
    assert_eq!(ch["finish_reason"], "length");
    assert_eq!(e["usage"]["completion_tokens"], 0);
    let lp = &ch["logprobs"];
    let n = whole.len();
    assert_eq!(lp["tokens"].as_array().unwrap().len(), n);
    assert_eq!(lp["token_logprobs"][0], Value::Null);
    assert_eq!(lp["top_logprobs"][0], Value::Null);
    let offsets: Vec<u64> = lp["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{offsets:?}");
    let scored: Vec<Value> = lp["token_logprobs"].as_array().unwrap()[prompt.len()..].to_vec();
    assert_eq!(
        Value::Array(scored),
        sampled,
        "{model}: scores differ from the sampled log-probs"
    );
    for i in 1..n {
        let top = lp["top_logprobs"][i].as_object().unwrap();
        assert!(!top.is_empty() && top.len() <= 3, "{top:?}");
    }
    // vLLM's field, implied by echo + logprobs: the same numbers, with ranks.
    let pl = ch["prompt_logprobs"].as_array().unwrap();
    assert_eq!(pl.len(), n);
    assert_eq!(pl[0], Value::Null);
    for i in 1..n {
        let entry = &pl[i][whole[i].to_string()];
        assert_eq!(entry["logprob"], lp["token_logprobs"][i]);
        assert!(entry["rank"].as_u64().unwrap() >= 1);
    }
}

#[test]
fn scored_prompts_equal_the_sampled_log_probs_bitwise() {
    let (dir, s) = start(CONFIG, &[]);
    let prompt: Vec<u32> = (0..37).map(|t| (t * 13 + 5) % 200 + 3).collect();
    // Temperature 1 and 0.7, base and adapter; the prompt's blocks are in the prefix cache by
    // the time it is scored (scoring computes them anyway).
    check_scores_equal_sampling(&s, "tiny", &prompt, 1.0);
    check_scores_equal_sampling(&s, "tiny", &prompt, 0.7);
    let tmp = tempfile::tempdir().unwrap();
    let peft = random_peft(
        &dir.path().join("tiny.gguf"),
        &tmp.path().join("l"),
        lora(),
        4,
    );
    let r = s.post("/v1/adapters", &json!({"name": "l", "path": peft}));
    assert_eq!(r.status, 201, "{}", r.body_text());
    check_scores_equal_sampling(&s, "l", &prompt, 1.0);
    // The adapter changes the scores.
    let score = |model: &str| {
        s.post(
            "/v1/completions",
            &json!({"model": model, "prompt": prompt, "max_tokens": 0, "echo": true, "logprobs": 0}),
        )
        .json()["choices"][0]["logprobs"]["token_logprobs"]
            .clone()
    };
    assert_ne!(score("tiny"), score("l"));
}

#[test]
fn prompt_logprobs_on_chat_and_the_rules_around_scoring() {
    let (_d, s) = start(CONFIG, &[]);
    let r = s.post(
        "/v1/chat/completions",
        &chat(
            "score me please",
            json!({"prompt_logprobs": 3, "max_tokens": 2}),
        ),
    );
    assert_eq!(r.status, 200, "{}", r.body_text());
    let b = r.json();
    let pl = b["prompt_logprobs"].as_array().unwrap();
    assert_eq!(
        pl.len() as u64,
        b["usage"]["prompt_tokens"].as_u64().unwrap()
    );
    assert_eq!(pl[0], Value::Null);
    for e in &pl[1..] {
        let m = e.as_object().unwrap();
        assert!((3..=4).contains(&m.len()), "{m:?}");
        let ranks: Vec<u64> = m.values().map(|v| v["rank"].as_u64().unwrap()).collect();
        for r in 1..=3 {
            assert!(ranks.contains(&r), "{m:?}");
        }
        assert!(m.values().all(|v| v["decoded_token"].is_string()));
    }
    // Scoring only, on chat: nothing generated.
    let r = s.post(
        "/v1/chat/completions",
        &chat("x", json!({"prompt_logprobs": 0, "max_tokens": 0})),
    );
    assert_eq!(r.status, 200, "{}", r.body_text());
    assert_eq!(r.json()["choices"][0]["message"]["content"], "");
    // max_tokens 0 needs echo or prompt_logprobs; prompt_logprobs is not streamed.
    let r = s.post("/v1/chat/completions", &chat("x", json!({"max_tokens": 0})));
    assert_error(&r, 400, Some("max_tokens"));
    let r = s.post(
        "/v1/completions",
        &json!({"model": "tiny", "prompt": "abc", "max_tokens": 0}),
    );
    assert_error(&r, 400, Some("max_tokens"));
    let r = s.post(
        "/v1/chat/completions",
        &chat("x", json!({"prompt_logprobs": 1, "stream": true})),
    );
    assert_error(&r, 400, Some("prompt_logprobs"));
    // Echo + logprobs streamed: the first chunk carries the prompt's scores, equal to the
    // non-streamed ones; n choices all report them.
    let body = json!({"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 2,
                      "echo": true, "logprobs": 1, "temperature": 0, "n": 2});
    let whole = s.post("/v1/completions", &body).json();
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let r = s.post("/v1/completions", &sb);
    let chunks: Vec<Value> = r
        .sse_data()
        .iter()
        .filter(|d| d.as_str() != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let first = &chunks[0]["choices"][0];
    assert_eq!(first["text"], "the quick brown fox");
    let want = &whole["choices"][0]["logprobs"];
    let k = first["logprobs"]["tokens"].as_array().unwrap().len();
    for f in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        assert_eq!(
            first["logprobs"][f].as_array().unwrap()[..],
            want[f].as_array().unwrap()[..k],
            "{f}"
        );
    }
    assert_eq!(
        whole["choices"][1]["logprobs"]["token_logprobs"]
            .as_array()
            .unwrap()[..k],
        want["token_logprobs"].as_array().unwrap()[..k]
    );
}

/// `/v1/embeddings`: each input's final hidden states (after the output norm), mean-pooled and
/// L2-normalised — equal to the independent f64 forward's; batched as alone; text as its token
/// ids; base64 as the floats' bytes; an adapter's differ from the base's; bad inputs are 400s.
#[test]
fn embeddings_are_the_mean_final_hidden_state_normalised() {
    let (dir, path) = common::write_tiny(&spec());
    // Compared with exact math below: f32 products (the default may be BF16's).
    let s = Server::start(&path, CONFIG, &["--precision", "exact"]);
    let embed = |body: Value| -> Value {
        let r = s.post("/v1/embeddings", &body);
        assert_eq!(r.status, 200, "{}", r.body_text());
        r.json()
    };
    // The vectors are f32s: compared as f32 (JSON's decimals parse back to them exactly).
    let vec_of = |v: &Value| -> Vec<f32> {
        v["embedding"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect()
    };
    let prompt = [5u32, 9, 17, 40, 41, 77, 3];
    let one = embed(json!({"model": "tiny", "input": prompt}));
    let got = vec_of(&one["data"][0]);
    let states =
        common::naive::naive_hidden_with(&path, &prompt, &|_, _, w, x| common::naive::matvec(w, x));
    let mut mean = vec![0.0; got.len()];
    for st in &states {
        for (m, x) in mean.iter_mut().zip(st) {
            *m += x / states.len() as f64;
        }
    }
    let norm = mean.iter().map(|x| x * x).sum::<f64>().sqrt();
    let diff = got
        .iter()
        .zip(&mean)
        .map(|(g, m)| (*g as f64 - m / norm).abs())
        .fold(0.0, f64::max);
    assert!(diff < 1e-4, "max |flywheel - f64 forward| = {diff}");
    assert_eq!(one["usage"]["prompt_tokens"], 7);
    // Batched with others (and beside a chat) as alone; text as its token ids.
    let text = "hello there";
    let ids = s.post("/tokenize", &json!({ "prompt": text })).json()["tokens"].clone();
    let chat = std::thread::scope(|sc| {
        let h = sc.spawn(|| {
            s.post(
                "/v1/chat/completions",
                &chat("hi", json!({"max_tokens": 16})),
            )
        });
        let many = embed(json!({"model": "tiny", "input": [text, prompt, ids]}));
        assert_eq!(h.join().unwrap().status, 200);
        many
    });
    let d = chat["data"].as_array().unwrap();
    assert_eq!(d.len(), 3);
    assert_eq!(vec_of(&d[1]), got);
    assert_eq!(vec_of(&d[0]), vec_of(&d[2]));
    assert_ne!(vec_of(&d[0]), got);
    // base64: the little-endian f32 bytes.
    let b = embed(json!({"model": "tiny", "input": prompt, "encoding_format": "base64"}));
    let raw = b["data"][0]["embedding"].as_str().unwrap();
    let bytes = decode_base64(raw);
    let floats: Vec<f32> = bytes
        .chunks(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(floats, got);
    // Through an adapter: its own states.
    let peft = random_peft(&path, &dir.path().join("a"), lora(), 7);
    let r = s.post(
        "/v1/load_lora_adapter",
        &json!({"lora_name": "a", "lora_path": peft.to_str().unwrap()}),
    );
    assert!(r.status < 300, "{}", r.body_text());
    let a = embed(json!({"model": "a", "input": prompt}));
    assert_eq!(a["adapter"], "a");
    assert_ne!(vec_of(&a["data"][0]), got);
    // Bad inputs.
    for (body, param) in [
        (json!({"model": "tiny", "input": []}), "input"),
        (json!({"model": "tiny", "input": [[]]}), "input"),
        (json!({"model": "tiny", "input": 3}), "input"),
        (json!({"model": "tiny", "input": vec![5; 600]}), "input"),
        (
            json!({"model": "tiny", "input": "x", "dimensions": 8}),
            "dimensions",
        ),
        (
            json!({"model": "tiny", "input": "x", "encoding_format": "hex"}),
            "encoding_format",
        ),
    ] {
        assert_error(&s.post("/v1/embeddings", &body), 400, Some(param));
    }
    assert_error(
        &s.post("/v1/embeddings", &json!({"model": "nope", "input": "x"})),
        404,
        Some("model"),
    );
}

fn decode_base64(s: &str) -> Vec<u8> {
    let val = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        _ => 63,
    };
    let mut out = Vec::new();
    for chunk in s.as_bytes().chunks(4) {
        let n = chunk
            .iter()
            .take_while(|&&c| c != b'=')
            .fold((0u32, 0usize), |(acc, k), &c| {
                (acc << 6 | val(c) as u32, k + 1)
            });
        let (bits, k) = (n.0 << (6 * (4 - n.1)), n.1);
        let bytes = [(bits >> 16) as u8, (bits >> 8) as u8, bits as u8];
        out.extend_from_slice(&bytes[..k.saturating_sub(1)]);
    }
    out
}
