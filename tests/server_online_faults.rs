//! Faults on the learning side, made through the public interface (HTTP, the data directory on
//! disk, restarts): none of them may make the trainer stop learning while feedback is still
//! acknowledged, lose an acknowledged reward, reuse a version number or corrupt the optimizer.

mod common;

use common::online::*;
use common::server::*;
use common::write_tiny;
use serde_json::{json, Value};
use std::path::Path;
use std::process::Command;

fn version_of(c: &Client, name: &str) -> u64 {
    let r = call(c, "GET", &format!("/v1/adapters/{name}"), None, USER);
    assert_eq!(r.status, 200, "{}", r.body_text());
    r.json()["version"].as_u64().unwrap()
}

fn optimizer_step(checkpoint: &Path) -> u64 {
    let j: Value =
        serde_json::from_slice(&std::fs::read(checkpoint.join("optimizer.json")).unwrap()).unwrap();
    j["step"].as_u64().unwrap()
}

fn checkpoint_dir(data: &Path, name: &str, version: u64) -> std::path::PathBuf {
    data.join(format!("adapters/{name}/v-{version:08}"))
}

#[test]
fn a_learning_adapter_is_not_replaced_by_a_publish_and_keeps_training() {
    let (dir, path) = write_tiny(&spec());
    let s = start_learning(&path, &dir.path().join("data"), &learning_config(), &["l"]);
    for body in [
        json!({"name": "l", "kind": "oft", "oft_block_size": 16}),
        json!({"name": "l", "kind": "lora"}),
    ] {
        let r = call(&s, "POST", "/v1/adapters", Some(&body), ADMIN);
        let e = assert_error(&r, 409, Some("name"));
        assert_eq!(e["error"]["code"], "adapter_is_learning", "{e}");
    }
    // Nor can its shape change through the training route.
    let r = call(
        &s,
        "POST",
        "/v1/adapters/l/train",
        Some(&json!({"method": "lora"})),
        ADMIN,
    );
    assert_error(&r, 409, Some("method"));
    // Settings that keep the shape do change.
    let r = call(
        &s,
        "POST",
        "/v1/adapters/l/train",
        Some(&json!({"lr": 0.001})),
        ADMIN,
    );
    assert_eq!(r.status, 200, "{}", r.body_text());
    let lr = r.json()["status"]["config"]["lr"].as_f64().unwrap();
    assert!((lr - 0.001).abs() < 1e-9, "{lr}");
    sample_and_reward(&s, "l", 2);
    let st = wait_status(&s, "l", 60, |st| st["steps"] == 1);
    assert_eq!(st["state"], "running", "{st}");
    assert_eq!(version_of(&s, "l"), 2);
}

#[test]
fn a_checkpoint_that_cannot_be_written_changes_nothing_and_is_retried() {
    let (dir, path) = write_tiny(&spec());
    let data = dir.path().join("data");
    let s = start_learning(&path, &data, &learning_config(), &["l"]);
    // The checkpoints' folder cannot be created: a file stands where it goes.
    let adapters = data.join("adapters");
    let _ = std::fs::remove_dir_all(&adapters);
    std::fs::write(&adapters, b"in the way").unwrap();
    sample_and_reward(&s, "l", 2);
    let st = wait_status(&s, "l", 60, |st| {
        st["consecutive_failures"].as_u64() >= Some(2)
    });
    assert_eq!(st["state"], "running", "{st}");
    assert_eq!(st["steps"], 0, "{st}");
    assert_eq!(st["last_error"]["kind"], "checkpoint", "{st}");
    assert_eq!(version_of(&s, "l"), 1);
    assert!(s.metric("flywheel_train_errors_total{adapter=\"l\",kind=\"checkpoint\"}") >= 2.0);
    // The server's paths are the admin's to see; serving is ready, learning degraded.
    let dir_text = data.to_str().unwrap();
    let msg = st["last_error"]["message"].as_str().unwrap();
    assert!(!msg.contains(dir_text) && msg.contains("[path]"), "{msg}");
    let admin = call(&s, "GET", "/v1/train/status", None, ADMIN).json();
    let msg = admin["adapters"]["l"]["last_error"]["message"]
        .as_str()
        .unwrap();
    assert!(msg.contains(dir_text), "{msg}");
    let h = s.get("/health");
    assert_eq!(h.status, 200, "{}", h.body_text());
    let learning = &h.json()["learning"];
    assert_eq!(learning["state"], "degraded", "{learning}");
    assert_eq!(
        learning["adapters"]["l"]["error"]["kind"], "checkpoint",
        "{learning}"
    );
    assert!(!learning.to_string().contains(dir_text), "{learning}");
    // Space comes back: the step is taken once, from the optimizer as it was.
    std::fs::remove_file(&adapters).unwrap();
    let st = wait_status(&s, "l", 60, |st| st["steps"] == 1);
    assert_eq!(st["consecutive_failures"], 0, "{st}");
    assert_eq!(s.get("/health").json()["learning"]["state"], "ok");
    assert_eq!(version_of(&s, "l"), 2);
    let cp = checkpoint_dir(&data, "l", 2);
    assert_eq!(optimizer_step(&cp), 1, "AdamW was applied more than once");
    let leftovers: Vec<_> = std::fs::read_dir(adapters.join("l"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn a_deleted_and_recreated_learning_adapter_never_reuses_a_version() {
    let (dir, path) = write_tiny(&spec());
    let data = dir.path().join("data");
    let cfg = learning_config();
    let mut s = start_learning(&path, &data, &cfg, &["l"]);
    sample_and_reward(&s, "l", 2);
    wait_status(&s, "l", 60, |st| st["steps"] == 1);
    assert_eq!(version_of(&s, "l"), 2);
    // A group sampled at version 2, rewarded only after the adapter is deleted and re-created.
    let old = sample(&s, "l", 2, 3, USER)["id"]
        .as_str()
        .unwrap()
        .to_string();
    let r = call(&s, "DELETE", "/v1/adapters/l", None, ADMIN);
    assert_eq!(r.status, 200, "{}", r.body_text());
    assert!(status(&s, "l").is_null());
    // Not learning now: its rewards would never train.
    let e = assert_error(&reward(&s, &old, 2, 409), 409, Some("[0].id"));
    assert_eq!(e["error"]["code"], "adapter_not_learning");
    let r = call(&s, "POST", "/v1/adapters/l/train", Some(&json!({})), ADMIN);
    assert_eq!(r.status, 201, "{}", r.body_text());
    assert_eq!(version_of(&s, "l"), 3);
    // The old group is from another lineage: dropped with that reason, never trained.
    reward(&s, &old, 2, 202);
    let st = wait_status(&s, "l", 60, |st| st["dropped"]["lineage"] == 2);
    assert_eq!(st["steps"], 0, "{st}");
    let fb = call(&s, "GET", &format!("/v1/feedback/{old}"), None, USER).json();
    assert_eq!(fb["choices"][0]["dropped"], "lineage", "{fb}");
    sample_and_reward(&s, "l", 2);
    wait_status(&s, "l", 60, |st| st["steps"] == 1);
    assert_eq!(version_of(&s, "l"), 4);
    // SIGTERM: the HTTP side drains, then the trainer ends after its step; the process exits
    // cleanly. A restart resumes the new lineage where it was.
    s.terminate();
    let exit = s.child.wait().unwrap();
    assert!(exit.success(), "{}", s.stderr());
    assert!(
        s.stderr()
            .contains("the trainer finished its step and stopped"),
        "{}",
        s.stderr()
    );
    let s = start_learning(&path, &data, &cfg, &["l"]);
    assert_eq!(version_of(&s, "l"), 4);
    let st = status(&s, "l");
    assert_eq!(st["steps"], 1);
    // The last step's report, the totals and the gauges survive the restart (the store has them).
    assert_eq!(st["last"]["version"], 4, "{st}");
    assert_eq!(st["last"]["sequences"], 2, "{st}");
    assert_eq!(st["trained"], 4, "{st}");
    assert_eq!(st["dropped"]["lineage"], 2, "{st}");
    assert_eq!(s.metric("flywheel_train_reward_mean{adapter=\"l\"}"), 0.5);
}

#[test]
fn a_copied_data_directory_leaves_the_original_intact() {
    let (dir, path) = write_tiny(&spec());
    let d0 = dir.path().join("d0");
    let cfg = learning_config();
    let s = start_learning(&path, &d0, &cfg, &["l"]);
    sample_and_reward(&s, "l", 2);
    wait_status(&s, "l", 60, |st| st["steps"] == 1);
    s.terminate();
    drop(s);
    let copy = dir.path().join("copy");
    let ok = Command::new("cp")
        .args(["-a", d0.to_str().unwrap(), copy.to_str().unwrap()])
        .status()
        .unwrap();
    assert!(ok.success());
    // Training on the copy retires the copy's old checkpoints, never the original's (a lineage
    // keeps its newest guard_window + 2 = 6: version 2's goes at the seventh step).
    let s = start_learning(&path, &copy, &cfg, &["l"]);
    for k in 2..=7 {
        sample_and_reward(&s, "l", 2);
        wait_status(&s, "l", 60, |st| st["steps"] == k);
    }
    assert!(!checkpoint_dir(&copy, "l", 2).exists());
    assert!(checkpoint_dir(&d0, "l", 2).exists());
    drop(s);
    let s = start_learning(&path, &d0, &cfg, &["l"]);
    assert_eq!(version_of(&s, "l"), 2);
    assert_eq!(status(&s, "l")["steps"], 1);
}

#[test]
fn a_database_deleted_under_the_server_stops_acknowledging_rewards() {
    let (dir, path) = write_tiny(&spec());
    let data = dir.path().join("data");
    let s = start_learning(&path, &data, &learning_config(), &["l"]);
    let id = sample(&s, "l", 2, 3, USER)["id"]
        .as_str()
        .unwrap()
        .to_string();
    std::fs::remove_file(data.join("flywheel.db")).unwrap();
    let e = assert_error(&reward(&s, &id, 2, 503), 503, None);
    assert_eq!(e["error"]["code"], "rollout_log_unavailable", "{e}");
    // Readiness fails, the metric and the status say so.
    assert_eq!(s.get("/health").status, 503);
    let st = wait_status(&s, "l", 10, |st| st["state"] == "failed");
    assert_eq!(st["last_error"]["kind"], "database", "{st}");
    assert_eq!(s.metric("flywheel_rollout_log_ok"), 0.0);
    assert_eq!(s.metric("flywheel_train_learner_ok{adapter=\"l\"}"), 0.0);
    // Completions through the learning adapter are not served unlogged either.
    let r = call(
        &s,
        "POST",
        "/v1/chat/completions",
        Some(&chat("hi", json!({"model": "l", "max_tokens": 2}))),
        USER,
    );
    assert_eq!(r.status, 503, "{}", r.body_text());
}

/// A learning server (adapter `l`) on a tiny model that has taken two steps (version 3): its
/// folder, model, data directory and the server.
fn two_steps() -> (
    tempfile::TempDir,
    std::path::PathBuf,
    std::path::PathBuf,
    Server,
) {
    let (dir, path) = write_tiny(&spec());
    let data = dir.path().join("data");
    let s = start_learning(&path, &data, &learning_config(), &["l"]);
    for k in 1..=2 {
        sample_and_reward(&s, "l", 2);
        wait_status(&s, "l", 60, |st| st["steps"] == k);
    }
    assert_eq!(version_of(&s, "l"), 3);
    (dir, path, data, s)
}

/// The rollout database lost between two runs on the same data directory: the restart continues
/// above every version a checkpoint folder carries (never serving v1 after v3 was served) and
/// writes over no folder; the next step is numbered above them too.
#[test]
fn a_restart_after_the_database_was_lost_reuses_no_version_and_overwrites_no_checkpoint() {
    let (_dir, path, data, s) = two_steps();
    let cfg = learning_config();
    s.terminate();
    drop(s);
    let manifest = |v: u64| std::fs::read(checkpoint_dir(&data, "l", v).join("manifest.json"));
    let before = (manifest(2).unwrap(), manifest(3).unwrap());
    for f in ["flywheel.db", "flywheel.db-wal", "flywheel.db-shm"] {
        let _ = std::fs::remove_file(data.join(f));
    }
    let s = start_learning(&path, &data, &cfg, &["l"]);
    assert_eq!(version_of(&s, "l"), 4, "{}", s.stderr());
    assert!(s
        .stderr()
        .contains("above every version the rollout store records"));
    assert_eq!(stream_one_version(&s, "l", "hi"), 4);
    sample_and_reward(&s, "l", 2);
    wait_status(&s, "l", 60, |st| st["steps"] == 1);
    assert_eq!(version_of(&s, "l"), 5);
    assert!(checkpoint_dir(&data, "l", 5).exists());
    // The old folders are as they were.
    assert_eq!((manifest(2).unwrap(), manifest(3).unwrap()), before);
}

#[test]
fn start_up_falls_back_to_the_newest_intact_checkpoint_and_names_bad_data_dirs() {
    let (dir, path, data, s) = two_steps();
    let cfg = learning_config();
    drop(s);
    // A truncated optimizer state in the newest checkpoint: back to version 2's weights and
    // optimizer, under a new number (3 was served).
    let f = checkpoint_dir(&data, "l", 3).join("optimizer.safetensors");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&f)
        .unwrap()
        .set_len(10)
        .unwrap();
    let s = start_learning(&path, &data, &cfg, &["l"]);
    assert_eq!(version_of(&s, "l"), 4);
    assert_eq!(status(&s, "l")["steps"], 1);
    assert!(s.stderr().contains("falling back"), "{}", s.stderr());
    // It trains on from there.
    sample_and_reward(&s, "l", 2);
    wait_status(&s, "l", 60, |st| st["steps"] == 2);
    assert_eq!(version_of(&s, "l"), 5);
    drop(s);
    // The newest checkpoint's folder gone: the same.
    std::fs::remove_dir_all(checkpoint_dir(&data, "l", 5)).unwrap();
    let s = start_learning(&path, &data, &cfg, &["l"]);
    assert_eq!(version_of(&s, "l"), 6);
    drop(s);
    // A data directory that cannot be created, or is not a directory: refused, path named.
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let bad = file.join("data");
    let err = refused_start(
        &path,
        &["--data-dir", bad.to_str().unwrap(), "--learn", "l"],
    );
    assert!(err.contains(bad.to_str().unwrap()), "{err}");
    // A read-only one (only where permissions bind this user: root bypasses them).
    let ro = dir.path().join("ro");
    std::fs::create_dir(&ro).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555)).unwrap();
    if std::fs::write(ro.join("probe"), b"x").is_ok() {
        eprintln!("skipped the read-only data directory check: this user writes through 0555");
    } else {
        let err = refused_start(&path, &["--data-dir", ro.to_str().unwrap(), "--learn", "l"]);
        assert!(err.contains(ro.to_str().unwrap()), "{err}");
    }
    // A rollout store that is not one (its password never shown), or a PostgreSQL that does not
    // answer: refused at start, naming it.
    let data = dir.path().join("data3");
    let d = data.to_str().unwrap();
    let err = refused_start(
        &path,
        &[
            "--data-dir",
            d,
            "--learn",
            "l",
            "--rollout-store",
            "mysql://u:secret@h/db",
        ],
    );
    assert!(
        err.contains("mysql://u:***@h/db") && !err.contains("secret"),
        "{err}"
    );
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("postgres://u:secret@127.0.0.1:{port}/db");
    let err = refused_start(
        &path,
        &["--data-dir", d, "--learn", "l", "--rollout-store", &url],
    );
    assert!(
        err.contains(&format!("postgres://u:***@127.0.0.1:{port}/db")),
        "{err}"
    );
    assert!(!err.contains("secret"), "{err}");
}
