//! A serving replica's learning adapter (`--role serve`): it never trains; each turn of the
//! trainer thread (woken by the store's notification of a committed step, at most 500 ms apart)
//! it follows the trainer: fetch, verify, publish (or, after the trainer rolled back, serve the
//! version it went back to).

use super::copies::Needed;
use super::{
    adopt_shape, identity, newest_intact, publish_at_start, reconfigure, Env, ErrorKind, Member,
    Status, StepReport, TrainError,
};
use crate::adapter::peft;
use crate::adapter::registry::Publisher;
use crate::online::checkpoint::remove_dir;
use crate::online::config::LearnConfig;
use crate::online::store::records::Lineage;
use std::path::PathBuf;

pub(super) struct Follower {
    cfg: LearnConfig,
    /// The trainer's lineage whose version it serves.
    lineage: Lineage,
    status: Status,
    /// Its copy of the version it serves, fetched from the adapter store (removed once it
    /// follows to the next).
    fetched: Option<PathBuf>,
}

impl Follower {
    /// Serve the newest checkpoint of the trainer's lineage that verifies (its identity if it has
    /// none yet), under the trainer's version number. Refused when there is no lineage yet, or
    /// when none of its checkpoints verifies: a replica does not serve unverified versions.
    pub(super) fn start(mut cfg: LearnConfig, env: &Env) -> Result<Follower, TrainError> {
        let name = cfg.name.clone();
        let start_err = |e: String| TrainError::new(ErrorKind::Start, e);
        let Some(lineage) = env.log.active_lineage(&name)? else {
            return Err(start_err(format!(
                "no lineage of '{name}' in the rollout store yet: a serving replica follows the \
                 trainer's, so start the trainer (--role train) first"
            )));
        };
        let (model, limits) = (&env.model.config, &env.registry.limits);
        let mut found = newest_intact(env, &name, &lineage, Needed::Adapter, |dir| {
            Ok(peft::load_within(dir, model, limits)?)
        })?;
        // Not a held candidate, and the pinned version when serving is pinned (the identity
        // when every checkpoint is held).
        let d = super::promote::decided(env, &name, lineage.id)?;
        match (
            super::promote::serving_checkpoint(env, lineage.id, &d)?,
            d.pinned,
        ) {
            (None, None) => {
                found.resumed = None;
                found.num_checkpoints = 0;
            }
            (None, Some(_)) => {}
            // An older one than the newest intact (a held newest, or a pin); a newer one is
            // one that did not verify, which the newest intact stands in for.
            (Some(cp), _)
                if found
                    .resumed
                    .as_ref()
                    .is_some_and(|(c, _, _)| c.version > cp.version) =>
            {
                let (dir, fetched) = env
                    .local_checkpoint(&cp, lineage.id, Needed::Adapter)
                    .map_err(|e| start_err(e.to_string()))?;
                let w = peft::load_within(&dir, model, limits)
                    .map_err(|e| start_err(format!("version {}: {e}", cp.version)))?;
                found.resumed = Some((cp, w, fetched.then_some(dir)));
            }
            (Some(_), _) => {}
        }
        let (weights, version, steps, fetched) = match found.resumed {
            Some((cp, w, fetched)) => {
                adopt_shape(&mut cfg, &w);
                tracing::info!(adapter = %name, version = cp.version, step = cp.step, "following the trainer's lineage");
                (w, cp.version, cp.step, fetched)
            }
            None if found.num_checkpoints > 0 => {
                return Err(start_err(format!(
                    "none of the {} checkpoints of '{name}' could be verified (see the \
                     warnings): a serving replica does not serve unverified versions",
                    found.num_checkpoints
                )))
            }
            // Not trained yet: the identity the lineage began with, under the trainer's number.
            None => {
                let w = identity(&cfg, env).map_err(|e| start_err(e.to_string()))?;
                (w, lineage.first_version, 0, None)
            }
        };
        let status = publish_at_start(env, &cfg, &lineage, weights, version, steps)?;
        Ok(Follower {
            cfg,
            lineage,
            status,
            fetched,
        })
    }

    /// Publish the trainer's newest checkpoint (its lineage's, in the shared store; its files in
    /// the shared data directory or the adapter store) under the trainer's version number, if
    /// newer than the one served.
    fn follow(&mut self, env: &Env) -> Result<(), TrainError> {
        let name = self.cfg.name.clone();
        let Some(l) = env.log.active_lineage(&name)? else {
            return Ok(());
        };
        // The trainer's newest checkpoint, unless it is held or serving is pinned.
        let Some((newest, committed)) = env.log.newest_checkpoint(l.id)? else {
            return Ok(());
        };
        // One read of the decisions for both.
        let d = super::promote::decided(env, &name, l.id)?;
        self.follow_canary(env, l.id, d.open_canary)?;
        let Some(cp) = super::promote::serving_checkpoint(env, l.id, &d)? else {
            return Ok(());
        };
        let committed = if cp.version == newest.version {
            committed
        } else {
            crate::util::now_secs()
        };
        let lag = env.metrics.replica_version_lag.with_label_values(&[&name]);
        lag.set(cp.version.saturating_sub(self.status.version) as i64);
        if l.id == self.lineage.id && cp.version == self.status.version {
            return Ok(());
        }
        // Older than the one served, in the same lineage: the trainer rolled back (a rollback
        // forgets the checkpoints above its target) or pinned an older version.
        let back = l.id == self.lineage.id && cp.version < self.status.version;
        let t0 = std::time::Instant::now();
        // Never serve what cannot be verified: the files loaded, against the manifest the
        // trainer wrote last (fetched from the adapter store first if there is one).
        let (dir, fetched) = env
            .local_checkpoint(&cp, l.id, Needed::Adapter)
            .map_err(|e| TrainError::new(ErrorKind::Checkpoint, e))?;
        let w = peft::load_within(&dir, &env.model.config, &env.registry.limits)
            .map_err(|e| TrainError::new(ErrorKind::Checkpoint, e))?;
        let who = Publisher::Claim {
            id: l.id,
            min_version: cp.version,
        };
        // A number this replica saw already (an older version, or the canary it ran) is served
        // as it is numbered.
        let seen = l.id == self.lineage.id && cp.version <= env.registry.last_version(&name);
        let v = match back || seen {
            true => env.registry.revert(&name, cp.version, w, l.id),
            false => env.registry.publish_as(&name, w, who).map(|(v, _)| v),
        }
        .map_err(|e| TrainError::new(ErrorKind::Publish, e))?;
        tracing::info!(
            adapter = %name, version = v.version, step = cp.step, rolled_back = back,
            load_ms = t0.elapsed().as_secs_f64() * 1e3,
            "followed the trainer to a new version"
        );
        // The copy fetched for the version served before is not needed any more.
        if let Some(old) = std::mem::replace(&mut self.fetched, fetched.then(|| dir.clone())) {
            if old != dir {
                if let Err(e) = remove_dir(&old) {
                    tracing::warn!(path = %old.display(), error = %e, "cannot remove a fetched version");
                }
            }
        }
        self.lineage = l;
        self.status.lineage = l.id;
        self.status.version = v.version;
        self.status.steps = cp.step;
        lag.set(0);
        env.metrics
            .replica_propagation_seconds
            .observe((crate::util::now_secs() - committed).max(0.0));
        Ok(())
    }
}

impl Follower {
    /// Run the trainer's canary here too (its candidate to the same fraction of this replica's
    /// requests), or end it when the trainer's has ended.
    fn follow_canary(
        &mut self,
        env: &Env,
        lineage: u64,
        open: Option<u64>,
    ) -> Result<(), TrainError> {
        let name = self.cfg.name.clone();
        let here = env
            .registry
            .get(&name)
            .and_then(|s| s.canary())
            .map(|c| c.0);
        if open == here {
            return Ok(());
        }
        let publish = |e| TrainError::new(ErrorKind::Publish, e);
        let Some(v) = open else {
            self.status.canary_version = None;
            return env.registry.set_canary(&name, None).map_err(publish);
        };
        let Some(cp) = env
            .log
            .checkpoints(lineage)?
            .into_iter()
            .find(|c| c.version == v)
        else {
            return Ok(());
        };
        let (dir, fetched) = env
            .local_checkpoint(&cp, lineage, Needed::Adapter)
            .map_err(|e| TrainError::new(ErrorKind::Checkpoint, e))?;
        let w = peft::load_within(&dir, &env.model.config, &env.registry.limits)
            .map_err(|e| TrainError::new(ErrorKind::Checkpoint, e));
        if fetched {
            let _ = remove_dir(&dir);
        }
        let cand = env
            .registry
            .candidate(&name, v, Some(self.status.version), w?)
            .map_err(publish)?;
        let fraction = self.cfg.promotion.canary.fraction;
        env.registry
            .set_canary(&name, Some((cand, fraction)))
            .map_err(publish)?;
        self.status.canary_version = Some(v);
        tracing::info!(adapter = %name, candidate = v, fraction, "following the trainer's canary");
        Ok(())
    }
}

impl Member for Follower {
    fn status(&self) -> &Status {
        &self.status
    }

    fn status_mut(&mut self) -> &mut Status {
        &mut self.status
    }

    fn turn(&mut self, env: &Env) -> Result<Option<StepReport>, TrainError> {
        self.follow(env).map(|()| None)
    }

    fn configure(&mut self, cfg: LearnConfig) -> Result<(), super::ShapeChanged> {
        reconfigure(&mut self.cfg, &mut self.status, cfg)
    }

    fn gives_up(&self) -> bool {
        false
    }
}
