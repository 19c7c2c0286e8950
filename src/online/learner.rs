//! One learning adapter, owned by the trainer thread: its settings, lineage, optimizer and the
//! status it shows. `start` resumes the newest intact checkpoint of its lineage (or begins a
//! lineage with the identity); `step` takes one GRPO-family step if a batch is ready and makes it
//! durable before it changes anything: the optimizer works on a copy that replaces the learner's
//! only once the checkpoint and its consumed groups are committed, so a step that fails at any
//! point leaves optimizer and adapter exactly as before.

use super::adapter_store::AdapterStore;
use super::checkpoint::{
    checkpoint_rel, load_checkpoint, max_version_on_disk, remove_dir, verify_checkpoint,
    write_checkpoint, MANIFEST_FILE,
};
use super::config::{LearnConfig, LearnMethod, OnlineConfig};
use super::groups::{self, Rules};
use super::lineage::{Checkpoint, Lineage};
use super::records::{LogError, PendingGroup};
use super::store::RolloutStore;
use crate::adapter::registry::{Publisher, Registry};
use crate::adapter::{peft, AdapterBase, OftConfig};
use crate::adapter::{AdapterConfig, AdapterError, AdapterWeights, LoraConfig, Method};
use crate::metrics::Metrics;
use crate::model::llama::Llama;
use crate::policy::is_greedy;
use crate::train::loss::{LossConfig, Objective};
use crate::train::offline::{grouped, step, Sample};
use crate::train::optim::{AdamW, AdamWConfig};
use crate::util::now_secs;
use flywheel_kernels::Cpu;
use std::path::PathBuf;
use std::sync::Arc;

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

/// Everything a learner works with (shared with the engine: model, compute, registry).
pub struct Env {
    pub cfg: OnlineConfig,
    pub log: Arc<dyn RolloutStore>,
    pub model: Arc<Llama>,
    pub cpu: Arc<Cpu>,
    pub registry: Arc<Registry>,
    pub metrics: Arc<Metrics>,
    /// Where versions are published besides the data directory (`online.adapter_store`).
    pub adapters: Option<Arc<AdapterStore>>,
}

pub struct Learner {
    pub cfg: LearnConfig,
    pub lineage: Lineage,
    opt: AdamW,
    pub status: Status,
    /// A replica's copy of the version it serves, fetched from the adapter store (removed
    /// once it follows to the next).
    fetched: Option<PathBuf>,
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

/// A fresh optimizer for `num_params` parameters; for a serving replica (`follow`), which never
/// steps, one without moment buffers.
fn adamw(cfg: &LearnConfig, num_params: usize, follow: bool) -> AdamW {
    let c = AdamWConfig {
        lr: cfg.lr,
        ..AdamWConfig::default()
    };
    AdamW::new(c, if follow { 0 } else { num_params })
}

/// How long a starting trainer waits for another's claim on its adapter before refusing.
const CLAIM_WAIT_SECS: f64 = 10.0;

/// The files of a checkpoint a serving replica loads (and so verifies).
const FOLLOWED: [&str; 2] = [peft::CONFIG_FILE, peft::WEIGHTS_FILE];
/// The files of a checkpoint a trainer resumes from.
const RESUMED: [&str; 4] = [
    peft::CONFIG_FILE,
    peft::WEIGHTS_FILE,
    crate::train::optim::STATE_FILE,
    crate::train::optim::CONFIG_FILE,
];

impl Learner {
    /// Resume `cfg.name`'s lineage from its newest intact checkpoint, or begin a lineage with the
    /// identity adapter; publish it either way. A broken newest checkpoint is skipped with a
    /// warning. Versions continue above every version the name ever had.
    pub fn start(mut cfg: LearnConfig, env: &Env) -> Result<Learner, TrainError> {
        let name = cfg.name.clone();
        let name = name.as_str();
        let start_err = |e: &dyn std::fmt::Display| TrainError::new(ErrorKind::Start, e);
        let recorded = env.log.max_version(name)?;
        // Folders the store does not know of (it was lost, or replaced): their numbers were
        // served, so the lineage continues above them and never writes over them.
        let on_disk = max_version_on_disk(&env.cfg.data_dir, name);
        if on_disk > recorded {
            tracing::warn!(
                adapter = name,
                recorded,
                on_disk,
                "checkpoint folders above every version the rollout store records (was it lost \
                 or replaced?): versions continue above them, and the folders are left as they are"
            );
        }
        let max_seen = recorded.max(on_disk).max(env.registry.last_version(name));
        let lineage = env.log.active_lineage(name)?;
        let follow = !env.cfg.role.trains();
        if !follow {
            // A trainer restarted right after a crash may find the claim still held while the
            // database notices the dead connection: wait a little, then refuse.
            let deadline = now_secs() + CLAIM_WAIT_SECS;
            loop {
                match env.log.claim_trainer(name) {
                    Ok(()) => break,
                    Err(LogError::Conflict(_)) if now_secs() < deadline => {
                        std::thread::sleep(std::time::Duration::from_millis(200))
                    }
                    Err(e) => return Err(start_err(&e)),
                }
            }
        }
        if follow && lineage.is_none() {
            return Err(start_err(&format!(
                "no lineage of '{name}' in the rollout store yet: a serving replica follows the \
                 trainer's, so start the trainer (--role train) first"
            )));
        }
        let mut resumed = None;
        let mut fetched = None;
        let mut num_checkpoints = 0;
        if let Some(l) = lineage {
            let cps = env.log.checkpoints(l.id)?;
            num_checkpoints = cps.len();
            for cp in cps {
                // A replica serves only what it can verify against the trainer's manifest.
                match env
                    .local_checkpoint(&cp, l.id)
                    .and_then(|(dir, was_fetched)| {
                        let (model, limits) = (&env.model.config, &env.registry.limits);
                        let x = match follow {
                            // A replica never steps: the adapter only, not the optimizer.
                            true => {
                                let w = peft::load_within(&dir, model, limits)
                                    .map_err(|e| e.to_string())?;
                                let mut opt = adamw(&cfg, w.layout.num_params, true);
                                opt.step = cp.step;
                                (w, opt)
                            }
                            false => load_checkpoint(&dir, model, limits)?,
                        };
                        fetched = was_fetched.then_some(dir);
                        Ok(x)
                    }) {
                    Ok(x) => {
                        resumed = Some((l, cp, x));
                        break;
                    }
                    Err(e) => tracing::warn!(
                        adapter = name, version = cp.version, error = %e,
                        "checkpoint unreadable: falling back to the one before"
                    ),
                }
            }
        }
        if follow && resumed.is_none() && num_checkpoints > 0 {
            return Err(start_err(&format!(
                "none of the {num_checkpoints} checkpoints of '{name}' could be verified (see \
                 the warnings): a serving replica does not serve unverified versions"
            )));
        }
        let (lineage, weights, opt, min_version) = match (lineage, resumed) {
            (_, Some((l, cp, (w, opt)))) => {
                // A lineage keeps its shape: the settings say what the checkpoint holds.
                let requested = (cfg.method, cfg.oft_block_size, cfg.lora_r);
                match &w.layout.config.method {
                    Method::Oft(o) => {
                        (cfg.method, cfg.oft_block_size) = (LearnMethod::Oft, o.block_size)
                    }
                    Method::Lora(r) => (cfg.method, cfg.lora_r) = (LearnMethod::Lora, r.r),
                }
                if requested != (cfg.method, cfg.oft_block_size, cfg.lora_r) {
                    tracing::warn!(adapter = name, method = %cfg.method, "resumed with the shape of its lineage, not the one asked for");
                }
                // The same number only if no later version was ever seen (then it is the same
                // weights); else a new number for these older weights.
                let v = if cp.version >= max_seen || follow {
                    cp.version
                } else {
                    max_seen + 1
                };
                tracing::info!(
                    adapter = name,
                    checkpoint = cp.version,
                    version = v,
                    step = cp.step,
                    "learning adapter resumed"
                );
                (l, w, opt, v)
            }
            (l, None) => {
                let w = identity(&cfg, env).map_err(|e| start_err(&e))?;
                let opt = adamw(&cfg, w.layout.num_params, follow);
                let (l, v) = match l {
                    // Never trained: the identity it started with, under the same number (a
                    // follower: the trainer's number, whatever it served).
                    Some(l) if num_checkpoints == 0 && (max_seen <= l.first_version || follow) => {
                        (l, l.first_version)
                    }
                    Some(l) => {
                        tracing::warn!(
                            adapter = name,
                            "no intact checkpoint in its lineage: starting again from the identity"
                        );
                        (l, max_seen + 1)
                    }
                    None => (env.log.begin_lineage(name, max_seen + 1)?, max_seen + 1),
                };
                tracing::info!(adapter = name, method = %cfg.method, lineage = l.id, version = v, "learning adapter created");
                (l, w, opt, v)
            }
        };
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
        // What the store remembers: the last step's report (its gauges too) and the totals.
        let history = env.log.history(name, lineage.id)?;
        let last: Option<StepReport> = history
            .last_stats
            .as_deref()
            .and_then(|s| serde_json::from_str(s).ok());
        if let Some(r) = &last {
            show_step(env, name, r);
        }
        Ok(Learner {
            status: Status {
                state: State::Running,
                version: v.version,
                lineage: lineage.id,
                steps: opt.step,
                pending_groups: 0,
                dropped: history.dropped,
                trained: history.trained,
                last,
                last_error: None,
                consecutive_failures: 0,
                retry_at: None,
                config: cfg.clone(),
            },
            cfg,
            lineage,
            opt,
            fetched: fetched.filter(|_| follow),
        })
    }

    /// Form groups (recording drops), and take one step if a batch is ready: Ok(None) when none
    /// was. On any error, optimizer and adapter are as before.
    pub fn step(&mut self, env: &Env) -> Result<Option<StepReport>, TrainError> {
        if !env.cfg.role.trains() {
            self.follow(env)?;
            return Ok(None);
        }
        let name = self.cfg.name.clone();
        env.log.claim_trainer(&name)?;
        let slot = env.registry.get(&name).ok_or_else(|| {
            TrainError::new(ErrorKind::Publish, format!("the adapter '{name}' is gone"))
        })?;
        let cur = slot.current();
        let rules = Rules {
            max_off_policy_steps: env.cfg.max_off_policy_steps,
            group_timeout_secs: env.cfg.group_timeout_secs,
            train_off_policy_samples: env.cfg.train_off_policy_samples,
        };
        let pending = env.log.pending_groups(&name)?;
        let plan = groups::form(
            pending,
            cur.version,
            self.lineage.first_version,
            now_secs(),
            &rules,
            self.cfg.loss,
        );
        for (reason, members) in &plan.dropped {
            env.log.drop_members(members, reason.as_str())?;
            let n = members.len() as u64;
            env.metrics
                .train_groups_dropped
                .with_label_values(&[&name, reason.as_str()])
                .inc_by(n);
            *self
                .status
                .dropped
                .entry(reason.as_str().to_string())
                .or_default() += n;
        }
        let num_pending = plan.waiting + plan.ready.len();
        self.status.pending_groups = num_pending;
        env.metrics
            .train_pending_groups
            .with_label_values(&[&name])
            .set(num_pending as i64);
        let batch = self.batch(&plan.ready, env.cfg.max_step_tokens);
        if batch.is_empty() {
            return Ok(None);
        }
        let samples: Vec<Sample> = batch
            .iter()
            .flat_map(|g| {
                g.members.iter().map(|m| Sample {
                    prompt: m.prompt.clone(),
                    completion: m.completion.clone(),
                    reward: m.reward.unwrap_or(0.0) as f32,
                    group: g.group_id.clone(),
                    behavior: Some(m.logprobs.clone()),
                    sampled_by_current: m.version == cur.version,
                    episode: m.episode.clone(),
                    forced: m.forced.clone(),
                })
            })
            .collect();
        let loss = self.loss_config(&samples, batch.len())?;
        let t = batch[0].members[0].temperature;
        let temperature = if is_greedy(t) { 1.0 } else { t };
        let groups = grouped(&samples, self.cfg.loss);
        let refs: Vec<_> = groups.iter().collect();
        // The step works on a copy: the learner's optimizer changes only once all is durable.
        let mut opt = self.opt.clone();
        opt.config.lr = self.cfg.lr;
        // The step's own work between its kernels counts as background work too: the grant
        // serving's steps give training is not lost to those gaps (kernels' `gate`).
        let work = env.cpu.pool.gate.background_work();
        let (next, stats) = step(
            &env.model,
            &env.cpu,
            &cur.weights,
            &mut opt,
            &loss,
            &refs,
            temperature,
            env.cfg.activation_mb << 20,
            env.cfg.max_step_tokens,
        )
        .map_err(|e| TrainError::new(ErrorKind::Step, e))?;
        drop(work);
        let version = cur.version + 1;
        let mut rel = checkpoint_rel(&name, version);
        if env.adapters.is_some() {
            // In object storage a name is written once: a version number retried after a
            // failed commit gets a folder of its own.
            rel = format!("{rel}-{:016x}", crate::util::random_u64());
        }
        write_checkpoint(
            &env.cfg.data_dir,
            &rel,
            (version, self.lineage.id),
            &next,
            &opt,
        )
        .map_err(|e| TrainError::new(ErrorKind::Checkpoint, e))?;
        if let Some(store) = &env.adapters {
            // Uploaded (manifest last) before the version's row is committed: a replica that
            // hears of it finds it complete.
            let t0 = std::time::Instant::now();
            let dir = env.cfg.data_dir.join(&rel);
            if let Err(e) = store.upload(&dir, &rel) {
                let _ = remove_dir(&dir);
                return Err(TrainError::new(ErrorKind::Checkpoint, format!("{e:#}")));
            }
            env.metrics
                .adapter_store_seconds
                .with_label_values(&["upload"])
                .observe(t0.elapsed().as_secs_f64());
        }
        let staleness_max = batch
            .iter()
            .flat_map(|g| g.members.iter().map(|m| cur.version - m.version))
            .max()
            .unwrap_or(0);
        let report = StepReport {
            stats,
            version,
            groups: batch.len(),
            staleness_max,
        };
        let consumed: Vec<(String, u32)> = batch
            .iter()
            .flat_map(|g| g.members.iter().map(|m| (m.id.clone(), m.choice)))
            .collect();
        let cp = Checkpoint {
            version,
            step: opt.step,
            path: rel,
        };
        let stats_json = serde_json::to_string(&report).unwrap_or_default();
        env.log
            .commit_step(&name, self.lineage.id, &cp, &stats_json, &consumed)?;
        // Durable: the step is taken, whatever happens next.
        self.opt = opt;
        // Fails only when the adapter was deleted meanwhile (its lineage has ended).
        let (v, _) = env
            .registry
            .publish_as(&name, next, Publisher::Owner(self.lineage.id))
            .map_err(|e| TrainError::new(ErrorKind::Publish, e))?;
        if v.version != version {
            tracing::warn!(adapter = %name, expected = version, got = v.version, "another publisher numbered this adapter's versions");
        }
        self.record(env, &report, &batch, cur.version);
        self.retire(env);
        tracing::info!(adapter = %name, step = cp.step, version = v.version, loss = report.stats.loss, "trained");
        Ok(Some(report))
    }

    /// Up to `groups_per_step` ready groups of the first one's temperature, within the token
    /// budget (the first always).
    fn batch<'a>(&self, ready: &'a [PendingGroup], max_tokens: usize) -> Vec<&'a PendingGroup> {
        let Some(t) = ready.first().map(|g| g.members[0].temperature) else {
            return Vec::new();
        };
        let mut batch: Vec<&PendingGroup> = Vec::new();
        let mut tokens = 0;
        for g in ready {
            let n: usize = g
                .members
                .iter()
                .map(|m| m.prompt.len() + m.completion.len())
                .sum();
            let same_t = g.members.iter().all(|m| m.temperature == t);
            if same_t && (batch.is_empty() || tokens + n <= max_tokens) {
                batch.push(g);
                tokens += n;
            }
            if batch.len() == self.cfg.groups_per_step {
                break;
            }
        }
        batch
    }

    fn loss_config(&self, samples: &[Sample], num_groups: usize) -> Result<LossConfig, TrainError> {
        let c = &self.cfg;
        let max_len = samples
            .iter()
            .map(|s| s.completion.len())
            .max()
            .unwrap_or(1);
        let group_size = samples.len() / num_groups.max(1);
        let mut loss = LossConfig::named(c.loss, max_len, group_size);
        loss.kl_coef = c.kl_coef;
        if let Objective::Clipped { eps_low, eps_high } = &mut loss.objective {
            *eps_low = c.clip_low.unwrap_or(*eps_low);
            *eps_high = c.clip_high.unwrap_or(*eps_high);
        }
        Ok(loss)
    }

    fn record(&mut self, env: &Env, r: &StepReport, batch: &[&PendingGroup], cur: u64) {
        let name = self.cfg.name.as_str();
        let m = &env.metrics;
        let s = &r.stats;
        m.train_steps.with_label_values(&[name]).inc();
        m.train_step_seconds
            .with_label_values(&[name])
            .observe(s.seconds);
        m.train_tokens
            .with_label_values(&[name])
            .inc_by(s.tokens as u64);
        show_step(env, name, r);
        let mut trained = 0;
        for g in batch {
            for mem in &g.members {
                m.train_staleness
                    .with_label_values(&[name])
                    .observe((cur - mem.version) as f64);
                trained += 1;
            }
        }
        m.train_samples_trained
            .with_label_values(&[name])
            .inc_by(trained);
        let st = &mut self.status;
        st.trained += trained;
        st.version = r.version;
        st.steps = s.step;
        st.last = Some(r.clone());
    }

    /// Remove checkpoints no longer needed (the newest two of the lineage stay).
    fn retire(&self, env: &Env) {
        let mut retired = std::collections::BTreeSet::new();
        match env.log.retire_checkpoints(&self.cfg.name, 2) {
            Ok(paths) => {
                retired.extend(paths.iter().cloned());
                for p in paths {
                    let dir: PathBuf = env.cfg.data_dir.join(&p);
                    if let Err(e) = remove_dir(&dir) {
                        tracing::warn!(path = %dir.display(), error = %e, "cannot remove an old checkpoint");
                    }
                }
            }
            Err(e) => {
                tracing::warn!(adapter = %self.cfg.name, error = %e, "checkpoint retention failed")
            }
        }
        // In the adapter store: the retired versions, and uploads no row ever named.
        if env.adapters.is_some() {
            self.sweep_orphans(env, &retired);
        }
    }

    /// Replace the settings (the adapter's shape stays: method, block size, rank).
    pub fn configure(&mut self, cfg: LearnConfig) -> Result<(), String> {
        let c = &self.cfg;
        let shape = |c: &LearnConfig| (c.method, c.oft_block_size, c.lora_r);
        if shape(c) != shape(&cfg) {
            return Err(format!(
                "'{}' learns with {} (oft_block_size {}, lora_r {}): a learning adapter's shape \
                 cannot change; DELETE it and train it again to start a new lineage",
                c.name, c.method, c.oft_block_size, c.lora_r
            ));
        }
        self.status.config = cfg.clone();
        self.cfg = cfg;
        Ok(())
    }
}

#[path = "learner_status.rs"]
mod status;
pub use status::{ErrorKind, State, Status, StepReport, TrainError};

#[path = "learner_follow.rs"]
mod follow;
#[path = "learner_store.rs"]
mod store_copies;
