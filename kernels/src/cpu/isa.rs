//! The kernels' vocabulary: which implementation runs (`Isa`) and the arithmetic of the base's
//! products (`Precision`), with what this CPU can run of each.

use super::features::{Features, PathsInUse};

/// Which implementation of the kernels runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// The scalar reference: slow, single-threaded, the truth.
    Reference,
    Avx2,
    Avx512,
}

impl Isa {
    /// Every ISA the kernels are written for.
    pub const ALL: [Isa; 3] = [Isa::Reference, Isa::Avx2, Isa::Avx512];

    /// The fast ISAs this CPU supports, after saying on stderr which run and which are skipped
    /// (for tests: a path the machine lacks is skipped with a message, never silently).
    pub fn tested() -> Vec<Isa> {
        let have = Isa::available();
        let (run, skip): (Vec<Isa>, Vec<Isa>) =
            Isa::ALL[1..].iter().partition(|i| have.contains(i));
        eprintln!(
            "kernel paths tested on this CPU: {run:?}; skipped (this CPU lacks them): {skip:?}"
        );
        run
    }

    /// The best ISA this CPU supports.
    pub fn detect() -> Isa {
        Isa::available()
            .into_iter()
            .last()
            .unwrap_or(Isa::Reference)
    }

    /// Every ISA this CPU can run, reference first.
    pub fn available() -> Vec<Isa> {
        let mut v = vec![Isa::Reference];
        #[cfg(target_arch = "x86_64")]
        {
            // Through `Features`, so that FLYWHEEL_MAX_ISA=avx2 caps the kernels too.
            let f = Features::get();
            if f.avx2 && f.fma && f.f16c {
                v.push(Isa::Avx2);
                if f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq {
                    v.push(Isa::Avx512);
                }
            }
        }
        v
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Reference => "reference",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    pub fn lanes(self) -> usize {
        match self {
            Isa::Reference => 1,
            Isa::Avx2 => 8,
            Isa::Avx512 => 16,
        }
    }
}

/// The arithmetic of the base's products (`Matmul`): the only place the fast path may differ.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    /// f32 products of dequantized weights and f32 activations (the default; exact math within
    /// f32 rounding).
    #[default]
    Exact,
    /// Weights and activations rounded to BF16, products summed in f32 (`vdpbf16ps`): twice the
    /// multiply-adds per instruction. Serving and training run it alike, so they stay equal.
    Bf16,
    /// Activations quantized per block of 32 to int8 and dotted with the weights' 4/8-bit codes
    /// (`vpdpbusd` with AVX512_VNNI, `vpmaddubsw` on AVX2: the same bits), block scales in f32:
    /// llama.cpp's arithmetic, for Q4_0, Q4_1, Q8_0, IQ4_NL, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS
    /// weights (others, and the LM head, stay exact). The input gradient runs in BF16 where the CPU has it, else in f32.
    Int8,
}

impl std::str::FromStr for Precision {
    type Err = String;
    fn from_str(s: &str) -> Result<Precision, String> {
        match s {
            "exact" => Ok(Precision::Exact),
            "bf16" => Ok(Precision::Bf16),
            "int8" => Ok(Precision::Int8),
            _ => Err(format!("'{s}': expected exact, bf16 or int8")),
        }
    }
}

impl Precision {
    pub fn name(self) -> &'static str {
        match self {
            Precision::Exact => "exact",
            Precision::Bf16 => "bf16",
            Precision::Int8 => "int8",
        }
    }

    /// The arithmetic of the input gradient dx = dy·W under this precision on `isa`'s kernels:
    /// int8 products take BF16's where the CPU has AVX512_BF16 (dy is not quantized to 8 bits)
    /// and the kernels are not AVX2's; the reference emulates the fast path's choice.
    pub fn backward(self, isa: Isa) -> Precision {
        match self {
            Precision::Int8 if Features::get().avx512_bf16 && isa != Isa::Avx2 => Precision::Bf16,
            Precision::Int8 => Precision::Exact,
            p => p,
        }
    }

    /// The arithmetic of the LM head's product under this precision: int8 products keep it exact
    /// (its outputs are the logits themselves: with it in int8 the next-token log-probs moved
    /// further from exact math than llama.cpp's, 0.103 vs 0.096 in tests/python/test_llamacpp.py;
    /// at decode it reads the memory about as fast either way, `lowp_bench`).
    pub fn head(self) -> Precision {
        match self {
            Precision::Int8 => Precision::Exact,
            p => p,
        }
    }

    /// What the CPU must have for this precision (for error messages).
    pub fn needs(self) -> &'static str {
        match self {
            Precision::Exact => "nothing",
            Precision::Bf16 => "AVX512_BF16",
            Precision::Int8 => "AVX2",
        }
    }

    /// Whether the kernels of `isa` can run this precision on this CPU (the reference emulates
    /// every precision).
    pub fn supported(self, isa: Isa) -> bool {
        match (self, isa) {
            (Precision::Exact, _) | (_, Isa::Reference) => true,
            (Precision::Bf16, Isa::Avx512) => Features::get().avx512_bf16,
            (Precision::Int8, _) => true,
            (Precision::Bf16, Isa::Avx2) => false,
        }
    }
}

/// The kernels and products `isa` and `precision` run on this CPU, and the features they use
/// (`Features::report`'s subject).
pub fn paths_in_use(isa: Isa, precision: Precision) -> PathsInUse {
    let mut uses = match isa {
        Isa::Reference => vec![],
        Isa::Avx2 => vec!["avx2", "fma", "f16c"],
        Isa::Avx512 => vec![
            "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
        ],
    };
    if isa != Isa::Reference {
        if precision == Precision::Int8 && isa == Isa::Avx512 && Features::get().avx512_vnni {
            uses.push("avx512_vnni");
        }
        if precision.backward(isa) == Precision::Bf16 {
            uses.push("avx512_bf16");
        }
    }
    let how = match precision {
        Precision::Exact => "f32 FMA on dequantized weights",
        Precision::Bf16 => "vdpbf16ps on BF16-rounded weights and activations, f32 sums",
        Precision::Int8 => {
            "int8 activations x the weights' 4/8-bit codes (vpdpbusd with AVX512_VNNI, else \
             vpmaddubsw), f32 block scales; input gradients in BF16 where present"
        }
    };
    PathsInUse {
        kernels: isa.name(),
        products: precision.name(),
        how,
        uses,
    }
}

#[cfg(test)]
mod tests {
    use super::super::features::Amx;
    use super::*;

    #[test]
    fn the_report_names_the_kernels_and_what_they_leave() {
        let f = Features {
            avx2: true,
            fma: true,
            f16c: true,
            avx512_bf16: true,
            ..Features::default()
        };
        let r = f.report(&paths_in_use(Isa::Avx2, Precision::Exact));
        assert!(r.starts_with("kernels=avx2 products=exact "), "{r}");
        assert!(r.contains("uses [avx2 fma f16c]"), "{r}");
        assert!(r.contains("not used by any path yet: [avx512_bf16]"), "{r}");
        assert!(!r.contains("AMX"), "{r}");
        let amx = Features {
            amx_tile: true,
            amx: Amx::Refused("errno 22".into()),
            ..f
        };
        assert!(amx
            .report(&paths_in_use(Isa::Avx2, Precision::Exact))
            .contains("refused by Linux: errno 22"));
        let b = Features {
            avx512f: true,
            ..amx
        }
        .report(&paths_in_use(Isa::Avx512, Precision::Bf16));
        assert!(b.starts_with("kernels=avx512 products=bf16 "), "{b}");
        assert!(b.contains(" avx512_bf16]; present"), "{b}");
        let capped = Features { capped: true, ..f };
        assert!(capped
            .report(&paths_in_use(Isa::Avx2, Precision::Exact))
            .contains("capped at AVX2 by FLYWHEEL_MAX_ISA=avx2"));
    }

    #[test]
    fn this_cpus_paths_are_reported() {
        let f = Features::get();
        let r = f.report(&paths_in_use(Isa::detect(), Precision::Exact));
        assert!(r.starts_with(&format!("kernels={} products=exact ", Isa::detect().name())));
        eprintln!("{r}");
    }
}
