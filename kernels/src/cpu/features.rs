//! What this CPU offers for matrix work, detected once per process, and what the kernels make of
//! it. `Features::get()` reads CPUID (through std's detection, and CPUID leaf 7 directly for the
//! AMX bits std does not expose on stable Rust) and, where the CPU has AMX tiles, asks Linux for
//! permission to use them (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`, once per
//! process, before any tile instruction). `Features::report` is the line the start-up log and
//! `flywheel bench` print: the kernels in use and the instruction sets present but not used by
//! any path yet.

use std::sync::OnceLock;

/// The kernels and products in use, as `Features::report` names them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PathsInUse {
    pub kernels: &'static str,
    pub products: &'static str,
    /// How the products compute.
    pub how: &'static str,
    /// The features those paths use.
    pub uses: Vec<&'static str>,
}

/// The instruction-set extensions that matter to the kernels.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Features {
    pub avx2: bool,
    pub fma: bool,
    pub f16c: bool,
    pub avx512f: bool,
    pub avx512bw: bool,
    pub avx512vl: bool,
    pub avx512dq: bool,
    /// `vdpbf16ps`: BF16 pairs dotted into f32.
    pub avx512_bf16: bool,
    /// `vpdpbusd` on 512-bit vectors: int8 dot products into int32.
    pub avx512_vnni: bool,
    /// The same on 256-bit vectors, VEX-encoded (Alder Lake and later, Zen 5).
    pub avx_vnni: bool,
    pub avx512_fp16: bool,
    pub amx_tile: bool,
    pub amx_bf16: bool,
    pub amx_int8: bool,
    /// Whether Linux granted this process the AMX tile state (asked only where `amx_tile`).
    pub amx: Amx,
    /// `FLYWHEEL_MAX_ISA=avx2`: the features above AVX2 (AVX-512, AVX-VNNI, AMX) hidden, so that
    /// this process runs what a CPU without AVX-512 (AMD Zen 3) runs, on any machine.
    pub capped: bool,
}

/// The environment variable that caps the instruction sets the kernels may use (as oneDNN's
/// `ONEDNN_MAX_CPU_ISA`): `avx2` (what a CPU without AVX-512 runs) or `native` (no cap).
pub const MAX_ISA_VAR: &str = "FLYWHEEL_MAX_ISA";

/// Whether `FLYWHEEL_MAX_ISA` asks for AVX2 at most (an unknown value is said once on stderr and
/// caps nothing).
fn capped_at_avx2() -> bool {
    match std::env::var(MAX_ISA_VAR).as_deref() {
        Err(_) | Ok("") | Ok("native") => false,
        Ok("avx2") => true,
        Ok(other) => {
            eprintln!("{MAX_ISA_VAR}={other:?} ignored: expected avx2 or native");
            false
        }
    }
}

/// The AMX tile state of this process.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Amx {
    /// No tiles on this CPU (or not x86_64 Linux): not asked.
    #[default]
    Absent,
    Granted,
    Refused(String),
}

impl Features {
    /// This CPU's features (detected on the first call; AMX permission requested then).
    pub fn get() -> &'static Features {
        static F: OnceLock<Features> = OnceLock::new();
        F.get_or_init(Features::detect)
    }

    #[cfg(target_arch = "x86_64")]
    fn detect() -> Features {
        // CPUID leaf 7 sub-leaf 0, EDX: AMX-BF16 (22), AMX-TILE (24), AMX-INT8 (25).
        // Leaf 7 is valid where the highest leaf is >= 7.
        let edx7 = if std::arch::x86_64::__cpuid(0).eax >= 7 {
            std::arch::x86_64::__cpuid_count(7, 0).edx
        } else {
            0
        };
        let capped = capped_at_avx2();
        // Beyond AVX2: hidden under FLYWHEEL_MAX_ISA=avx2.
        let above = |on: bool| on && !capped;
        let amx_tile = above(edx7 & (1 << 24) != 0);
        Features {
            capped,
            avx2: is_x86_feature_detected!("avx2"),
            fma: is_x86_feature_detected!("fma"),
            f16c: is_x86_feature_detected!("f16c"),
            avx512f: above(is_x86_feature_detected!("avx512f")),
            avx512bw: above(is_x86_feature_detected!("avx512bw")),
            avx512vl: above(is_x86_feature_detected!("avx512vl")),
            avx512dq: above(is_x86_feature_detected!("avx512dq")),
            avx512_bf16: above(is_x86_feature_detected!("avx512bf16")),
            avx512_vnni: above(is_x86_feature_detected!("avx512vnni")),
            avx_vnni: above(is_x86_feature_detected!("avxvnni")),
            avx512_fp16: above(is_x86_feature_detected!("avx512fp16")),
            amx_tile,
            amx_bf16: above(edx7 & (1 << 22) != 0),
            amx_int8: above(edx7 & (1 << 25) != 0),
            amx: match amx_tile {
                false => Amx::Absent,
                true => match request_amx() {
                    Ok(()) => Amx::Granted,
                    Err(e) => Amx::Refused(e),
                },
            },
        }
    }

    #[cfg(not(target_arch = "x86_64"))]
    fn detect() -> Features {
        Features::default()
    }

    /// Each feature with its name as Linux's /proc/cpuinfo spells it.
    pub fn named(&self) -> [(&'static str, bool); 14] {
        [
            ("avx2", self.avx2),
            ("fma", self.fma),
            ("f16c", self.f16c),
            ("avx512f", self.avx512f),
            ("avx512bw", self.avx512bw),
            ("avx512vl", self.avx512vl),
            ("avx512dq", self.avx512dq),
            ("avx512_bf16", self.avx512_bf16),
            ("avx512_vnni", self.avx512_vnni),
            ("avx_vnni", self.avx_vnni),
            ("avx512_fp16", self.avx512_fp16),
            ("amx_tile", self.amx_tile),
            ("amx_bf16", self.amx_bf16),
            ("amx_int8", self.amx_int8),
        ]
    }

    /// What runs and what is left: `kernels=avx512 products=exact (f32 FMA on dequantized
    /// weights) uses [...]; present, not used by any path yet: [...]` (`paths`: from
    /// `isa::paths_in_use`).
    pub fn report(&self, paths: &PathsInUse) -> String {
        let used = &paths.uses;
        let present: Vec<&str> = self
            .named()
            .iter()
            .filter(|(_, on)| *on)
            .map(|(n, _)| *n)
            .collect();
        let idle: Vec<&str> = present
            .iter()
            .copied()
            .filter(|n| !used.contains(n))
            .collect();
        let mut amx = match &self.amx {
            Amx::Granted => "; AMX tile state granted by Linux".to_string(),
            Amx::Refused(e) => format!("; AMX tile state refused by Linux: {e}"),
            Amx::Absent => String::new(),
        };
        if self.capped {
            amx.push_str(&format!(
                "; capped at AVX2 by {MAX_ISA_VAR}=avx2 (what the CPU has beyond it is hidden)"
            ));
        }
        format!(
            "kernels={} products={} ({}) uses [{}]; present, not used by any path yet: \
             [{}]{amx}",
            paths.kernels,
            paths.products,
            paths.how,
            used.join(" "),
            idle.join(" ")
        )
    }
}

/// Ask Linux for the AMX tile data state (needed once per process before the first tile
/// instruction; without it that instruction faults).
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
fn request_amx() -> Result<(), String> {
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_GET_XCOMP_PERM: u64 = 0x1022;
    const ARCH_REQ_XCOMP_PERM: u64 = 0x1023;
    const XFEATURE_XTILEDATA: u64 = 18;
    // SAFETY: arch_prctl with these codes reads/writes only the u64 we pass a pointer to.
    unsafe fn arch_prctl(code: u64, arg: u64) -> i64 {
        let ret: i64;
        std::arch::asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL => ret,
            in("rdi") code,
            in("rsi") arg,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack)
        );
        ret
    }
    // SAFETY: see arch_prctl.
    let ret = unsafe { arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) };
    if ret != 0 {
        return Err(format!(
            "arch_prctl(ARCH_REQ_XCOMP_PERM) failed (errno {})",
            -ret
        ));
    }
    let mut mask: u64 = 0;
    // SAFETY: see arch_prctl; `mask` outlives the call.
    let ret = unsafe { arch_prctl(ARCH_GET_XCOMP_PERM, &mut mask as *mut u64 as u64) };
    if ret != 0 || mask & (1 << XFEATURE_XTILEDATA) == 0 {
        return Err(format!(
            "arch_prctl(ARCH_GET_XCOMP_PERM) = {ret}, mask {mask:#x}: tile data not granted"
        ));
    }
    Ok(())
}

#[cfg(all(not(target_os = "linux"), target_arch = "x86_64"))]
fn request_amx() -> Result<(), String> {
    Err("AMX permission is only requested on Linux".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Detection agrees with the kernel's view of the CPU (/proc/cpuinfo's flags), feature by
    /// feature; the AMX permission was granted exactly where the CPU has tiles.
    #[test]
    fn detection_agrees_with_proc_cpuinfo() {
        let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") else {
            eprintln!("skipped: no /proc/cpuinfo");
            return;
        };
        let flags: std::collections::BTreeSet<&str> = info
            .lines()
            .find(|l| l.starts_with("flags"))
            .and_then(|l| l.split_once(':'))
            .map(|(_, f)| f.split_whitespace().collect())
            .unwrap_or_default();
        let f = Features::get();
        for (name, on) in f.named() {
            // Under FLYWHEEL_MAX_ISA=avx2 only AVX2, FMA and F16C may show.
            let allowed = !f.capped || ["avx2", "fma", "f16c"].contains(&name);
            assert_eq!(
                on,
                flags.contains(name) && allowed,
                "{name}: detected {on}, /proc/cpuinfo says otherwise (capped: {})",
                f.capped
            );
        }
        assert_eq!(f.amx == Amx::Granted, f.amx_tile, "{:?}", f.amx);
    }
}
