//! Learning servers sharing one PostgreSQL rollout store, as separate processes through their
//! HTTP API: one server (`all`) on PostgreSQL; a trainer and serving replicas (`--role`) with a
//! shared data directory, through kill -9s and database restarts, under load, and with
//! checkpoints they must verify; and with versions in an S3-compatible object store (moto)
//! instead of a shared directory. Each test starts a throwaway PostgreSQL (skipped with a message
//! where it is not installed).

mod common;

use common::replicas::{reward_group, Shared};
use std::sync::Arc;

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
