//! The BF16 products (`Precision::Bf16`) against their scalar twin, to the bit, for every format,
//! path (rows and panel) and batch; how far they sit from the exact f32 products; and BF16
//! rounding itself. Skipped, with a message, on a CPU without AVX512_BF16 (the scalar twin's own
//! tests still run).

mod common;

use common::Rng;
use flywheel_kernels::cpu::Precision;
use flywheel_kernels::quant::quantize::quantize;
use flywheel_kernels::reference::{self, bf16_round};
use flywheel_kernels::{Cpu, Isa, QuantType, ThreadPool};
use std::time::Duration;

/// The BF16 `Cpu`, or None after saying why the path is skipped.
fn bf16_cpu(threads: usize) -> Option<Cpu> {
    let isa = Isa::detect();
    let cpu = Cpu::new(isa, ThreadPool::new(threads, Duration::from_micros(50)));
    match cpu.with_precision(Precision::Bf16) {
        Ok(c) => Some(c),
        Err(e) => {
            eprintln!("BF16 kernel path skipped: {e}");
            None
        }
    }
}

fn col_sizes(ty: QuantType) -> Vec<usize> {
    match ty.block_size() {
        1 => vec![32, 96, 160],
        32 => vec![32, 96, 576],
        _ => vec![256, 512],
    }
}

#[test]
fn bf16_products_equal_their_scalar_twin_to_the_bit() {
    let Some(cpu) = bf16_cpu(2) else { return };
    let mut rng = Rng(17);
    let rows = 37;
    for ty in QuantType::ALL {
        for cols in col_sizes(ty) {
            let w = quantize(ty, &rng.vec(rows * cols, 1.0));
            // 1..7 rows take the rows path, 8 and more the panel (66: a partial X_BLOCK).
            for n in [1usize, 2, 3, 5, 8, 13, 66] {
                let x = rng.vec(n * cols, 2.0);
                let mut want = vec![0.0; n * rows];
                reference::matmul_bf16(ty, &w, rows, cols, &x, &mut want);
                let mut got = vec![0.0; n * rows];
                cpu.matmul(ty, &w, rows, cols, &x, &mut got);
                for k in 0..n * rows {
                    assert_eq!(
                        got[k].to_bits(),
                        want[k].to_bits(),
                        "{ty:?} cols={cols} n={n} [{k}]: {} vs {}",
                        got[k],
                        want[k]
                    );
                }
            }
        }
    }
}

#[test]
fn bf16_rows_do_not_depend_on_the_batch() {
    let Some(cpu) = bf16_cpu(2) else { return };
    let mut rng = Rng(18);
    let (rows, cols, n) = (96, 576, 24);
    for ty in [
        QuantType::Q4_1,
        QuantType::Q8_0,
        QuantType::Q4K,
        QuantType::F32,
    ] {
        let cols = if ty.block_size() == 256 { 512 } else { cols };
        let w = quantize(ty, &rng.vec(rows * cols, 1.0));
        let x = rng.vec(n * cols, 1.0);
        let mut all = vec![0.0; n * rows];
        cpu.matmul(ty, &w, rows, cols, &x, &mut all);
        for i in 0..n {
            let mut one = vec![0.0; rows];
            cpu.matmul(ty, &w, rows, cols, &x[i * cols..(i + 1) * cols], &mut one);
            assert_eq!(one, all[i * rows..(i + 1) * rows], "{ty:?} row {i}");
        }
    }
}

/// Each product within BF16's rounding of its operands of the exact one: |Δ| ≤ 2·2⁻⁸·Σ|w·x| plus
/// f32 summation, and not equal to it (the path really rounds).
#[test]
fn bf16_products_stay_within_bf16_rounding_of_exact() {
    let Some(cpu) = bf16_cpu(2) else { return };
    let exact = Cpu::new(Isa::detect(), ThreadPool::new(2, Duration::from_micros(50)));
    let mut rng = Rng(19);
    let (rows, cols, n) = (64, 576, 9);
    let w = quantize(QuantType::Q8_0, &rng.vec(rows * cols, 1.0));
    let x = rng.vec(n * cols, 1.0);
    let (mut a, mut b) = (vec![0.0; n * rows], vec![0.0; n * rows]);
    exact.matmul(QuantType::Q8_0, &w, rows, cols, &x, &mut a);
    cpu.matmul(QuantType::Q8_0, &w, rows, cols, &x, &mut b);
    let mut wrow = vec![0.0; cols];
    let rb = QuantType::Q8_0.row_bytes(cols).unwrap();
    let mut differ = 0;
    for r in 0..rows {
        reference::dequantize_row(QuantType::Q8_0, &w[r * rb..(r + 1) * rb], &mut wrow);
        for i in 0..n {
            let mag: f32 = (0..cols).map(|c| (wrow[c] * x[i * cols + c]).abs()).sum();
            let k = i * rows + r;
            assert!(
                (a[k] - b[k]).abs() <= mag * (2.0 / 256.0 + 1e-5),
                "[{i}][{r}]: exact {} bf16 {} (Σ|wx| {mag})",
                a[k],
                b[k]
            );
            differ += (a[k] != b[k]) as usize;
        }
    }
    assert!(differ > n * rows / 2, "only {differ} products changed");
}

/// The reference path emulates BF16 too (every CPU can check against it).
#[test]
fn the_reference_cpu_runs_bf16_products() {
    let cpu = Cpu::new(Isa::Reference, ThreadPool::new(1, Duration::ZERO))
        .with_precision(Precision::Bf16)
        .expect("the reference emulates BF16");
    let mut rng = Rng(20);
    let (rows, cols) = (5, 64);
    let w = quantize(QuantType::F32, &rng.vec(rows * cols, 1.0));
    let x = rng.vec(2 * cols, 1.0);
    let (mut got, mut want) = (vec![0.0; 2 * rows], vec![0.0; 2 * rows]);
    cpu.matmul(QuantType::F32, &w, rows, cols, &x, &mut got);
    reference::matmul_bf16(QuantType::F32, &w, rows, cols, &x, &mut want);
    assert_eq!(got, want);
    // Rows whose length is not a multiple of 32 stay exact.
    let w = quantize(QuantType::F32, &rng.vec(rows * 48, 1.0));
    let x = rng.vec(48, 1.0);
    let (mut got, mut want) = (vec![0.0; rows], vec![0.0; rows]);
    cpu.matmul(QuantType::F32, &w, rows, 48, &x, &mut got);
    reference::matmul(QuantType::F32, &w, rows, 48, &x, &mut want);
    assert_eq!(got, want);
}

#[test]
fn bf16_rounding_is_to_nearest_even_with_denormals_flushed() {
    // Representable values stay.
    for v in [
        0.0f32,
        -0.0,
        1.0,
        -2.5,
        0.15625,
        f32::from_bits(0x7f00_0000),
        f32::INFINITY,
    ] {
        assert_eq!(bf16_round(v).to_bits(), v.to_bits(), "{v}");
    }
    // 1 + 2⁻⁸ is halfway between 1 and 1 + 2⁻⁷: ties go to the even (1).
    assert_eq!(bf16_round(1.0 + 1.0 / 256.0), 1.0);
    // 1 + 3·2⁻⁸ is halfway between 1 + 2⁻⁷ (odd) and 1 + 2⁻⁶ (even).
    assert_eq!(bf16_round(1.0 + 3.0 / 256.0), 1.0 + 1.0 / 64.0);
    // Just above halfway rounds up.
    assert_eq!(
        bf16_round(f32::from_bits((1.0f32 + 1.0 / 256.0).to_bits() + 1)),
        1.0 + 1.0 / 128.0
    );
    // Denormals become signed zero; NaN stays NaN; the largest finite rounds to infinity.
    assert_eq!(bf16_round(1e-40).to_bits(), 0);
    assert_eq!(bf16_round(-1e-40).to_bits(), (-0.0f32).to_bits());
    assert!(bf16_round(f32::NAN).is_nan());
    assert_eq!(bf16_round(f32::MAX), f32::INFINITY);
}

/// The BF16 input gradient dx = dy·W against its scalar twin, to the bit (odd row counts pair the
/// last row with zero), and within BF16 rounding of the f64 reference.
#[test]
fn bf16_input_gradients_equal_their_scalar_twin_to_the_bit() {
    let Some(cpu) = bf16_cpu(2) else { return };
    let mut rng = Rng(21);
    for ty in QuantType::ALL {
        for cols in col_sizes(ty) {
            for rows in [37usize, 64] {
                let w = quantize(ty, &rng.vec(rows * cols, 1.0));
                for n in [1usize, 3, 6] {
                    let dy = rng.vec(n * rows, 1.0);
                    let mut want = vec![0.0; n * cols];
                    reference::linear_backward_bf16(ty, &w, rows, cols, &dy, &mut want);
                    let mut got = vec![0.0; n * cols];
                    cpu.linear_backward(ty, &w, rows, cols, &dy, &mut got);
                    for k in 0..n * cols {
                        assert_eq!(
                            got[k].to_bits(),
                            want[k].to_bits(),
                            "{ty:?} rows={rows} cols={cols} n={n} [{k}]: {} vs {}",
                            got[k],
                            want[k]
                        );
                    }
                    let mut exact = vec![0.0; n * cols];
                    reference::linear_backward(ty, &w, rows, cols, &dy, &mut exact);
                    let scale = exact.iter().fold(0f32, |m, v| m.max(v.abs()));
                    for k in 0..n * cols {
                        assert!(
                            (got[k] - exact[k]).abs() <= 0.05 * scale,
                            "{ty:?} [{k}]: bf16 {} vs exact {}",
                            got[k],
                            exact[k]
                        );
                    }
                }
            }
        }
    }
}
