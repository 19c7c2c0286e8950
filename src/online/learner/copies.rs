//! A learner's copies of its versions beside the data directory: fetching a checkpoint from the
//! adapter store (verified before use), and sweeping the uploads no committed version names
//! (a step whose upload succeeded but whose commit failed leaves one, under a name of its own).

use super::Env;
use crate::adapter::peft;
use crate::online::checkpoint::{
    adapter_rel, remove_dir, verify_checkpoint, CheckpointError, MANIFEST_FILE,
};
use crate::online::store::records::Checkpoint;
use std::collections::BTreeSet;
use std::path::PathBuf;

/// The files of a checkpoint a start or a turn needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Needed {
    /// The adapter: what a serving replica loads (always verified against the manifest).
    Adapter,
    /// The adapter and the optimizer: what a trainer resumes from (its own copy from before
    /// manifests is taken as it is).
    Resume,
}

impl Needed {
    fn files(self) -> &'static [&'static str] {
        match self {
            Needed::Adapter => &[peft::CONFIG_FILE, peft::WEIGHTS_FILE],
            Needed::Resume => &[
                peft::CONFIG_FILE,
                peft::WEIGHTS_FILE,
                crate::train::optim::STATE_FILE,
                crate::train::optim::CONFIG_FILE,
            ],
        }
    }
}

impl Env {
    /// Checkpoint `cp` of `lineage` as a folder on local disk, and whether it was fetched now.
    /// The data directory's copy is used if it matches its manifest (a trainer's own copy from
    /// before manifests, as it is); otherwise the files `needed` (a replica's: not the
    /// optimizer) are fetched from the adapter store (if any) and verified: no process loads an
    /// unverified upload.
    pub(super) fn local_checkpoint(
        &self,
        cp: &Checkpoint,
        lineage: u64,
        needed: Needed,
    ) -> Result<(PathBuf, bool), CheckpointError> {
        let dir = self.cfg.data_dir.join(&cp.path);
        let follow = needed == Needed::Adapter;
        let needed = needed.files();
        let here = match follow {
            _ if !dir.is_dir() => Err(CheckpointError::Missing { dir: dir.clone() }),
            false if !dir.join(MANIFEST_FILE).exists() => Ok(()), // written before manifests
            _ => verify_checkpoint(&dir, cp.version, lineage, needed),
        };
        let missing = match here {
            Ok(()) => return Ok((dir, false)),
            Err(e) => e,
        };
        let Some(store) = &self.adapters else {
            return Err(missing);
        };
        let t0 = std::time::Instant::now();
        store
            .fetch(&cp.path, &dir, needed)
            .map_err(|e| CheckpointError::Fetch {
                missing: Box::new(missing),
                error: format!("{e:#}"),
            })?;
        verify_checkpoint(&dir, cp.version, lineage, needed)?;
        let secs = t0.elapsed().as_secs_f64();
        self.metrics
            .adapter_store_seconds
            .with_label_values(&["fetch"])
            .observe(secs);
        tracing::info!(version = cp.version, path = %cp.path, fetch_ms = secs * 1e3, "fetched a version from the adapter store");
        Ok((dir, true))
    }
}

/// After a committed step of `name` and its retention (this trainer holds the adapter's claim,
/// so no other uploads): remove the version folders, in the adapter store and in the data
/// directory, that no checkpoint of `lineage` names (retired ones, and uploads whose commit
/// failed). Failures only warn (the next step tries again).
/// `retired`: the versions retention just retired (said so in the log, apart from uploads a
/// failed commit left).
pub(super) fn sweep_orphans(env: &Env, name: &str, lineage: u64, retired: &BTreeSet<String>) {
    let Some(store) = &env.adapters else { return };
    let keep: BTreeSet<String> = match env.log.checkpoints(lineage) {
        Ok(cps) => cps.into_iter().map(|c| c.path).collect(),
        Err(_) => return,
    };
    let dir_rel = adapter_rel(name);
    match store.versions(&dir_rel) {
        Ok(listed) => {
            for rel in listed.iter().filter(|r| !keep.contains(*r)) {
                let what = if retired.contains(rel) {
                    "a version retention retired (the newest two are kept)"
                } else {
                    "an upload no committed version names (a failed commit's)"
                };
                match store.delete(rel) {
                    Ok(()) => {
                        tracing::info!(path = %rel, "removed {what} from the adapter store")
                    }
                    Err(e) => {
                        tracing::warn!(path = %rel, error = %e, "cannot remove {what} from the adapter store")
                    }
                }
            }
        }
        Err(e) => tracing::warn!(error = %e, "cannot list the adapter store"),
    }
    let Ok(entries) = std::fs::read_dir(env.cfg.data_dir.join(&dir_rel)) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let rel = format!("{dir_rel}/{name}");
        if name.starts_with(".tmp-") || keep.contains(&rel) {
            continue;
        }
        if let Err(err) = remove_dir(&e.path()) {
            tracing::warn!(path = %e.path().display(), error = %err, "cannot remove a local copy no version names");
        }
    }
}
