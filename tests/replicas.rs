//! Learning servers sharing one PostgreSQL rollout store, as separate processes through their
//! HTTP API: one server (`all`) on PostgreSQL; a trainer and serving replicas (`--role`) with a
//! shared data directory, through kill -9s and database restarts, under load, and with
//! checkpoints they must verify; and with versions in an S3-compatible object store (moto)
//! instead of a shared directory. Each test starts a throwaway PostgreSQL (skipped with a message
//! where it is not installed).

mod common;

use common::pg::Pg;
use std::sync::Arc;

/// A learning server in `role` on the PostgreSQL store `url`, its data directory `data`.
fn start_role(
    model: &std::path::Path,
    data: &std::path::Path,
    cfg: &str,
    url: &str,
    role: &str,
) -> common::server::Server {
    common::online::start_learning_with(
        model,
        data,
        cfg,
        &[],
        &["--rollout-store", url, "--role", role],
    )
}

/// A PostgreSQL database, a tiny model and a shared data directory for learning servers (a
/// fast LoRA adapter `l`; `online` adds `[online]` settings).
struct Shared {
    pg: Pg,
    url: String,
    _dir: tempfile::TempDir,
    model: std::path::PathBuf,
    data: std::path::PathBuf,
    cfg: String,
}

impl Shared {
    fn new(online: &str) -> Option<Shared> {
        let pg = Pg::start()?;
        let url = pg.fresh_db();
        let (dir, model) = common::write_tiny(&common::server::spec());
        let data = dir.path().join("shared");
        let cfg = common::online::config(&format!(
            "reward_min = -1.0\nreward_max = 1.0\n{online}\n\n[[learn]]\nname = \"l\"\n\
             method = \"lora\"\nlr = 0.01\nlora_r = 4\n"
        ));
        Some(Shared {
            pg,
            url,
            _dir: dir,
            model,
            data,
            cfg,
        })
    }

    fn start(&self, role: &str) -> common::server::Server {
        start_role(&self.model, &self.data, &self.cfg, &self.url, role)
    }

    /// `flywheel serve` in `role` (learning `l`), expected to refuse to start: its stderr.
    fn refused(&self, role: &str, store: Option<&str>) -> String {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_flywheel"));
        cmd.args([
            "serve",
            "--model",
            self.model.to_str().unwrap(),
            "--port",
            "0",
        ])
        .args(["--data-dir", self.data.to_str().unwrap(), "--learn", "l"])
        .args(["--role", role]);
        if let Some(url) = store {
            cmd.args(["--rollout-store", url]);
        }
        // Bounded: a server that does start is killed and fails the test.
        let log = tempfile::NamedTempFile::new().unwrap();
        let mut child = cmd
            .stdout(std::process::Stdio::null())
            .stderr(log.reopen().unwrap())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        let status = loop {
            if let Some(st) = child.try_wait().unwrap() {
                break Some(st);
            }
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        };
        let err = std::fs::read_to_string(log.path()).unwrap();
        assert!(status.is_some_and(|s| !s.success()), "it started: {err}");
        err
    }
}

/// A learning server on PostgreSQL (`--rollout-store`), through its HTTP API: completions are
/// logged there, a reward is acknowledged once committed there, the trainer consumes the group
/// and records its checkpoint there; a restart resumes the lineage (versions never reused); with
/// the database down a reward is a 503 naming the log (nothing acknowledged), and once it is
/// back the same reward is taken.
#[test]
fn a_learning_server_keeps_its_log_on_postgres() {
    use common::online::*;
    use serde_json::{json, Value};
    let Some(mut sh) = Shared::new("") else {
        return;
    };
    let url = sh.url.clone();
    let start = || {
        start_learning_with(
            &sh.model,
            &sh.data,
            &sh.cfg,
            &[],
            &["--rollout-store", &url],
        )
    };
    let s = start();
    let r = sample(&s, "l", 2, 3, USER);
    let id = r["id"].as_str().unwrap().to_string();
    let items = json!([{"id": id, "choice": 0, "reward": 1}, {"id": id, "choice": 1, "reward": 0}]);
    let post = |s: &common::server::Server, body: &Value| {
        call(s, "POST", "/v1/feedback", Some(body), USER)
    };
    assert_eq!(post(&s, &items).status, 202);
    wait_status(&s, "l", 60, |st| st["steps"] == 1 && st["version"] == 2);
    let got = call(&s, "GET", &format!("/v1/feedback/{id}"), None, USER).json();
    assert_eq!(got["choices"][0]["trained_step"], 1, "{got}");
    let mut db = postgres::Client::connect(&url, postgres::NoTls).unwrap();
    let n: i64 = db
        .query_one(
            "SELECT count(*) FROM completions WHERE consumed_step = 1",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(n, 2);
    let v: i64 = db
        .query_one(
            "SELECT max(version) FROM checkpoints WHERE adapter = 'l'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(v, 2);
    drop(s);
    // A restart resumes from the lineage in PostgreSQL and the checkpoint on disk.
    let s = start();
    assert_eq!(status(&s, "l")["version"], 2);
    let r = sample(&s, "l", 2, 3, USER);
    assert_eq!(r["adapter_version"], 2);
    let id2 = r["id"].as_str().unwrap().to_string();
    drop(db);
    sh.pg.stop();
    let one = json!({"id": id2, "choice": 0, "reward": 1});
    let r = post(&s, &one);
    assert_eq!(r.status, 503, "{}", r.body_text());
    assert_eq!(r.json()["error"]["code"], "rollout_log_unavailable");
    // The base model still answers; a completion through the learning adapter, which could not
    // be logged, is a 503 rather than an answer whose log is lost.
    let chat = |model: &str| {
        let body = json!({"model": model, "messages": [{"role": "user", "content": "hi"}],
                          "max_tokens": 2});
        call(&s, "POST", "/v1/chat/completions", Some(&body), USER)
    };
    assert_eq!(chat("tiny").status, 200);
    let r = chat("l");
    assert_eq!(r.status, 503, "{}", r.body_text());
    assert_eq!(r.json()["error"]["code"], "rollout_log_unavailable");
    // One process (role all): not ready while it cannot learn.
    assert_eq!(call(&s, "GET", "/health", None, USER).status, 503);
    sh.pg.restart();
    assert_eq!(post(&s, &one).status, 202);
    assert_eq!(post(&s, &one).status, 200);
}

/// Two serving replicas and one trainer (separate processes, one PostgreSQL, one shared data
/// directory): a completion served by replica A is rewarded through replica B; the trainer
/// trains it and publishes; both replicas follow to the new version (reported: the delay from
/// the trainer's status to each replica's) and serve it; no replica trains. Then kill -9 of a
/// replica and of the trainer loses no acknowledged reward and trains no group twice; with
/// PostgreSQL down a replica stays ready, and once it is back learning goes on.
#[test]
fn two_replicas_and_a_trainer_share_one_postgres() {
    use common::online::*;
    use serde_json::json;
    let Some(mut sh) = Shared::new("") else {
        return;
    };
    let url = sh.url.clone();
    let start = |role: &str| sh.start(role);
    let trainer = start("train");
    // One trainer per adapter: a second one waits for the claim, then refuses to start.
    let t0 = std::time::Instant::now();
    let err = sh.refused("train", Some(&url));
    assert!(err.contains("another trainer holds 'l'"), "{err}");
    assert!(t0.elapsed().as_secs_f64() >= 9.0);
    let (a, b) = (start("serve"), start("serve"));
    for s in [&trainer, &a, &b] {
        assert_eq!(status(s, "l")["version"], 1);
    }
    let r = sample(&a, "l", 2, 3, USER);
    assert_eq!(r["adapter_version"], 1);
    let id = r["id"].as_str().unwrap();
    let items = json!([{"id": id, "choice": 0, "reward": 1}, {"id": id, "choice": 1, "reward": 0}]);
    assert_eq!(
        call(&b, "POST", "/v1/feedback", Some(&items), USER).status,
        202
    );
    wait_status(&trainer, "l", 60, |st| st["version"] == 2);
    let t0 = std::time::Instant::now();
    for (name, s) in [("A", &a), ("B", &b)] {
        wait_status(s, "l", 10, |st| st["version"] == 2);
        eprintln!(
            "replica {name} serves version 2 {:.0} ms after the trainer's status did",
            t0.elapsed().as_secs_f64() * 1e3
        );
        assert_eq!(sample(s, "l", 1, 2, USER)["adapter_version"], 2);
        // Its metrics: no lag, one propagation observed (commit in PostgreSQL -> served).
        assert_eq!(s.metric("flywheel_replica_version_lag{adapter=\"l\"}"), 0.0);
        assert_eq!(s.metric("flywheel_replica_propagation_seconds_count"), 1.0);
        eprintln!(
            "replica {name}: commit -> served {:.1} ms",
            s.metric("flywheel_replica_propagation_seconds_sum") * 1e3
        );
    }
    let got = call(&b, "GET", &format!("/v1/feedback/{id}"), None, USER).json();
    assert_eq!(got["choices"][0]["trained_step"], 1, "{got}");
    // The replicas never trained: one step in all, the trainer's.
    assert_eq!(status(&trainer, "l")["steps"], 1);
    let mut db = postgres::Client::connect(&url, postgres::NoTls).unwrap();
    let n: i64 = db
        .query_one("SELECT count(*) FROM checkpoints", &[])
        .unwrap()
        .get(0);
    assert_eq!(n, 1);
    // kill -9 of the replica that served a completion and of the trainer: the reward posted
    // through the other replica meanwhile is acknowledged, kept, and trained once by the
    // restarted trainer, which resumes the lineage; the surviving replica follows.
    let r = sample(&a, "l", 2, 3, USER);
    let id2 = r["id"].as_str().unwrap().to_string();
    drop(a);
    drop(trainer);
    let items =
        json!([{"id": id2, "choice": 0, "reward": 0}, {"id": id2, "choice": 1, "reward": 1}]);
    assert_eq!(
        call(&b, "POST", "/v1/feedback", Some(&items), USER).status,
        202
    );
    let trainer = start("train");
    wait_status(&trainer, "l", 60, |st| st["version"] == 3);
    wait_status(&b, "l", 10, |st| st["version"] == 3);
    let rows: Vec<(String, Option<i64>)> = db
        .query(
            "SELECT id, consumed_step FROM completions ORDER BY id, choice",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let steps: Vec<Option<i64>> = rows
        .iter()
        .filter(|(i, _)| i == id || i == &id2)
        .map(|r| r.1)
        .collect();
    let want = if id < id2.as_str() {
        [Some(1), Some(1), Some(2), Some(2)]
    } else {
        [Some(2), Some(2), Some(1), Some(1)]
    };
    assert_eq!(steps, want, "{rows:?}");
    assert_eq!(status(&trainer, "l")["steps"], 2);
    // The database down: a replica stays ready (the base model answers) and says why it cannot
    // learn; a completion through the learning adapter is a 503 (it could not be logged).
    drop(db);
    sh.pg.stop();
    let h = call(&b, "GET", "/health", None, USER);
    assert_eq!(h.status, 200, "{}", h.body_text());
    assert_eq!(
        h.json()["learning"]["state"],
        "unavailable",
        "{}",
        h.body_text()
    );
    let chat = |model: &str| {
        let body = json!({"model": model, "messages": [{"role": "user", "content": "hi"}],
                          "max_tokens": 2});
        call(&b, "POST", "/v1/chat/completions", Some(&body), USER).status
    };
    assert_eq!((chat("tiny"), chat("l")), (200, 503));
    // PostgreSQL back: the processes reconnect (pooled connections replaced, the replica's
    // LISTEN connection re-established) and learning goes on through both roles.
    sh.pg.restart();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let r = loop {
        let body = json!({"model": "l", "messages": [{"role": "user", "content": "hi"}],
                          "n": 2, "max_tokens": 3, "temperature": 1.0});
        let r = call(&b, "POST", "/v1/chat/completions", Some(&body), USER);
        if r.status == 200 {
            break r.json();
        }
        assert!(std::time::Instant::now() < deadline, "{}", r.body_text());
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    let id3 = r["id"].as_str().unwrap();
    let items =
        json!([{"id": id3, "choice": 0, "reward": 1}, {"id": id3, "choice": 1, "reward": 0}]);
    assert_eq!(
        call(&b, "POST", "/v1/feedback", Some(&items), USER).status,
        202
    );
    wait_status(&trainer, "l", 60, |st| st["version"] == 4);
    wait_status(&b, "l", 10, |st| st["version"] == 4);
    // A replica refuses to start without a shared store, naming it.
    let err = sh.refused("serve", None);
    assert!(err.contains("rollout_store"), "{err}");
}

/// Load through both replicas while the trainer publishes versions: streams round-robin over
/// the replicas all complete (no error chunk), each reports one version from its first chunk
/// to its last, and the versions the replicas serve rise with the trainer's.
#[test]
fn streams_through_both_replicas_while_versions_publish_never_fail() {
    use common::online::*;
    use serde_json::{json, Value};
    let Some(sh) = Shared::new("max_off_policy_steps = 1000") else {
        return;
    };
    let start = |role: &str| sh.start(role);
    let trainer = start("train");
    let replicas = [start("serve"), start("serve")];
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let streams: Vec<_> = (0..2)
        .map(|t| {
            let c = replicas[t % 2].client.clone();
            let done = done.clone();
            std::thread::spawn(move || {
                let mut versions = Vec::new();
                // Until the trainer is done (bounded).
                for i in 0..1000 {
                    if done.load(std::sync::atomic::Ordering::Acquire) {
                        break;
                    }
                    // Leave the trainer some of the two cores.
                    std::thread::sleep(std::time::Duration::from_millis(10));
                    versions.push(stream_one_version(&c, "l", &format!("stream {t} {i}")));
                }
                versions
            })
        })
        .collect();
    // Meanwhile: groups sampled on one replica, rewarded through the other, trained.
    for k in 0..4 {
        let (a, b) = (&replicas[k % 2], &replicas[(k + 1) % 2]);
        let r = sample(a, "l", 4, 2, USER);
        let id = r["id"].as_str().unwrap();
        let items: Vec<Value> = (0..4)
            .map(|i| json!({"id": id, "choice": i, "reward": (i % 2) as f64}))
            .collect();
        let before = status(&trainer, "l")["steps"].as_u64().unwrap();
        assert_eq!(
            call(b, "POST", "/v1/feedback", Some(&Value::Array(items)), USER).status,
            202
        );
        wait_status(&trainer, "l", 60, |st| {
            st["steps"].as_u64().unwrap() > before
        });
    }
    done.store(true, std::sync::atomic::Ordering::Release);
    let mut seen = Vec::new();
    for t in streams {
        seen.extend(t.join().unwrap());
    }
    let newest = status(&trainer, "l")["version"].as_u64().unwrap();
    assert_eq!(newest, 5);
    for r in &replicas {
        wait_status(r, "l", 10, |st| st["version"] == newest);
    }
    assert!(seen.iter().all(|&v| (1..=newest).contains(&v)), "{seen:?}");
    let mut distinct = seen.clone();
    distinct.sort();
    distinct.dedup();
    assert!(
        distinct.len() >= 3,
        "the streams overlapped the publishing: {distinct:?}"
    );
    eprintln!("{} streams, versions seen: {distinct:?}", seen.len());
}

/// A replica serves only checkpoints it can verify: the trainer writes a manifest last (version,
/// lineage, each file's SHA-256); a replica started on a checkpoint whose weights changed since
/// refuses, naming the file, and starts once the file is whole again.
#[test]
fn a_replica_serves_only_verified_checkpoints() {
    use common::online::*;
    use serde_json::json;
    let Some(sh) = Shared::new("") else { return };
    let trainer = sh.start("train");
    let r = sample(&trainer, "l", 2, 3, USER);
    let id = r["id"].as_str().unwrap();
    let items = json!([{"id": id, "choice": 0, "reward": 1}, {"id": id, "choice": 1, "reward": 0}]);
    assert_eq!(
        call(&trainer, "POST", "/v1/feedback", Some(&items), USER).status,
        202
    );
    wait_status(&trainer, "l", 60, |st| st["version"] == 2);
    let cp = sh.data.join("adapters/l/v-00000002");
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(cp.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["version"], 2);
    for f in [
        "adapter_model.safetensors",
        "adapter_config.json",
        "optimizer.safetensors",
    ] {
        assert_eq!(
            manifest["files"][f].as_str().unwrap().len(),
            64,
            "{manifest}"
        );
    }
    let weights = cp.join("adapter_model.safetensors");
    let good = std::fs::read(&weights).unwrap();
    let mut bad = good.clone();
    let last = bad.len() - 1;
    bad[last] ^= 1;
    std::fs::write(&weights, &bad).unwrap();
    let err = sh.refused("serve", Some(&sh.url));
    assert!(
        err.contains("SHA-256") && err.contains("could be verified"),
        "{err}"
    );
    std::fs::write(&weights, &good).unwrap();
    let replica = sh.start("serve");
    assert_eq!(status(&replica, "l")["version"], 2);
    assert_eq!(sample(&replica, "l", 1, 2, USER)["adapter_version"], 2);
}

/// Reward one group sampled through `from` (2 choices), posting through `to`.
fn reward_group(from: &common::server::Server, to: &common::server::Server) {
    use common::online::*;
    let r = sample(from, "l", 2, 3, USER);
    let id = r["id"].as_str().unwrap();
    let items = serde_json::json!([{"id": id, "choice": 0, "reward": 1},
                                   {"id": id, "choice": 1, "reward": 0}]);
    assert_eq!(
        call(to, "POST", "/v1/feedback", Some(&items), USER).status,
        202
    );
}

/// The version folders of `l` in a data directory.
fn local_versions(data: &std::path::Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(data.join("adapters/l"))
        .map(|d| {
            d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// A trainer and serving replicas with no shared directory: versions travel through an
/// S3-compatible object store (moto). The trainer uploads each version (create-only, manifest
/// last) before committing it; replicas fetch, verify and serve it and drop the copy of the one
/// before; a trainer restarted on an empty data directory (a new machine) resumes from the
/// store; a replica never serves an upload it cannot verify (it stays on the version before)
/// and catches up once it can.
#[test]
fn replicas_follow_the_trainer_through_an_object_store() {
    use common::online::*;
    let Some(s3) = common::s3::S3::start() else {
        return;
    };
    let Some(sh) = Shared::new(&s3.online_config("ckpt")) else {
        return;
    };
    let root = tempfile::tempdir().unwrap();
    let own = |n: &str| root.path().join(n);
    let start = |role: &str, data: &str| start_role(&sh.model, &own(data), &sh.cfg, &sh.url, role);
    let trainer = start("train", "t1");
    let (a, b) = (start("serve", "a"), start("serve", "b"));
    reward_group(&a, &b);
    wait_status(&trainer, "l", 60, |st| st["version"] == 2);
    for s in [&a, &b] {
        wait_status(s, "l", 10, |st| st["version"] == 2);
        assert_eq!(sample(s, "l", 1, 2, USER)["adapter_version"], 2);
        assert_eq!(
            s.metric("flywheel_adapter_store_seconds_count{op=\"fetch\"}"),
            1.0
        );
    }
    assert_eq!(
        trainer.metric("flywheel_adapter_store_seconds_count{op=\"upload\"}"),
        1.0
    );
    // Under the URL's prefix: the version's folder, a name of its own, the manifest included.
    let keys = s3.keys();
    let v2: Vec<&String> = keys
        .iter()
        .filter(|k| k.starts_with("ckpt/adapters/l/v-00000002-"))
        .collect();
    assert_eq!(v2.len(), 5, "{keys:?}");
    assert!(v2.iter().any(|k| k.ends_with("/manifest.json")), "{keys:?}");
    let folder = v2[0].rsplit_once('/').unwrap().0.to_string();
    let leaf = folder.rsplit_once('/').unwrap().1.to_string();
    assert_eq!(local_versions(&own("a")), vec![leaf.clone()]);
    // kill -9 of the trainer; it comes back on an empty data directory and resumes from the
    // store (same version, one step taken); the replicas follow its next step and drop their
    // copy of version 2.
    drop(trainer);
    let trainer = start("train", "t2");
    let st = status(&trainer, "l");
    assert_eq!(
        (st["version"].clone(), st["steps"].clone()),
        (2.into(), 1.into())
    );
    reward_group(&b, &a);
    wait_status(&trainer, "l", 60, |st| st["version"] == 3);
    for (s, d) in [(&a, "a"), (&b, "b")] {
        wait_status(s, "l", 10, |st| st["version"] == 3);
        let v = local_versions(&own(d));
        assert!(v.len() == 1 && v[0].starts_with("v-00000003-"), "{v:?}");
    }
    // Version 3's weights altered in the store: a new replica does not serve it; it serves
    // version 2 (verified) and keeps trying; restored, it catches up.
    let keys = s3.keys();
    let weights = keys
        .iter()
        .find(|k| {
            k.starts_with("ckpt/adapters/l/v-00000003-")
                && k.ends_with("/adapter_model.safetensors")
        })
        .unwrap()
        .clone();
    let good = std::fs::read(own("t2").join(weights.strip_prefix("ckpt/").unwrap())).unwrap();
    let mut bad = good.clone();
    bad[good.len() - 1] ^= 1;
    s3.overwrite(&weights, bad);
    let c = start("serve", "c");
    assert_eq!(status(&c, "l")["version"], 2);
    assert_eq!(sample(&c, "l", 1, 2, USER)["adapter_version"], 2);
    let st = wait_status(&c, "l", 20, |st| !st["last_error"].is_null());
    assert!(
        st["last_error"]["message"]
            .as_str()
            .unwrap()
            .contains("SHA-256"),
        "{st}"
    );
    assert_eq!(st["state"], "running", "{st}");
    assert!(c.metric("flywheel_replica_version_lag{adapter=\"l\"}") >= 1.0);
    s3.overwrite(&weights, good);
    wait_status(&c, "l", 30, |st| st["version"] == 3);
    assert_eq!(sample(&c, "l", 1, 2, USER)["adapter_version"], 3);
    // Retention (the newest two versions) applies to the store too, and uploads no version
    // names (a step whose commit failed after its upload) go, in the store and on disk.
    let orphan = "adapters/l/v-00000009-00000000deadbeef";
    s3.overwrite(&format!("ckpt/{orphan}/manifest.json"), b"{}".to_vec());
    std::fs::create_dir_all(own("t2").join(orphan)).unwrap();
    reward_group(&c, &trainer);
    wait_status(&trainer, "l", 60, |st| st["version"] == 4);
    let keys = s3.keys();
    let has = |v: &str| keys.iter().any(|k| k.contains(&format!("/{v}-")));
    assert_eq!(
        (
            has("v-00000002"),
            has("v-00000003"),
            has("v-00000004"),
            has("v-00000009")
        ),
        (false, true, true, false),
        "{keys:?}"
    );
    let local = local_versions(&own("t2"));
    assert!(
        local.len() == 2 && local[0].starts_with("v-00000003-"),
        "{local:?}"
    );
    // The log says which is which: version 2 retired by retention, version 9 a failed upload.
    let log = trainer.stderr();
    let line = |v: &str| {
        log.lines()
            .find(|l| l.contains(" removed ") && l.contains(v))
            .unwrap_or_else(|| panic!("no removal of {v} in the log:\n{log}"))
            .to_string()
    };
    assert!(line("v-00000002-").contains("retention retired"), "{log}");
    assert!(line("v-00000009-").contains("failed commit"), "{log}");
}

/// SIGTERM ends every role on PostgreSQL with exit 0 after its drain: the blocking clients the
/// store pools (each with a runtime of its own) are closed off the async runtime, not dropped
/// inside it (which aborted the process with SIGABRT).
#[test]
fn every_role_on_postgres_exits_0_on_sigterm() {
    let Some(sh) = Shared::new("") else { return };
    let stop = |mut s: common::server::Server, role: &str| {
        s.terminate();
        let exit = s.child.wait().unwrap();
        assert!(exit.success(), "{role}: {exit:?}\n{}", s.stderr());
    };
    let train = sh.start("train");
    let serve = sh.start("serve");
    // Traffic through both, so that each pools connections and the trainer holds its claim.
    reward_group(&serve, &train);
    common::online::wait_status(&train, "l", 60, |st| st["steps"] == 1);
    stop(serve, "serve");
    stop(train, "train");
    let all = sh.start("all");
    reward_group(&all, &all);
    common::online::wait_status(&all, "l", 60, |st| st["steps"] == 1);
    stop(all, "all");
}
