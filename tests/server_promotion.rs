//! Promotion by evaluation, over HTTP on a tiny model: a gated learning adapter's candidate that
//! scores worse than the version serving is held (never served; its samples dropped, or kept and
//! trained from), one that scores as well serves, every decision with its scores in the status,
//! the metrics and the store; a pin keeps serving on a version while training goes on; a
//! restart keeps what serves.

mod common;

use common::online::*;
use common::server::*;
use common::write_tiny;
use serde_json::{json, Value};

const PROMPTS: [&str; 3] = ["say something", "count to three", "name a colour"];

/// Greedy answers of `model` to `PROMPTS` (8 tokens).
fn answers(c: &Client, model: &str) -> Vec<String> {
    PROMPTS
        .iter()
        .map(|p| {
            let body = json!({"model": model, "temperature": 0, "max_tokens": 8,
                              "messages": [{"role": "user", "content": p}]});
            let r = call(c, "POST", "/v1/chat/completions", Some(&body), USER);
            assert_eq!(r.status, 200, "{}", r.body_text());
            r.json()["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect()
}

/// `[[learn]]` settings of adapter `g` (LoRA r=4) as the train route's body, gated on an
/// evaluation set whose references are `refs` (exact answers to `PROMPTS`).
fn gated(lr: f64, on_hold: &str, refs: &[String]) -> Value {
    let eval: Vec<Value> = PROMPTS
        .iter()
        .zip(refs)
        .map(|(p, r)| {
            json!({"messages": [{"role": "user", "content": p}], "scorer": "exact",
                   "reference": r})
        })
        .collect();
    json!({"method": "lora", "lora_r": 4, "lr": lr, "promotion": "gated", "on_hold": on_hold,
           "eval": eval, "eval_max_tokens": 8})
}

fn train(c: &Client, body: &Value) -> Value {
    let r = call(c, "POST", "/v1/adapters/g/train", Some(body), ADMIN);
    assert!(r.status == 200 || r.status == 201, "{}", r.body_text());
    r.json()
}

/// Sample a group of 4 through `g`, reward it, wait for the step (or decision) it makes.
fn step(c: &Client) -> Value {
    let before = status(c, "g");
    let r = sample(c, "g", 4, 3, USER);
    let id = r["id"].as_str().unwrap();
    let items: Vec<Value> = (0..4)
        .map(|i| {
            let x = [0.0, 1.0, 0.2, 0.9][i];
            json!({"id": id, "choice": i, "reward": x})
        })
        .collect();
    let f = call(c, "POST", "/v1/feedback", Some(&Value::Array(items)), USER);
    assert_eq!(f.status, 202, "{}", f.body_text());
    wait_status(c, "g", 60, |s| {
        s["steps"] != before["steps"]
            || s["last_decision"] != before["last_decision"]
            || s["dropped"] != before["dropped"]
    })
}

/// Kill `s` and start it again on the same model, data and settings.
fn restart(mut s: Server, path: &std::path::Path, data: &std::path::Path, cfg: &str) -> Server {
    s.child.kill().unwrap();
    s.child.wait().unwrap();
    start_learning(path, data, cfg, &[])
}

/// The newest decision of `g` of this kind (from its history).
fn newest_decision(c: &Client, kind: &str) -> Value {
    let r = call(c, "GET", "/v1/train/g/history", None, USER);
    let decisions = r.json()["decisions"].clone();
    decisions
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["decision"] == kind)
        .cloned()
        .unwrap_or_else(|| panic!("no {kind}: {decisions}"))
}

/// `POST /v1/adapters/g/pin` with `body`, as the admin.
fn pin(c: &Client, body: Value) -> Response {
    call(c, "POST", "/v1/adapters/g/pin", Some(&body), ADMIN)
}

fn served(c: &Client) -> u64 {
    sample(c, "g", 1, 2, USER)["adapter_version"]
        .as_u64()
        .unwrap()
}

#[test]
fn a_gated_candidate_that_scores_worse_is_held_and_one_that_scores_as_well_serves() {
    let (dir, path) = write_tiny(&spec());
    // f32 products: the last part needs a step too small to change a greedy answer, and BF16's
    // rounding of activations can turn the smallest change into a different near-tie.
    let (data, exact) = (dir.path().join("data"), ["--precision", "exact"]);
    let s = start_learning_with(&path, &data, &learning_config(), &[], &exact);
    let c = &s.client;
    // The untrained adapter (the identity) answers as the base does: those are the references.
    let refs = answers(c, &s_model(c));
    train(c, &gated(0.5, "incumbent", &refs));
    let first = status(c, "g")["version"].as_u64().unwrap();
    assert_eq!(answers(c, "g"), refs);
    // A large step changes the answers: held, explained, its samples dropped as held.
    let logged = r#"flywheel_rollouts_logged_total{adapter="g"}"#;
    let before = s.metric(logged);
    let st = step(c);
    // The evaluation's requests (three for each version) were not logged for training: only
    // the group sampled was.
    assert_eq!(s.metric(logged) - before, 4.0);
    let d = &st["last_decision"];
    assert_eq!(
        (&d["decision"], &d["reason"]),
        (&json!("hold"), &json!("eval")),
        "{st}"
    );
    let cand = d["from_version"].as_u64().unwrap();
    assert!(cand > first);
    assert_eq!(d["to_version"], first);
    let ev: Value = serde_json::from_str(d["evidence"].as_str().unwrap()).unwrap();
    assert_eq!(ev["incumbent_score"], 1.0, "{ev}");
    assert!(ev["candidate_score"].as_f64().unwrap() < 1.0, "{ev}");
    assert_eq!(st["version"], first, "{st}");
    assert_eq!(st["dropped"]["held"], 4, "{st}");
    assert_eq!(st["eval_scores"][first.to_string()], 1.0, "{st}");
    assert_eq!(
        st["eval_scores"][cand.to_string()],
        ev["candidate_score"],
        "{st}"
    );
    assert_eq!(served(c), first);
    assert_eq!(answers(c, "g"), refs, "serving is as before");
    assert_eq!(
        s.metric(
            r#"flywheel_promotion_decisions_total{adapter="g",decision="hold",reason="eval"}"#
        ),
        1.0
    );
    assert_eq!(
        s.metric(r#"flywheel_eval_score{adapter="g",which="served"}"#),
        1.0
    );
    // A step too small to change a greedy answer scores as the incumbent does: it serves.
    train(c, &gated(1e-7, "incumbent", &refs));
    let st = step(c);
    let d = &st["last_decision"];
    assert_eq!(
        (&d["decision"], &d["reason"]),
        (&json!("promote"), &json!("eval")),
        "{st}"
    );
    let v = st["version"].as_u64().unwrap();
    assert!(v > cand, "numbers are never reused: {st}");
    assert_eq!(st["last"]["eval"]["score"], 1.0, "{st}");
    assert_eq!(served(c), v);
    // The versions route shows each version's score and the decisions.
    let r = call(c, "GET", "/v1/adapters/g/versions", None, USER);
    assert_eq!(r.status, 200, "{}", r.body_text());
    let list = r.json();
    let row = |n: u64| {
        list["data"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["version"] == n)
            .cloned()
            .unwrap_or_else(|| panic!("no version {n}: {list}"))
    };
    assert_eq!(row(v)["eval_score"], 1.0, "{list}");
    assert_eq!(row(v)["serving"], true, "{list}");
    assert_eq!(row(cand)["status"], "held", "{list}");
    assert_eq!(row(first)["eval_score"], 1.0, "{list}");
}

/// The base model's name, as `/v1/models` lists it first.
fn s_model(c: &Client) -> String {
    let r = call(c, "GET", "/v1/models", None, USER);
    r.json()["data"][0]["id"].as_str().unwrap().to_string()
}

#[test]
fn a_held_candidate_can_be_trained_from_and_a_restart_serves_the_incumbent() {
    let (dir, path) = write_tiny(&spec());
    let data = dir.path().join("data");
    let s = start_learning(&path, &data, &learning_config(), &[]);
    let c = &s.client;
    let refs = answers(c, &s_model(c));
    train(c, &gated(0.5, "candidate", &refs));
    let first = status(c, "g")["version"].as_u64().unwrap();
    let st = step(c);
    let held = st["held_version"].as_u64().expect("held");
    assert_eq!(st["last_decision"]["decision"], "hold", "{st}");
    assert_eq!(st["version"], first);
    assert!(st["dropped"]["held"].is_null(), "kept, not dropped: {st}");
    // The next step builds on the held one (its number above), still held.
    let st = step(c);
    let held2 = st["held_version"].as_u64().expect("held");
    assert!(held2 > held, "{st}");
    assert_eq!(st["steps"], 2, "{st}");
    assert_eq!(served(c), first);
    // A restart (the adapter learns again when the train route asks) serves the incumbent
    // again (the identity here), and trains from the held one.
    let s = restart(s, &path, &data, &learning_config());
    let c = &s.client;
    train(c, &gated(0.5, "candidate", &refs));
    let st = status(c, "g");
    assert_eq!(st["version"], first, "{st}");
    assert_eq!(st["held_version"], held2, "{st}");
    assert_eq!(answers(c, "g"), refs);
    // A pin to the version serving, then an unpin: the newest version serves.
    let r = pin(c, json!({"version": first}));
    assert_eq!(r.status, 200, "{}", r.body_text());
    assert_eq!(r.json()["status"]["pinned_version"], first);
    let r = pin(c, json!({"version": null}));
    assert_eq!(r.status, 200, "{}", r.body_text());
    let st = &r.json()["status"];
    assert_eq!(st["version"], held2, "{st}");
    assert!(st["held_version"].is_null(), "{st}");
    assert_eq!(st["last_decision"]["decision"], "unpin");
    assert_eq!(served(c), held2);
}

#[test]
fn a_pin_keeps_serving_while_training_goes_on_and_survives_a_restart() {
    let (dir, path) = write_tiny(&spec());
    let data = dir.path().join("data");
    let learn = "[[learn]]\nname = \"g\"\nmethod = \"lora\"\nlora_r = 4\nlr = 0.01\n";
    let cfg = format!("{}\n{learn}", learning_config());
    let s = start_learning(&path, &data, &cfg, &[]);
    let c = &s.client;
    let v2 = step(c)["version"].as_u64().unwrap();
    let r = pin(c, json!({"version": v2}));
    assert_eq!(r.status, 200, "{}", r.body_text());
    let st = step(c);
    let v3 = st["held_version"].as_u64().expect("held while pinned");
    assert!(v3 > v2);
    assert_eq!(
        (&st["version"], &st["pinned_version"]),
        (&json!(v2), &json!(v2)),
        "{st}"
    );
    assert_eq!(served(c), v2);
    // Pinned back to v2 after another step: v3 and v4 were made, v2 serves.
    let st = step(c);
    let v4 = st["held_version"].as_u64().unwrap();
    assert!(v4 > v3);
    // Bad pins name the version.
    for (body, param) in [
        (json!({"version": 999}), "version"),
        (json!({"versoin": 1}), "versoin"),
        (json!({}), "version"),
    ] {
        let r = call(c, "POST", "/v1/adapters/g/pin", Some(&body), ADMIN);
        assert_error(&r, 400, Some(param));
    }
    let r = call(
        c,
        "POST",
        "/v1/adapters/g/pin",
        Some(&json!({"version": v2})),
        USER,
    );
    assert!(r.status == 401 || r.status == 403, "{}", r.body_text());
    // A restart keeps the pin, under the same number.
    let s = restart(s, &path, &data, &cfg);
    let c = &s.client;
    let st = status(c, "g");
    assert_eq!(
        (&st["version"], &st["pinned_version"]),
        (&json!(v2), &json!(v2)),
        "{st}"
    );
    assert_eq!(st["held_version"], v4, "{st}");
    assert_eq!(served(c), v2);
    let r = pin(c, json!({"version": null}));
    assert_eq!(r.status, 200, "{}", r.body_text());
    assert_eq!(served(c), v4);
    // Training goes on, serving each step again.
    let st = step(c);
    assert!(st["version"].as_u64().unwrap() > v4, "{st}");
    assert_eq!(served(c), st["version"].as_u64().unwrap());
}

/// Reward a group of 4 sampled through `g`: `low` or high rewards (both with a spread).
fn reward_by(c: &Client, id: &str, rewards: [f64; 4]) {
    let items: Vec<Value> = (0..4)
        .map(|i| json!({"id": id, "choice": i, "reward": rewards[i]}))
        .collect();
    let f = call(c, "POST", "/v1/feedback", Some(&Value::Array(items)), USER);
    assert_eq!(f.status, 202, "{}", f.body_text());
}

/// Sample through `g` until one group of the candidate `cv` and one of the incumbent `iv` are
/// rewarded (`for_cand`, `for_inc`); groups of other versions are left unrewarded.
fn reward_arms(c: &Client, cv: u64, iv: u64, for_cand: [f64; 4], for_inc: [f64; 4]) {
    let (mut got_c, mut got_i) = (false, false);
    for _ in 0..200 {
        let r = sample(c, "g", 4, 3, USER);
        let v = r["adapter_version"].as_u64().unwrap();
        let id = r["id"].as_str().unwrap();
        if v == cv && !got_c {
            reward_by(c, id, for_cand);
            got_c = true;
        } else if v == iv && !got_i {
            reward_by(c, id, for_inc);
            got_i = true;
        }
        if got_c && got_i {
            return;
        }
    }
    panic!("200 requests never reached both arms ({cv}: {got_c}, {iv}: {got_i})");
}

#[test]
fn a_canary_rolls_back_a_worse_candidate_and_promotes_one_as_good_across_a_restart() {
    let (dir, path) = write_tiny(&spec());
    let data = dir.path().join("data");
    let learn = "[[learn]]\nname = \"g\"\nmethod = \"lora\"\nlora_r = 4\nlr = 0.01\n\
                 promotion = \"canary\"\ncanary_fraction = 0.5\ncanary_window = 4\n";
    let cfg = format!("{}\n{learn}", learning_config());
    let s = start_learning(&path, &data, &cfg, &[]);
    let c = &s.client;
    let first = status(c, "g")["version"].as_u64().unwrap();
    // The step's version runs as a canary: half the requests, training waiting.
    let st = step(c);
    let cv = st["canary_version"].as_u64().expect("a canary runs");
    assert_eq!(st["version"], first, "{st}");
    assert_eq!(st["last_decision"]["decision"], "canary", "{st}");
    // Its samples are rewarded far below the incumbent's: rolled back.
    reward_arms(c, cv, first, [0.0, 0.1, 0.0, 0.1], [1.0, 0.9, 1.0, 0.9]);
    // (The incumbent's group then makes the next candidate at once, again a canary.)
    let st = wait_status(c, "g", 60, |s| {
        s["canary_version"].as_u64().is_some_and(|v| v != cv)
    });
    let d = &newest_decision(c, "rollback");
    assert_eq!(
        (&d["reason"], &d["from_version"], &d["to_version"]),
        (&json!("canary"), &json!(cv), &json!(first)),
        "{d}"
    );
    let ev: Value = serde_json::from_str(d["evidence"].as_str().unwrap()).unwrap();
    assert!(ev["difference"].as_f64().unwrap() < -0.8, "{ev}");
    assert_eq!(ev["candidate"]["n"], 4, "{ev}");
    assert_eq!(
        s.metric(
            r#"flywheel_promotion_decisions_total{adapter="g",decision="rollback",reason="canary"}"#
        ),
        1.0
    );
    // The candidate's samples never train; the numbers are never reused.
    let cv2 = st["canary_version"].as_u64().unwrap();
    assert!(cv2 > cv, "{st}");
    assert_eq!(st["dropped"]["rolled_back"], 4, "{st}");
    assert_eq!(st["version"], first);
    // A restart runs the canary again.
    let s = restart(s, &path, &data, &cfg);
    let c = &s.client;
    let st = status(c, "g");
    assert_eq!(
        (&st["version"], &st["canary_version"]),
        (&json!(first), &json!(cv2)),
        "{st}"
    );
    // As good as the incumbent: promoted, and it serves.
    reward_arms(c, cv2, first, [0.0, 1.0, 0.0, 1.0], [0.0, 1.0, 0.0, 1.0]);
    // (Both groups then train at once: the next candidate is a canary again.)
    let st = wait_status(c, "g", 60, |s| s["version"] == cv2);
    assert_ne!(st["canary_version"], cv2, "{st}");
    let d = &newest_decision(c, "promote");
    assert_eq!(
        (&d["reason"], &d["from_version"]),
        (&json!("canary"), &json!(cv2)),
        "{d}"
    );
    let r = call(c, "GET", "/v1/adapters/g", None, USER);
    assert_eq!(r.json()["version"], cv2, "{}", r.body_text());
}
