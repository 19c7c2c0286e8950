//! Learning servers in their roles on a shared PostgreSQL rollout store (`tests/replicas*.rs`).

use super::pg::Pg;

/// A learning server in `role` on the PostgreSQL store `url`, its data directory `data`.
pub fn start_role(
    model: &std::path::Path,
    data: &std::path::Path,
    cfg: &str,
    url: &str,
    role: &str,
) -> super::server::Server {
    super::online::start_learning_with(
        model,
        data,
        cfg,
        &[],
        &["--rollout-store", url, "--role", role],
    )
}

/// A PostgreSQL database, a tiny model and a shared data directory for learning servers (a
/// fast LoRA adapter `l`; `online` adds `[online]` settings).
pub struct Shared {
    pub pg: Pg,
    pub url: String,
    _dir: tempfile::TempDir,
    pub model: std::path::PathBuf,
    pub data: std::path::PathBuf,
    pub cfg: String,
}

impl Shared {
    pub fn new(online: &str) -> Option<Shared> {
        let pg = Pg::start()?;
        let url = pg.fresh_db();
        let (dir, model) = super::write_tiny(&super::server::spec());
        let data = dir.path().join("shared");
        let cfg = super::online::config(&format!(
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

    pub fn start(&self, role: &str) -> super::server::Server {
        start_role(&self.model, &self.data, &self.cfg, &self.url, role)
    }

    /// `flywheel serve` in `role` (learning `l`), expected to refuse to start: its stderr.
    pub fn refused(&self, role: &str, store: Option<&str>) -> String {
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

/// Reward one group sampled through `from` (2 choices), posting through `to`.
pub fn reward_group(from: &super::server::Server, to: &super::server::Server) {
    use super::online::*;
    let r = sample(from, "l", 2, 3, USER);
    let id = r["id"].as_str().unwrap();
    let items = serde_json::json!([{"id": id, "choice": 0, "reward": 1},
                                   {"id": id, "choice": 1, "reward": 0}]);
    assert_eq!(
        call(to, "POST", "/v1/feedback", Some(&items), USER).status,
        202
    );
}
