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
    std::fs::write(out.join("conversions.txt"), conversions(&nvcc, &fatbin)).unwrap();

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

/// Per kernel and architecture, the integer-to-float conversions of values (I2F, I2FP: an eighth
/// of the FP32 rate on sm_90) in the fatbin's SASS, "name arch count" a line, from cuobjdump beside nvcc
/// (`scripts/cuda-toolkit` installs it); "unavailable: why" without it (the test says so).
fn conversions(nvcc: &Path, fatbin: &Path) -> String {
    let bin = nvcc.parent().unwrap();
    let cuobjdump = bin.join("cuobjdump");
    // Read again once scripts/cuda-toolkit has installed it.
    println!("cargo:rerun-if-changed={}", cuobjdump.display());
    if !cuobjdump.exists() {
        return format!(
            "unavailable: no {} (run scripts/cuda-toolkit)\n",
            cuobjdump.display()
        );
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut dirs = vec![bin.to_path_buf()];
    dirs.extend(std::env::split_paths(&path));
    let o = Command::new(&cuobjdump)
        .arg("-sass")
        .arg(fatbin)
        .env("PATH", std::env::join_paths(dirs).unwrap())
        .output();
    let o = match o {
        Ok(o) if o.status.success() => o,
        Ok(o) => {
            return format!(
                "unavailable: cuobjdump failed: {}\n",
                String::from_utf8_lossy(&o.stderr).trim()
            )
        }
        Err(e) => return format!("unavailable: cuobjdump: {e}\n"),
    };
    let (mut arch, mut report) = (String::new(), String::new());
    let mut current: Option<(String, usize)> = None;
    let flush = |current: &mut Option<(String, usize)>, arch: &str, report: &mut String| {
        if let Some((name, n)) = current.take() {
            report.push_str(&format!("{name} {arch} {n}\n"));
        }
    };
    for line in String::from_utf8_lossy(&o.stdout).lines() {
        let t = line.trim();
        if let Some(a) = t.strip_prefix("code for ") {
            flush(&mut current, &arch, &mut report);
            arch = a.trim().to_string();
        } else if let Some(f) = t.strip_prefix("Function : ") {
            flush(&mut current, &arch, &mut report);
            current = Some((f.trim().to_string(), 0));
        } else if let (Some((_, n)), Some(rest)) = (current.as_mut(), t.strip_prefix("/*")) {
            // "/*0a10*/  @!P0 I2FP.F32.U32 R1, R2 ;": the opcode after the address and predicate.
            let op = rest
                .split_once("*/")
                .map(|(_, r)| {
                    r.split_whitespace()
                        .find(|w| !w.starts_with('@'))
                        .unwrap_or("")
                })
                .unwrap_or("");
            // Not I2F.RP (.U32.RP): with MUFU.RCP, the compiler's integer division.
            if op.starts_with("I2F") && !op.contains(".RP") {
                *n += 1;
            }
        }
    }
    flush(&mut current, &arch, &mut report);
    report
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
