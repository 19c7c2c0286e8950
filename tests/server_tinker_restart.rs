//! Tinker sessions and training runs across a kill -9 of the server (`online::runs::kept`): the
//! session, the run and its newest state come back under the same ids and owner; a step's
//! gradient summed before the kill is reported lost (once, with nothing applied) rather than
//! silently replaced by a smaller one; and a run resumed this way trains to the same bits as a
//! run never interrupted.

mod common;

use common::server::*;
use common::tinker::*;
use common::write_tiny;
use flywheel::api::tinker::proto;
use prost::Message;
use serde_json::json;

const KEY: &str = "tml-a";

fn post(s: &Server, path: &str, body: serde_json::Value) -> Response {
    s.try_request("POST", path, Some(&body.to_string()), &[("X-API-Key", KEY)])
        .unwrap()
}

/// A new session and a rank-4 run (seed 1) in it: the run's id.
fn new_run(s: &Server) -> (String, String) {
    let sid = post(s, "/api/v1/create_session", json!({})).json()["session_id"]
        .as_str()
        .unwrap()
        .to_string();
    let r = post(
        s,
        "/api/v1/create_model",
        json!({"session_id": sid, "model_seq_id": 0, "base_model": "tiny",
               "lora_config": {"rank": 4, "seed": 1, "train_unembed": false}}),
    );
    let run = r.json()["model_id"].as_str().unwrap().to_string();
    assert_eq!(result_as(s, &r, KEY).json()["model_id"], run.as_str());
    (sid, run)
}

/// Cross-entropy on one fixed shifted sequence: `forward_only` gives its log-probs.
fn call(s: &Server, run: &str, forward_only: bool) -> Vec<f32> {
    let seq: Vec<i32> = vec![5, 17, 29, 41, 53, 65, 77, 89, 101];
    let targets: Vec<i64> = seq[1..].iter().map(|&t| t as i64).collect();
    let weights = vec![1.0f32; seq.len() - 1];
    let req = proto::ForwardBackwardRequest {
        model_id: run.to_string(),
        seq_id: 1,
        data: vec![datum(
            &seq[..seq.len() - 1],
            &targets,
            &[("weights", tensor_f32(&weights))],
        )],
        loss_fn: "cross_entropy".into(),
        forward_only,
        ..Default::default()
    };
    let got = result_as(
        s,
        &fb_request_as(s, &req, "application/x-protobuf", KEY),
        KEY,
    );
    let out = proto::ForwardBackwardOutput::decode(got.body.as_slice())
        .unwrap_or_else(|e| panic!("{e}: {got:?}"));
    output(&out, "logprobs").remove(0)
}

fn step(s: &Server, run: &str) -> serde_json::Value {
    let r = post(
        s,
        "/api/v1/optim_step",
        json!({"model_id": run, "seq_id": 2, "adam_params": {"learning_rate": 5e-3}}),
    );
    result_as(s, &r, KEY).json()
}

#[test]
fn tinker_runs_survive_a_kill_and_a_lost_gradient_is_refused_once() {
    let (_m, model) = write_tiny(&spec());
    let data = tempfile::tempdir().unwrap();
    let args = [
        "--api-key",
        KEY,
        "--data-dir",
        data.path().to_str().unwrap(),
    ];
    let s1 = Server::start(&model, CONFIG, &args);
    let (sid, run) = new_run(&s1);
    for _ in 0..2 {
        call(&s1, &run, false);
        assert_eq!(step(&s1, &run)["metrics"]["datums:sum"], 1.0);
    }
    let after_two = call(&s1, &run, true);
    // A gradient summed for the third step, then the kill.
    call(&s1, &run, false);
    let mut s1 = s1;
    s1.child.kill().unwrap();
    s1.child.wait().unwrap();

    let s2 = Server::start(&model, CONFIG, &args);
    // The session and the run are back, the key's alone.
    let beat = post(&s2, "/api/v1/session_heartbeat", json!({"session_id": sid}));
    assert_eq!(beat.status, 200, "{beat:?}");
    let got = s2
        .try_request(
            "GET",
            &format!("/api/v1/sessions/{sid}"),
            None,
            &[("X-API-Key", KEY)],
        )
        .unwrap();
    assert_eq!(got.json()["training_run_ids"], json!([run]), "{got:?}");
    let info = post(&s2, "/api/v1/get_info", json!({"model_id": run}));
    assert_eq!(info.json()["lora_rank"], 4, "{info:?}");
    let other = s2
        .try_request(
            "POST",
            "/api/v1/get_info",
            Some(&json!({"model_id": run}).to_string()),
            &[("X-API-Key", "tml-admin")],
        )
        .unwrap();
    assert_ne!(other.status, 200, "{other:?}");
    // Its state is the one after two steps, to the bit.
    assert_eq!(call(&s2, &run, true), after_two);
    // The third step's gradient was lost with the process: refused once, nothing applied.
    let refused = step(&s2, &run);
    assert_eq!(refused["category"], "user", "{refused}");
    assert!(
        refused["error"].as_str().unwrap().contains("restarted"),
        "{refused}"
    );
    assert_eq!(call(&s2, &run, true), after_two, "nothing applied");
    // Done again, the step lands where a run never interrupted lands, to the bit.
    call(&s2, &run, false);
    assert_eq!(step(&s2, &run)["metrics"]["datums:sum"], 1.0);
    let resumed = call(&s2, &run, true);
    let (_, fresh) = new_run(&s2);
    for _ in 0..3 {
        call(&s2, &fresh, false);
        step(&s2, &fresh);
    }
    assert_eq!(call(&s2, &fresh, true), resumed);
    assert_ne!(resumed, after_two);
    // One state folder per run is kept (the replaced ones deleted).
    let folders = std::fs::read_dir(data.path().join("runs"))
        .unwrap()
        .map(|e| std::fs::read_dir(e.unwrap().path()).unwrap().count())
        .collect::<Vec<_>>();
    assert_eq!(folders, [1, 1]);
}
