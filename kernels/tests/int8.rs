//! The int8 products (`Precision::Int8`) against their scalar twin, to the bit, for every format
//! they take, odd block counts, decode and batches, on every kernel ISA the CPU has (AVX2's
//! `vpmaddubsw` kernels and AVX-512's VNNI ones give the same bits); how far they sit from the
//! exact f32 products; the quantizer.

mod common;

use common::Rng;
use flywheel_kernels::cpu::Precision;
use flywheel_kernels::quant::quantize::quantize;
use flywheel_kernels::reference::{self, int8_applies};
use flywheel_kernels::{Cpu, Isa, QuantType, ThreadPool};
use std::time::Duration;

const FORMATS: [QuantType; 9] = [
    QuantType::Q4_0,
    QuantType::Q4_1,
    QuantType::Q8_0,
    QuantType::IQ4NL,
    QuantType::Q3K,
    QuantType::Q4K,
    QuantType::Q5K,
    QuantType::Q6K,
    QuantType::IQ4XS,
];

/// An int8 `Cpu` per kernel ISA this CPU runs (which ran and which were skipped is said, and
/// whether AVX-512's take the VNNI kernels).
fn int8_cpus(threads: usize) -> Vec<Cpu> {
    let vnni = flywheel_kernels::cpu::Features::get().avx512_vnni;
    eprintln!(
        "int8 on avx512 takes the {} kernels",
        if vnni { "VNNI" } else { "AVX2" }
    );
    Isa::tested()
        .into_iter()
        .map(|isa| {
            Cpu::new(isa, ThreadPool::new(threads, Duration::from_micros(50)))
                .with_precision(Precision::Int8)
                .expect("int8 runs on every kernel ISA")
        })
        .collect()
}

/// The int8 `Cpu` of the best kernels.
fn int8_cpu(threads: usize) -> Option<Cpu> {
    int8_cpus(threads).pop()
}

fn exact_cpu() -> Cpu {
    Cpu::new(Isa::detect(), ThreadPool::new(2, Duration::from_micros(50)))
}

#[test]
fn int8_products_equal_their_scalar_twin_to_the_bit() {
    for cpu in int8_cpus(2) {
        products_equal_the_twin(&cpu);
    }
}

fn products_equal_the_twin(cpu: &Cpu) {
    let mut rng = Rng(31);
    let rows = 37;
    for ty in FORMATS {
        // 32 and 96: an odd number of blocks (the last pair has one); K-quants: 1, 2, 6 and 9
        // super-blocks.
        for cols in cols_for(ty, &[32, 96, 576, 1536]) {
            let w = quantize(ty, &rng.vec(rows * cols, 1.0));
            // 1..8 rows in one group, 9 and 13 in two, 70 past one X_BLOCK.
            for n in [1usize, 2, 3, 5, 8, 9, 13, 70] {
                let mut x = rng.vec(n * cols, 2.0);
                // A block of zeros (scale 0) and one with a single large value.
                x[..32].fill(0.0);
                if cols >= 64 {
                    x[40] = 300.0;
                }
                let mut want = vec![0.0; n * rows];
                reference::matmul_int8(ty, &w, rows, cols, &x, &mut want);
                let mut got = vec![0.0; n * rows];
                cpu.matmul(ty, &w, rows, cols, &x, &mut got);
                for k in 0..n * rows {
                    assert_eq!(
                        got[k].to_bits(),
                        want[k].to_bits(),
                        "{:?} {ty:?} cols={cols} n={n} [{k}]: {} vs {}",
                        cpu.isa,
                        got[k],
                        want[k]
                    );
                }
            }
        }
    }
}

/// Row lengths to test for format `ty`: `small` for 32-value blocks, whole super-blocks for the
/// K-quants.
fn cols_for(ty: QuantType, small: &[usize]) -> Vec<usize> {
    if ty.block_size() == 256 {
        vec![256, 512, 1536, 2304]
    } else {
        small.to_vec()
    }
}

#[test]
fn int8_rows_do_not_depend_on_the_batch() {
    for cpu in int8_cpus(2) {
        rows_alone_as_in_a_batch(&cpu);
    }
}

fn rows_alone_as_in_a_batch(cpu: &Cpu) {
    let mut rng = Rng(32);
    let (rows, n) = (96, 24);
    for ty in FORMATS {
        let cols = if ty.block_size() == 256 { 512 } else { 576 };
        let w = quantize(ty, &rng.vec(rows * cols, 1.0));
        let x = rng.vec(n * cols, 1.0);
        let mut all = vec![0.0; n * rows];
        cpu.matmul(ty, &w, rows, cols, &x, &mut all);
        for i in 0..n {
            let mut one = vec![0.0; rows];
            cpu.matmul(ty, &w, rows, cols, &x[i * cols..(i + 1) * cols], &mut one);
            assert_eq!(
                one,
                all[i * rows..(i + 1) * rows],
                "{:?} {ty:?} row {i}",
                cpu.isa
            );
        }
    }
}

/// Several products in one call on the same activations (q, k and v), in one format or
/// several, equal each product alone to the bit (they share one quantization per format).
#[test]
fn products_sharing_activations_equal_each_alone() {
    use flywheel_kernels::Matmul;
    let mut rng = Rng(36);
    let n = 3;
    // A Q4_K_M file's layer: Q4_K and Q6_K products on one input, with a Q8_0 one beside them.
    let sets: [(usize, &[(QuantType, usize)]); 2] = [
        (
            96,
            &[
                (QuantType::Q4_1, 40),
                (QuantType::Q4_1, 24),
                (QuantType::Q8_0, 24),
            ],
        ),
        (
            512,
            &[
                (QuantType::Q4K, 40),
                (QuantType::Q6K, 24),
                (QuantType::Q4K, 8),
                (QuantType::Q5K, 8),
                (QuantType::Q3K, 8),
                (QuantType::IQ4XS, 8),
                (QuantType::IQ4NL, 8),
                (QuantType::Q8_0, 16),
            ],
        ),
    ];
    for (cols, shapes) in sets {
        let x = rng.vec(n * cols, 1.0);
        let ws: Vec<Vec<u8>> = shapes
            .iter()
            .map(|&(ty, rows)| quantize(ty, &rng.vec(rows * cols, 1.0)))
            .collect();
        for cpu in int8_cpus(2) {
            let mut ys: Vec<Vec<f32>> = shapes.iter().map(|&(_, r)| vec![0.0; n * r]).collect();
            let mut jobs: Vec<Matmul> = shapes
                .iter()
                .zip(&ws)
                .zip(ys.iter_mut())
                .map(|((&(ty, rows), w), y)| Matmul {
                    ty,
                    w,
                    rows,
                    cols,
                    x: &x,
                    y,
                })
                .collect();
            // On a fresh thread: its quantization buffer holds nothing from earlier products.
            std::thread::scope(|t| {
                t.spawn(|| cpu.matmul_many(&mut jobs));
            });
            for ((&(ty, rows), w), y) in shapes.iter().zip(&ws).zip(&ys) {
                let mut alone = vec![0.0; n * rows];
                cpu.matmul(ty, w, rows, cols, &x, &mut alone);
                assert_eq!(&alone, y, "{:?} {ty:?} x {rows}", cpu.isa);
            }
        }
    }
}

/// Each product within int8 quantization of its activations of the exact one: per block the
/// error of x is at most d/2 = max|x_block|/254 per value, so |Δ| ≤ Σ_blocks Σ|w|·max|x|/254
/// (plus f32 summation); and not equal to it (the path really quantizes).
#[test]
fn int8_products_stay_within_the_activations_quantization_of_exact() {
    let Some(cpu) = int8_cpu(2) else { return };
    let exact = exact_cpu();
    let mut rng = Rng(33);
    let (rows, n) = (64, 9);
    for ty in FORMATS {
        let cols = if ty.block_size() == 256 { 512 } else { 576 };
        let w = quantize(ty, &rng.vec(rows * cols, 1.0));
        let x = rng.vec(n * cols, 1.0);
        let (mut a, mut b) = (vec![0.0; n * rows], vec![0.0; n * rows]);
        exact.matmul(ty, &w, rows, cols, &x, &mut a);
        cpu.matmul(ty, &w, rows, cols, &x, &mut b);
        let mut wrow = vec![0.0; cols];
        let rb = ty.row_bytes(cols).unwrap();
        let mut differ = 0;
        for r in 0..rows {
            reference::dequantize_row(ty, &w[r * rb..(r + 1) * rb], &mut wrow);
            for i in 0..n {
                let xi = &x[i * cols..(i + 1) * cols];
                let bound: f32 = (0..cols / 32)
                    .map(|blk| {
                        let amax = xi[blk * 32..][..32]
                            .iter()
                            .fold(0f32, |m, v| m.max(v.abs()));
                        let wsum: f32 = wrow[blk * 32..][..32].iter().map(|v| v.abs()).sum();
                        wsum * amax / 254.0
                    })
                    .sum();
                let k = i * rows + r;
                assert!(
                    (a[k] - b[k]).abs() <= bound * 1.01 + 1e-4,
                    "{ty:?} [{i}][{r}]: exact {} int8 {} (bound {bound})",
                    a[k],
                    b[k]
                );
                differ += (a[k] != b[k]) as usize;
            }
        }
        assert!(
            differ > n * rows / 2,
            "{ty:?}: only {differ} products changed"
        );
    }
}

/// Formats and shapes outside the int8 path stay exact under `Precision::Int8`.
#[test]
fn other_formats_stay_exact_under_int8() {
    let Some(cpu) = int8_cpu(2) else { return };
    let exact = exact_cpu();
    let mut rng = Rng(34);
    for (ty, cols) in [
        (QuantType::Q5_0, 512),
        (QuantType::F32, 64),
        (QuantType::F16, 48),
    ] {
        assert!(!int8_applies(ty, cols));
        let w = quantize(ty, &rng.vec(8 * cols, 1.0));
        let x = rng.vec(3 * cols, 1.0);
        let (mut a, mut b) = (vec![0.0; 24], vec![0.0; 24]);
        exact.matmul(ty, &w, 8, cols, &x, &mut a);
        cpu.matmul(ty, &w, 8, cols, &x, &mut b);
        assert_eq!(a, b, "{ty:?}");
    }
}

/// The reference path emulates int8 too (every CPU can check against it), and its quantizer
/// rounds as documented.
#[test]
fn the_reference_cpu_runs_int8_products() {
    let cpu = Cpu::new(Isa::Reference, ThreadPool::new(1, Duration::ZERO))
        .with_precision(Precision::Int8)
        .expect("the reference emulates int8");
    let mut rng = Rng(35);
    let (rows, cols) = (5, 96);
    let w = quantize(QuantType::Q4_1, &rng.vec(rows * cols, 1.0));
    let x = rng.vec(2 * cols, 1.0);
    let (mut got, mut want) = (vec![0.0; 2 * rows], vec![0.0; 2 * rows]);
    cpu.matmul(QuantType::Q4_1, &w, rows, cols, &x, &mut got);
    reference::matmul_int8(QuantType::Q4_1, &w, rows, cols, &x, &mut want);
    assert_eq!(got, want);

    // The quantizer: d = max|x|/127, codes to nearest even.
    let x: Vec<f32> = (0..32).map(|v| v as f32 - 8.0).collect();
    let (q, d) = reference::quantize_block_q8(&x);
    assert_eq!(d, 23.0 / 127.0);
    assert_eq!(q[31], 127);
    assert_eq!(q[0], (-8.0f32 * (1.0 / d)).round_ties_even() as i8);
    // Ties go to even: 0.5 and 1.5 and 2.5 of a step.
    let mut x = [0.0f32; 32];
    x[0] = 127.0;
    (x[1], x[2], x[3]) = (0.5, 1.5, 2.5);
    let (q, d) = reference::quantize_block_q8(&x);
    assert_eq!((d, q[1], q[2], q[3]), (1.0, 0, 2, 2));
    // A block of zeros has scale 0 and codes 0.
    assert_eq!(reference::quantize_block_q8(&[0.0; 32]), ([0; 32], 0.0));
}

#[test]
fn int8_runs_on_every_kernel_isa_and_parses() {
    for isa in Isa::available() {
        assert!(Precision::Int8.supported(isa), "{isa:?}");
    }
    assert_eq!("int8".parse::<Precision>(), Ok(Precision::Int8));
}
