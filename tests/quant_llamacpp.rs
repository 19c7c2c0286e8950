//! Every block format against llama.cpp's own dequantization (its `gguf` Python package,
//! `gguf.quants.dequantize`), bit for bit: the scalar reference and each fast path this CPU has,
//! on blocks a quantizer writes and on random bytes (subnormal, infinite and NaN scales).
//! Skipped, saying so, where the package is missing (scripts/test installs it).

mod common;

use common::{python_json, Rng};
use flywheel::kernels::quant::quantize::quantize;
use flywheel::kernels::{reference, Cpu, Isa, QuantType, ThreadPool};
use std::time::Duration;

const SCRIPT: &str = r#"
import json, sys
try:
    import numpy as np
    from gguf import quants, GGMLQuantizationType
except ImportError:
    print("null"); sys.exit()
ty, rows, row_bytes, path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
data = np.fromfile(path, dtype=np.uint8).reshape(rows, row_bytes)
out = quants.dequantize(data, GGMLQuantizationType(ty)).astype(np.float32)
print(json.dumps(out.reshape(-1).view(np.uint32).tolist()))
"#;

fn llamacpp(ty: QuantType, rows: usize, row_bytes: usize, bytes: &[u8]) -> Option<Vec<f32>> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("blocks.bin");
    std::fs::write(&path, bytes).unwrap();
    let args = [
        ty.ggml_id().to_string(),
        rows.to_string(),
        row_bytes.to_string(),
        path.to_str().unwrap().to_string(),
    ];
    let args: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
    let bits: Option<Vec<u32>> = python_json(SCRIPT, &args);
    bits.map(|b| b.into_iter().map(f32::from_bits).collect())
}

/// The same value: equal bits, or both NaN (a NaN's payload is not part of the contract), or
/// zeros of either sign (the AVX paths decode Q4_0 as one FMA, q·d − 8d, whose zero is +0 where
/// llama.cpp's (q − 8)·d gives −0 for a negative d; no product or sum can tell them apart).
fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()) || (a == 0.0 && b == 0.0)
}

#[test]
fn every_format_dequantizes_as_llama_cpp_does_bit_for_bit() {
    let mut rng = Rng(21);
    let (rows, cols) = (4, 512);
    let isas: Vec<Isa> = std::iter::once(Isa::Reference)
        .chain(Isa::tested())
        .collect();
    for ty in QuantType::ALL {
        let rb = ty.row_bytes(cols).unwrap();
        let quantized: Vec<u8> = (0..rows)
            .flat_map(|_| quantize(ty, &rng.vec(cols, 2.0)))
            .collect();
        let raw: Vec<u8> = (0..rows * rb).map(|_| rng.next() as u8).collect();
        for (what, bytes) in [("quantized", &quantized), ("random bytes", &raw)] {
            let Some(want) = llamacpp(ty, rows, rb, bytes) else {
                eprintln!("skipped: Python's gguf package (llama.cpp's) is not installed");
                return;
            };
            for &isa in &isas {
                let cpu = Cpu::new(isa, ThreadPool::new(1, Duration::ZERO));
                let mut got = vec![0f32; rows * cols];
                for r in 0..rows {
                    let src = &bytes[r * rb..(r + 1) * rb];
                    let dst = &mut got[r * cols..(r + 1) * cols];
                    match isa {
                        Isa::Reference => reference::dequantize_row(ty, src, dst),
                        _ => cpu.dequantize_row(ty, src, dst),
                    }
                }
                let bad = (0..got.len()).find(|&i| !same(got[i], want[i]));
                assert!(
                    bad.is_none(),
                    "{} ({what}, {}): value {} is {} here, {} in llama.cpp",
                    ty.name(),
                    isa.name(),
                    bad.unwrap(),
                    got[bad.unwrap()],
                    want[bad.unwrap()]
                );
            }
        }
    }
}
