//! `--device` through the server's public interface, whatever the build and the machine: auto
//! serves and says where and why; an explicit `cuda` either serves on the GPU or stops at start
//! with the reason; a bad value is refused by name. CI also runs these against the CUDA build
//! (FLYWHEEL_BIN; no GPU there: auto falls back to the CPU), the GPU proof on a GPU.

mod common;

use common::server::{server_binary, Server};
use common::{write_tiny, TinySpec};
use serde_json::json;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn auto_serves_and_says_on_which_device_and_why() {
    let (_dir, path) = write_tiny(&TinySpec::small());
    let s = Server::start(&path, "", &["--device", "auto"]);
    let r = s.post(
        "/v1/completions",
        &json!({"model": "tiny", "prompt": "hello", "max_tokens": 4}),
    );
    assert_eq!(r.status, 200, "{}", r.body_text());
    let log = s.stderr();
    let cpu = log.contains("device: cpu (auto: ");
    let gpu = log.contains("device: cuda, ");
    assert!(
        cpu ^ gpu,
        "the start-up log names one device and why: {log}"
    );
}

/// Start `serve --device cuda`: Ok(log) once its log says it runs on the GPU, Err(stderr) once
/// it exits (it listens first, answering 503 while the model loads, then stops on the error).
fn serve_on_cuda(model: &std::path::Path) -> Result<String, String> {
    let dir = tempfile::tempdir().unwrap();
    let err_path = dir.path().join("stderr.log");
    let mut child = Command::new(server_binary())
        .args(["serve", "--model", model.to_str().unwrap(), "--port", "0"])
        .args(["--host", "127.0.0.1", "--device", "cuda"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let log = std::fs::read_to_string(&err_path).unwrap();
        if log.contains("device: cuda, ") {
            let _ = child.kill();
            let _ = child.wait();
            return Ok(log);
        }
        if let Some(status) = child.try_wait().unwrap() {
            assert!(!status.success(), "serve exited 0: {log}");
            return Err(std::fs::read_to_string(&err_path).unwrap());
        }
        assert!(
            Instant::now() < deadline,
            "serve --device cuda neither ran nor stopped: {log}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn an_explicit_cuda_serves_on_the_gpu_or_stops_with_the_reason() {
    let (_dir, path) = write_tiny(&TinySpec::small());
    match serve_on_cuda(&path) {
        Ok(log) => assert!(log.contains("device: cuda, "), "{log}"),
        Err(err) => {
            assert!(err.contains("--device cuda: "), "{err}");
            eprintln!("no usable GPU here: {}", err.lines().last().unwrap_or(""));
        }
    }
}

#[test]
fn a_device_that_is_not_one_is_refused_by_name() {
    let (_dir, path) = write_tiny(&TinySpec::small());
    let out = Command::new(server_binary())
        .args(["serve", "--model", path.to_str().unwrap(), "--port", "0"])
        .args(["--device", "gpu"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("engine.device") && err.contains("cpu, cuda or auto"),
        "{err}"
    );
}

/// On a GPU: the tokens drawn there (greedy, at temperatures, among llama.cpp's default top-k 40 /
/// top-p 0.95 / min-p 0.05, `n` > 1 whose first token forks on the host) are those the host's
/// sampler draws from the same logits (FLYWHEEL_CUDA_SAMPLING=0), with the same alternatives and
/// log-probs within 1e-5 (the host's log-softmax is the CPU's SIMD kernel, the GPU's the
/// reference's arithmetic); so does a top-p alone (a nucleus: drawn on the GPU where its cut falls
/// among the 128 best, else from the row's log-probs on the host).
/// Without a usable GPU there is nothing to compare, and it says so.
#[test]
fn tokens_drawn_on_the_gpu_are_those_the_host_draws() {
    let (_dir, path) = write_tiny(&TinySpec::small());
    if let Err(err) = serve_on_cuda(&path) {
        eprintln!(
            "skipped: no usable GPU here ({})",
            err.lines().last().unwrap_or("")
        );
        return;
    }
    let gpu = Server::start(&path, "", &["--device", "cuda"]);
    assert!(
        gpu.stderr().contains("tokens drawn on the GPU"),
        "{}",
        gpu.stderr()
    );
    let host = Server::start_in(
        &["env", "FLYWHEEL_CUDA_SAMPLING=0"],
        &path,
        "",
        &["--device", "cuda"],
    );
    let log = host.stderr();
    assert!(
        log.contains("tokens drawn on the host (FLYWHEEL_CUDA_SAMPLING=0)"),
        "{log}"
    );
    let prompt = "The quick brown fox";
    for extra in [
        json!({"temperature": 0, "logprobs": 5}),
        json!({"temperature": 0.8, "seed": 7, "n": 3, "logprobs": 3}),
        json!({"temperature": 1.0, "seed": 11, "logprobs": 0}),
        json!({"temperature": 0.8, "seed": 5, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "logprobs": 2}),
        json!({"temperature": 1.3, "seed": 3, "top_p": 0.8, "logprobs": 2}),
    ] {
        let mut body = json!({"model": "tiny", "prompt": prompt, "max_tokens": 16});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let (a, b) = (
            gpu.post("/v1/completions", &body),
            host.post("/v1/completions", &body),
        );
        assert_eq!(
            (a.status, b.status),
            (200, 200),
            "{} {}",
            a.body_text(),
            b.body_text()
        );
        let (a, b) = (a.json(), b.json());
        let (ca, cb) = (
            a["choices"].as_array().unwrap(),
            b["choices"].as_array().unwrap(),
        );
        assert_eq!(ca.len(), cb.len());
        for (x, y) in ca.iter().zip(cb) {
            let what = format!("{extra}: {x} against {y}");
            assert_eq!(x["text"], y["text"], "{what}");
            let (lx, ly) = (&x["logprobs"], &y["logprobs"]);
            assert_eq!(lx["tokens"], ly["tokens"], "{what}");
            let lps = |l: &serde_json::Value| -> Vec<f64> {
                l["token_logprobs"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_f64().unwrap())
                    .collect()
            };
            for (p, q) in lps(lx).into_iter().zip(lps(ly)) {
                assert!((p - q).abs() <= 1e-5 * q.abs().max(1.0), "{what}");
            }
            let keys = |l: &serde_json::Value| -> Vec<Vec<String>> {
                l["top_logprobs"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|m| m.as_object().unwrap().keys().cloned().collect())
                    .collect()
            };
            assert_eq!(keys(lx), keys(ly), "{what}");
        }
    }
}

/// On a GPU: an adapter learning while the server serves on the GPU trains from the log-probs
/// the GPU served (the trainer's steps' log-probs from the GPU's forward between serving steps;
/// its backward on the CPU): a step's `logprob_diff_max` over its own samples is 0, as on the
/// CPU — the tokens drawn on the GPU and those the host draws beside it (each choice's first of an
/// `n` > 1 request: the prompt's row forks there) alike, the host's with the log-sum-exp the GPU's
/// log-softmax took (`Gpu::normalize`). Without a usable GPU there is nothing to run, and it says
/// so.
#[test]
fn an_adapter_learning_on_the_gpu_trains_from_the_served_log_probs() {
    use common::online::{call, learning_config, sample, start_learning_with, wait_status, USER};
    let (dir, path) = write_tiny(&TinySpec::small());
    if let Err(err) = serve_on_cuda(&path) {
        eprintln!(
            "skipped: no usable GPU here ({})",
            err.lines().last().unwrap_or("")
        );
        return;
    }
    let data = dir.path().join("data");
    let s = start_learning_with(
        &path,
        &data,
        &learning_config(),
        &["l"],
        &["--device", "cuda"],
    );
    let log = s.stderr();
    assert!(
        log.contains("device: cuda") && log.contains("the steps' log-probs from the GPU's forward"),
        "{log}"
    );
    for step in 1..=2u64 {
        let id = sample(&s, "l", 4, 6, USER)["id"]
            .as_str()
            .unwrap()
            .to_string();
        let items: Vec<serde_json::Value> = (0..4)
            .map(|i| json!({"id": id, "choice": i, "reward": (i % 2) as f64}))
            .collect();
        let r = call(
            &s,
            "POST",
            "/v1/feedback",
            Some(&serde_json::Value::Array(items)),
            USER,
        );
        assert_eq!(r.status, 202, "{}", r.body_text());
        let st = wait_status(&s, "l", 120, |st| st["steps"] == step);
        assert_eq!(st["state"], "running", "{st}");
        let d = st["last"]["logprob_diff_max"].as_f64().unwrap();
        assert_eq!(
            d, 0.0,
            "step {step}: the trainer's log-probs and the GPU's served ones differ: {st}"
        );
    }
}

/// `--gpu-memory-utilization` sizes a GPU's KV cache from what its memory holds (the log says
/// how, and the model's whole context is served); beside `--device cpu` it is refused at start
/// with the reason, and where auto lands on the CPU the log says it does not apply there.
#[test]
fn the_gpu_memory_utilization_sizes_a_gpus_kv_cache() {
    let (_dir, path) = write_tiny(&TinySpec::small());
    let out = Command::new(server_binary())
        .args(["serve", "--model", path.to_str().unwrap(), "--port", "0"])
        .args(["--device", "cpu", "--gpu-memory-utilization", "0.5"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("with --device cpu the KV cache is engine.kv_cache_mb"),
        "{err}"
    );
    // Under auto: the GPU where one is usable (a KV cache far larger than the tiny model's
    // context needs: tens of GB, millions of its blocks of 64 tokens), else the CPU with its own
    // cache.
    let s = Server::start(
        &path,
        "[engine]\nblock_size = 64\n",
        &["--device", "auto", "--gpu-memory-utilization", "0.3"],
    );
    let log = s.stderr();
    let models = s.get("/v1/models");
    assert_eq!(models.status, 200);
    let len = models.json()["data"][0]["max_model_len"].as_u64().unwrap();
    assert_eq!(
        len as usize,
        TinySpec::small().ctx,
        "the model's whole context"
    );
    if log.contains("device: cuda, ") {
        assert!(
            log.contains("KV cache: ")
                && log.contains("MiB of the GPU (--gpu-memory-utilization 0.3"),
            "{log}"
        );
    } else {
        assert!(
            log.contains("--gpu-memory-utilization 0.3: the engine runs on the CPU"),
            "{log}"
        );
    }
    let r = s.post(
        "/v1/completions",
        &json!({"model": "tiny", "prompt": "hello", "max_tokens": 4}),
    );
    assert_eq!(r.status, 200, "{}", r.body_text());
}
