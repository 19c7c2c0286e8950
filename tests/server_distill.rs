//! On-policy distillation over HTTP on a tiny generated model: an adapter with `loss =
//! "distill"` and a teacher prompt trains on its own completions with no reward posted, each
//! token's advantage the teacher's log-prob minus its own; the reverse KL to the teacher (the
//! base reading the teacher prompt) falls on held-out prompts, measured through the public API
//! on the student's greedy answers (greedy answers are not trained on: the measure stays apart).

mod common;

use common::online::*;
use common::server::Client;
use common::write_tiny;
use serde_json::{json, Value};

const TEACHER: &str = "Always answer briefly and politely. ";

/// The mean per-token reverse KL estimate log π_student − log π_teacher over greedy answers of
/// the student (`model`) to `prompts`: its log-probs as served, the teacher's by scoring the
/// teacher prompt + prompt + answer on the base (`prompt_logprobs`).
fn reverse_kl(c: &Client, model: &str, base: &str, prompts: &[&str]) -> f64 {
    let t = call(
        c,
        "POST",
        "/tokenize",
        Some(&json!({"prompt": TEACHER})),
        USER,
    )
    .json();
    let teacher: Vec<Value> = t["tokens"].as_array().unwrap().clone();
    let (mut sum, mut n) = (0.0, 0usize);
    for p in prompts {
        // Greedy: not a draw from the policy, so never trained on (the measure stays apart).
        let body = json!({"model": model, "prompt": p, "max_tokens": 16, "temperature": 0.0,
                          "ignore_eos": true, "logprobs": 0, "return_token_ids": true});
        let r = call(c, "POST", "/v1/completions", Some(&body), USER).json();
        for choice in r["choices"].as_array().unwrap() {
            let student: Vec<f64> = choice["logprobs"]["token_logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap())
                .collect();
            let mut ids = teacher.clone();
            ids.extend(
                choice["prompt_token_ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .cloned(),
            );
            let first = ids.len();
            ids.extend(choice["token_ids"].as_array().unwrap().iter().cloned());
            let body = json!({"model": base, "prompt": ids, "max_tokens": 0, "echo": true,
                              "logprobs": 0, "temperature": 1.0});
            let s = call(c, "POST", "/v1/completions", Some(&body), USER);
            assert_eq!(s.status, 200, "{}", s.body_text());
            let lp = s.json()["choices"][0]["logprobs"]["token_logprobs"].clone();
            for (k, st) in student.iter().enumerate() {
                sum += st - lp[first + k].as_f64().unwrap();
                n += 1;
            }
        }
    }
    sum / n as f64
}

#[test]
fn a_distilling_adapter_learns_its_teachers_answers_without_rewards() {
    let (dir, path) = write_tiny(&common::TinySpec {
        ctx: 256,
        ..common::TinySpec::small()
    });
    let learn = format!(
        "[[learn]]\nname = \"d\"\nloss = \"distill\"\nteacher_prompt = \"{TEACHER}\"\n\
         method = \"lora\"\nlora_r = 8\nlr = 0.003\ngroups_per_step = 1\n"
    );
    let cfg = format!("{}\n{learn}", config("max_off_policy_steps = 1000"));
    let s = start_learning(&path, &dir.path().join("data"), &cfg, &[]);
    // Settings are checked, naming the key.
    for (body, param) in [
        (json!({"loss": "distill"}), "teacher_prompt"),
        (json!({"distill_weight": 0.5}), "distill_weight"),
        (json!({"teacher_prompt": "x"}), "teacher_prompt"),
        (
            json!({"loss": "gspo", "teacher_prompt": "x", "distill_weight": 1}),
            "teacher_prompt",
        ),
    ] {
        let r = call(&s, "POST", "/v1/adapters/x/train", Some(&body), ADMIN);
        assert_eq!(r.status, 400, "{}", r.body_text());
        assert_eq!(r.json()["error"]["param"], param, "{}", r.body_text());
    }
    let base = call(&s, "GET", "/v1/models", None, USER).json()["data"][0]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let held_out = [
        "the sea",
        "a red door",
        "seven birds",
        "under the bridge",
        "my friend",
        "rain",
    ];
    let before = reverse_kl(&s, "d", &base, &held_out);
    // Its own samples, no reward posted: each request is a step's batch.
    let train = [
        "hello",
        "what time",
        "tell me",
        "a story",
        "good morning",
        "why not",
    ];
    let mut kls = Vec::new();
    for round in 0..10 {
        for (i, p) in train.iter().enumerate() {
            let body = json!({"model": "d", "prompt": p, "max_tokens": 8, "n": 2,
                              "temperature": 1.0, "ignore_eos": true, "seed": round * 100 + i});
            let r = call(&s, "POST", "/v1/completions", Some(&body), USER);
            assert_eq!(r.status, 200, "{}", r.body_text());
        }
        let want = (round + 1) * train.len() * 2;
        let st = wait_status(&s, "d", 120, |st| {
            st["trained"].as_u64() >= Some(want as u64)
        });
        kls.push(st["last"]["teacher_kl"].as_f64().unwrap());
        // Samples of the weights trained (if any in the step) are trained on what was served.
        let diff = &st["last"]["logprob_diff_max"];
        assert!(diff.is_null() || *diff == 0.0, "{st}");
    }
    let after = reverse_kl(&s, "d", &base, &held_out);
    eprintln!("held-out reverse KL {before:.4} -> {after:.4}; steps' teacher_kl {kls:?}");
    // Measured (Zen 4, 60 steps): 2.58 -> 1.97 with AVX-512, -> 2.18 on the AVX2 path.
    assert!(after < 0.9 * before, "{before} -> {after} ({kls:?})");
}
