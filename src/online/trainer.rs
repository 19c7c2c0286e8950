//! The in-process trainer: one thread beside the engine. It picks rewarded groups of each
//! learning adapter from the rollout log, drops what must not be trained on (stale, sampled off
//! the policy's distribution, no reward variance), runs one GRPO-family step (the training
//! issue's forward/backward/AdamW on the same quantized base and compute pool), checkpoints
//! adapter + optimizer atomically, records the checkpoint and the consumed groups in one SQLite
//! transaction, and only then publishes the step as the adapter's next version.
//!
//! Sharing the two cores: the trainer calls the same `Cpu` as the engine; the pool runs one
//! kernel at a time, so serving and training interleave kernel by kernel (no call holds the pool
//! for more than one kernel's time).

use super::config::{LearnConfig, OnlineConfig};
use super::log::{now_secs, Checkpoint, Member, PendingGroup, RolloutLog};
use crate::adapter::registry::Registry;
use crate::adapter::{peft, AdapterConfig, AdapterLayout, AdapterWeights, LoraConfig, Method};
use crate::adapter::{OftConfig, Target};
use crate::engine::sampler::is_greedy;
use crate::metrics::Metrics;
use crate::model::llama::Llama;
use crate::train::loss::{LossConfig, Objective};
use crate::train::offline::{grouped, step, Sample};
use crate::train::optim::{AdamW, AdamWConfig};
use flywheel_kernels::Cpu;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// What `GET /v1/train/status` shows of a learning adapter.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Status {
    pub version: u64,
    pub steps: u64,
    pub paused: bool,
    pub pending_groups: usize,
    pub dropped: BTreeMap<String, u64>,
    pub last: Option<Value>,
    pub config: Option<LearnConfig>,
}

struct Learner {
    cfg: LearnConfig,
    status: Status,
}

/// The learning side of the server, shared by the HTTP handlers and the trainer thread.
pub struct Online {
    pub cfg: OnlineConfig,
    pub log: Arc<RolloutLog>,
    learners: Mutex<BTreeMap<String, Learner>>,
    /// Each learner's optimizer state, used by the trainer thread (one step at a time).
    optimizers: Mutex<BTreeMap<String, AdamW>>,
    wake: (Mutex<bool>, Condvar),
    metrics: Arc<Metrics>,
    compute: Compute,
}

/// Everything the trainer thread computes with.
pub struct Compute {
    pub model: Arc<Llama>,
    pub cpu: Arc<Cpu>,
    pub registry: Arc<Registry>,
}

fn layout_for(cfg: &LearnConfig, model: &Llama) -> anyhow::Result<Arc<AdapterLayout>> {
    let method = match cfg.method.as_str() {
        "lora" => Method::Lora(LoraConfig {
            r: cfg.lora_r,
            alpha: 2.0 * cfg.lora_r as f32,
            use_rslora: false,
        }),
        _ => Method::Oft(OftConfig {
            block_size: cfg.oft_block_size,
            ..OftConfig::default()
        }),
    };
    let c = AdapterConfig {
        method,
        targets: Target::ALL.to_vec(),
        base_model: String::new(),
    };
    Ok(Arc::new(AdapterLayout::new(c, &model.config)?))
}

fn adamw(cfg: &LearnConfig) -> AdamWConfig {
    AdamWConfig {
        lr: cfg.lr,
        ..AdamWConfig::default()
    }
}

impl Online {
    /// Open the rollout log, publish each learning adapter (its last checkpoint, or the
    /// identity), and start the trainer thread.
    pub fn start(
        cfg: OnlineConfig,
        learn: &[LearnConfig],
        compute: Compute,
        metrics: Arc<Metrics>,
    ) -> anyhow::Result<Arc<Online>> {
        let log = Arc::new(RolloutLog::open(&cfg.data_dir.join("flywheel.db"))?);
        let online = Arc::new(Online {
            cfg,
            log,
            learners: Mutex::new(BTreeMap::new()),
            optimizers: Mutex::new(BTreeMap::new()),
            wake: (Mutex::new(false), Condvar::new()),
            metrics,
            compute,
        });
        for l in learn {
            online.add_learner(l.clone())?;
        }
        let o = online.clone();
        std::thread::Builder::new()
            .name("flywheel-trainer".into())
            .spawn(move || o.run())?;
        Ok(online)
    }

    /// Make `cfg.name` a learning adapter: resume its checkpoint or publish the identity
    /// (an adapter already serving under that name is replaced by it).
    pub fn add_learner(&self, cfg: LearnConfig) -> anyhow::Result<()> {
        let c = &self.compute;
        let name = cfg.name.clone();
        anyhow::ensure!(!self.is_learning(&name), "'{name}' is already learning");
        let (opt, version, steps) = match self.log.latest_checkpoint(&name)? {
            Some(cp) => {
                let dir = PathBuf::from(&cp.path);
                let w = peft::load(&dir, &c.model.config)?;
                let opt = AdamW::load(&dir)?;
                c.registry.publish_from(&name, w, cp.version)?;
                tracing::info!(adapter = %name, step = cp.step, version = cp.version, "learning adapter resumed");
                (opt, cp.version, cp.step)
            }
            None => {
                let layout = layout_for(&cfg, &c.model)?;
                let n = layout.num_params;
                let (v, _) = c
                    .registry
                    .publish(&name, AdapterWeights::identity(layout, 0))?;
                tracing::info!(adapter = %name, method = %cfg.method, "learning adapter created");
                (AdamW::new(adamw(&cfg), n), v.version, 0)
            }
        };
        let status = Status {
            version,
            steps,
            config: Some(cfg.clone()),
            ..Status::default()
        };
        self.optimizers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.clone(), opt);
        self.lock().insert(name, Learner { cfg, status });
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Learner>> {
        self.learners.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    pub fn is_learning(&self, name: &str) -> bool {
        self.lock().contains_key(name)
    }

    pub fn status(&self) -> BTreeMap<String, Status> {
        self.lock()
            .iter()
            .map(|(k, l)| (k.clone(), l.status.clone()))
            .collect()
    }

    /// Pause or resume training of `name` (false: not a learning adapter).
    pub fn set_paused(&self, name: &str, paused: bool) -> bool {
        let mut g = self.lock();
        let Some(l) = g.get_mut(name) else {
            return false;
        };
        l.status.paused = paused;
        drop(g);
        self.notify();
        true
    }

    /// Replace the settings of `name` (its method must stay); false: not a learning adapter.
    pub fn update_config(&self, cfg: LearnConfig) -> Result<bool, String> {
        let mut g = self.lock();
        let Some(l) = g.get_mut(&cfg.name) else {
            return Ok(false);
        };
        if l.cfg.method != cfg.method {
            return Err(format!(
                "'{}' learns with {}; its method cannot change",
                cfg.name, l.cfg.method
            ));
        }
        l.status.config = Some(cfg.clone());
        l.cfg = cfg;
        Ok(true)
    }

    /// Wake the trainer (a reward arrived).
    pub fn notify(&self) {
        let (m, c) = &self.wake;
        *m.lock().unwrap_or_else(|e| e.into_inner()) = true;
        c.notify_one();
    }

    fn run(self: Arc<Self>) {
        // Serving first: this thread's kernels yield to engine steps (see kernels' `gate`).
        flywheel_kernels::cpu::set_background(true);
        self.compute.cpu.pool.gate.set_share(self.cfg.train_share);
        let mut last_prune = 0.0;
        loop {
            {
                let (m, cv) = &self.wake;
                let g = m.lock().unwrap_or_else(|e| e.into_inner());
                let (mut g, _) = cv
                    .wait_timeout_while(g, Duration::from_millis(500), |woken| !*woken)
                    .unwrap_or_else(|e| e.into_inner());
                *g = false;
            }
            let names: Vec<(String, LearnConfig, bool)> = self
                .lock()
                .iter()
                .map(|(k, l)| (k.clone(), l.cfg.clone(), l.status.paused))
                .collect();
            for (name, cfg, paused) in names {
                if paused {
                    continue;
                }
                let mut opts = self.optimizers.lock().unwrap_or_else(|e| e.into_inner());
                let Some(opt) = opts.get_mut(&name) else {
                    continue;
                };
                // Keep stepping while whole steps are ready (a reward burst).
                for _ in 0..16 {
                    match self.try_step(&self.compute, &cfg, opt) {
                        Ok(true) => {}
                        Ok(false) => break,
                        Err(e) => {
                            tracing::error!(adapter = %name, error = %e, "training step failed");
                            self.metrics.train_errors.with_label_values(&[&name]).inc();
                            std::thread::sleep(Duration::from_secs(1));
                            break;
                        }
                    }
                }
            }
            let now = now_secs();
            if now - last_prune > 600.0 {
                last_prune = now;
                let max_age = self.cfg.retention_days * 86400.0;
                if let Err(e) = self.log.prune(max_age, self.cfg.retention_max_rows) {
                    tracing::warn!(error = %e, "rollout log retention failed");
                }
            }
        }
    }

    /// Sort pending groups into ready ones and drops; drop what must not train. Returns the
    /// ready groups (oldest first) and how many are still waiting.
    fn classify(
        &self,
        name: &str,
        current: u64,
        pending: Vec<PendingGroup>,
    ) -> anyhow::Result<(Vec<PendingGroup>, usize)> {
        let now = now_secs();
        let mut drops: BTreeMap<&'static str, Vec<(String, u32)>> = BTreeMap::new();
        let mut ready = Vec::new();
        let mut waiting = 0;
        let key = |m: &Member| (m.id.clone(), m.choice);
        for mut g in pending {
            if !self.cfg.train_off_policy_samples {
                let (ok, off): (Vec<Member>, Vec<Member>) =
                    g.members.into_iter().partition(|m| m.policy_sampled);
                drops
                    .entry("off_policy_sample")
                    .or_default()
                    .extend(off.iter().map(key));
                g.members = ok;
            }
            if g.members.is_empty() {
                continue;
            }
            let stale = g
                .members
                .iter()
                .any(|m| current.saturating_sub(m.version) > self.cfg.max_off_policy_steps);
            if stale {
                drops
                    .entry("stale")
                    .or_default()
                    .extend(g.members.iter().map(key));
                continue;
            }
            let rewarded: Vec<&Member> = g.members.iter().filter(|m| m.reward.is_some()).collect();
            let all = rewarded.len() == g.members.len();
            let oldest = rewarded
                .iter()
                .filter_map(|m| m.rewarded_at)
                .fold(f64::INFINITY, f64::min);
            let timed_out = rewarded.len() >= 2 && now - oldest > self.cfg.group_timeout_secs;
            // A request's choices are logged together: rewarded all, the group is whole.
            let whole = all && g.group_size > 0;
            if !(whole || timed_out) {
                waiting += 1;
                continue;
            }
            let (keep, late): (Vec<Member>, Vec<Member>) =
                g.members.into_iter().partition(|m| m.reward.is_some());
            drops
                .entry("timeout")
                .or_default()
                .extend(late.iter().map(key));
            g.members = keep;
            let first = g.members[0].reward;
            if g.members.len() < 2 {
                drops
                    .entry("single")
                    .or_default()
                    .extend(g.members.iter().map(key));
            } else if g.members.iter().all(|m| m.reward == first) {
                drops
                    .entry("no_variance")
                    .or_default()
                    .extend(g.members.iter().map(key));
            } else {
                ready.push(g);
            }
        }
        let mut g = self.lock();
        for (reason, members) in &drops {
            if members.is_empty() {
                continue;
            }
            self.log.drop_members(members, reason)?;
            self.metrics
                .train_groups_dropped
                .with_label_values(&[name, reason])
                .inc_by(members.len() as u64);
            if let Some(l) = g.get_mut(name) {
                *l.status.dropped.entry(reason.to_string()).or_default() += members.len() as u64;
            }
        }
        Ok((ready, waiting))
    }

    /// One step of `cfg.name` if a batch is ready; Ok(false) when nothing was ready.
    fn try_step(&self, c: &Compute, cfg: &LearnConfig, opt: &mut AdamW) -> anyhow::Result<bool> {
        let name = cfg.name.as_str();
        let slot = c
            .registry
            .get(name)
            .ok_or_else(|| anyhow::anyhow!("the adapter '{name}' is gone"))?;
        let cur = slot.current();
        let pending = self.log.pending_groups(name)?;
        let (ready, waiting) = self.classify(name, cur.version, pending)?;
        {
            let mut g = self.lock();
            if let Some(l) = g.get_mut(name) {
                l.status.pending_groups = waiting + ready.len();
            }
        }
        self.metrics
            .train_pending_groups
            .with_label_values(&[name])
            .set((waiting + ready.len()) as i64);
        let Some(t) = ready.first().map(|g| g.members[0].temperature) else {
            return Ok(false);
        };
        // Up to groups_per_step groups of one temperature within the token budget.
        let mut batch: Vec<&PendingGroup> = Vec::new();
        let mut tokens = 0;
        for g in &ready {
            let n: usize = g
                .members
                .iter()
                .map(|m| m.prompt.len() + m.completion.len())
                .sum();
            let same_t = g.members.iter().all(|m| m.temperature == t);
            if same_t && (batch.is_empty() || tokens + n <= self.cfg.max_step_tokens) {
                batch.push(g);
                tokens += n;
            }
            if batch.len() == cfg.groups_per_step {
                break;
            }
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
                })
            })
            .collect();
        let groups = grouped(&samples, &cfg.loss);
        let refs: Vec<_> = groups.iter().collect();
        let max_len = samples
            .iter()
            .map(|s| s.completion.len())
            .max()
            .unwrap_or(1);
        let group_size = samples.len() / batch.len().max(1);
        let mut loss = LossConfig::named(&cfg.loss, max_len, group_size)
            .ok_or_else(|| anyhow::anyhow!("unknown loss {}", cfg.loss))?;
        loss.kl_coef = cfg.kl_coef;
        if let Objective::Clipped { eps_low, eps_high } = &mut loss.objective {
            *eps_low = cfg.clip_low.unwrap_or(*eps_low);
            *eps_high = cfg.clip_high.unwrap_or(*eps_high);
        }
        opt.config.lr = cfg.lr;
        let temperature = if is_greedy(t) { 1.0 } else { t };
        let staleness: Vec<u64> = batch
            .iter()
            .flat_map(|g| g.members.iter().map(|m| cur.version - m.version))
            .collect();
        let (next, mut stats) = step(
            &c.model,
            &c.cpu,
            &cur.weights,
            opt,
            &loss,
            &refs,
            temperature,
            self.cfg.activation_mb << 20,
        )?;
        let version = cur.version + 1;
        let step_no = opt.step;
        let dir = self.checkpoint(name, step_no, &next, opt)?;
        let consumed: Vec<(String, u32)> = batch
            .iter()
            .flat_map(|g| g.members.iter().map(|m| (m.id.clone(), m.choice)))
            .collect();
        stats["version"] = json!(version);
        stats["groups"] = json!(batch.len());
        stats["staleness_max"] = json!(staleness.iter().max());
        let rewards: Vec<f64> = samples.iter().map(|s| s.reward as f64).collect();
        let mean = rewards.iter().sum::<f64>() / rewards.len().max(1) as f64;
        let std = (rewards.iter().map(|r| (r - mean).powi(2)).sum::<f64>()
            / rewards.len().max(1) as f64)
            .sqrt();
        stats["reward_std"] = json!(std);
        let cp = Checkpoint {
            step: step_no,
            version,
            path: dir.to_string_lossy().into_owned(),
        };
        self.log
            .commit_step(name, &cp, &stats.to_string(), &consumed)?;
        let (v, _) = c.registry.publish(name, next)?;
        if v.version != version {
            tracing::warn!(
                adapter = name,
                expected = version,
                got = v.version,
                "another publisher numbered this adapter's versions"
            );
        }
        for old in self.log.old_checkpoints(name, 2)? {
            let _ = std::fs::remove_dir_all(&old);
        }
        self.record(name, &stats, &staleness, v.version, step_no);
        tracing::info!(adapter = name, step = step_no, version = v.version, stats = %stats, "trained");
        Ok(true)
    }

    /// Save adapter + optimizer to data_dir/adapters/NAME/step-N, atomically (a temp folder,
    /// fsynced, renamed, the parent fsynced).
    fn checkpoint(
        &self,
        name: &str,
        step_no: u64,
        w: &AdapterWeights,
        opt: &AdamW,
    ) -> anyhow::Result<PathBuf> {
        let parent = self.cfg.data_dir.join("adapters").join(name);
        std::fs::create_dir_all(&parent)?;
        let dir = parent.join(format!("step-{step_no:08}"));
        let tmp = parent.join(format!(".tmp-step-{step_no:08}"));
        for p in [&dir, &tmp] {
            if p.exists() {
                // Left by a crash before its record was committed: never read, replace it.
                std::fs::remove_dir_all(p)?;
            }
        }
        peft::save(w, &tmp)?;
        opt.save(&tmp)?;
        peft::sync_dir(&tmp)?;
        std::fs::rename(&tmp, &dir)?;
        peft::sync_dir(&parent)?;
        Ok(dir)
    }

    fn record(&self, name: &str, stats: &Value, staleness: &[u64], version: u64, steps: u64) {
        let m = &self.metrics;
        let f = |k: &str| stats[k].as_f64().unwrap_or(0.0);
        m.train_steps.with_label_values(&[name]).inc();
        m.train_step_seconds
            .with_label_values(&[name])
            .observe(f("seconds"));
        m.train_tokens
            .with_label_values(&[name])
            .inc_by(f("tokens") as u64);
        m.train_tokens_per_second
            .with_label_values(&[name])
            .set(f("tokens_per_second"));
        for (g, k) in [
            (&m.train_loss, "loss"),
            (&m.train_reward_mean, "reward_mean"),
            (&m.train_reward_std, "reward_std"),
            (&m.train_kl, "kl"),
            (&m.train_clip_fraction, "clip_fraction"),
            (&m.train_masked_fraction, "masked_fraction"),
            (&m.train_grad_norm, "grad_norm"),
        ] {
            g.with_label_values(&[name]).set(f(k));
        }
        if let Some(d) = stats["logprob_diff_max"].as_f64() {
            m.train_logprob_diff.with_label_values(&[name]).set(d);
        }
        for s in staleness {
            m.train_staleness
                .with_label_values(&[name])
                .observe(*s as f64);
        }
        let mut g = self.lock();
        if let Some(l) = g.get_mut(name) {
            l.status.version = version;
            l.status.steps = steps;
            l.status.last = Some(stats.clone());
        }
    }
}
