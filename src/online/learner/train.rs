//! A learning adapter in a process that trains (`--role train` or `all`): `resume::start`
//! resumes the newest intact checkpoint of its lineage (or begins a lineage with the identity)
//! under the adapter's claim; each turn, `step` takes one GRPO-family step if a batch is ready — a plan
//! (`plan`: groups formed and drops recorded, the batch, its samples and loss), the step computed
//! on a copy of the optimizer (`compute`), the candidate judged (`promote`: evaluated, gated,
//! held, or a canary), then an ordered commit, each a function: `write` the checkpoint →
//! `upload` it → `commit` it with its consumed groups → serve it (or hold it, or begin its
//! canary) → `retire` old ones. Until the commit, the learner is as before, whatever fails.

use super::copies::sweep_orphans;
use super::{reconfigure, show_step, Env, ErrorKind, Member, Status, StepReport, TrainError};
use crate::adapter::registry::AdapterVersion;
use crate::adapter::AdapterWeights;
use crate::online::checkpoint::{checkpoint_rel, remove_dir, write_checkpoint};
use crate::online::config::LearnConfig;
use crate::online::eval::EvalScore;
use crate::online::groups::{self, Rules};
use crate::online::guard::StepPoint;
use crate::online::store::records::{Checkpoint, Lineage};
use crate::online::store::records::{PendingGroup, VersionSpan};
use crate::policy::is_greedy;
use crate::train::distill::Teacher;
use crate::train::loss::{LossConfig, Objective};
use crate::train::offline::{grouped, step, Sample, StepStats};
use crate::train::optim::{AdamW, AdamWConfig};
use crate::util::now_secs;
use std::path::PathBuf;
use std::sync::Arc;

pub(super) struct Learner {
    pub(super) cfg: LearnConfig,
    pub(super) lineage: Lineage,
    pub(super) opt: AdamW,
    pub(super) status: Status,
    /// What the guards judge (`online::guard`): the steps since the start or the last rollback,
    /// and the version serving before the first of them.
    pub(super) guarded: (Vec<StepPoint>, u64),
    /// Versions rolled back (inclusive ranges, from the store's decisions): their samples are
    /// not trained on.
    pub(super) rolled_back: Vec<(u64, u64)>,
    /// The held candidate training goes on from (not served), if any.
    pub(super) trainee: Option<Arc<AdapterVersion>>,
    /// The checkpoint of the weights serving (its version number; they may serve under a newer
    /// number after a restart).
    pub(super) served_checkpoint: u64,
    /// The version serving is pinned to.
    pub(super) pinned: Option<u64>,
    /// Evaluation scores by version (the newest `promote::SCORES_KEPT`).
    pub(super) scores: std::collections::BTreeMap<u64, EvalScore>,
    /// The canary running, if one is (training waits for it).
    pub(super) canary: Option<CanaryRun>,
}

/// What becomes of a candidate.
pub(super) enum Outcome {
    Publish {
        /// A gated promotion's evidence (recorded as a decision).
        evidence: Option<serde_json::Value>,
    },
    /// Held: `reason` "eval" (the gate) or "pinned" (serving is pinned).
    Hold {
        reason: &'static str,
        evidence: serde_json::Value,
    },
    /// Served to a fraction of requests first (`learner::canary`).
    Canary,
}

/// A canary running.
pub(super) struct CanaryRun {
    pub cand: Arc<AdapterVersion>,
    /// The version serving the rest.
    pub incumbent: u64,
    /// Unix seconds it began (at this start, after a restart).
    pub started: f64,
    /// The step that made the candidate (None after a restart).
    pub report: Option<StepReport>,
}

/// A fresh optimizer for `num_params` parameters.
pub(super) fn adamw(cfg: &LearnConfig, num_params: usize) -> AdamW {
    let c = AdamWConfig {
        lr: cfg.lr,
        ..AdamWConfig::default()
    };
    AdamW::new(c, num_params)
}

/// A step's plan: the batch of ready groups, its samples, loss and temperature.
struct Plan {
    batch: Vec<PendingGroup>,
    samples: Vec<Sample>,
    loss: LossConfig,
    temperature: f32,
}

impl Learner {
    /// Form groups (recording drops), and take one step if a batch is ready: Ok(None) when none
    /// was. On any error, optimizer and adapter are as before. The step trains from the held
    /// candidate if there is one, else from what serves; its version is a candidate that
    /// serves, or is held, as promotion decides (`promote`).
    fn step(&mut self, env: &Env) -> Result<Option<StepReport>, TrainError> {
        let name = self.cfg.name.clone();
        env.log.claim_trainer(&name)?;
        let slot = env.registry.get(&name).ok_or_else(|| {
            TrainError::new(ErrorKind::Publish, format!("the adapter '{name}' is gone"))
        })?;
        if self.canary.is_some() {
            self.watch_canary(env)?;
            if self.canary.is_some() {
                return Ok(None);
            }
        }
        let cur = slot.current();
        let from = self.trainee.clone().unwrap_or_else(|| cur.clone());
        let mut pending = env.log.pending_groups(&name)?;
        if let Some(r) = self.cfg.repetition_reward {
            groups::shape_repetition(&mut pending, r);
        }
        let Some(plan) = self.plan(env, pending, cur.version, from.version)? else {
            return Ok(None);
        };
        // The step works on a copy: the learner's optimizer changes only once all is durable.
        let (next, opt, stats) = self.compute(env, &from.weights, &plan)?;
        // Above every number the name had (a rollback serves an older one; held candidates
        // took theirs).
        let version = cur
            .version
            .max(from.version)
            .max(env.registry.last_version(&name))
            + 1;
        let cand = env
            .registry
            .candidate(&name, version, Some(cur.version), next)
            .map_err(|e| TrainError::new(ErrorKind::Publish, e))?;
        let (outcome, eval) = self.judge_candidate(env, &cur, &cand)?;
        let mut report = StepReport {
            stats,
            version,
            groups: plan.batch.len(),
            staleness_max: plan
                .batch
                .iter()
                .flat_map(|g| {
                    g.members
                        .iter()
                        .map(|m| cur.version.saturating_sub(m.version))
                })
                .max()
                .unwrap_or(0),
            staleness_token_mean: token_staleness(&plan.batch, cur.version),
            eval,
            held: matches!(outcome, Outcome::Hold { .. }),
        };
        match &outcome {
            Outcome::Hold { reason, evidence } if !self.keeps_held() => {
                debug_assert_eq!(*reason, "eval");
                self.drop_held(env, &plan.batch, version, cur.version, evidence)?;
                return Ok(Some(report));
            }
            // Recorded before the commit: a restart never takes a held checkpoint for a served one.
            Outcome::Hold {
                reason: "eval",
                evidence,
            } => {
                self.decide(env, "hold", "eval", (version, cur.version), evidence)?;
                env.registry.note_version(&name, version);
            }
            Outcome::Canary => {
                let c = &self.cfg.promotion.canary;
                let evidence = serde_json::json!({"fraction": c.fraction, "window": c.window});
                self.decide(env, "canary", "start", (version, cur.version), &evidence)?;
                env.registry.note_version(&name, version);
            }
            _ => {}
        }
        let rel = self.write(env, version, &cand.weights, &opt)?;
        upload(env, &rel)?;
        let cp = Checkpoint {
            version,
            step: opt.step,
            path: rel,
        };
        self.commit(env, &cp, &report, &plan.batch)?;
        // Durable: the step is taken, whatever happens next; its number with it.
        env.registry.note_version(&name, version);
        self.opt = opt;
        let published = match outcome {
            Outcome::Publish { evidence } => {
                env.registry
                    .serve(cand, self.lineage.id)
                    .map_err(|e| TrainError::new(ErrorKind::Publish, e))?;
                self.trainee = None;
                self.served_checkpoint = version;
                if let Some(e) = evidence {
                    self.decide(env, "promote", "eval", (version, cur.version), &e)?;
                }
                true
            }
            Outcome::Hold { .. } => {
                self.trainee = Some(cand);
                false
            }
            Outcome::Canary => {
                self.trainee = None;
                self.begin_canary(env, cand, Some(report.clone()))?;
                false
            }
        };
        self.status.held_version = self.trainee.as_ref().map(|t| t.version);
        report.held = !published;
        self.record(env, &report, &plan.batch, cur.version, published);
        self.retire(env);
        tracing::info!(adapter = %name, step = cp.step, version, loss = report.stats.loss, published, "trained");
        if published {
            self.guard(env, &report)?;
        }
        Ok(Some(report))
    }

    /// The groups formed from `pending` (drops recorded in the store, the metrics and the
    /// status), and the step to take if a batch is ready.
    /// (`current`: the version serving; `trains`: the version the step starts from.)
    fn plan(
        &mut self,
        env: &Env,
        pending: Vec<PendingGroup>,
        current: u64,
        trains: u64,
    ) -> Result<Option<Plan>, TrainError> {
        let name = self.cfg.name.as_str();
        let rules = Rules {
            max_off_policy_steps: env.cfg.max_off_policy_steps,
            group_timeout_secs: env.cfg.group_timeout_secs,
            // A correction weighs what was not drawn from the policy instead of dropping it.
            train_off_policy_samples: env.cfg.train_off_policy_samples
                || self.cfg.correction.is_some(),
            rolled_back: self.rolled_back.clone(),
        };
        let formed = groups::form(
            pending,
            current,
            self.lineage.first_version,
            now_secs(),
            &rules,
            self.cfg.loss,
        );
        for (reason, members) in &formed.dropped {
            env.log.drop_members(members, reason.as_str())?;
            let n = members.len() as u64;
            env.metrics
                .train_groups_dropped
                .with_label_values(&[name, reason.as_str()])
                .inc_by(n);
            *self
                .status
                .dropped
                .entry(reason.as_str().to_string())
                .or_default() += n;
        }
        let num_pending = formed.waiting + formed.ready.len();
        self.status.pending_groups = num_pending;
        env.metrics
            .train_pending_groups
            .with_label_values(&[name])
            .set(num_pending as i64);
        let batch = self.batch(formed.ready, env.cfg.max_step_tokens);
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
                    sampling: (!m.sampling.is_empty()).then(|| m.sampling.clone()),
                    sampled_by_current: VersionSpan::positions_of(
                        m.version,
                        &m.switches,
                        m.completion.len(),
                        trains,
                    ),
                    episode: m.episode.clone(),
                    forced: m.forced.clone(),
                })
            })
            .collect();
        let loss = self.loss_config(&samples, batch.len());
        let t = batch[0].members[0].temperature;
        Ok(Some(Plan {
            batch,
            samples,
            loss,
            temperature: if is_greedy(t) { 1.0 } else { t },
        }))
    }

    /// The step of `plan` from `weights`, on a copy of the optimizer: the next weights, the
    /// optimizer after the step, and the step's statistics.
    fn compute(
        &self,
        env: &Env,
        weights: &AdapterWeights,
        plan: &Plan,
    ) -> Result<(AdapterWeights, AdamW, StepStats), TrainError> {
        let groups = grouped(&plan.samples, self.cfg.loss);
        let refs: Vec<_> = groups.iter().collect();
        let mut opt = self.opt.clone();
        opt.config.lr = self.cfg.lr;
        // The step's own work between its kernels counts as background work too: the grant
        // serving's steps give training is not lost to those gaps (kernels' `gate`).
        let _work = env.cpu.pool.gate.background_work();
        let teacher = match &self.cfg.teacher_prompt {
            Some(p) => Some(Teacher {
                prefix: env.tokenizer.encode_with(p, false).map_err(|e| {
                    TrainError::new(ErrorKind::Step, format!("teacher_prompt: {e}"))
                })?,
                weight: self.cfg.distill_weight.unwrap_or(1.0),
            }),
            None => None,
        };
        let (next, stats) = step(
            &env.model,
            &env.cpu,
            env.scorer.get().map(|s| s.as_ref()),
            weights,
            &mut opt,
            &plan.loss,
            &refs,
            plan.temperature,
            env.cfg.activation_mb << 20,
            env.cfg.max_step_tokens,
            teacher.as_ref(),
        )
        .map_err(|e| TrainError::new(ErrorKind::Step, e))?;
        Ok((next, opt, stats))
    }

    /// Write version `version`'s checkpoint in the data directory; its folder (relative).
    fn write(
        &self,
        env: &Env,
        version: u64,
        next: &AdapterWeights,
        opt: &AdamW,
    ) -> Result<String, TrainError> {
        let mut rel = checkpoint_rel(&self.cfg.name, version);
        if env.adapters.is_some() {
            // In object storage a name is written once: a version number retried after a
            // failed commit gets a folder of its own.
            rel = format!("{rel}-{:016x}", crate::util::random_u64());
        }
        let at = (version, self.lineage.id);
        write_checkpoint(&env.cfg.data_dir, &rel, at, next, opt, true)
            .map_err(|e| TrainError::new(ErrorKind::Checkpoint, e))?;
        Ok(rel)
    }

    /// Commit the checkpoint `cp`, its report and the groups `batch` consumed, in one transaction.
    fn commit(
        &self,
        env: &Env,
        cp: &Checkpoint,
        report: &StepReport,
        batch: &[PendingGroup],
    ) -> Result<(), TrainError> {
        let consumed: Vec<(String, u32)> = batch
            .iter()
            .flat_map(|g| g.members.iter().map(|m| (m.id.clone(), m.choice)))
            .collect();
        let stats_json = serde_json::to_string(report).unwrap_or_default();
        let name = &self.cfg.name;
        env.log
            .commit_step(name, self.lineage.id, cp, &stats_json, &consumed)?;
        Ok(())
    }

    /// Up to `groups_per_step` ready groups of the first one's temperature, within the token
    /// budget (the first always).
    fn batch(&self, ready: Vec<PendingGroup>, max_tokens: usize) -> Vec<PendingGroup> {
        let Some(t) = ready.first().map(|g| g.members[0].temperature) else {
            return Vec::new();
        };
        let mut batch: Vec<PendingGroup> = Vec::new();
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

    fn loss_config(&self, samples: &[Sample], num_groups: usize) -> LossConfig {
        let c = &self.cfg;
        let max_len = samples
            .iter()
            .map(|s| s.completion.len())
            .max()
            .unwrap_or(1);
        let group_size = samples.len() / num_groups.max(1);
        let mut loss = LossConfig::named(c.loss, max_len, group_size);
        loss.kl_coef = c.kl_coef;
        loss.correction = c.correction;
        if let Objective::Clipped { eps_low, eps_high } = &mut loss.objective {
            *eps_low = c.clip_low.unwrap_or(*eps_low);
            *eps_high = c.clip_high.unwrap_or(*eps_high);
        }
        loss
    }

    fn record(
        &mut self,
        env: &Env,
        r: &StepReport,
        batch: &[PendingGroup],
        cur: u64,
        published: bool,
    ) {
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
                    .observe(cur.saturating_sub(mem.version) as f64);
                trained += 1;
            }
        }
        m.train_samples_trained
            .with_label_values(&[name])
            .inc_by(trained);
        let st = &mut self.status;
        st.trained += trained;
        if published {
            st.version = r.version;
        }
        st.steps = s.step;
        st.last = Some(r.clone());
    }

    /// Remove checkpoints no longer needed (the newest two of the lineage stay, and as many as
    /// the reward guard may roll back across: its window and two more; and every one from the
    /// served version's up, while training goes on from a held one).
    fn retire(&self, env: &Env) {
        let mut retired = std::collections::BTreeSet::new();
        let mut keep = (self.cfg.guards.window + 2).max(2);
        if self.trainee.is_some() || self.pinned.is_some() {
            let floor = self.served_checkpoint;
            match env.log.checkpoints(self.lineage.id) {
                Ok(cps) => keep = keep.max(cps.iter().filter(|c| c.version >= floor).count()),
                Err(e) => {
                    tracing::warn!(adapter = %self.cfg.name, error = %e, "checkpoint retention skipped");
                    return;
                }
            }
        }
        match env.log.retire_checkpoints(&self.cfg.name, keep) {
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
            sweep_orphans(env, &self.cfg.name, self.lineage.id, &retired);
        }
    }
}

/// Upload the checkpoint folder `rel` to the adapter store, if there is one (manifest last),
/// before its version's row is committed: a replica that hears of it finds it complete. A failed
/// upload removes the local folder.
fn upload(env: &Env, rel: &str) -> Result<(), TrainError> {
    let Some(store) = &env.adapters else {
        return Ok(());
    };
    let t0 = std::time::Instant::now();
    let dir = env.cfg.data_dir.join(rel);
    if let Err(e) = store.upload(&dir, rel) {
        let _ = remove_dir(&dir);
        return Err(TrainError::new(ErrorKind::Checkpoint, format!("{e:#}")));
    }
    env.metrics
        .adapter_store_seconds
        .with_label_values(&["upload"])
        .observe(t0.elapsed().as_secs_f64());
    Ok(())
}

impl Member for Learner {
    fn status(&self) -> &Status {
        &self.status
    }

    fn status_mut(&mut self) -> &mut Status {
        &mut self.status
    }

    fn turn(&mut self, env: &Env) -> Result<Option<StepReport>, TrainError> {
        self.step(env)
    }

    fn configure(&mut self, cfg: LearnConfig) -> Result<(), super::ShapeChanged> {
        let same_eval =
            cfg.eval.raw == self.cfg.eval.raw && cfg.eval_max_tokens == self.cfg.eval_max_tokens;
        reconfigure(&mut self.cfg, &mut self.status, cfg)?;
        // Scores of another evaluation set do not compare.
        if !same_eval {
            self.scores.clear();
            self.status.eval_scores.clear();
        }
        Ok(())
    }

    fn serve(&mut self, env: &Env, op: super::ServeOp) -> Result<(), TrainError> {
        match op {
            super::ServeOp::Rollback { to, pause } => {
                let evidence = serde_json::json!({"asked_for": to});
                self.roll_back(env, to, "manual", evidence, pause)
            }
            super::ServeOp::Pin(to) => self.pin(env, Some(to)),
            super::ServeOp::Unpin => self.pin(env, None),
        }
    }

    fn resumed(&mut self, env: &Env) {
        self.record_resume(env)
    }

    fn gives_up(&self) -> bool {
        true
    }
}

/// The mean over `batch`'s completion tokens of `current` minus the version that computed each.
fn token_staleness(batch: &[PendingGroup], current: u64) -> f64 {
    let (mut sum, mut n) = (0u64, 0u64);
    for m in batch.iter().flat_map(|g| &g.members) {
        for (s, r) in VersionSpan::ranges(m.version, &m.switches, m.completion.len()) {
            sum += current.saturating_sub(s.version) * r.len() as u64;
            n += r.len() as u64;
        }
    }
    sum as f64 / n.max(1) as f64
}
