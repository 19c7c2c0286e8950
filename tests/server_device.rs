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
