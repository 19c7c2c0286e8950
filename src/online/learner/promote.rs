//! A learner's promotion of its candidates (`online::promotion`) and pins: each step's version is
//! a candidate; with an evaluation set it is scored (and the incumbent, once per version); the
//! policy says whether it serves. A held candidate is dropped with its samples (`on_hold =
//! "incumbent"`) or kept and trained on (`"candidate"`, and always while serving is pinned): the
//! learner then trains from it (`trainee`) while serving stays on the incumbent. Holds, promotions
//! and pins are decisions in the store, with their evidence; a restart reads them back.

use super::train::{Learner, Outcome};
use super::{Env, ErrorKind, TrainError};
use crate::adapter::registry::AdapterVersion;
use crate::online::eval::{evaluate, EvalScore, Through};
use crate::online::promotion::{gate, OnHold, Policy};
use crate::online::store::records::{Checkpoint, Decision, PendingGroup};
use crate::util::now_secs;
use serde_json::{json, Value};
use std::sync::Arc;

/// Scores remembered (newest versions).
const SCORES_KEPT: usize = 64;

impl Learner {
    /// `v`'s score on the evaluation set (remembered per version); None without a set, or before
    /// the server serves (when the policy does not need it).
    pub(super) fn score(
        &mut self,
        env: &Env,
        v: &Arc<AdapterVersion>,
    ) -> Result<Option<EvalScore>, TrainError> {
        let set = self.cfg.eval.clone();
        if set.is_empty() {
            return Ok(None);
        }
        if let Some(s) = self.scores.get(&v.version) {
            return Ok(Some(s.clone()));
        }
        let Some(runner) = env.evaluator.get() else {
            return match self.cfg.promotion.policy {
                Policy::Immediate | Policy::Canary => Ok(None),
                Policy::Gated => Err(TrainError::new(
                    ErrorKind::Eval,
                    "the server does not serve yet: candidates wait for their evaluation",
                )),
            };
        };
        let s = evaluate(
            runner.as_ref(),
            &set,
            Through::Version(v.clone()),
            v.version,
        )
        .map_err(|e| TrainError::new(ErrorKind::Eval, e))?;
        let name = self.cfg.name.as_str();
        env.metrics
            .eval_seconds
            .with_label_values(&[name])
            .observe(s.seconds);
        tracing::info!(
            adapter = name,
            version = v.version,
            score = s.score,
            seconds = s.seconds,
            "evaluated"
        );
        self.scores.insert(v.version, s.clone());
        while self.scores.len() > SCORES_KEPT {
            self.scores.pop_first();
        }
        self.status.eval_scores = self.scores.iter().map(|(k, s)| (*k, s.score)).collect();
        Ok(Some(s))
    }

    /// Score `cand` (and the incumbent `served`) and say what becomes of it.
    pub(super) fn judge_candidate(
        &mut self,
        env: &Env,
        served: &Arc<AdapterVersion>,
        cand: &Arc<AdapterVersion>,
    ) -> Result<(Outcome, Option<EvalScore>), TrainError> {
        let gated = self.cfg.promotion.policy == Policy::Gated;
        let inc = match gated || !self.cfg.eval.is_empty() {
            true => self.score(env, served)?,
            false => None,
        };
        let c = self.score(env, cand)?;
        let name = self.cfg.name.as_str();
        if let Some(s) = &inc {
            env.metrics
                .eval_score
                .with_label_values(&[name, "served"])
                .set(s.score);
        }
        if let Some(s) = &c {
            env.metrics
                .eval_score
                .with_label_values(&[name, "candidate"])
                .set(s.score);
        }
        let g = match (gated, &c, &inc) {
            (true, Some(c), Some(i)) => Some(gate(c, i, self.cfg.promotion.margin)),
            _ => None,
        };
        let outcome = match (self.pinned, g) {
            (Some(p), g) => Outcome::Hold {
                reason: "pinned",
                evidence: json!({"pinned_version": p,
                                 "gate": g.map(|g| g.evidence)}),
            },
            (None, Some(g)) if !g.promote => Outcome::Hold {
                reason: "eval",
                evidence: g.evidence,
            },
            (None, _) if self.cfg.promotion.policy == Policy::Canary => Outcome::Canary,
            (None, g) => Outcome::Publish {
                evidence: g.map(|g| g.evidence),
            },
        };
        Ok((outcome, c))
    }

    /// Record a decision of this lineage (`decision`, `reason`, from `from` to `to`), count it
    /// and show it.
    pub(super) fn decide(
        &mut self,
        env: &Env,
        decision: &str,
        reason: &str,
        (from, to): (u64, u64),
        evidence: &Value,
    ) -> Result<(), TrainError> {
        let d = Decision {
            lineage: self.lineage.id,
            decision: decision.into(),
            reason: reason.into(),
            from_version: from,
            to_version: to,
            evidence: evidence.to_string(),
            paused: false,
            created: now_secs(),
        };
        env.log.record_decision(&self.cfg.name, &d)?;
        env.metrics
            .promotion_decisions
            .with_label_values(&[&self.cfg.name, decision, reason])
            .inc();
        tracing::info!(adapter = %self.cfg.name, decision, reason, from, to, evidence = %d.evidence, "promotion decision");
        self.status.last_decision = Some(d);
        Ok(())
    }

    /// Whether a held candidate is trained on (else dropped with its samples).
    pub(super) fn keeps_held(&self) -> bool {
        self.pinned.is_some() || self.cfg.promotion.on_hold == OnHold::Candidate
    }

    /// Drop a held candidate (numbered `version`) and what it trained on (`batch`): its samples
    /// count as dropped `held`; the learner goes on from the incumbent as it was.
    pub(super) fn drop_held(
        &mut self,
        env: &Env,
        batch: &[PendingGroup],
        version: u64,
        served: u64,
        evidence: &Value,
    ) -> Result<(), TrainError> {
        self.decide(env, "hold", "eval", (version, served), evidence)?;
        // Its number is taken: the store records it.
        env.registry.note_version(&self.cfg.name, version);
        let members: Vec<(String, u32)> = batch
            .iter()
            .flat_map(|g| g.members.iter().map(|m| (m.id.clone(), m.choice)))
            .collect();
        env.log.drop_members(&members, "held")?;
        let n = members.len() as u64;
        env.metrics
            .train_groups_dropped
            .with_label_values(&[&self.cfg.name, "held"])
            .inc_by(n);
        *self.status.dropped.entry("held".into()).or_default() += n;
        Ok(())
    }
}

/// What a start reads of promotion from the store: the checkpoint to serve when it is not the
/// newest (a held candidate is newest, or serving is pinned: its version and weights; version 0,
/// the lineage's identity, when every checkpoint is held), and the pin.
pub(super) struct AtStart {
    pub served: Option<(u64, crate::adapter::AdapterWeights)>,
    pub pinned: Option<u64>,
}

/// What the store's decisions say of a lineage's versions (read once: `decided`).
pub(super) struct Decided {
    /// The version serving is pinned to (a pin lasts until an unpin or a rollback).
    pub pinned: Option<u64>,
    /// Candidates held, and canaries not (yet) promoted.
    held: std::collections::BTreeSet<u64>,
    /// The candidate of a canary not ended (no promotion, hold or rollback of it since).
    pub open_canary: Option<u64>,
}

/// Read `lineage`'s decisions (the newest `DECISIONS_READ` of `name`).
pub(super) fn decided(env: &Env, name: &str, lineage: u64) -> Result<Decided, TrainError> {
    let mine: Vec<Decision> = env
        .log
        .decisions(name, super::rollback::DECISIONS_READ)?
        .into_iter()
        .filter(|d| d.lineage == lineage)
        .collect();
    let pinned = mine
        .iter()
        .find(|d| matches!(d.decision.as_str(), "pin" | "unpin" | "rollback"))
        .filter(|d| d.decision == "pin")
        .map(|d| d.to_version);
    let ended: std::collections::BTreeSet<u64> = mine
        .iter()
        .filter(|d| matches!(d.decision.as_str(), "promote" | "hold" | "rollback"))
        .map(|d| d.from_version)
        .collect();
    let promoted: std::collections::BTreeSet<u64> = mine
        .iter()
        .filter(|d| d.decision == "promote")
        .map(|d| d.from_version)
        .collect();
    let held = mine
        .iter()
        .filter(|d| d.decision == "hold" || d.decision == "canary")
        .map(|d| d.from_version)
        .filter(|v| !promoted.contains(v))
        .collect();
    // Newest first: the newest canary, if nothing ended it since.
    let open_canary = mine
        .iter()
        .find(|d| d.decision == "canary")
        .map(|d| d.from_version)
        .filter(|v| !ended.contains(v));
    Ok(Decided {
        pinned,
        held,
        open_canary,
    })
}

/// What serves in `lineage` by its decisions: the pinned checkpoint, else the newest one not
/// held. (None: no checkpoint serves: the lineage has none, or the pinned one is gone.)
pub(super) fn serving_checkpoint(
    env: &Env,
    lineage: u64,
    d: &Decided,
) -> Result<Option<Checkpoint>, TrainError> {
    let cps = env.log.checkpoints(lineage)?;
    Ok(match d.pinned {
        Some(p) => cps.into_iter().find(|c| c.version == p),
        None => cps.into_iter().find(|c| !d.held.contains(&c.version)),
    })
}

/// Read the decisions of `lineage` (newest checkpoint `newest`): serve the pinned checkpoint, or
/// the newest one not held, when that is not `newest`.
pub(super) fn at_start(
    env: &Env,
    cfg: &crate::online::config::LearnConfig,
    lineage: &crate::online::store::records::Lineage,
    newest: Option<u64>,
) -> Result<AtStart, TrainError> {
    let name = cfg.name.as_str();
    let d = decided(env, name, lineage.id)?;
    let (cp, pinned) = (serving_checkpoint(env, lineage.id, &d)?, d.pinned);
    let Some(newest) = newest else {
        return Ok(AtStart {
            served: None,
            pinned,
        });
    };
    let gone = pinned.is_some() && cp.is_none();
    if cp.is_none() && !gone {
        // Every checkpoint is held: the identity the lineage began with serves.
        let w = super::identity(cfg, env).map_err(|e| TrainError::new(ErrorKind::Start, e))?;
        return Ok(AtStart {
            served: Some((0, w)),
            pinned,
        });
    }
    // An older one than the newest intact (a held newest, or a pin); a newer one did not load,
    // and the newest intact stands in for it.
    let Some(cp) = cp.filter(|c| c.version < newest) else {
        if gone {
            tracing::warn!(
                adapter = name,
                pinned,
                "the pinned version has no checkpoint: the newest serves, unpinned"
            );
        }
        return Ok(AtStart {
            served: None,
            pinned: pinned.filter(|_| !gone),
        });
    };
    let (w, _) = env
        .local_checkpoint(&cp, lineage.id, super::copies::Needed::Resume)
        .and_then(|(dir, _)| {
            crate::online::checkpoint::load_checkpoint(
                &dir,
                &env.model.config,
                &env.registry.limits,
            )
        })
        .map_err(|e| TrainError::new(ErrorKind::Start, format!("version {}: {e}", cp.version)))?;
    tracing::info!(
        adapter = name,
        serves = cp.version,
        trains_from = newest,
        pinned,
        "held candidates or a pin: an older checkpoint serves"
    );
    Ok(AtStart {
        served: Some((cp.version, w)),
        pinned,
    })
}

impl Learner {
    /// Pin serving to version `to` (a version with a checkpoint, or the one serving), training
    /// going on from the newest; `None` unpins: the newest version serves (whatever the
    /// policy: what the operator asked for; scores of the versions made while pinned are shown).
    pub(super) fn pin(&mut self, env: &Env, to: Option<u64>) -> Result<(), TrainError> {
        let name = self.cfg.name.clone();
        let err = |m: String| TrainError::new(ErrorKind::Rollback, m);
        let served = self.status.version;
        match to {
            Some(_) if self.canary.is_some() => {
                return Err(err(format!(
                    "a canary of version {} runs: wait for its verdict, or roll back",
                    self.status.canary_version.unwrap_or(0)
                )));
            }
            Some(p) => {
                let newest = self.trainee.as_ref().map_or(served, |t| t.version);
                if p != served {
                    let cp = env
                        .log
                        .checkpoints(self.lineage.id)?
                        .into_iter()
                        .find(|c| c.version == p)
                        .ok_or_else(|| {
                            err(format!(
                                "version {p} has no checkpoint kept (versions with one: the \
                                 newest {} and those from the one serving up)",
                                (self.cfg.guards.window + 2).max(2)
                            ))
                        })?;
                    let (w, _) = env
                        .local_checkpoint(&cp, self.lineage.id, super::copies::Needed::Resume)
                        .and_then(|(dir, _)| {
                            crate::online::checkpoint::load_checkpoint(
                                &dir,
                                &env.model.config,
                                &env.registry.limits,
                            )
                        })
                        .map_err(|e| err(format!("version {p}'s checkpoint: {e}")))?;
                    let slot = env
                        .registry
                        .get(&name)
                        .ok_or_else(|| err(format!("the adapter '{name}' is gone")))?;
                    let cur = slot.current();
                    env.registry
                        .revert(&name, p, w, self.lineage.id)
                        .map_err(|e| TrainError::new(ErrorKind::Publish, e))?;
                    // Training goes on from the newest version.
                    if self.trainee.is_none() && cur.version != p {
                        self.trainee = Some(cur);
                    }
                    if self.trainee.as_ref().is_some_and(|t| t.version == p) {
                        self.trainee = None;
                    }
                    self.served_checkpoint = p;
                }
                let evidence = json!({"asked_for": p, "training_from": newest});
                self.decide(env, "pin", "manual", (served, p), &evidence)?;
                self.pinned = Some(p);
                self.status.version = p;
                self.guarded = (Vec::new(), p);
            }
            None => {
                if self.pinned.take().is_none() {
                    return Err(err(format!("'{name}' is not pinned")));
                }
                let mut now = served;
                if let Some(t) = self.trainee.take() {
                    now = t.version;
                    env.registry
                        .serve(t, self.lineage.id)
                        .map_err(|e| TrainError::new(ErrorKind::Publish, e))?;
                    self.served_checkpoint = now;
                }
                let evidence = json!({"held_version": self.trainee.as_ref().map(|t| t.version)});
                self.decide(env, "unpin", "manual", (served, now), &evidence)?;
                self.status.version = now;
                self.guarded = (Vec::new(), now);
            }
        }
        self.status.pinned_version = self.pinned;
        self.status.held_version = self.trainee.as_ref().map(|t| t.version);
        Ok(())
    }
}
