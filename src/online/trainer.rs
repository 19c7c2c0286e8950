//! The trainer: one thread that owns the learners (their settings, lineages and optimizers), and
//! the `TrainerHandle` everyone else talks to it with. Like the engine, it is the only owner of
//! its mutable state: request threads send commands (add, remove, configure, pause, resume) and
//! await the answer, which comes between two steps; they read the status from a snapshot the
//! thread publishes, so no request ever waits on a step or an fsync for a status.
//!
//! Nothing fails silently. A step's error is counted (`flywheel_train_errors_total{adapter,
//! kind}`), shown in the status (`last_error`), and retried with backoff (1, 2, 4, ... 60 s); after
//! `MAX_FAILURES` in a row, or a panic, the learner is `failed`: feedback for it gets 503 until an
//! operator resumes it. (A serving replica's learner only follows the trainer: it keeps serving
//! the version it has and keeps trying, backing off, with its lag in `flywheel_replica_*`.) A
//! rollout log that became unusable fails every learner. The thread is supervised: a panic is
//! caught and reported the same way; if it ever ends, every learner counts as failed.
//!
//! Sharing the two cores: the trainer calls the same `Cpu` as the engine; its kernels run as
//! background work (the pool's gate lets them run between engine steps, within the share its
//! policy sets: `share_policy`, steered here after each step and each wake-up).
//!
//! This file holds the handle and the start-up; the thread's loop is in `trainer/thread.rs`.

use super::adapter_store::AdapterStore;
use super::config::{LearnConfig, OnlineConfig};
use super::learner::{Env, Member, ServeOp, State, Status, TrainError};
use super::runs::kept::{Restored, RunMeta};
use super::runs::{RunError, RunOutput, RunState, RunWork};
use super::share_policy::{PolicyView, SharePolicy, Steering};
use super::store::records::Accepting;
use super::store::{Announcement, RolloutStore};
use crate::engine::repetition::RepetitionRule;

mod thread;
use crate::adapter::registry::Registry;
use crate::adapter::AdapterWeights;
use crate::metrics::Metrics;
use crate::model::decoder::Decoder;
use crate::train::optim::AdamW;
use crate::util::now_secs;
use flywheel_kernels::Cpu;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, RwLock};
use std::time::Duration;

/// Failures in a row after which a learner is `failed`.
pub const MAX_FAILURES: u32 = 5;

/// Steps one learner takes in a row while batches are ready (then the others get a turn).
const MAX_STEPS_IN_A_ROW: usize = 16;

/// Everything the trainer computes with.
#[derive(Clone)]
pub struct Compute {
    pub model: Arc<Decoder>,
    /// The model's tokenizer (a distilling adapter's teacher prompt).
    pub tokenizer: Arc<crate::model::tokenizer::Tokenizer>,
    pub cpu: Arc<Cpu>,
    pub registry: Arc<Registry>,
    /// Runs evaluation sets' requests (set by the server once it serves).
    pub evaluator: crate::online::eval::RunnerCell,
    /// Where the engine serves on a GPU, the training steps' log-probs from there (set before
    /// the trainer starts).
    pub scorer: super::learner::ScorerCell,
}

type Reply<T> = tokio::sync::oneshot::Sender<Result<T, CommandError>>;

enum Command {
    /// Make a name learn (resume or create); true when it is new.
    Add(LearnConfig, Reply<Status>),
    /// Replace a learner's settings.
    Configure(LearnConfig, Reply<Status>),
    Pause(String, bool, Reply<Status>),
    /// An operator's choice of what a learner serves (a rollback, a pin).
    Serve(String, ServeOp, Reply<Status>),
    /// End a learner's lineage and remove its adapter.
    Remove(String, Reply<()>),
    /// Replace the policy that splits the cores with serving.
    Policy(SharePolicy, Reply<PolicyView>),
    /// A client-driven training run (the Tinker API): start one, work on one, end some.
    Run(RunCommand),
    /// A reward arrived.
    Wake,
    /// Finish the step in progress, then end the thread (graceful shutdown).
    Stop(Reply<()>),
}

/// Commands on client-driven runs (`online::runs`).
enum RunCommand {
    Start(String, AdapterWeights, Option<AdamW>, RunMeta, Reply<()>),
    Work(String, RunWork, Reply<RunOutput>),
    /// End sessions (with their runs, by id): forgotten here and in the store.
    End(Vec<String>, Vec<String>),
    /// Bring back the runs kept by an earlier process.
    Restore(Reply<Restored>),
}

/// What the handle reads without the thread.
struct Shared {
    status: RwLock<BTreeMap<String, Status>>,
    policy: RwLock<PolicyView>,
    /// False once the trainer thread has ended.
    alive: AtomicBool,
}

/// The handle to the trainer (cheap to clone).
#[derive(Clone)]
pub struct TrainerHandle {
    tx: mpsc::Sender<Command>,
    shared: Arc<Shared>,
    log: Arc<dyn RolloutStore>,
    pub cfg: OnlineConfig,
    pub metrics: Arc<Metrics>,
}

/// Why learning cannot go on now (readiness).
#[derive(Debug, thiserror::Error)]
pub enum Unhealthy {
    #[error("the trainer thread has stopped")]
    Stopped,
    #[error(transparent)]
    Log(#[from] super::store::records::LogError),
    /// The health check itself did not finish.
    #[error("the health check failed")]
    Unchecked,
}

/// Why a command was not carried out.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    #[error("'{0}' is not a learning adapter")]
    NotLearning(String),
    #[error(transparent)]
    Conflict(#[from] super::learner::ShapeChanged),
    #[error(transparent)]
    Train(#[from] TrainError),
    #[error("no training run '{0}' (ended, or never started)")]
    NoRun(String),
    #[error(transparent)]
    Run(#[from] RunError),
    /// No answer: the thread has ended, or the command panicked (counted and logged).
    #[error("the trainer did not answer (it has stopped, or the command failed: see its log)")]
    Stopped,
}

struct Trainer {
    env: Env,
    learners: BTreeMap<String, Box<dyn Member>>,
    /// Client-driven training runs by id.
    runs: BTreeMap<String, RunState>,
    shared: Arc<Shared>,
    rx: mpsc::Receiver<Command>,
    last_prune: f64,
    log_ok: bool,
    /// Set by `Command::Stop`: no further step; the thread ends.
    stopping: bool,
    /// Whether it applies the store's retention (one process prunes a shared store: the one
    /// that trains).
    prunes: bool,
    /// The split of the cores with serving (the gate's share).
    steering: Steering,
}

/// The stores the online side writes to, opened once.
pub struct Stores {
    /// The rollout store (`online.rollout_store`: SQLite in the data directory by default).
    pub log: Arc<dyn RolloutStore>,
    /// Where versions are published besides the data directory (`online.adapter_store`).
    pub adapters: Option<Arc<AdapterStore>>,
}

impl TrainerHandle {
    /// Start the trainer thread over the opened stores (`Online` opens them) and add each of
    /// `learn` (an error in one of them is returned: the server does not start half-learning).
    /// Blocking.
    pub fn start(
        cfg: OnlineConfig,
        learn: &[LearnConfig],
        compute: Compute,
        metrics: Arc<Metrics>,
        stores: Stores,
    ) -> anyhow::Result<TrainerHandle> {
        let Stores { log, adapters } = stores;
        let (tx, rx) = mpsc::channel();
        // Woken at once by what it works on: a trainer by rewards (recorded in-process, it is
        // told by `notify`; by another replica, the store announces them), a serving replica by
        // committed steps. Polling (at most 500 ms apart) stays the catch-up and the clock for
        // group timeouts and retries.
        let heard = match cfg.role.trains() {
            true => Announcement::Rewards,
            false => Announcement::Steps,
        };
        let wake = tx.clone();
        log.subscribe(
            heard,
            Box::new(move || {
                let _ = wake.send(Command::Wake);
            }),
        );
        let steering = Steering::new(cfg.share.clone());
        let shared = Arc::new(Shared {
            status: RwLock::new(BTreeMap::new()),
            policy: RwLock::new(steering.view().clone()),
            alive: AtomicBool::new(true),
        });
        let trainer = Trainer {
            env: Env {
                cfg: cfg.clone(),
                log: log.clone(),
                model: compute.model,
                tokenizer: compute.tokenizer,
                cpu: Arc::new(compute.cpu.background()),
                registry: compute.registry,
                metrics: metrics.clone(),
                adapters,
                evaluator: compute.evaluator,
                scorer: compute.scorer,
            },
            learners: BTreeMap::new(),
            runs: BTreeMap::new(),
            shared: shared.clone(),
            rx,
            last_prune: now_secs(),
            log_ok: true,
            stopping: false,
            prunes: cfg.role.trains(),
            steering,
        };
        std::thread::Builder::new()
            .name("flywheel-trainer".into())
            .spawn(move || trainer.run())?;
        let handle = TrainerHandle {
            tx,
            shared,
            log,
            cfg,
            metrics,
        };
        for l in learn {
            let (reply, rx) = tokio::sync::oneshot::channel();
            handle.send(Command::Add(l.clone(), reply))?;
            rx.blocking_recv()
                .map_err(|_| anyhow::anyhow!("the trainer stopped"))?
                .map_err(|e| anyhow::anyhow!("learning adapter '{}': {e}", l.name))?;
        }
        Ok(handle)
    }

    fn send(&self, c: Command) -> Result<(), CommandError> {
        self.tx.send(c).map_err(|_| CommandError::Stopped)
    }

    async fn ask<T>(&self, make: impl FnOnce(Reply<T>) -> Command) -> Result<T, CommandError> {
        let (reply, rx) = tokio::sync::oneshot::channel();
        self.send(make(reply))?;
        rx.await.map_err(|_| CommandError::Stopped)?
    }

    /// Make `cfg.name` learn (resumed from its lineage's checkpoint, or a new lineage from the
    /// identity), or change its settings if it already does. (status, whether it is new).
    pub async fn train(&self, cfg: LearnConfig) -> Result<(Status, bool), CommandError> {
        if self.is_learning(&cfg.name) {
            let s = self.ask(|r| Command::Configure(cfg, r)).await?;
            return Ok((s, false));
        }
        Ok((self.ask(|r| Command::Add(cfg, r)).await?, true))
    }

    /// Pause or resume `name` (resuming a failed learner clears its failure).
    pub async fn set_paused(&self, name: &str, paused: bool) -> Result<Status, CommandError> {
        let n = name.to_string();
        self.ask(|r| Command::Pause(n, paused, r)).await
    }

    /// Stop learning `name`: its lineage ends (never resumed, its versions never reused), its
    /// adapter is removed. Waits for a step in progress to end.
    /// Replace the share policy (validated by the caller); the view after the change.
    pub async fn set_policy(&self, p: SharePolicy) -> Result<PolicyView, CommandError> {
        self.ask(|r| Command::Policy(p, r)).await
    }

    /// The share policy, the share in force and what it measured.
    pub fn policy(&self) -> PolicyView {
        let v = self.shared.policy.read().unwrap_or_else(|e| e.into_inner());
        v.clone()
    }

    /// Choose what learner `name` serves (`ServeOp`): its status after.
    pub async fn serve(&self, name: &str, op: ServeOp) -> Result<Status, CommandError> {
        let name = name.to_string();
        self.ask(|r| Command::Serve(name, op, r)).await
    }

    pub async fn remove(&self, name: &str) -> Result<(), CommandError> {
        let n = name.to_string();
        self.ask(|r| Command::Remove(n, r)).await
    }

    /// Let the step in progress finish (a step is committed whole or not at all, so this only
    /// saves its work), then end the trainer thread: waits at most `timeout`.
    pub async fn stop(&self, timeout: Duration) {
        match tokio::time::timeout(timeout, self.ask(Command::Stop)).await {
            Ok(Ok(())) => tracing::info!("the trainer finished its step and stopped"),
            Ok(Err(_)) => {}
            Err(_) => tracing::warn!("shutdown timeout reached with a training step running"),
        }
    }

    /// Start client-driven run `id` from `weights` and `opt` (a new AdamW when None), kept
    /// (`runs::kept`) with `meta` before it is answered.
    pub async fn start_run(
        &self,
        id: &str,
        weights: AdapterWeights,
        opt: Option<AdamW>,
        meta: RunMeta,
    ) -> Result<(), CommandError> {
        let id = id.to_string();
        self.ask(|r| Command::Run(RunCommand::Start(id, weights, opt, meta, r)))
            .await
    }

    /// Bring back the sessions and runs an earlier process kept (their states into the trainer).
    pub async fn restore_runs(&self) -> Result<Restored, CommandError> {
        self.ask(|r| Command::Run(RunCommand::Restore(r))).await
    }

    /// Queue `work` on run `id` now, after the calls queued before it (a run's calls are
    /// carried out in the order they were queued); its answer comes through the receiver.
    pub fn run_work(
        &self,
        id: &str,
        work: RunWork,
    ) -> Result<tokio::sync::oneshot::Receiver<Result<RunOutput, CommandError>>, CommandError> {
        let (reply, rx) = tokio::sync::oneshot::channel();
        self.send(Command::Run(RunCommand::Work(id.to_string(), work, reply)))?;
        Ok(rx)
    }

    /// End sessions `sessions` and their runs `runs`: their states are dropped, and forgotten
    /// by the store.
    pub fn end_sessions(&self, sessions: Vec<String>, runs: Vec<String>) {
        if !sessions.is_empty() {
            let _ = self.send(Command::Run(RunCommand::End(sessions, runs)));
        }
    }

    /// The rollout store.
    pub fn store(&self) -> &Arc<dyn RolloutStore> {
        &self.log
    }

    /// Wake the trainer (a reward arrived).
    pub fn notify(&self) {
        let _ = self.tx.send(Command::Wake);
    }

    pub fn is_alive(&self) -> bool {
        self.shared.alive.load(Ordering::Acquire)
    }

    pub fn is_learning(&self, name: &str) -> bool {
        self.read().contains_key(name)
    }

    /// Whether learning adapter `name` distills (its completions need no reward).
    pub fn distills(&self, name: &str) -> bool {
        self.read()
            .get(name)
            .is_some_and(|s| s.config.loss == crate::train::loss::LossName::Distill)
    }

    /// The repetition rule learning adapter `name`'s requests run with unless they say.
    pub fn repetition_rule(&self, name: &str) -> Option<RepetitionRule> {
        self.read().get(name)?.config.stop_on_repetition
    }

    /// Whether learning adapter `name`'s generations follow its newest version: Some(whether a
    /// switch keeps the K/V computed so far).
    pub fn follows_latest(&self, name: &str) -> Option<bool> {
        use crate::online::config::{VersionPolicy, VersionSwitch};
        let st = self.read();
        let c = &st.get(name)?.config;
        (c.version_policy == VersionPolicy::Latest)
            .then_some(c.version_switch == VersionSwitch::Keep)
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, Status>> {
        self.shared.status.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Every learner's status, by name.
    pub fn status(&self) -> BTreeMap<String, Status> {
        let mut s = self.read().clone();
        if !self.is_alive() {
            for st in s.values_mut() {
                st.state = State::Failed;
            }
        }
        s
    }

    /// Which adapters take rewards now (a value for the rollout store to judge rewards by).
    pub fn accepting(&self) -> Accepting {
        if !self.is_alive() {
            return Accepting::stopped("the trainer thread has stopped");
        }
        Accepting::new(self.read().iter().map(|(name, s)| {
            let ok = match s.state {
                State::Failed => Err(s
                    .last_error
                    .as_ref()
                    .map_or_else(|| "failed".to_string(), |e| e.to_string())),
                _ => Ok(()),
            };
            (name.clone(), ok)
        }))
    }

    /// Ok while the trainer runs and the rollout log is usable (readiness).
    pub fn health(&self) -> Result<(), Unhealthy> {
        if !self.is_alive() {
            return Err(Unhealthy::Stopped);
        }
        Ok(self.log.check()?)
    }
}
