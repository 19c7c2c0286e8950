//! A learner's guards and rollbacks: after each step the guards judge the steps so far
//! (`online::guard`); a verdict to roll back (or an operator's) serves the target version again
//! with its optimizer, records the decision with its reason and evidence in the store (which
//! forgets the checkpoints above it in the same transaction), drops what the rolled-back
//! versions sampled from training, and pauses training when the setting says so. A restart
//! reads the decisions back: the ranges rolled back, and a pause not yet resumed.

use super::copies::Needed;
use super::train::Learner;
use super::{Env, ErrorKind, State, StepReport, TrainError};
use crate::online::checkpoint::{load_checkpoint, remove_dir};
use crate::online::guard::{judge, AfterRollback, StepPoint, Verdict};
use crate::online::store::records::Decision;
use crate::util::now_secs;

/// Decisions read back at a start (the newest this many).
pub(super) const DECISIONS_READ: usize = 1000;

impl Learner {
    /// The ranges of versions its lineage rolled back, and whether its newest decision paused
    /// training (not resumed since).
    pub(super) fn read_decisions(&mut self, env: &Env) -> Result<(), TrainError> {
        let lineage = self.lineage.id;
        let mine: Vec<Decision> = env
            .log
            .decisions(&self.cfg.name, DECISIONS_READ)?
            .into_iter()
            .filter(|d| d.lineage == lineage)
            .collect();
        self.rolled_back = mine
            .iter()
            .filter(|d| d.decision == "rollback")
            .map(|d| (d.to_version + 1, d.from_version))
            .collect();
        if let Some(d) = mine.first() {
            if d.decision == "rollback" && d.paused {
                self.status.state = State::Paused;
            }
            self.status.last_decision = Some(d.clone());
        }
        Ok(())
    }

    /// Judge the steps with step `r` added; roll back if a guard says so.
    pub(super) fn guard(&mut self, env: &Env, r: &StepReport) -> Result<(), TrainError> {
        let s = &r.stats;
        self.guarded.0.push(StepPoint {
            version: r.version,
            reward_mean: s.reward_mean,
            reward_std: s.reward_std,
            n: s.sequences,
            kl: s.kl,
            entropy: s.entropy,
        });
        let verdict = judge(&self.guarded.0, self.guarded.1, &self.cfg.guards);
        if let Verdict::Rollback {
            to,
            reason,
            evidence,
        } = verdict
        {
            let pause = self.cfg.guards.after_rollback == AfterRollback::Pause;
            self.roll_back(env, to, reason, evidence, pause)?;
        }
        Ok(())
    }

    /// Serve version `to` again, with its optimizer, because of `reason` (`evidence`: what the
    /// rule read); pause training with it when `pause`.
    pub(super) fn roll_back(
        &mut self,
        env: &Env,
        to: u64,
        reason: &str,
        evidence: serde_json::Value,
        pause: bool,
    ) -> Result<(), TrainError> {
        let name = self.cfg.name.clone();
        let from = self.status.version;
        let err = |m: String| TrainError::new(ErrorKind::Rollback, m);
        if to >= from {
            return Err(err(format!(
                "version {to} is not older than the one served ({from})"
            )));
        }
        let cp = env
            .log
            .checkpoints(self.lineage.id)?
            .into_iter()
            .find(|c| c.version == to)
            .ok_or_else(|| {
                err(format!(
                    "version {to} has no checkpoint kept (a lineage keeps its newest {})",
                    (self.cfg.guards.window + 2).max(2)
                ))
            })?;
        let (w, opt) = env
            .local_checkpoint(&cp, self.lineage.id, Needed::Resume)
            .and_then(|(dir, _)| load_checkpoint(&dir, &env.model.config, &env.registry.limits))
            .map_err(|e| err(format!("version {to}'s checkpoint: {e}")))?;
        let d = Decision {
            lineage: self.lineage.id,
            decision: "rollback".into(),
            reason: reason.into(),
            from_version: from,
            to_version: to,
            evidence: evidence.to_string(),
            paused: pause,
            created: now_secs(),
        };
        let undone_to = from.max(env.registry.last_version(&name));
        let paths = env.log.rollback(&name, &d)?;
        env.registry
            .revert(&name, to, w, self.lineage.id)
            .map_err(|e| TrainError::new(ErrorKind::Publish, e))?;
        for p in paths {
            if let Err(e) = remove_dir(&env.cfg.data_dir.join(&p)) {
                tracing::warn!(path = %p, error = %e, "cannot remove a rolled-back checkpoint");
            }
        }
        self.opt = opt;
        // What was held, pinned or in a canary above it is forgotten with it.
        if self.canary.take().is_some() {
            let _ = env.registry.set_canary(&name, None);
            self.status.canary_version = None;
        }
        self.trainee = None;
        self.pinned = None;
        self.served_checkpoint = to;
        self.status.held_version = None;
        self.status.pinned_version = None;
        self.rolled_back.push((to + 1, undone_to));
        self.guarded = (Vec::new(), to);
        let st = &mut self.status;
        st.version = to;
        st.steps = self.opt.step;
        if pause {
            st.state = State::Paused;
        }
        env.metrics
            .promotion_decisions
            .with_label_values(&[&name, "rollback", reason])
            .inc();
        tracing::warn!(
            adapter = %name, from, to, reason, paused = pause, evidence = %d.evidence,
            "rolled back"
        );
        st.last_decision = Some(d);
        Ok(())
    }

    /// An operator resumed training: after a rollback that paused it, that is a decision too.
    pub(super) fn record_resume(&mut self, env: &Env) {
        let paused_by_rollback = self
            .status
            .last_decision
            .as_ref()
            .is_some_and(|d| d.decision == "rollback" && d.paused);
        if !paused_by_rollback {
            return;
        }
        let v = self.status.version;
        let d = Decision {
            lineage: self.lineage.id,
            decision: "resume".into(),
            reason: "manual".into(),
            from_version: v,
            to_version: v,
            evidence: "{}".into(),
            paused: false,
            created: now_secs(),
        };
        match env.log.record_decision(&self.cfg.name, &d) {
            Ok(()) => {
                env.metrics
                    .promotion_decisions
                    .with_label_values(&[&self.cfg.name, "resume", "manual"])
                    .inc();
                self.status.last_decision = Some(d);
            }
            Err(e) => {
                tracing::warn!(adapter = %self.cfg.name, error = %e, "cannot record the resume")
            }
        }
    }
}
