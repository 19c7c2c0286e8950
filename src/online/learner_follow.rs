//! A serving replica's learner (`--role serve`): it never trains; each turn of the trainer
//! thread (woken by the store's notification, at most 500 ms apart) it follows the trainer.

use super::*;

impl Learner {
    /// A serving replica's turn: publish the trainer's newest checkpoint (its lineage's, in the
    /// shared store; its files in the shared data directory) under the trainer's version number,
    /// if newer than the one served. Polled by the trainer thread's loop (at most 500 ms apart).
    pub(super) fn follow(&mut self, env: &Env) -> Result<(), TrainError> {
        let name = self.cfg.name.clone();
        let Some(l) = env.log.active_lineage(&name)? else {
            return Ok(());
        };
        let Some((cp, committed)) = env.log.newest_checkpoint(l.id)? else {
            return Ok(());
        };
        let lag = env.metrics.replica_version_lag.with_label_values(&[&name]);
        lag.set(cp.version.saturating_sub(self.status.version) as i64);
        if l.id == self.lineage.id && cp.version <= self.status.version {
            return Ok(());
        }
        let t0 = std::time::Instant::now();
        // Never serve what cannot be verified: the files loaded, against the manifest the
        // trainer wrote last (fetched from the adapter store first if there is one).
        let (dir, fetched) = env
            .local_checkpoint(&cp, l.id)
            .map_err(|e| TrainError::new(ErrorKind::Checkpoint, e))?;
        let w = peft::load_within(&dir, &env.model.config, &env.registry.limits)
            .map_err(|e| TrainError::new(ErrorKind::Checkpoint, e))?;
        let who = Publisher::Claim {
            id: l.id,
            min_version: cp.version,
        };
        let (v, _) = env
            .registry
            .publish_as(&name, w, who)
            .map_err(|e| TrainError::new(ErrorKind::Publish, e))?;
        tracing::info!(
            adapter = %name, version = v.version, step = cp.step,
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
