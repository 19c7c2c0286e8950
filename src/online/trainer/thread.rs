//! The trainer thread's side of `trainer`: its loop (commands, steps, the log check, retention,
//! the share policy), its supervision (a panic fails the learner, or is counted outside a
//! step) and its failure rules (backoff, `MAX_FAILURES`, an unusable log fails every learner).

use super::{Command, CommandError, RunCommand, Shared, Trainer, MAX_FAILURES, MAX_STEPS_IN_A_ROW};
use crate::online::learner::{self, ErrorKind, State, Status, TrainError};
use crate::online::runs::{kept, RunState};
use crate::online::share_policy::Totals;
use crate::util::now_secs;
use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::sync::mpsc::RecvTimeoutError;
use std::sync::Arc;
use std::time::Duration;

/// Ends `alive` when the thread ends, however it ends.
struct AliveGuard(Arc<Shared>);

impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.0.alive.store(false, Ordering::Release);
    }
}

impl Trainer {
    pub(super) fn run(mut self) {
        let _alive = AliveGuard(self.shared.clone());
        // Serving first: the trainer's kernels (its `Cpu` is a background one) yield to engine
        // steps, within the policy's share of their time (see kernels' `gate`).
        self.env.cpu.pool.gate.set_share(self.steering.share());
        self.env.metrics.train_share.set(self.steering.share());
        loop {
            let wait = self.next_wait();
            match self.rx.recv_timeout(wait) {
                Ok(c) => self.supervised("", |t| t.handle(c)),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
            while let Ok(c) = self.rx.try_recv() {
                self.supervised("", |t| t.handle(c));
            }
            if self.stopping {
                tracing::info!("the trainer stopped (no step in progress)");
                return;
            }
            self.supervised("", Trainer::check_log);
            let names: Vec<String> = self.learners.keys().cloned().collect();
            for name in names {
                self.supervised(&name.clone(), |t| t.train(&name));
            }
            self.supervised("", Trainer::prune);
            self.steer();
            self.publish_status();
        }
    }

    /// Let the policy measure and, each period, move the share (`share_policy`).
    fn steer(&mut self) {
        let mut t = Totals::default();
        for l in self.learners.values() {
            let st = l.status();
            t.steps += st.steps;
            t.trained += st.trained;
            t.stale += st.dropped.get("stale").copied().unwrap_or(0);
            t.dropped += st.dropped.values().sum::<u64>();
            t.pending += st.pending_groups as u64;
        }
        let gate = &self.env.cpu.pool.gate;
        let (wall, waited) = gate.serving_time();
        let serving = (wall.as_secs_f64(), waited.as_secs_f64());
        let m = &self.env.metrics;
        if let Some(share) = self.steering.tick(now_secs(), t, serving) {
            gate.set_share(share);
            m.train_share.set(share);
            let why = self.steering.view().last_change.clone().unwrap_or_default();
            tracing::info!(share, "training share: {why}");
        }
        let v = self.steering.view();
        m.train_itl_stretch.set(v.itl_stretch.unwrap_or(1.0));
        m.train_steps_per_minute
            .set(v.steps_per_minute.unwrap_or(0.0));
        *self
            .shared
            .policy
            .write()
            .unwrap_or_else(|e| e.into_inner()) = v.clone();
    }

    /// Run `f`, catching a panic. In a learner's turn (`name`) it fails that learner; elsewhere
    /// (a command, the log check, retention) it is logged and counted under adapter "", and the
    /// command's caller gets an error (its reply is dropped): the other learners go on.
    fn supervised(&mut self, name: &str, f: impl FnOnce(&mut Trainer)) {
        let r = std::panic::catch_unwind(AssertUnwindSafe(|| f(self)));
        if let Err(p) = r {
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".into());
            let e = TrainError::new(ErrorKind::Panic, msg);
            if name.is_empty() {
                self.count("", e.kind);
                tracing::error!(error = %e, "the trainer caught a panic outside a training step");
            } else {
                self.fail(name, e, true);
            }
            self.publish_status();
        }
    }

    /// How long to wait for a command: until the earliest retry, at most 500 ms.
    fn next_wait(&self) -> Duration {
        let now = now_secs();
        let soonest = self
            .learners
            .values()
            .filter(|l| l.status().state == State::Running)
            .filter_map(|l| l.status().retry_at)
            .fold(0.5f64, |w, at| w.min((at - now).max(0.0)));
        Duration::from_secs_f64(soonest)
    }

    fn handle(&mut self, c: Command) {
        match c {
            Command::Wake => {}
            Command::Policy(p, reply) => {
                self.steering.set_policy(p);
                let share = self.steering.share();
                self.env.cpu.pool.gate.set_share(share);
                self.env.metrics.train_share.set(share);
                let v = self.steering.view().clone();
                *self
                    .shared
                    .policy
                    .write()
                    .unwrap_or_else(|e| e.into_inner()) = v.clone();
                tracing::info!(policy = ?v.policy, "training share policy set");
                let _ = reply.send(Ok(v));
            }
            Command::Run(c) => self.run_command(c),
            Command::Stop(reply) => {
                self.stopping = true;
                let _ = reply.send(Ok(()));
            }
            Command::Add(cfg, reply) => {
                let name = cfg.name.clone();
                let r = match self.learners.get(&name) {
                    Some(l) => Ok(l.status().clone()),
                    None => learner::start(cfg, &self.env).map(|l| {
                        let s = l.status().clone();
                        self.learners.insert(name.clone(), l);
                        s
                    }),
                };
                if let Err(e) = &r {
                    self.count(&name, e.kind);
                    tracing::error!(adapter = %name, error = %e, "cannot start learning");
                }
                self.publish_status();
                let _ = reply.send(r.map_err(CommandError::Train));
            }
            Command::Configure(cfg, reply) => {
                let r = match self.learners.get_mut(&cfg.name) {
                    None => Err(CommandError::NotLearning(cfg.name)),
                    Some(l) => l
                        .configure(cfg)
                        .map(|_| l.status().clone())
                        .map_err(CommandError::Conflict),
                };
                self.publish_status();
                let _ = reply.send(r);
            }
            Command::Pause(name, paused, reply) => {
                let r = match self.learners.get_mut(&name) {
                    None => Err(CommandError::NotLearning(name)),
                    Some(l) => {
                        let s = l.status_mut();
                        s.state = if paused {
                            State::Paused
                        } else {
                            State::Running
                        };
                        s.consecutive_failures = 0;
                        s.retry_at = None;
                        if !paused {
                            l.resumed(&self.env);
                        }
                        self.env
                            .metrics
                            .train_learner_ok
                            .with_label_values(&[&name])
                            .set(1);
                        Ok(l.status().clone())
                    }
                };
                self.publish_status();
                let _ = reply.send(r);
            }
            Command::Serve(name, op, reply) => {
                let r = match self.learners.get_mut(&name) {
                    None => Err(CommandError::NotLearning(name)),
                    Some(l) => match l.serve(&self.env, op) {
                        Ok(()) => Ok(l.status().clone()),
                        Err(e) => Err(CommandError::Train(e)),
                    },
                };
                self.publish_status();
                let _ = reply.send(r);
            }
            Command::Remove(name, reply) => {
                let r = match self.learners.remove(&name) {
                    None => Err(CommandError::NotLearning(name)),
                    Some(_) => {
                        self.env.registry.remove(&name);
                        let m = &self.env.metrics;
                        let _ = m.train_learner_ok.remove_label_values(&[&name]);
                        tracing::info!(adapter = %name, "learning adapter deleted: its lineage ended");
                        let ended = self.env.log.end_lineage(&name);
                        ended.map_err(|e| CommandError::Train(e.into()))
                    }
                };
                self.publish_status();
                let _ = reply.send(r);
            }
        }
    }

    /// A command on a client-driven run: its work runs here, between learners' steps; each
    /// change of its state is kept (`runs::kept`) before it is answered.
    fn run_command(&mut self, c: RunCommand) {
        match c {
            RunCommand::Start(id, weights, opt, meta, reply) => {
                let state = RunState::new(weights, opt);
                let kept =
                    kept::keep_new(&self.env, &id, &meta, state.weights(), state.optimizer());
                if kept.is_ok() {
                    self.runs.insert(id, state);
                }
                let _ = reply.send(kept.map_err(CommandError::Run));
            }
            RunCommand::Work(id, work, reply) => {
                let r = match self.runs.get_mut(&id) {
                    None => Err(CommandError::NoRun(id)),
                    Some(run) => {
                        let keep = kept::Kept {
                            env: &self.env,
                            id: &id,
                        };
                        let out = run.work(
                            &self.env.model,
                            &self.env.cpu,
                            self.env.scorer.get().map(|s| s.as_ref()),
                            work,
                            &keep,
                        );
                        out.map_err(CommandError::Run)
                    }
                };
                let _ = reply.send(r);
            }
            RunCommand::End(sessions, ids) => {
                for id in ids {
                    self.runs.remove(&id);
                }
                kept::end_sessions(&self.env, &sessions);
            }
            RunCommand::Restore(reply) => {
                let r = kept::restore(&self.env).map(|(restored, states)| {
                    self.runs.extend(states);
                    restored
                });
                let _ = reply.send(r.map_err(CommandError::Run));
            }
        }
    }

    /// Take the steps `name` has ready (while it runs and is not waiting out a backoff).
    fn train(&mut self, name: &str) {
        for _ in 0..MAX_STEPS_IN_A_ROW {
            if self.stopping {
                return;
            }
            let Some(l) = self.learners.get_mut(name) else {
                return;
            };
            let waiting = l.status().retry_at.is_some_and(|at| now_secs() < at);
            if l.status().state != State::Running || waiting {
                return;
            }
            match l.turn(&self.env) {
                Ok(None) => return,
                Ok(Some(_)) => {
                    let s = l.status_mut();
                    s.consecutive_failures = 0;
                    s.retry_at = None;
                }
                Err(e) => {
                    self.fail(name, e, false);
                    return;
                }
            }
            self.steer();
            self.publish_status();
            // Commands wait at most one step.
            while let Ok(c) = self.rx.try_recv() {
                self.handle(c);
            }
        }
    }

    fn count(&self, name: &str, kind: ErrorKind) {
        self.env
            .metrics
            .train_errors
            .with_label_values(&[name, kind.as_str()])
            .inc();
    }

    /// Record a failure of `name`: retry later with backoff, or fail it (`fatal`, or too many).
    fn fail(&mut self, name: &str, e: TrainError, fatal: bool) {
        self.count(name, e.kind);
        let Some(l) = self.learners.get_mut(name) else {
            return;
        };
        // A follower (a serving replica) never gives up (`Member::gives_up`).
        let gives_up_at = l.gives_up().then_some(MAX_FAILURES);
        let s = l.status_mut();
        s.consecutive_failures += 1;
        let gives_up = gives_up_at.is_some_and(|n| s.consecutive_failures >= n);
        let failed = fatal || gives_up;
        if failed {
            s.state = State::Failed;
            s.retry_at = None;
            self.env
                .metrics
                .train_learner_ok
                .with_label_values(&[name])
                .set(0);
            tracing::error!(adapter = %name, error = %e, "learner failed: feedback for it is refused until it is resumed");
        } else {
            let backoff = (1u64 << (s.consecutive_failures - 1).min(6)).min(60) as f64;
            s.retry_at = Some(now_secs() + backoff);
            tracing::error!(adapter = %name, error = %e, retry_in_secs = backoff, "training step failed: optimizer and adapter rolled back");
        }
        s.last_error = Some(e);
    }

    /// A rollout log that became unusable fails every learner (once).
    fn check_log(&mut self) {
        if !self.log_ok {
            return;
        }
        if let Err(e) = self.env.log.check() {
            self.log_ok = false;
            self.env.metrics.rollout_log_ok.set(0);
            let names: Vec<String> = self.learners.keys().cloned().collect();
            for n in names {
                self.fail(&n, TrainError::new(ErrorKind::Database, &e), true);
            }
        }
    }

    fn prune(&mut self) {
        let now = now_secs();
        // One process prunes a shared store: the trainer.
        if now - self.last_prune < 600.0 || !self.log_ok || !self.prunes {
            return;
        }
        self.last_prune = now;
        let c = &self.env.cfg;
        if let Err(e) = self
            .env
            .log
            .prune(c.retention_days * 86400.0, c.retention_max_rows)
        {
            tracing::warn!(error = %e, "rollout log retention failed");
        }
    }

    fn publish_status(&self) {
        let s: BTreeMap<String, Status> = self
            .learners
            .iter()
            .map(|(k, l)| (k.clone(), l.status().clone()))
            .collect();
        *self
            .shared
            .status
            .write()
            .unwrap_or_else(|e| e.into_inner()) = s;
    }
}
