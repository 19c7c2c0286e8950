//! With the `cuda` feature: compile `cuda/kernels.cu` with nvcc 13.0 into one fatbin (SASS for
//! sm_80 and sm_90, and sm_80's PTX for later chips), keep ptxas's register/spill report for the
//! tests, and build the host twin of the shared helpers (`cuda/twin.cu`). Without the feature,
//! nothing: the CPU build needs no CUDA.
//!
//! nvcc is found at $FLYWHEEL_NVCC, $CUDA_HOME/bin, $FLYWHEEL_CUDA_VENV or
//! ~/.cache/flywheel/cuda-13.0.2-venv (where `scripts/cuda-toolkit` installs PyPI's toolkit), the
//! workspace's target/cuda-venv (where it did before), or PATH. It must be 13.0: the lent GPUs' driver
//! (580, CUDA 13.0) cannot load the PTX that a later nvcc writes.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=cuda");
    println!("cargo:rerun-if-env-changed=FLYWHEEL_NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rerun-if-env-changed=FLYWHEEL_CUDA_VENV");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let nvcc = find_nvcc().unwrap_or_else(|| {
        panic!(
            "the cuda feature needs nvcc 13.0 and none was found: run scripts/cuda-toolkit \
             (PyPI's cuda-toolkit 13.0.2 into ~/.cache/flywheel), or set FLYWHEEL_NVCC"
        )
    });
    let version = run(Command::new(&nvcc).arg("--version"), "nvcc --version");
    if !version.contains("release 13.0") {
        panic!(
            "{} is not nvcc 13.0 ({}): the lent GPUs' driver (CUDA 13.0) cannot load a later \
             nvcc's PTX; run scripts/cuda-toolkit",
            nvcc.display(),
            version.lines().last().unwrap_or("")
        );
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    let src = Path::new("cuda");

    // The kernels: one fatbin, ptxas's report (registers, spills, shared memory per kernel and
    // architecture) kept for `tests/cuda.rs`.
    let fatbin = out.join("flywheel.fatbin");
    let report = run(
        Command::new(&nvcc)
            .args(["-std=c++17", "-O3", "--fatbin", "-Xptxas", "-v"])
            .args(["-gencode", "arch=compute_80,code=[sm_80,compute_80]"])
            .args(["-gencode", "arch=compute_90,code=sm_90"])
            .arg("-o")
            .arg(&fatbin)
            .arg(src.join("kernels.cu")),
        "nvcc (the kernels)",
    );
    std::fs::write(out.join("ptxas.txt"), report).unwrap();

    // The host twin: the helpers of common.cuh through nvcc's host path.
    let lib = nvcc.parent().unwrap().join("../lib");
    run(
        Command::new(&nvcc)
            .args(["-std=c++17", "-O2"])
            .arg(format!("-L{}", lib.display()))
            .arg("-o")
            .arg(out.join("fw_twin"))
            .arg(src.join("twin.cu")),
        "nvcc (the host twin)",
    );
}

/// Runs `cmd`, panicking with its output if it fails; returns stdout and stderr together.
fn run(cmd: &mut Command, what: &str) -> String {
    let o = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run {cmd:?}: {e}"));
    let text =
        String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
    if !o.status.success() {
        panic!("{what} failed ({}):\n{text}", o.status);
    }
    text
}

fn find_nvcc() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("FLYWHEEL_NVCC") {
        return Some(PathBuf::from(p));
    }
    if let Some(home) = std::env::var_os("CUDA_HOME") {
        let p = PathBuf::from(home).join("bin/nvcc");
        if p.exists() {
            return Some(p);
        }
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap()).join("../target")
        });
    let cache = std::env::var_os("FLYWHEEL_CUDA_VENV")
        .map(PathBuf::from)
        .or_else(|| {
            let home = PathBuf::from(std::env::var_os("HOME")?);
            Some(home.join(".cache/flywheel/cuda-13.0.2-venv"))
        });
    for venv in cache.into_iter().chain([target.join("cuda-venv")]) {
        let Ok(entries) = std::fs::read_dir(venv.join("lib")) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path().join("site-packages/nvidia/cu13/bin/nvcc");
            if p.exists() {
                return Some(p);
            }
        }
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("nvcc"))
        .find(|p| p.exists())
}
