//! The online side as the server holds it (`Online`): built by the composition root (`app.rs`)
//! with what the trainer computes with, and started there when the server has learning adapters,
//! else on first use (the first `POST /v1/adapters/{name}/train`): a server that never learns
//! never opens a rollout store or writes to its data directory. Starting opens the stores (the
//! rollout store, the adapter store) and hands them to the trainer thread and, through
//! [`Online::store`], to the handlers that log completions and record rewards.

use super::adapter_store::AdapterStore;
use super::checkpoint::sweep_temporaries;
use super::config::{LearnConfig, OnlineConfig};
use super::store::open::open_store;
use super::store::RolloutStore;
use super::trainer::{Compute, Stores, TrainerHandle};
use crate::metrics::Metrics;
use std::sync::{Arc, Mutex, OnceLock};

/// Open the stores for `cfg`: the data directory must be writable where this process writes
/// (a trainer, or a replica that fetches versions into it) and there otherwise; leftover
/// temporary checkpoints are removed.
fn open_stores(cfg: &OnlineConfig, metrics: &Metrics) -> anyhow::Result<Stores> {
    // A serving replica only reads the shared data directory (the trainer's checkpoints),
    // unless it fetches them from an adapter store into it.
    let adapters = match &cfg.adapter_store {
        Some(url) => Some(Arc::new(AdapterStore::open(
            url,
            &cfg.adapter_store_options,
        )?)),
        None => None,
    };
    let writes = cfg.role.trains() || adapters.is_some();
    if writes {
        check_writable(&cfg.data_dir)?;
    } else {
        anyhow::ensure!(
            cfg.data_dir.is_dir(),
            "the shared data directory {} is not there (a serving replica reads the \
             trainer's checkpoints in it)",
            cfg.data_dir.display()
        );
    }
    let log = open_store(cfg.rollout_store.as_deref(), &cfg.data_dir)?;
    metrics.rollout_log_ok.set(1);
    if writes {
        sweep_temporaries(&cfg.data_dir);
    }
    Ok(Stores { log, adapters })
}

/// Check that `dir` exists (created if needed) and takes files; the error names the path.
fn check_writable(dir: &std::path::Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| {
        anyhow::anyhow!(
            "the data directory {} cannot be created: {e}",
            dir.display()
        )
    })?;
    let probe = dir.join(format!(".probe-{:016x}", crate::util::random_u64()));
    std::fs::write(&probe, b"probe")
        .and_then(|_| std::fs::remove_file(&probe))
        .map_err(|e| anyhow::anyhow!("the data directory {} is not writable: {e}", dir.display()))
}

/// What the handlers of a started online side use: the rollout store (where completions through
/// learning adapters are logged and rewards recorded) and the trainer (commands, status, which
/// adapters take rewards).
#[derive(Clone)]
pub struct Learning {
    pub store: Arc<dyn RolloutStore>,
    pub trainer: TrainerHandle,
}

/// The online side: its settings, what its trainer computes with, and once started the rollout
/// store and the trainer.
pub struct Online {
    cfg: OnlineConfig,
    compute: Compute,
    metrics: Arc<Metrics>,
    /// The rollout store and the trainer, once started.
    started: OnceLock<Learning>,
    /// Held while starting: one start, however many requests ask at once.
    starting: Mutex<()>,
}

impl Online {
    pub fn new(cfg: OnlineConfig, compute: Compute, metrics: Arc<Metrics>) -> Online {
        Online {
            cfg,
            compute,
            metrics,
            started: OnceLock::new(),
            starting: Mutex::new(()),
        }
    }

    /// Where evaluation sets' requests run: the server's runner (set once, when it serves).
    pub fn set_evaluator(&self, runner: Arc<dyn super::eval::Runner>) {
        let _ = self.compute.evaluator.set(runner);
    }

    /// The settings (`[online]`).
    pub fn cfg(&self) -> &OnlineConfig {
        &self.cfg
    }

    /// The trainer, if started.
    pub fn get(&self) -> Option<&TrainerHandle> {
        self.started().map(|l| &l.trainer)
    }

    /// The rollout store and the trainer, once started.
    pub fn started(&self) -> Option<&Learning> {
        self.started.get()
    }

    /// The store and trainer if `name` is a learning adapter.
    pub fn learning(&self, name: &str) -> Option<&Learning> {
        self.started().filter(|l| l.trainer.is_learning(name))
    }

    /// The trainer, started now (with no learning adapter) if it was not. Blocking.
    pub fn get_or_start(&self) -> anyhow::Result<&TrainerHandle> {
        self.start_with(&[])
    }

    /// Start the trainer with `learn` (an error in one of them is returned: the server does not
    /// start half-learning), unless it runs already. Blocking.
    pub fn start_with(&self, learn: &[LearnConfig]) -> anyhow::Result<&TrainerHandle> {
        if let Some(o) = self.get() {
            return Ok(o);
        }
        let _g = self.starting.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(o) = self.get() {
            return Ok(o);
        }
        let stores = open_stores(&self.cfg, &self.metrics)?;
        let log = stores.log.clone();
        let trainer = TrainerHandle::start(
            self.cfg.clone(),
            learn,
            self.compute.clone(),
            self.metrics.clone(),
            stores,
        )?;
        let started = self.started.get_or_init(|| Learning {
            store: log,
            trainer,
        });
        Ok(&started.trainer)
    }
}
