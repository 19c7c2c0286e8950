//! The Tinker API over real HTTP on a tiny model (the official SDK's own run is
//! `tests/python/test_tinker.py`): sessions and training runs belong to their key, every bad
//! field is a 400 naming it, runs come through futures and stay within their bound, their
//! training calls (protobuf) lower the loss and name every bad datum.

mod common;

use common::server::*;
use common::tinker::*;
use flywheel::api::tinker::proto;
use prost::Message;
use serde_json::{json, Value};
use std::time::Duration;

/// The Tinker API's sessions (the official SDK's own run is in tests/python/test_tinker.py):
/// opened for a key and seen only with it, heartbeats recorded, every bad field a 400 naming it.
#[test]
fn tinker_sessions_belong_to_their_key_and_bad_fields_are_named() {
    let (_d, s) = start(CONFIG, &["--api-key", "tml-a", "--admin-key", "tml-admin"]);
    let as_key = |key: &str, method: &str, path: &str, body: Option<&Value>| {
        let body = body.map(Value::to_string);
        s.try_request(method, path, body.as_deref(), &[("X-API-Key", key)])
            .unwrap()
    };
    let r = as_key(
        "tml-a",
        "POST",
        "/api/v1/client/config",
        Some(&json!({"sdk_version": "0.38.0"})),
    );
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.json()["pjwt_auth_enabled"], false);
    let r = as_key("tml-a", "GET", "/api/v1/healthz", None);
    assert_eq!(r.json(), json!({"status": "ok"}));
    let open = json!({"tags": ["t"], "user_metadata": {"run": "1"}, "sdk_version": "0.38.0",
                      "display_name": "mine", "type": "create_session"});
    let r = as_key("tml-a", "POST", "/api/v1/create_session", Some(&open));
    assert_eq!(r.status, 200, "{r:?}");
    let id = r.json()["session_id"].as_str().unwrap().to_string();
    assert!(id.len() > 32, "{id}");
    let path = format!("/api/v1/sessions/{id}");
    let before = as_key("tml-a", "GET", &path, None).json();
    assert_eq!(before["user_metadata"], json!({"run": "1"}));
    assert_eq!(before["display_name"], "mine");
    std::thread::sleep(Duration::from_millis(20));
    let beat = json!({"session_id": id, "type": "session_heartbeat"});
    let r = as_key("tml-a", "POST", "/api/v1/session_heartbeat", Some(&beat));
    assert_eq!(r.json(), json!({"type": "session_heartbeat"}));
    let after = as_key("tml-a", "GET", &path, None).json();
    assert!(after["last_heartbeat_at"].as_f64() > before["last_heartbeat_at"].as_f64());
    // Another key (the admin's) sees no such session and cannot keep it alive.
    let r = as_key("tml-admin", "GET", &path, None);
    assert_error(&r, 404, None);
    assert_eq!(r.json()["error"]["code"], "session_not_found");
    assert_error(
        &as_key(
            "tml-admin",
            "POST",
            "/api/v1/session_heartbeat",
            Some(&beat),
        ),
        404,
        None,
    );
    assert_error(&as_key("tml-b", "GET", &path, None), 401, None);
    for (body, field) in [
        (json!({"tags": "t"}), "tags"),
        (json!({"tags": [1]}), "tags"),
        (json!({"user_metadata": {"n": 1}}), "user_metadata"),
        (json!({"display_name": 3}), "display_name"),
        (json!({"type": "create_model"}), "type"),
    ] {
        let r = as_key("tml-a", "POST", "/api/v1/create_session", Some(&body));
        assert_error(&r, 400, Some(field));
    }
    let r = as_key(
        "tml-a",
        "POST",
        "/api/v1/session_heartbeat",
        Some(&json!({})),
    );
    assert_error(&r, 400, Some("session_id"));
    let r = as_key("tml-a", "GET", &format!("{path}?access_scope=all"), None);
    assert_error(&r, 400, Some("access_scope"));
    let r = as_key(
        "tml-a",
        "GET",
        &format!("{path}?access_scope=accessible"),
        None,
    );
    assert_eq!(r.status, 200);
    let r = as_key(
        "tml-a",
        "POST",
        "/api/v1/telemetry",
        Some(&json!({"events": []})),
    );
    assert_eq!(r.json(), json!({"status": "accepted"}));
    assert_error(
        &as_key("tml-a", "POST", "/api/v1/telemetry", Some(&json!({}))),
        400,
        Some("events"),
    );
}

/// Tinker training runs: created on the served base for a session of the key, answered through a
/// future, read back with `get_info`, listed by their session; bad settings and other
/// optimizers are refused by name, OFT runs are made on request, and a run is its key's alone.
#[test]
fn tinker_runs_are_created_through_futures_and_refuse_what_is_not_served() {
    let (_d, s) = start(CONFIG, &["--api-key", "tml-a", "--admin-key", "tml-admin"]);
    let call = |key: &str, path: &str, body: &Value| {
        s.try_request("POST", path, Some(&body.to_string()), &[("X-API-Key", key)])
            .unwrap()
    };
    let model = s
        .try_request("GET", "/v1/models", None, &[("X-API-Key", "tml-a")])
        .unwrap()
        .json()["data"][0]["id"]
        .clone();
    let sid = call("tml-a", "/api/v1/create_session", &json!({"tags": []})).json()["session_id"]
        .as_str()
        .unwrap()
        .to_string();
    let lora = json!({"rank": 4, "seed": 3, "train_unembed": false});
    let create = json!({"session_id": sid, "model_seq_id": 0, "base_model": model,
                        "lora_config": lora, "optimizer_config": {"type": "adamw"},
                        "user_metadata": {"who": "me"}, "type": "create_model"});
    let r = call("tml-a", "/api/v1/create_model", &create);
    assert_eq!(r.status, 200, "{r:?}");
    let want = format!("{sid}:train:0");
    assert_eq!(r.json()["model_id"], want.as_str());
    let req = r.json()["request_id"].clone();
    let done = call(
        "tml-a",
        "/api/v1/retrieve_future",
        &json!({"request_id": req}),
    );
    assert_eq!(
        done.json(),
        json!({"type": "create_model", "model_id": want})
    );
    // Only its key sees the future, the run and the session's list.
    let r = call(
        "tml-admin",
        "/api/v1/retrieve_future",
        &json!({"request_id": req}),
    );
    assert_error(&r, 410, None);
    assert_eq!(r.json()["error"]["code"], "future_not_found");
    let info = call("tml-a", "/api/v1/get_info", &json!({"model_id": want})).json();
    assert_eq!(info["lora_rank"], 4);
    assert_eq!(info["is_lora"], true);
    assert_eq!(info["model_data"]["model_name"], model);
    assert_eq!(info["user_metadata"], json!({"who": "me"}));
    // Seven projections of rank 4 on the tiny model: (in + out) × 4 parameters each.
    assert!(info["num_parameters"].as_u64().unwrap() > 0, "{info}");
    let r = call("tml-admin", "/api/v1/get_info", &json!({"model_id": want}));
    assert_error(&r, 404, Some("model_id"));
    let session = s
        .try_request(
            "GET",
            &format!("/api/v1/sessions/{sid}"),
            None,
            &[("X-API-Key", "tml-a")],
        )
        .unwrap()
        .json();
    assert_eq!(session["training_run_ids"], json!([want]));
    // The same run again is a conflict; bad fields are named.
    let r = call("tml-a", "/api/v1/create_model", &create);
    assert_error(&r, 409, Some("model_seq_id"));
    for (patch, field, status) in [
        (
            json!({"lora_config": {"rank": 4, "train_unembed": "yes"}}),
            "lora_config.train_unembed",
            400,
        ),
        (
            json!({"lora_config": {"rank": 0, "train_unembed": false}}),
            "lora_config.rank",
            400,
        ),
        (
            json!({"lora_config": {"rank": 4, "train_unembed": false, "alpha": 8}}),
            "lora_config.alpha",
            400,
        ),
        (
            json!({"lora_config": {"rank": 4, "train_unembed": false, "train_attn": false,
                                "train_mlp": false}}),
            "lora_config",
            400,
        ),
        (json!({"lora_config": null}), "lora_config", 400),
        (
            json!({"optimizer_config": {"type": "dimuon", "version": 1}}),
            "optimizer_config",
            400,
        ),
        (json!({"base_model": "Qwen/Qwen3-8B"}), "base_model", 404),
        (json!({"model_seq_id": -1}), "model_seq_id", 400),
        (json!({"session_id": "session-none"}), "session_id", 404),
        // OFT runs (our extension, through user_metadata): no LM head, a block size that
        // divides every targeted width, a method we have.
        (
            json!({"lora_config": {"rank": 16},
                   "user_metadata": {"flywheel.adapter": "oft"}}),
            "lora_config.train_unembed",
            400,
        ),
        (
            json!({"lora_config": {"rank": 7, "train_unembed": false},
                   "user_metadata": {"flywheel.adapter": "oft"}}),
            "lora_config.rank",
            400,
        ),
        (
            json!({"user_metadata": {"flywheel.adapter": "boft"}}),
            "user_metadata.flywheel.adapter",
            400,
        ),
    ] {
        let mut b = create.clone();
        for (k, v) in patch.as_object().unwrap() {
            b[k] = v.clone();
        }
        b["model_seq_id"] = patch.get("model_seq_id").cloned().unwrap_or(json!(1));
        let r = call("tml-a", "/api/v1/create_model", &b);
        assert_error(
            &r,
            status,
            if field == "session_id" {
                None
            } else {
                Some(field)
            },
        );
    }
    // An OFT run: its block size where LoRA's rank would be.
    let mut oft = create.clone();
    oft["model_seq_id"] = json!(5);
    oft["lora_config"] = json!({"rank": 16, "train_unembed": false});
    oft["user_metadata"] = json!({"flywheel.adapter": "oft"});
    let r = call("tml-a", "/api/v1/create_model", &oft);
    assert_eq!(r.status, 200, "{r:?}");
    let id = format!("{sid}:train:5");
    let info = call("tml-a", "/api/v1/get_info", &json!({"model_id": id})).json();
    assert_eq!(
        (
            &info["is_lora"],
            &info["lora_rank"],
            &info["oft_block_size"]
        ),
        (&json!(false), &json!(null), &json!(16)),
        "{info}"
    );
}

/// Tinker training runs are bounded together: at most twice the parameters one adapter may
/// have (`max_adapter_params`), a 429 saying so past that; one run past the bound alone is a 400
/// naming its rank.
#[test]
fn tinker_runs_together_stay_within_twice_the_adapter_bound() {
    // The tiny model's LoRA of rank 4 on its seven projections has 7424 parameters.
    let config = format!("{CONFIG}[limits]\nmax_adapter_params = 10000\n");
    let (_d, s) = start(&config, &[]);
    let sid = s.post("/api/v1/create_session", &json!({})).json()["session_id"]
        .as_str()
        .unwrap()
        .to_string();
    let run = |seq: u32, rank: u32| {
        s.post(
            "/api/v1/create_model",
            &json!({"session_id": sid, "model_seq_id": seq, "base_model": "tiny",
                    "lora_config": {"rank": rank, "train_unembed": false}}),
        )
    };
    assert_eq!(run(0, 4).status, 200);
    let info = s.post(
        "/api/v1/get_info",
        &json!({"model_id": format!("{sid}:train:0")}),
    );
    assert_eq!(info.json()["num_parameters"], 7424);
    assert_eq!(run(1, 4).status, 200);
    let r = run(2, 4);
    assert_error(&r, 429, None);
    assert_eq!(r.json()["error"]["code"], "training_runs_full");
    assert!(r.body_text().contains("14848"), "{r:?}");
    assert_error(&run(3, 8), 400, Some("lora_config.rank"));
}

/// Training calls on a run, through futures: `forward` gives each target token's log-prob and
/// the weighted cross-entropy (`loss:sum`), the same bits as `forward_backward`'s; steps of
/// `forward_backward` + `optim_step` lower the loss; every bad datum or setting is a 400 naming
/// it, with nothing applied (the log-probs after them are the same bits).
#[test]
fn tinker_training_calls_lower_the_loss_and_name_bad_datums() {
    let (_d, s) = start(CONFIG, &[]);
    let sid = s.post("/api/v1/create_session", &json!({})).json()["session_id"]
        .as_str()
        .unwrap()
        .to_string();
    let r = s.post(
        "/api/v1/create_model",
        &json!({"session_id": sid, "model_seq_id": 0, "base_model": "tiny",
                "lora_config": {"rank": 4, "seed": 1, "train_unembed": false}}),
    );
    let run = r.json()["model_id"].as_str().unwrap().to_string();
    assert_eq!(result_of(&s, &r).json()["model_id"], run.as_str());
    // The shifted sequence: input t[..n-1], targets t[1..]; the prompt's positions weigh 0.
    let seq: Vec<i32> = vec![5, 17, 29, 41, 53, 65, 77, 89, 101];
    let input = &seq[..seq.len() - 1];
    let targets: Vec<i64> = seq[1..].iter().map(|&t| t as i64).collect();
    let weights: Vec<f32> = (0..input.len())
        .map(|j| if j < 3 { 0.0 } else { 1.0 })
        .collect();
    let good = datum(input, &targets, &[("weights", tensor_f32(&weights))]);
    let call =
        |data: Vec<proto::Datum>, loss: &str, forward_only: bool| proto::ForwardBackwardRequest {
            model_id: run.clone(),
            seq_id: 1,
            data,
            loss_fn: loss.into(),
            forward_only,
            ..Default::default()
        };
    let run_call = |req: &proto::ForwardBackwardRequest| {
        let got = result_of(&s, &fb_request(&s, req, "application/x-protobuf"));
        assert_eq!(
            got.header("content-type"),
            Some("application/x-protobuf"),
            "{got:?}"
        );
        proto::ForwardBackwardOutput::decode(got.body.as_slice()).unwrap()
    };
    let forward = || run_call(&call(vec![good.clone()], "cross_entropy", true));
    let first = forward();
    let lp = &output(&first, "logprobs")[0];
    assert_eq!(lp.len(), input.len());
    assert!(lp.iter().all(|&v| v < 0.0 && v.is_finite()), "{lp:?}");
    let want: f64 = lp
        .iter()
        .zip(&weights)
        .map(|(l, w)| -(*l as f64) * *w as f64)
        .sum();
    let loss0 = first.metrics["loss:sum"];
    assert!(
        (loss0 - want).abs() < 1e-5 * want.abs(),
        "{loss0} vs {want}"
    );
    let elementwise = &output(&first, "elementwise_loss")[0];
    assert_eq!(elementwise[..3], [0.0, 0.0, 0.0]);

    // Bad calls, each named; none changes the run.
    let mut bad_targets = targets.clone();
    bad_targets[2] += 1;
    let vocab_out = datum(&[5, 1_000_000], &[17, 29], &[]);
    let cases: Vec<(proto::ForwardBackwardRequest, &str)> = vec![
        (
            call(
                vec![datum(input, &bad_targets, &[])],
                "cross_entropy",
                false,
            ),
            "data[0].loss_fn_inputs.target_tokens",
        ),
        (
            call(vec![good.clone(), vocab_out], "cross_entropy", false),
            "data[1].model_input",
        ),
        (
            call(
                vec![datum(
                    input,
                    &targets,
                    &[("advantages", tensor_f32(&weights))],
                )],
                "cross_entropy",
                false,
            ),
            "data[0].loss_fn_inputs.advantages",
        ),
        (
            call(
                vec![datum(
                    input,
                    &targets,
                    &[("advantages", tensor_f32(&weights))],
                )],
                "importance_sampling",
                false,
            ),
            "data[0].loss_fn_inputs.logprobs",
        ),
        (
            call(
                vec![datum(input, &targets, &[("weights", tensor_f32(&[1.0]))])],
                "cross_entropy",
                false,
            ),
            "data[0].loss_fn_inputs.weights",
        ),
        (call(vec![good.clone()], "gspo", false), "loss_fn"),
        (
            proto::ForwardBackwardRequest {
                loss_fn_config: [("beta".to_string(), 1.0)].into(),
                ..call(vec![good.clone()], "ppo", false)
            },
            "loss_fn_config.beta",
        ),
    ];
    for (req, param) in &cases {
        assert_error(
            &fb_request(&s, req, "application/x-protobuf"),
            400,
            Some(param),
        );
    }
    let r = fb_request(
        &s,
        &call(vec![good.clone()], "cross_entropy", false),
        "application/json",
    );
    assert_eq!(r.status, 415, "{r:?}");
    let other = proto::ForwardBackwardRequest {
        model_id: format!("{sid}:train:9"),
        ..call(vec![good.clone()], "cross_entropy", false)
    };
    assert_error(
        &fb_request(&s, &other, "application/x-protobuf"),
        404,
        Some("model_id"),
    );
    let step = |lr: f64| {
        s.post(
            "/api/v1/optim_step",
            &json!({"model_id": run, "seq_id": 2, "adam_params": {"learning_rate": lr}}),
        )
    };
    assert_error(&step(-1.0), 400, Some("adam_params.learning_rate"));
    let again = forward();
    assert_eq!(
        output(&again, "logprobs"),
        output(&first, "logprobs"),
        "nothing applied"
    );

    // Training: forward_backward's log-probs are forward's bits; the loss falls over steps.
    let mut losses = vec![loss0];
    for k in 0..6 {
        let out = run_call(&call(vec![good.clone()], "cross_entropy", false));
        if k == 0 {
            assert_eq!(output(&out, "logprobs"), output(&first, "logprobs"));
        }
        let done = result_of(&s, &step(5e-3));
        assert_eq!(done.json()["metrics"]["datums:sum"], 1.0, "{done:?}");
        losses.push(forward().metrics["loss:sum"]);
    }
    assert!(
        losses[6] < 0.8 * losses[0],
        "the loss did not fall: {losses:?}"
    );
}
