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

/// The products decode a code a weight without converting it from an integer (I2F/I2FP run at 16
/// a clock an SM against FP32's 128 on sm_90, by the CUDA guide's table; the H200's profile found
/// the decode products issue-bound, with one a weight; the gain is not timed yet). `units.cuh`'s `fw_code` makes the float from the
/// bits instead; what is left are the per-unit scales' conversions (a few a unit), far from the 32
/// a unit that one a weight would put there. Read from the fatbin's SASS (cuobjdump) on every
/// machine.
#[test]
fn the_products_convert_no_code_a_weight_to_float() {
    let report = flywheel_kernels::cuda::SASS_CONVERSIONS;
    assert!(
        !report.starts_with("unavailable"),
        "the SASS could not be read: {report}"
    );
    let count = |name: &str, arch: &str| -> usize {
        report
            .lines()
            .find_map(|l| {
                let mut w = l.split_whitespace();
                (w.next() == Some(name) && w.next() == Some(arch))
                    .then(|| w.next().unwrap().parse().unwrap())
            })
            .unwrap_or_else(|| panic!("no {name} for {arch} in the SASS report"))
    };
    let formats = [
        "q4_0", "q4_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k",
    ];
    // (layout, units a thread decodes at a time)
    let layouts = [
        ("fw_matmul1", 1),
        ("fw_matmulw", 2),
        ("fw_matmul", 1),
        ("fw_matmul_t4x8", 4),
        ("fw_matmul_t2x16", 2),
        ("fw_matmul_experts", 2),
    ];
    for arch in ["sm_80", "sm_90"] {
        for f in formats {
            for (layout, units) in layouts {
                let name = format!("{layout}_{f}");
                let n = count(&name, arch);
                eprintln!("{name} {arch}: {n} conversions");
                // A unit's scales and mins (Q2_K: 4), never one a value: the decode is unrolled
                // over the unit's 32 values, so one a value would be 32 a unit.
                assert!(
                    n < 16 * units,
                    "{name} on {arch}: {n} integer-to-float conversions (32 a unit means one a \
                     weight)"
                );
            }
        }
        // The int8 products: each dp4a's sum becomes a float by its bits (fw_dp4a_float), and the
        // formats without K-quant scales convert nothing (there were 12 to 136 before).
        for f in ["q4_0", "q4_1", "q8_0"] {
            for layout in [
                "fw_matmul_i8",
                "fw_matmul_i8b",
                "fw_matmul_i8l",
                "fw_matmul_i8lb",
                "fw_matmul_experts_i8",
            ] {
                let name = format!("{layout}_{f}");
                assert_eq!(count(&name, arch), 0, "{name} on {arch}");
            }
        }
    }
    // The count sees conversions where there are some: IQ4_XS's 6-bit block scale, once a unit.
    // (One a value, as every format above had before fw_code, shows as ≥ 32 a unit.)
    assert!(count("fw_matmul1_iq4_xs", "sm_90") >= 1);
}
