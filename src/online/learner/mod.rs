//! A learning adapter as the trainer thread holds it, in one of two roles chosen once, at start,
//! from the process's role (`start`):
//! - `train::Learner` (`--role train` or `all`) trains: it resumes the newest intact checkpoint of
//!   its lineage (or begins a lineage with the identity), and each turn takes one GRPO-family step
//!   if a batch is ready — a plan (groups formed, the batch, the loss) and an ordered commit
//!   (write → upload → commit → publish → retire); the optimizer works on a copy that replaces
//!   the learner's only once the step is committed, so a step that fails at any point leaves
//!   optimizer and adapter exactly as before.
//! - `follow::Follower` (`--role serve`, a serving replica) never trains: each turn it publishes
//!   the trainer's newest verified checkpoint under the trainer's version number.
//!
//! `copies` is where both find a checkpoint's files (the data directory, or fetched from the
//! adapter store and verified); `status` is what they report.

mod canary;
mod copies;
mod follow;
mod promote;
mod resume;
mod rollback;
mod status;
mod train;

pub use status::{ErrorKind, State, Status, StepReport, TrainError};

use super::adapter_store::AdapterStore;
use super::checkpoint::CheckpointError;
use super::config::{LearnConfig, LearnMethod, OnlineConfig};
use super::store::records::{Checkpoint, Lineage};
use super::store::RolloutStore;
use crate::adapter::registry::{Publisher, Registry};
use crate::adapter::{AdapterBase, AdapterConfig, AdapterError, AdapterWeights, Method};
use crate::adapter::{LoraConfig, OftConfig};
use crate::metrics::Metrics;
use crate::model::decoder::Decoder;
use flywheel_kernels::Cpu;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Everything a learner works with (shared with the engine: model, compute, registry).
pub struct Env {
    pub cfg: OnlineConfig,
    pub log: Arc<dyn RolloutStore>,
    pub model: Arc<Decoder>,
    pub tokenizer: Arc<crate::model::tokenizer::Tokenizer>,
    pub cpu: Arc<Cpu>,
    pub registry: Arc<Registry>,
    pub metrics: Arc<Metrics>,
    /// Where versions are published besides the data directory (`online.adapter_store`).
    pub adapters: Option<Arc<AdapterStore>>,
    /// Runs evaluation sets (`online::eval`), once the server serves.
    pub evaluator: crate::online::eval::RunnerCell,
    /// The log-probs of a step's loss from the device that serves (`Compute::scorer`).
    pub scorer: ScorerCell,
}

/// Set where the engine serves on a GPU: the trainer's log-probs from there
/// (`train::offline::Scorer`).
pub type ScorerCell = Arc<std::sync::OnceLock<Arc<dyn crate::train::offline::Scorer>>>;

/// A learning adapter in the trainer thread: a `Learner` where this process trains, a
/// `Follower` in a serving replica.
pub trait Member: Send {
    fn status(&self) -> &Status;
    fn status_mut(&mut self) -> &mut Status;
    /// One turn: a `Learner` takes a step if a batch is ready (`Ok(Some)`); a `Follower`
    /// publishes the trainer's newest version if there is one (`Ok(None)`). On any error, what
    /// it serves and (a learner's) optimizer are as before.
    fn turn(&mut self, env: &Env) -> Result<Option<StepReport>, TrainError>;
    /// Replace the settings (the adapter's shape stays: method, block size, rank).
    fn configure(&mut self, cfg: LearnConfig) -> Result<(), ShapeChanged>;
    /// An operator's choice of what serves (a rollback, a pin); a `Follower` follows its
    /// trainer's decisions and refuses.
    fn serve(&mut self, _env: &Env, _op: ServeOp) -> Result<(), TrainError> {
        Err(TrainError::new(
            ErrorKind::Rollback,
            "this process serves the adapter for its trainer (--role serve): ask there",
        ))
    }
    /// Training resumes (an operator's resume): a learner paused by a rollback records it.
    fn resumed(&mut self, _env: &Env) {}
    /// Whether `MAX_FAILURES` failures in a row fail it. A `Learner` does; a `Follower` that
    /// cannot follow (a version it cannot fetch or verify, the store down) keeps serving the
    /// version it has and keeps trying, backing off: its lag metric and status say so.
    fn gives_up(&self) -> bool;
}

/// An operator's choice of the version a learning adapter serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ServeOp {
    /// Serve version `to` again, with its optimizer, forgetting what came after (pausing
    /// training or not).
    Rollback { to: u64, pause: bool },
    /// Serve version `to` (or keep the one serving) while training goes on; nothing it makes
    /// serves until unpinned.
    Pin(u64),
    /// The newest version serves again (under `gated`, the next that passes the gate).
    Unpin,
}

/// Start learning `cfg.name` in the role this process has (`OnlineConfig::role`), publishing
/// what it serves first.
pub fn start(cfg: LearnConfig, env: &Env) -> Result<Box<dyn Member>, TrainError> {
    Ok(match env.cfg.role.trains() {
        true => Box::new(train::Learner::start(cfg, env)?),
        false => Box::new(follow::Follower::start(cfg, env)?),
    })
}

/// The adapter `cfg` learns on `base`: its method on every projection the base has to adapt.
pub fn adapter_config(cfg: &LearnConfig, base: &impl AdapterBase) -> AdapterConfig {
    let method = match cfg.method {
        LearnMethod::Lora => Method::Lora(LoraConfig {
            r: cfg.lora_r,
            alpha: 2.0 * cfg.lora_r as f32,
            use_rslora: false,
        }),
        LearnMethod::Oft => Method::Oft(OftConfig {
            block_size: cfg.oft_block_size,
            ..OftConfig::default()
        }),
    };
    AdapterConfig {
        method,
        targets: base.adapter_shape().default_targets(),
        base_model: String::new(),
    }
}

/// The identity adapter of `cfg`'s method, within the registry's limits.
fn identity(cfg: &LearnConfig, env: &Env) -> Result<AdapterWeights, AdapterError> {
    let c = adapter_config(cfg, &env.model.config);
    let layout = env.registry.limits.layout(c, &env.model.config)?;
    Ok(AdapterWeights::identity(Arc::new(layout), 0))
}

/// What a start found of a lineage: the newest checkpoint that loaded (what `load` made of it,
/// and the folder if it was fetched from the adapter store now), and how many there are.
struct Found<T> {
    resumed: Option<(Checkpoint, T, Option<PathBuf>)>,
    num_checkpoints: usize,
}

/// The newest checkpoint of `lineage` whose files (`needed`) are at hand and load with `load`;
/// a broken one is skipped with a warning, for the one before.
fn newest_intact<T>(
    env: &Env,
    name: &str,
    lineage: &Lineage,
    needed: copies::Needed,
    load: impl Fn(&Path) -> Result<T, CheckpointError>,
) -> Result<Found<T>, TrainError> {
    let cps = env.log.checkpoints(lineage.id)?;
    let num_checkpoints = cps.len();
    for cp in cps {
        let loaded = env
            .local_checkpoint(&cp, lineage.id, needed)
            .and_then(|(dir, fetched)| Ok((load(&dir)?, fetched.then_some(dir))));
        match loaded {
            Ok((x, fetched)) => {
                return Ok(Found {
                    resumed: Some((cp, x, fetched)),
                    num_checkpoints,
                })
            }
            Err(e) => tracing::warn!(
                adapter = name, version = cp.version, error = %e,
                "checkpoint unreadable: falling back to the one before"
            ),
        }
    }
    Ok(Found {
        resumed: None,
        num_checkpoints,
    })
}

/// A lineage keeps its shape: `cfg` takes what the checkpoint's adapter holds (warned when it
/// asked for another).
fn adopt_shape(cfg: &mut LearnConfig, w: &AdapterWeights) {
    let requested = (cfg.method, cfg.oft_block_size, cfg.lora_r);
    match &w.layout.config.method {
        Method::Oft(o) => (cfg.method, cfg.oft_block_size) = (LearnMethod::Oft, o.block_size),
        Method::Lora(r) => (cfg.method, cfg.lora_r) = (LearnMethod::Lora, r.r),
    }
    if requested != (cfg.method, cfg.oft_block_size, cfg.lora_r) {
        tracing::warn!(adapter = %cfg.name, method = %cfg.method, "resumed with the shape of its lineage, not the one asked for");
    }
}

/// Publish `weights` as what `cfg.name` serves at start (numbered `min_version` or above, under
/// `lineage`'s claim), and the status it starts with: the store's totals and last step (its
/// gauges too).
fn publish_at_start(
    env: &Env,
    cfg: &LearnConfig,
    lineage: &Lineage,
    weights: AdapterWeights,
    min_version: u64,
    steps: u64,
) -> Result<Status, TrainError> {
    let name = cfg.name.as_str();
    let who = Publisher::Claim {
        id: lineage.id,
        min_version,
    };
    let (v, _) = env
        .registry
        .publish_as(name, weights, who)
        .map_err(|e| TrainError::new(ErrorKind::Publish, e))?;
    env.metrics
        .train_learner_ok
        .with_label_values(&[name])
        .set(1);
    let history = env.log.history(name, lineage.id)?;
    let last: Option<StepReport> = history
        .last_stats
        .as_deref()
        .and_then(|s| serde_json::from_str(s).ok());
    if let Some(r) = &last {
        show_step(env, name, r);
    }
    Ok(Status {
        state: State::Running,
        version: v.version,
        lineage: lineage.id,
        steps,
        pending_groups: 0,
        dropped: history.dropped,
        trained: history.trained,
        last,
        last_error: None,
        consecutive_failures: 0,
        retry_at: None,
        config: cfg.clone(),
        last_decision: None,
        eval_scores: Default::default(),
        held_version: None,
        pinned_version: None,
        canary_version: None,
    })
}

/// A new configuration that would change a learning adapter's shape, which its lineage fixes.
#[derive(Debug, thiserror::Error)]
#[error(
    "'{name}' learns with {method} (oft_block_size {oft_block_size}, lora_r {lora_r}): a learning \
     adapter's shape cannot change; DELETE it and train it again to start a new lineage"
)]
pub struct ShapeChanged {
    name: String,
    method: crate::online::config::LearnMethod,
    oft_block_size: usize,
    lora_r: usize,
}

/// Replace `cur` (and the status's copy) by `new`, unless its shape differs.
fn reconfigure(
    cur: &mut LearnConfig,
    status: &mut Status,
    new: LearnConfig,
) -> Result<(), ShapeChanged> {
    let shape = |c: &LearnConfig| (c.method, c.oft_block_size, c.lora_r);
    if shape(cur) != shape(&new) {
        return Err(ShapeChanged {
            name: cur.name.clone(),
            method: cur.method,
            oft_block_size: cur.oft_block_size,
            lora_r: cur.lora_r,
        });
    }
    status.config = new.clone();
    *cur = new;
    Ok(())
}

/// A step's report in the gauges that show the last step.
fn show_step(env: &Env, name: &str, r: &StepReport) {
    let m = &env.metrics;
    let s = &r.stats;
    m.train_tokens_per_second
        .with_label_values(&[name])
        .set(s.tokens_per_second);
    for (g, v) in [
        (&m.train_loss, s.loss),
        (&m.train_reward_mean, s.reward_mean),
        (&m.train_reward_std, s.reward_std),
        (&m.train_kl, s.kl),
        (&m.train_clip_fraction, s.clip_fraction),
        (&m.train_masked_fraction, s.masked_fraction),
        (&m.train_grad_norm, s.grad_norm),
    ] {
        g.with_label_values(&[name]).set(v);
    }
    if let Some(d) = s.logprob_diff_max {
        m.train_logprob_diff.with_label_values(&[name]).set(d);
    }
}
