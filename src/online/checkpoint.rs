//! A learning adapter's checkpoints on disk: folders `adapters/NAME/v-VERSION` under the data
//! directory (adapter in PEFT's format + optimizer + a manifest written last: version, lineage
//! and each file's SHA-256), written atomically (a temporary sibling, fsynced, renamed, the
//! parent fsynced), read back checked, and their leftovers swept. A serving replica verifies
//! the manifest before it serves a checkpoint it did not write.

use crate::adapter::{peft, AdapterBase, AdapterError, AdapterLimits, AdapterWeights};
use crate::train::optim::{AdamW, OptimError};
use std::path::{Path, PathBuf};

/// Why a checkpoint folder cannot be used; each names the folder or the file.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error(transparent)]
    Adapter(#[from] AdapterError),
    #[error(transparent)]
    Optimizer(#[from] OptimError),
    #[error("{}: the optimizer holds {values} values for an adapter of {params} parameters", dir.display())]
    OptimizerSize {
        dir: PathBuf,
        values: usize,
        params: usize,
    },
    #[error("{}: not in the data directory", dir.display())]
    Missing { dir: PathBuf },
    #[error("{}: no manifest ({error})", dir.display())]
    NoManifest { dir: PathBuf, error: std::io::Error },
    #[error("{}: unreadable manifest ({error})", dir.display())]
    BadManifest {
        dir: PathBuf,
        error: serde_json::Error,
    },
    /// `found`: the version and lineage the manifest names.
    #[error("{}: the manifest is of {found}, not version {version} of lineage {lineage}", dir.display())]
    OtherVersion {
        dir: PathBuf,
        found: String,
        version: u64,
        lineage: u64,
    },
    #[error("{}: the manifest lists no {file}", dir.display())]
    Unlisted { dir: PathBuf, file: String },
    #[error("{}: {error}", path.display())]
    Unreadable {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{}: SHA-256 {got}, the manifest says {want}", path.display())]
    Altered {
        path: PathBuf,
        got: String,
        want: String,
    },
    /// Not at hand, and fetching it from the adapter store failed.
    #[error("{missing}; fetching it: {error}")]
    Fetch {
        missing: Box<CheckpointError>,
        error: String,
    },
}

/// The folder of a learning adapter's checkpoints, relative to the data directory.
pub fn adapter_rel(name: &str) -> String {
    format!(
        "adapters/{}",
        crate::adapter::registry::adapter_file_name(name)
    )
}

/// A learning adapter's checkpoint folder, relative to the data directory.
pub fn checkpoint_rel(name: &str, version: u64) -> String {
    format!("{}/v-{version:08}", adapter_rel(name))
}

/// The highest version any checkpoint folder of `name` under `data_dir` carries (`v-VERSION`, or
/// `v-VERSION-SUFFIX` in object storage's naming; temporary folders were never committed), 0 when
/// none: a version floor that survives losing the rollout store, so that no number is served
/// twice and no folder written over.
pub fn max_version_on_disk(data_dir: &Path, name: &str) -> u64 {
    let Ok(entries) = std::fs::read_dir(data_dir.join(adapter_rel(name))) else {
        return 0;
    };
    entries
        .flatten()
        .filter_map(|e| {
            let n = e.file_name();
            let digits = n
                .to_str()?
                .strip_prefix("v-")?
                .split('-')
                .next()?
                .to_string();
            digits.parse::<u64>().ok()
        })
        .max()
        .unwrap_or(0)
}

/// Adapter and optimizer of a checkpoint folder, checked against each other.
pub fn load_checkpoint(
    dir: &Path,
    model: &impl AdapterBase,
    limits: &AdapterLimits,
) -> Result<(AdapterWeights, AdamW), CheckpointError> {
    let w = peft::load_within(dir, model, limits)?;
    let opt = AdamW::load(dir)?;
    if opt.m.len() != w.layout.num_params {
        return Err(CheckpointError::OptimizerSize {
            dir: dir.to_path_buf(),
            values: opt.m.len(),
            params: w.layout.num_params,
        });
    }
    Ok((w, opt))
}

/// The manifest's file name in a checkpoint folder.
pub const MANIFEST_FILE: &str = "manifest.json";

fn sha256_hex(path: &Path) -> std::io::Result<String> {
    use sha2::Digest;
    let bytes = std::fs::read(path)?;
    Ok(sha2::Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// Write `dir`'s manifest: `{"version", "lineage", "files": {name: sha256}}` over every file in
/// it (written last, so its presence says the rest is complete); with `hashed` false, `files` is
/// empty (a folder only this process reads back: a training run's state, `runs::kept`, where
/// hashing took 160 ms of a 340 ms write of 131 MB on the Zen 4 test machine).
fn write_manifest(dir: &Path, version: u64, lineage: u64, hashed: bool) -> anyhow::Result<()> {
    let mut files = serde_json::Map::new();
    let mut names: Vec<String> = std::fs::read_dir(dir)?
        .filter_map(|e| Some(e.ok()?.file_name().to_string_lossy().into_owned()))
        .filter(|n| n != MANIFEST_FILE)
        .collect();
    names.sort();
    names.retain(|_| hashed);
    for n in names {
        files.insert(n.clone(), sha256_hex(&dir.join(&n))?.into());
    }
    let m = serde_json::json!({"version": version, "lineage": lineage, "files": files});
    crate::util::write_synced(&dir.join(MANIFEST_FILE), m.to_string().as_bytes())?;
    Ok(())
}

/// Check that `dir` holds checkpoint `version` of `lineage` and that each of `needed` (file
/// names) is there with the SHA-256 its manifest records.
pub fn verify_checkpoint(
    dir: &Path,
    version: u64,
    lineage: u64,
    needed: &[&str],
) -> Result<(), CheckpointError> {
    let d = || dir.to_path_buf();
    let text = std::fs::read_to_string(dir.join(MANIFEST_FILE))
        .map_err(|error| CheckpointError::NoManifest { dir: d(), error })?;
    let m: serde_json::Value = serde_json::from_str(&text)
        .map_err(|error| CheckpointError::BadManifest { dir: d(), error })?;
    if m["version"].as_u64() != Some(version) || m["lineage"].as_u64() != Some(lineage) {
        return Err(CheckpointError::OtherVersion {
            dir: d(),
            found: format!("version {} of lineage {}", m["version"], m["lineage"]),
            version,
            lineage,
        });
    }
    for name in needed {
        let want = m["files"][*name]
            .as_str()
            .ok_or_else(|| CheckpointError::Unlisted {
                dir: d(),
                file: name.to_string(),
            })?;
        let path = dir.join(name);
        let got = sha256_hex(&path).map_err(|error| CheckpointError::Unreadable {
            path: path.clone(),
            error,
        })?;
        if got != want {
            return Err(CheckpointError::Altered {
                path,
                got,
                want: want.to_string(),
            });
        }
    }
    Ok(())
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
/// renamed, the parent fsynced. The temporary folder is removed on failure. `hashed`: the
/// manifest records each file's SHA-256 (see `write_manifest`).
pub fn write_checkpoint(
    data_dir: &Path,
    rel: &str,
    (version, lineage): (u64, u64),
    w: &AdapterWeights,
    opt: &AdamW,
    hashed: bool,
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
        write_manifest(&tmp, version, lineage, hashed)?;
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
