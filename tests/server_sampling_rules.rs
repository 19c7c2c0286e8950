//! vLLM's sampling rules beyond OpenAI's, over HTTP on the tiny model: `min_tokens`,
//! `allowed_token_ids`, `bad_words`, `include_stop_str_in_output`, `truncate_prompt_tokens`
//! (each was a 400 before), and their bad values.

mod common;

use common::server::*;
use serde_json::{json, Value};

fn completion(s: &Server, extra: Value) -> Value {
    let mut b = json!({"model": "tiny", "prompt": "hello there", "max_tokens": 8,
                       "temperature": 0, "return_token_ids": true});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    let r = s.post("/v1/completions", &b);
    assert_eq!(r.status, 200, "{}", r.body_text());
    r.json()
}

fn ids(v: &Value) -> Vec<u64> {
    v["choices"][0]["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

fn text(v: &Value) -> String {
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

#[test]
fn min_tokens_holds_back_the_end_and_stop_strings() {
    let (_d, s) = start(CONFIG, &[]);
    let greedy = completion(&s, json!({"ignore_eos": true}));
    let first = ids(&greedy)[0];
    // The first greedy token as a stop token ends the choice at once ...
    let stopped = completion(&s, json!({ "stop_token_ids": [first] }));
    assert_eq!(ids(&stopped), vec![first]);
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
    // ... unless min_tokens: it cannot be drawn before the 4th token.
    let held = completion(&s, json!({"stop_token_ids": [first], "min_tokens": 4}));
    let got = ids(&held);
    assert!(got.len() >= 4, "{got:?}");
    assert!(!got[..4].contains(&first), "{got:?}");
    // A stop string found before min_tokens does not end the choice either.
    let greedy_text = text(&greedy);
    let stop: String = greedy_text.chars().take(1).collect();
    let r = completion(&s, json!({ "stop": [stop], "ignore_eos": true }));
    assert_eq!(r["usage"]["completion_tokens"], 1, "{r}");
    let r = completion(
        &s,
        json!({ "stop": [stop], "ignore_eos": true, "min_tokens": 3 }),
    );
    assert!(
        r["usage"]["completion_tokens"].as_u64().unwrap() >= 3,
        "{r}"
    );
}

#[test]
fn allowed_tokens_and_bad_words_limit_what_is_drawn() {
    let (_d, s) = start(CONFIG, &[]);
    let allowed = [40u64, 41, 42, 77];
    for seed in 0..4 {
        let r = completion(
            &s,
            json!({"allowed_token_ids": allowed, "temperature": 1.0, "seed": seed,
                   "ignore_eos": true, "max_tokens": 16}),
        );
        let got = ids(&r);
        assert_eq!(got.len(), 16);
        assert!(got.iter().all(|t| allowed.contains(t)), "{got:?}");
    }
    // A bad word is never written: the greedy choice's most frequent token, banned by its text.
    let greedy = completion(&s, json!({"ignore_eos": true, "max_tokens": 16}));
    let g = ids(&greedy);
    let word = g
        .iter()
        .copied()
        .find_map(|t| {
            let d = s.post("/detokenize", &json!({ "tokens": [t] })).json();
            let w = d["prompt"].as_str().unwrap().to_string();
            let again = s.post("/tokenize", &json!({ "prompt": w })).json();
            let single_space = w.strip_prefix(' ').unwrap_or(&w) == w.trim_start();
            (!w.trim().is_empty() && single_space && again["tokens"] == json!([t]))
                .then_some((t, w))
        })
        .expect("a greedy token that is a word");
    let r = completion(
        &s,
        json!({"ignore_eos": true, "max_tokens": 16, "bad_words": [word.1.trim()]}),
    );
    assert!(!ids(&r).contains(&word.0), "{:?} banned {word:?}", ids(&r));
    assert_ne!(ids(&r), g);
}

#[test]
fn the_stop_string_can_be_kept_and_the_prompt_truncated() {
    let (_d, s) = start(CONFIG, &[]);
    let greedy = text(&completion(
        &s,
        json!({"ignore_eos": true, "max_tokens": 12}),
    ));
    let chars: Vec<char> = greedy.chars().collect();
    assert!(chars.len() >= 4, "{greedy:?}");
    let stop: String = chars[2..4].iter().collect();
    let at = greedy.find(&stop).unwrap();
    for stream in [false, true] {
        for include in [false, true] {
            let body = json!({"model": "tiny", "prompt": "hello there", "max_tokens": 12,
                              "temperature": 0, "ignore_eos": true, "stop": [stop],
                              "include_stop_str_in_output": include, "stream": stream});
            let r = s.post("/v1/completions", &body);
            assert_eq!(r.status, 200, "{}", r.body_text());
            let got: String = if stream {
                r.sse_chunks()
                    .iter()
                    .filter_map(|c| c["choices"][0]["text"].as_str().map(str::to_string))
                    .collect()
            } else {
                r.json()["choices"][0]["text"].as_str().unwrap().to_string()
            };
            let want = if include {
                &greedy[..at + stop.len()]
            } else {
                &greedy[..at]
            };
            assert_eq!(got, want, "stream {stream} include {include}");
        }
    }
    // The last k prompt tokens, as if only they had been sent.
    let prompt: Vec<u32> = (5..45).collect();
    let cut = completion(
        &s,
        json!({"prompt": prompt, "truncate_prompt_tokens": 10, "ignore_eos": true}),
    );
    assert_eq!(cut["usage"]["prompt_tokens"], 10);
    let tail = completion(&s, json!({"prompt": prompt[30..], "ignore_eos": true}));
    assert_eq!(ids(&cut), ids(&tail));
    let whole = completion(
        &s,
        json!({"prompt": prompt, "truncate_prompt_tokens": 100, "ignore_eos": true}),
    );
    assert_eq!(whole["usage"]["prompt_tokens"], 40);
    // On chat too.
    let r = s.post(
        "/v1/chat/completions",
        &chat("hi there", json!({"truncate_prompt_tokens": 3})),
    );
    assert_eq!(r.status, 200, "{}", r.body_text());
    assert_eq!(r.json()["usage"]["prompt_tokens"], 3);
}

#[test]
fn bad_values_of_the_rules_are_400s_naming_them() {
    let (_d, s) = start(CONFIG, &[]);
    for (extra, param) in [
        (json!({"min_tokens": 9}), "min_tokens"),
        (json!({"min_tokens": -1}), "min_tokens"),
        (json!({"allowed_token_ids": []}), "allowed_token_ids"),
        (
            json!({"allowed_token_ids": [1_000_000]}),
            "allowed_token_ids",
        ),
        (json!({"bad_words": [""]}), "bad_words"),
        (json!({"bad_words": "word"}), "bad_words"),
        (json!({"bad_words": vec!["w"; 200]}), "bad_words"),
        (
            json!({"truncate_prompt_tokens": 0}),
            "truncate_prompt_tokens",
        ),
        (
            json!({"truncate_prompt_tokens": -2}),
            "truncate_prompt_tokens",
        ),
        (
            json!({"include_stop_str_in_output": "yes"}),
            "include_stop_str_in_output",
        ),
    ] {
        let mut b = json!({"model": "tiny", "prompt": "hello", "max_tokens": 8});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        let r = s.post("/v1/completions", &b);
        assert_error(&r, 400, Some(param));
    }
}
