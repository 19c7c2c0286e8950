//! A learning adapter's checkpoints on disk: folders `adapters/NAME/v-VERSION` under the data
//! directory (adapter in PEFT's format + optimizer), written atomically (a temporary sibling,
//! fsynced, renamed, the parent fsynced), read back checked, and their leftovers swept.

use crate::adapter::{peft, AdapterBase, AdapterLimits, AdapterWeights};
use crate::train::optim::{AdamW, OptimError};
use std::path::Path;

/// A learning adapter's checkpoint folder, relative to the data directory.
pub fn checkpoint_rel(name: &str, version: u64) -> String {
    let dir = crate::adapter::registry::adapter_file_name(name);
    format!("adapters/{dir}/v-{version:08}")
}

/// Adapter and optimizer of a checkpoint folder, checked against each other.
pub fn load_checkpoint(
    dir: &Path,
    model: &impl AdapterBase,
    limits: &AdapterLimits,
) -> Result<(AdapterWeights, AdamW), String> {
    let w = peft::load_within(dir, model, limits).map_err(|e| e.to_string())?;
    let opt = AdamW::load(dir).map_err(|e: OptimError| e.to_string())?;
    if opt.m.len() != w.layout.num_params {
        return Err(format!(
            "{}: the optimizer holds {} values for an adapter of {} parameters",
            dir.display(),
            opt.m.len(),
            w.layout.num_params
        ));
    }
    Ok((w, opt))
}

/// Remove `path` (a folder) if it exists.
pub fn remove_dir(path: &Path) -> std::io::Result<()> {
    match std::fs::remove_dir_all(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Remove the temporary folders a crash or a failed checkpoint left under `data_dir/adapters`.
pub fn sweep_temporaries(data_dir: &Path) {
    let Ok(names) = std::fs::read_dir(data_dir.join("adapters")) else {
        return;
    };
    for dir in names.flatten() {
        let Ok(entries) = std::fs::read_dir(dir.path()) else {
            continue;
        };
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with(".tmp-") {
                match remove_dir(&e.path()) {
                    Ok(()) => {
                        tracing::info!(path = %e.path().display(), "removed a leftover temporary checkpoint")
                    }
                    Err(err) => {
                        tracing::warn!(path = %e.path().display(), error = %err, "cannot remove a leftover temporary checkpoint")
                    }
                }
            }
        }
    }
}

/// Write adapter + optimizer to `data_dir/rel` atomically: a temporary sibling folder, fsynced,
/// renamed, the parent fsynced. The temporary folder is removed on failure.
pub fn write_checkpoint(
    data_dir: &Path,
    rel: &str,
    w: &AdapterWeights,
    opt: &AdamW,
) -> anyhow::Result<()> {
    let dir = data_dir.join(rel);
    let parent = dir.parent().expect("a checkpoint path has a parent");
    std::fs::create_dir_all(parent)
        .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", parent.display()))?;
    let base = dir.file_name().expect("named").to_string_lossy();
    let tmp = parent.join(format!(".tmp-{base}"));
    // Left by a crash or a failed try before its record was committed: never read, replaced.
    remove_dir(&tmp)?;
    remove_dir(&dir)?;
    let write = || -> anyhow::Result<()> {
        peft::save(w, &tmp)?;
        opt.save(&tmp)?;
        crate::util::sync_dir(&tmp)?;
        std::fs::rename(&tmp, &dir)?;
        crate::util::sync_dir(parent)?;
        Ok(())
    };
    let r = write();
    if r.is_err() {
        let _ = remove_dir(&tmp);
    }
    r.map_err(|e| anyhow::anyhow!("checkpoint {}: {e}", dir.display()))
}
