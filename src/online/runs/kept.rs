//! Runs kept across restarts: each run's newest state (adapter and AdamW) is a checkpoint folder
//! under `runs/` in the data directory, recorded in the rollout store with what the run was made
//! with, and replaced (written, recorded, then the old folder deleted) after each optimizer step
//! and each load; the count of datums whose gradients were summed since is recorded after each
//! `forward_backward`, so a restart knows what it lost. Nothing is answered before it is kept.

use super::{RunError, RunState};
use crate::adapter::registry::adapter_file_name;
use crate::adapter::AdapterWeights;
use crate::online::checkpoint::{load_checkpoint, remove_dir, write_checkpoint};
use crate::online::learner::Env;
use crate::online::store::records::{RunRecord, SessionRecord};
use crate::train::optim::AdamW;

/// What is kept of a run, besides its state.
#[derive(Clone, Debug)]
pub struct RunMeta {
    pub session: String,
    pub owner: String,
    /// What it was made with (JSON).
    pub info: String,
}

/// Where a run's state is kept: the run's folder under `runs/` (its id as one file-name
/// component), one sub-folder per state, named at random (a new state never writes over the
/// one recorded).
fn run_rel(id: &str) -> String {
    format!("runs/{}", adapter_file_name(id))
}

/// Write `w` and `opt` as a new state folder of run `id` (unhashed: only this process reads it
/// back); its path relative to the data directory.
fn write_state(env: &Env, id: &str, w: &AdapterWeights, opt: &AdamW) -> Result<String, RunError> {
    let rel = format!("{}/s-{:016x}", run_rel(id), crate::util::random_u64());
    write_checkpoint(&env.cfg.data_dir, &rel, (opt.step, 0), w, opt, false)
        .map_err(|e| RunError::Write(e.to_string()))?;
    Ok(rel)
}

/// Run `id` kept in `env`'s data directory and rollout store: `RunState::work` keeps each change
/// of its state with it before it answers.
pub struct Kept<'a> {
    pub env: &'a Env,
    pub id: &'a str,
}

impl Kept<'_> {
    /// The adapter and optimizer are about to become `w` and `opt`: keep them first.
    pub fn state(&self, w: &AdapterWeights, opt: &AdamW) -> Result<(), RunError> {
        let dir = &self.env.cfg.data_dir;
        let rel = write_state(self.env, self.id, w, opt)?;
        let old = match self.env.log.set_run_state(self.id, &rel, opt.step) {
            Ok(old) => old,
            Err(e) => {
                let _ = remove_dir(&dir.join(&rel));
                return Err(RunError::Write(e.to_string()));
            }
        };
        if let Err(e) = remove_dir(&dir.join(&old)) {
            tracing::warn!(run = %self.id, "cannot delete a replaced state {old}: {e}");
        }
        Ok(())
    }

    /// The gradients of `datums` datums are about to be summed since the state kept.
    pub fn pending(&self, datums: usize) -> Result<(), RunError> {
        let log = &self.env.log;
        log.set_run_pending(self.id, datums as u64)
            .map_err(|e| RunError::Write(e.to_string()))
    }
}

/// Keep new run `id` (`meta`, starting from `w` and `opt`): its first state, then its record.
pub fn keep_new(
    env: &Env,
    id: &str,
    meta: &RunMeta,
    w: &AdapterWeights,
    opt: &AdamW,
) -> Result<(), RunError> {
    let rel = write_state(env, id, w, opt)?;
    let rec = RunRecord {
        id: id.to_string(),
        session: meta.session.clone(),
        owner: meta.owner.clone(),
        info: meta.info.clone(),
        state: rel.clone(),
        step: opt.step,
        pending: 0,
    };
    if let Err(e) = env.log.put_run(&rec) {
        let _ = remove_dir(&env.cfg.data_dir.join(&rel));
        return Err(RunError::Write(e.to_string()));
    }
    Ok(())
}

/// The sessions and runs a restart brings back.
pub struct Restored {
    pub sessions: Vec<SessionRecord>,
    /// Each run kept, with its state's parameter count; its state is back in the trainer.
    pub runs: Vec<(RunRecord, usize)>,
}

/// Read back the runs kept in `env` (each run's folder swept of states never recorded): their
/// states, and what the API keeps of them. A run whose state cannot be read is left out (said
/// in the log; its record stays for a later start).
pub fn restore(env: &Env) -> Result<(Restored, Vec<(String, RunState)>), RunError> {
    let (sessions, records) = env
        .log
        .open_sessions()
        .map_err(|e| RunError::Write(e.to_string()))?;
    let (dir, limits) = (&env.cfg.data_dir, &env.registry.limits);
    let (mut runs, mut states) = (Vec::new(), Vec::new());
    for r in records {
        sweep(dir, &r);
        match load_checkpoint(&dir.join(&r.state), &env.model.config, limits) {
            Ok((w, opt)) => {
                let n = w.layout.num_params;
                let mut s = RunState::new(w, Some(opt));
                s.lost = r.pending as usize;
                states.push((r.id.clone(), s));
                runs.push((r, n));
            }
            Err(e) => tracing::error!(run = %r.id, "cannot restore the run from {}: {e}", r.state),
        }
    }
    Ok((Restored { sessions, runs }, states))
}

/// Delete the folders of run `r` other than its recorded state (left by a process that died
/// between writing a state and recording it, or before deleting the one it replaced).
fn sweep(dir: &std::path::Path, r: &RunRecord) {
    let Ok(entries) = std::fs::read_dir(dir.join(run_rel(&r.id))) else {
        return;
    };
    for e in entries.flatten() {
        let rel = format!("{}/{}", run_rel(&r.id), e.file_name().to_string_lossy());
        if rel != r.state {
            let _ = remove_dir(&e.path());
        }
    }
}

/// End sessions `ids` in the store, with their runs, and delete the runs' folders.
pub fn end_sessions(env: &Env, ids: &[String]) {
    match env.log.end_sessions(ids) {
        Ok(states) => {
            for s in states {
                let folder = s.rsplit_once('/').map(|(f, _)| f).unwrap_or(&s);
                let _ = remove_dir(&env.cfg.data_dir.join(folder));
            }
        }
        Err(e) => tracing::warn!("cannot forget the ended sessions {ids:?}: {e}"),
    }
}
