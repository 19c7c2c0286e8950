//! ptxas's report for the fatbin, read on every machine: every kernel compiled for sm_80 and sm_90,
//! no spills, no stack, registers and shared memory within the devices' limits.

use flywheel_kernels::cuda::{kernels, PTXAS_REPORT};

struct Kernel {
    name: String,
    arch: String,
    registers: u32,
    smem: u32,
    stack: u32,
    spills: u32,
}

fn number_before(line: &str, unit: &str) -> Option<u32> {
    let at = line.find(unit)?;
    line[..at].split_whitespace().last()?.parse().ok()
}

fn ptxas_kernels() -> Vec<Kernel> {
    let mut out: Vec<Kernel> = Vec::new();
    for line in PTXAS_REPORT.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let mut parts = rest.split('\'');
            let name = parts.next().unwrap().to_string();
            let arch = parts.nth(1).unwrap_or("").to_string();
            out.push(Kernel {
                name,
                arch,
                registers: 0,
                smem: 0,
                stack: u32::MAX,
                spills: u32::MAX,
            });
        } else if let Some(k) = out.last_mut() {
            if line.contains("spill stores") {
                k.stack = number_before(line, "bytes stack frame").unwrap();
                k.spills = number_before(line, "bytes spill stores").unwrap()
                    + number_before(line, "bytes spill loads").unwrap();
            } else if line.contains("registers") {
                k.registers = number_before(line, "registers").unwrap();
                k.smem = number_before(line, "bytes smem").unwrap_or(0);
            }
        }
    }
    out
}

#[test]
fn every_kernel_compiles_for_sm80_and_sm90_without_spills_within_the_limits() {
    let compiled = ptxas_kernels();
    let names = kernels();
    for arch in ["sm_80", "sm_90"] {
        for name in &names {
            let k = compiled
                .iter()
                .find(|k| k.name == *name && k.arch == arch)
                .unwrap_or_else(|| panic!("{name} was not compiled for {arch}"));
            // 255 registers a thread, 64 K a block of up to 256 threads; 48 KiB of static shared
            // memory (both architectures' limit without opting in).
            assert_eq!(k.spills, 0, "{name} spills on {arch}");
            assert_eq!(k.stack, 0, "{name} uses a stack frame on {arch}");
            assert!(
                k.registers <= 255 && k.registers * 256 <= 65536,
                "{name}: {} registers",
                k.registers
            );
            assert!(
                k.smem <= 48 * 1024,
                "{name}: {} bytes of shared memory",
                k.smem
            );
        }
    }
    assert_eq!(
        compiled.len(),
        2 * names.len(),
        "kernels the list does not name"
    );
}
