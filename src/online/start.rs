//! The online side as the server holds it (`Online`): built by the composition root (`app.rs`)
//! with what the trainer computes with, and started there when the server has learning adapters,
//! else on first use (the first `POST /v1/adapters/{name}/train`): a server that never learns
//! never opens a rollout store or writes to its data directory.

use super::config::{LearnConfig, OnlineConfig};
use super::trainer::{Compute, TrainerHandle};
use crate::metrics::Metrics;
use std::sync::{Arc, Mutex, OnceLock};

pub struct Online {
    cfg: OnlineConfig,
    compute: Compute,
    metrics: Arc<Metrics>,
    started: OnceLock<TrainerHandle>,
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

    /// The settings (`[online]`).
    pub fn cfg(&self) -> &OnlineConfig {
        &self.cfg
    }

    /// The trainer, if started.
    pub fn get(&self) -> Option<&TrainerHandle> {
        self.started.get()
    }

    /// The trainer if `name` is a learning adapter.
    pub fn learning(&self, name: &str) -> Option<&TrainerHandle> {
        self.get().filter(|o| o.is_learning(name))
    }

    /// The trainer, started now (with no learning adapter) if it was not. Blocking.
    pub fn get_or_start(&self) -> anyhow::Result<&TrainerHandle> {
        self.start_with(&[])
    }

    /// Start the trainer with `learn` (an error in one of them is returned: the server does not
    /// start half-learning), unless it runs already. Blocking.
    pub fn start_with(&self, learn: &[LearnConfig]) -> anyhow::Result<&TrainerHandle> {
        if let Some(o) = self.started.get() {
            return Ok(o);
        }
        let _g = self.starting.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(o) = self.started.get() {
            return Ok(o);
        }
        let o = TrainerHandle::start(
            self.cfg.clone(),
            learn,
            self.compute.clone(),
            self.metrics.clone(),
        )?;
        Ok(self.started.get_or_init(|| o))
    }
}
