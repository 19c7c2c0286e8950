//! Training under a memory limit, on the default model (SmolLM2-135M, `scripts/fetch_model.py`;
//! skipped with a message where it is absent or where this machine offers no memory cgroup): a
//! rewarded group far larger than `max_step_tokens`, pending when the server restarts inside a
//! cgroup whose limit leaves room for passes of `max_step_tokens` but not for the whole group in
//! one pass, is trained once, within the limit, and the next restart finds nothing to retrain.
//! (Taken whole, such a group killed the server on every restart: a crash loop.)

mod common;

use common::online::*;
use common::server::*;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

/// A memory cgroup (v1) of our own, removed on drop.
struct Cgroup(PathBuf);

impl Cgroup {
    fn new() -> Option<Cgroup> {
        let root = Path::new("/sys/fs/cgroup/memory");
        if !root.join("memory.limit_in_bytes").exists() {
            return None;
        }
        let dir = root.join(format!("flywheel-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).ok()?;
        Some(Cgroup(dir))
    }

    fn read(&self, file: &str) -> u64 {
        std::fs::read_to_string(self.0.join(file))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }

    fn write(&self, file: &str, value: &str) {
        std::fs::write(self.0.join(file), value).unwrap_or_else(|e| panic!("{file}: {e}"));
    }

    /// A command prefix that joins this cgroup, then execs its arguments.
    fn wrapper(&self) -> Vec<String> {
        let procs = self.0.join("cgroup.procs");
        vec![
            "sh".into(),
            "-c".into(),
            format!("echo $$ > {} && exec \"$@\"", procs.display()),
            "sh".into(),
        ]
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

fn model() -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    p.exists().then_some(p)
}

const CONFIG: &str = "[server]\nserved_model_name = \"smol\"\n[model]\nmax_model_len = 512\n[engine]\nkv_cache_mb = 48\n\
                      [online]\nmax_off_policy_steps = 1000\nmax_step_tokens = 256\n";

#[test]
fn a_group_far_over_the_step_bound_trains_after_a_restart_under_a_memory_limit() {
    let (Some(model), Some(cg)) = (model(), Cgroup::new()) else {
        eprintln!("skipped: needs models/SmolLM2-135M-Instruct.Q4_1.gguf and a memory cgroup (v1)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let args = [
        "--data-dir",
        data.to_str().unwrap(),
        "--api-key",
        USER,
        "--admin-key",
        ADMIN,
        "--learn",
        "l",
    ];
    let wrapper = cg.wrapper();
    let wrapper: Vec<&str> = wrapper.iter().map(String::as_str).collect();
    let start = || Server::start_in(&wrapper, &model, CONFIG, &args);
    // 1. Unlimited: sample a group of 32 x 64 tokens, reward it while the learner is paused, stop.
    let mut s = start();
    let r = call(&s, "POST", "/v1/train/l/pause", None, ADMIN);
    assert_eq!(r.status, 200, "{}", r.body_text());
    let r = sample(&s, "l", 32, 64, USER);
    let id = r["id"].as_str().unwrap();
    let tokens = r["usage"]["total_tokens"].as_u64().unwrap();
    let items: Vec<Value> = (0..32)
        .map(|i| json!({"id": id, "choice": i, "reward": (i % 4) as f64}))
        .collect();
    let f = call(&s, "POST", "/v1/feedback", Some(&Value::Array(items)), USER);
    assert_eq!(f.status, 202, "{}", f.body_text());
    let serving = cg.read("memory.max_usage_in_bytes");
    s.terminate();
    assert!(s.child.wait().unwrap().success(), "{}", s.stderr());
    drop(s);
    // 2. A limit with 300 MB above what serving took: passes of 256 tokens fit (about 70 MB on
    // this model), the whole group of ~2,900 tokens in one pass (~800 MB) does not.
    let limit = serving + (300 << 20);
    cg.write("memory.limit_in_bytes", &limit.to_string());
    cg.write("memory.max_usage_in_bytes", "0");
    let s = start();
    let st = wait_status(&s, "l", 300, |st| st["steps"] == 1);
    assert_eq!(st["trained"], 32, "{st}");
    assert!(st["last"]["micro_batches"].as_u64().unwrap() >= 8, "{st}");
    assert!(
        st["last"]["max_micro_batch_tokens"].as_u64().unwrap() <= 256,
        "{st}"
    );
    let peak = cg.read("memory.max_usage_in_bytes");
    eprintln!(
        "group of {tokens} tokens: serving took {} MB, the step's peak {} MB, limit {} MB",
        serving >> 20,
        peak >> 20,
        limit >> 20
    );
    assert!(peak <= limit);
    assert!(s.get("/health").status == 200);
    drop(s);
    // 3. Nothing is pending or retrained after another restart.
    let s = start();
    let st = status(&s, "l");
    assert_eq!(
        (st["steps"].clone(), st["pending_groups"].clone()),
        (json!(1), json!(0)),
        "{st}"
    );
}
