//! A learner's canary (`promotion = "canary"`, `online::promotion::canary`): the step's version
//! takes a fraction of the adapter's new requests while training waits; each turn the rewarded
//! samples of the candidate and the incumbent (pending in the store) are compared, and the
//! candidate is promoted (it serves) or rejected (rolled back: the store forgets it and its
//! samples do not train; or, with `on_hold = "candidate"`, held and trained from). Its start
//! and end are decisions in the store; a restart resumes a canary that had not ended.

use super::train::{CanaryRun, Learner};
use super::{Env, ErrorKind, StepReport, TrainError};
use crate::adapter::registry::AdapterVersion;
use crate::online::checkpoint::{load_checkpoint, remove_dir};
use crate::online::promotion::{canary, Arm, CanaryVerdict, OnHold};
use crate::online::store::records::Decision;
use crate::util::now_secs;
use std::sync::Arc;

impl Learner {
    /// Begin a canary of `cand` (committed), against the version serving.
    pub(super) fn begin_canary(
        &mut self,
        env: &Env,
        cand: Arc<AdapterVersion>,
        report: Option<StepReport>,
    ) -> Result<(), TrainError> {
        let fraction = self.cfg.promotion.canary.fraction;
        env.registry
            .set_canary(&self.cfg.name, Some((cand.clone(), fraction)))
            .map_err(|e| TrainError::new(ErrorKind::Publish, e))?;
        self.status.canary_version = Some(cand.version);
        self.canary = Some(CanaryRun {
            incumbent: self.status.version,
            cand,
            started: now_secs(),
            report,
        });
        Ok(())
    }

    /// Compare the arms of the running canary and carry out its verdict.
    pub(super) fn watch_canary(&mut self, env: &Env) -> Result<(), TrainError> {
        let Some(run) = &self.canary else {
            return Ok(());
        };
        let (cv, iv) = (run.cand.version, run.incumbent);
        let c = &self.cfg.promotion;
        let timed_out = c
            .canary
            .max_secs
            .is_some_and(|s| now_secs() - run.started > s);
        let (mut rc, mut ri) = (Vec::new(), Vec::new());
        for g in env.log.pending_groups(&self.cfg.name)? {
            for m in g.members {
                match (m.reward, m.version) {
                    (Some(r), v) if v == cv => rc.push(r),
                    (Some(r), v) if v == iv => ri.push(r),
                    _ => {}
                }
            }
        }
        let verdict = canary(&Arm::of(&rc), &Arm::of(&ri), c.margin, &c.canary, timed_out);
        match verdict {
            CanaryVerdict::Wait => Ok(()),
            CanaryVerdict::Promote(evidence) => self.promote_canary(env, &evidence),
            CanaryVerdict::Reject(evidence) => self.reject_canary(env, evidence),
        }
    }

    fn promote_canary(
        &mut self,
        env: &Env,
        evidence: &serde_json::Value,
    ) -> Result<(), TrainError> {
        let Some(run) = self.canary.take() else {
            return Ok(());
        };
        let name = self.cfg.name.clone();
        let v = run.cand.version;
        let end = |e| TrainError::new(ErrorKind::Publish, e);
        env.registry.set_canary(&name, None).map_err(end)?;
        env.registry.serve(run.cand, self.lineage.id).map_err(end)?;
        self.served_checkpoint = v;
        self.status.version = v;
        self.status.canary_version = None;
        self.decide(env, "promote", "canary", (v, run.incumbent), evidence)?;
        if let Some(r) = run.report {
            self.guard(env, &r)?;
        }
        Ok(())
    }

    /// Reject the candidate: rolled back (the store forgets its checkpoint, its samples do not
    /// train, the optimizer returns to the incumbent's), or held and trained from.
    fn reject_canary(&mut self, env: &Env, evidence: serde_json::Value) -> Result<(), TrainError> {
        let Some(run) = self.canary.take() else {
            return Ok(());
        };
        let name = self.cfg.name.clone();
        env.registry
            .set_canary(&name, None)
            .map_err(|e| TrainError::new(ErrorKind::Publish, e))?;
        self.status.canary_version = None;
        let (v, inc) = (run.cand.version, run.incumbent);
        if self.cfg.promotion.on_hold == OnHold::Candidate {
            self.trainee = Some(run.cand);
            self.status.held_version = Some(v);
            return self.decide(env, "hold", "canary", (v, inc), &evidence);
        }
        // The incumbent's optimizer: its checkpoint's, or a fresh one for the identity.
        let opt = match self.served_checkpoint {
            0 => super::train::adamw(&self.cfg, self.opt.m.len()),
            s => {
                let cp = env
                    .log
                    .checkpoints(self.lineage.id)?
                    .into_iter()
                    .find(|c| c.version == s)
                    .ok_or_else(|| {
                        TrainError::new(
                            ErrorKind::Rollback,
                            format!("version {s} has no checkpoint kept"),
                        )
                    })?;
                env.local_checkpoint(&cp, self.lineage.id, super::copies::Needed::Resume)
                    .and_then(|(dir, _)| {
                        load_checkpoint(&dir, &env.model.config, &env.registry.limits)
                    })
                    .map_err(|e| TrainError::new(ErrorKind::Rollback, format!("version {s}: {e}")))?
                    .1
            }
        };
        let d = Decision {
            lineage: self.lineage.id,
            decision: "rollback".into(),
            reason: "canary".into(),
            from_version: v,
            to_version: inc,
            evidence: evidence.to_string(),
            paused: false,
            created: now_secs(),
        };
        for p in env.log.rollback(&name, &d)? {
            if let Err(e) = remove_dir(&env.cfg.data_dir.join(&p)) {
                tracing::warn!(path = %p, error = %e, "cannot remove a rejected candidate's checkpoint");
            }
        }
        self.opt = opt;
        self.status.steps = self.opt.step;
        self.rolled_back.push((inc + 1, v));
        env.metrics
            .promotion_decisions
            .with_label_values(&[&name, "rollback", "canary"])
            .inc();
        tracing::warn!(adapter = %name, candidate = v, incumbent = inc, evidence = %d.evidence, "canary rejected");
        self.status.last_decision = Some(d);
        Ok(())
    }
}
