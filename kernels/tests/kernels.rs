//! Every fast path against the scalar reference, every format, odd shapes, with an error budget
//! stated per op.

mod common;

use common::{cpu, fast_isas, Rng};
use flywheel_kernels::cpu::ops;
use flywheel_kernels::quant::quantize::quantize;
use flywheel_kernels::reference;
use flywheel_kernels::{QuantType, RopeLayout};

fn col_sizes(ty: QuantType) -> Vec<usize> {
    match ty.block_size() {
        1 => vec![1, 15, 16, 37, 64, 100],
        32 => vec![32, 96, 576],
        _ => vec![256, 512],
    }
}

#[test]
fn dequantize_matches_reference_exactly_enough() {
    let mut rng = Rng(1);
    for isa in fast_isas() {
        let c = cpu(isa, 1);
        for ty in QuantType::ALL {
            for cols in col_sizes(ty) {
                let x = rng.vec(cols, 2.0);
                let q = quantize(ty, &x);
                let mut want = vec![0.0; cols];
                let mut got = vec![0.0; cols];
                reference::dequantize_row(ty, &q, &mut want);
                c.dequantize_row(ty, &q, &mut got);
                for i in 0..cols {
                    // Budget: one rounding of a fused multiply-add vs separate multiply and add.
                    let tol = 1e-6 * want[i].abs().max(1.0);
                    assert!(
                        (got[i] - want[i]).abs() <= tol,
                        "{isa:?} {ty:?} cols={cols} i={i}: {} vs {}",
                        got[i],
                        want[i]
                    );
                }
            }
        }
    }
}

#[test]
fn quantizers_round_trip_within_their_step() {
    let mut rng = Rng(2);
    for ty in QuantType::ALL {
        let n = 512;
        let x = rng.vec(n, 1.0);
        let mut y = vec![0.0; n];
        reference::dequantize_row(ty, &quantize(ty, &x), &mut y);
        let budget = match ty {
            QuantType::F32 => 0.0,
            QuantType::F16 => 1e-3,
            QuantType::BF16 => 8e-3,
            QuantType::Q8_0 => 1e-2,
            QuantType::Q6K => 5e-2,
            // Four levels over a sub-block's range of up to 2: half a step is 1/3, plus the
            // 4-bit scale's rounding.
            QuantType::Q2K => 0.4,
            // Codes −4..3 with the largest magnitude at −4: a value of the other sign near it
            // clamps to 3, a whole step (max/4) off.
            QuantType::Q3K => 0.3,
            _ => 0.15,
        };
        let worst = x
            .iter()
            .zip(&y)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(worst <= budget, "{ty:?}: worst error {worst} > {budget}");
    }
}

/// A row's product is the same to the bit whatever batch it is computed in (and so whichever
/// path runs: fused, paired, panel): the server's seed contract and train/serve agreement rest
/// on this.
#[test]
fn matmul_rows_do_not_depend_on_the_batch() {
    let mut rng = Rng(17);
    for isa in fast_isas() {
        for threads in [1, 2] {
            let c = cpu(isa, threads);
            for ty in QuantType::ALL {
                let cols = ty.block_size().max(32) * 3;
                let rows = 37;
                let w = quantize(ty, &rng.vec(rows * cols, 1.0));
                let n_max = 70;
                let x = rng.vec(n_max * cols, 1.0);
                let mut alone = vec![0.0; n_max * rows];
                for i in 0..n_max {
                    c.matmul(
                        ty,
                        &w,
                        rows,
                        cols,
                        &x[i * cols..(i + 1) * cols],
                        &mut alone[i * rows..(i + 1) * rows],
                    );
                }
                for n in [2usize, 3, 5, 8, 9, 16, 24, 33, 70] {
                    for start in [0usize, n_max - n] {
                        let mut got = vec![f32::NAN; n * rows];
                        c.matmul(
                            ty,
                            &w,
                            rows,
                            cols,
                            &x[start * cols..(start + n) * cols],
                            &mut got,
                        );
                        for (k, g) in got.iter().enumerate() {
                            let want = alone[start * rows + k];
                            assert!(
                                g.to_bits() == want.to_bits(),
                                "{isa:?} t={threads} {ty:?} n={n} start={start} element {k}: {g} vs {want} alone"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn matmul_matches_reference_for_every_format_and_shape() {
    let mut rng = Rng(3);
    for isa in fast_isas() {
        for threads in [1, 2] {
            let c = cpu(isa, threads);
            for ty in QuantType::ALL {
                for cols in col_sizes(ty) {
                    for rows in [1usize, 5, 33, 70] {
                        for n in [1usize, 2, 7, 13, 14, 23, 24, 31, 50] {
                            let w = quantize(ty, &rng.vec(rows * cols, 1.0));
                            let x = rng.vec(n * cols, 1.0);
                            let mut want = vec![0.0; n * rows];
                            let mut got = vec![f32::NAN; n * rows];
                            reference::matmul(ty, &w, rows, cols, &x, &mut want);
                            c.matmul(ty, &w, rows, cols, &x, &mut got);
                            // Budget: f32 accumulation in a different order, relative to sum |w||x|.
                            let mut wrow = vec![0.0; cols];
                            for r in 0..rows {
                                reference::dequantize_row(
                                    ty,
                                    &w[r * ty.row_bytes(cols).unwrap()..],
                                    &mut wrow,
                                );
                                for i in 0..n {
                                    let mag: f32 =
                                        (0..cols).map(|k| (wrow[k] * x[i * cols + k]).abs()).sum();
                                    let (g, e) = (got[i * rows + r], want[i * rows + r]);
                                    assert!(
                                        (g - e).abs() <= 2e-6 * mag + 1e-6,
                                        "{isa:?} t={threads} {ty:?} rows={rows} cols={cols} n={n} ({i},{r}): {g} vs {e}"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn rmsnorm_swiglu_log_softmax_match_reference() {
    let mut rng = Rng(4);
    for isa in fast_isas() {
        for d in [1usize, 7, 64, 576, 577] {
            let x = rng.vec(3 * d, 3.0);
            let w = rng.vec(d, 1.0);
            let mut want = vec![0.0; 3 * d];
            let mut got = vec![0.0; 3 * d];
            reference::rmsnorm(&x, &w, 1e-5, &mut want);
            ops::rmsnorm(isa, &x, &w, 1e-5, &mut got);
            for i in 0..3 * d {
                assert!(
                    (got[i] - want[i]).abs() <= 1e-5 * want[i].abs().max(1.0),
                    "rmsnorm {isa:?} d={d}"
                );
            }
            let g = rng.vec(d, 30.0);
            let u = rng.vec(d, 2.0);
            reference::swiglu(&g, &u, &mut want[..d]);
            ops::swiglu(isa, &g, &u, &mut got[..d]);
            for i in 0..d {
                assert!(
                    (got[i] - want[i]).abs() <= 2e-6 * want[i].abs().max(1.0),
                    "swiglu {isa:?} {} vs {}",
                    got[i],
                    want[i]
                );
            }
        }
        for n in [1usize, 5, 49152] {
            let mut a = rng.vec(n, 20.0);
            let mut b = a.clone();
            reference::log_softmax(&mut a);
            ops::log_softmax(isa, &mut b);
            for i in 0..n {
                assert!(
                    (a[i] - b[i]).abs() <= 1e-5 * a[i].abs().max(1.0),
                    "log_softmax {isa:?} n={n}"
                );
            }
        }
    }
}

/// dz = −scale·softmax and the entropy from a row of log-probs, against the f64 reference; a
/// −inf log-prob (probability 0) contributes nothing.
#[test]
fn softmax_backward_row_matches_reference() {
    let mut rng = Rng(9);
    for isa in fast_isas() {
        for n in [1usize, 5, 17, 49152] {
            let mut lp = rng.vec(n, 20.0);
            if n > 1 {
                lp[n / 2] = f32::NEG_INFINITY;
            }
            reference::log_softmax(&mut lp);
            let (mut want, mut got) = (vec![0.0; n], vec![0.0; n]);
            let ew = reference::softmax_backward_row(&lp, 1.25, &mut want);
            let eg = ops::softmax_backward_row(isa, &lp, 1.25, &mut got);
            assert!(ew.is_finite() && ew >= 0.0, "entropy {ew}");
            assert!(
                (eg - ew).abs() <= 1e-5 * ew.max(1.0),
                "{isa:?} n={n}: {eg} vs {ew}"
            );
            for i in 0..n {
                assert!(
                    (got[i] - want[i]).abs() <= 1e-6 * want[i].abs().max(1e-30),
                    "{isa:?} n={n} [{i}]: {} vs {}",
                    got[i],
                    want[i]
                );
            }
            let sum: f64 = want.iter().map(|&v| v as f64).sum();
            assert!((sum + 1.25).abs() < 1e-4, "softmax sums to {}", -sum / 1.25);
        }
    }
}

#[test]
fn exp_is_accurate_over_the_range_that_matters() {
    for isa in fast_isas() {
        let xs: Vec<f32> = (-2000..=2000).map(|i| i as f32 * 0.05).collect();
        let u = vec![1.0; xs.len()];
        let mut got = vec![0.0; xs.len()];
        // swiglu(g, 1) = g * sigmoid(g) exercises exp(-g) over [-100, 100].
        ops::swiglu(isa, &xs, &u, &mut got);
        for (i, &x) in xs.iter().enumerate() {
            let want = (x as f64) / (1.0 + (-(x as f64)).exp());
            assert!(
                (got[i] as f64 - want).abs() <= 1e-6 * want.abs().max(1.0),
                "{isa:?} x={x}"
            );
        }
    }
}

#[test]
fn rope_table_rotates_adjacent_and_neox_pairs_like_the_formula() {
    let mut rng = Rng(5);
    let (heads, hd, base) = (3usize, 8usize, 10000.0f32);
    let positions = [0u32, 1, 17, 4095];
    let x = rng.vec(positions.len() * heads * hd, 1.0);
    for layout in [RopeLayout::Adjacent, RopeLayout::Neox] {
        let mut want = x.clone();
        reference::rope(&mut want, &positions, heads, hd, hd, base, layout);
        let mut got = x.clone();
        ops::rope(
            &mut got,
            &ops::rope_table(&positions, hd, base, None),
            heads,
            hd,
            hd,
            layout,
        );
        for i in 0..x.len() {
            assert!((got[i] - want[i]).abs() < 1e-6, "{layout:?} {i}");
        }
        // Position 0 is the identity.
        assert_eq!(&got[..heads * hd], &x[..heads * hd]);
    }
    // The layouts differ: NeoX pairs dim 0 with dim hd/2, which the adjacent layout never does.
    let (mut a, mut n) = (x.clone(), x.clone());
    reference::rope(
        &mut a,
        &positions,
        heads,
        hd,
        hd,
        base,
        RopeLayout::Adjacent,
    );
    reference::rope(&mut n, &positions, heads, hd, hd, base, RopeLayout::Neox);
    let row = heads * hd;
    assert_ne!(&a[row..2 * row], &n[row..2 * row]);
    // Llama 3's frequency factors divide each pair's angle.
    let factors = [1.0f32, 2.0, 4.0, 8.0];
    let t = ops::rope_table(&positions, hd, base, Some(&factors));
    for (k, &p) in positions.iter().enumerate() {
        for (i, f) in factors.iter().enumerate() {
            let th = p as f64 * (base as f64).powf(-2.0 * i as f64 / hd as f64) / *f as f64;
            let (c, s) = (t[k * hd + 2 * i], t[k * hd + 2 * i + 1]);
            assert!((c as f64 - th.cos()).abs() < 1e-6 && (s as f64 - th.sin()).abs() < 1e-6);
        }
    }
    // One NeoX pair, written out: position 1, head 0, pair 0 = (x[0], x[hd/2]), angle 1 rad.
    let (c, s) = (1f32.cos(), 1f32.sin());
    let (x0, x4) = (x[row], x[row + hd / 2]);
    assert!((n[row] - (x0 * c - x4 * s)).abs() < 1e-6);
    assert!((n[row + hd / 2] - (x0 * s + x4 * c)).abs() < 1e-6);
}

#[test]
fn f16_conversions_are_exact_on_representable_values() {
    use flywheel_kernels::quant::{f16_to_f32, f32_to_f16};
    for h in 0u16..=0xffff {
        let f = f16_to_f32(h);
        if f.is_nan() {
            continue;
        }
        assert_eq!(f32_to_f16(f), h, "{h:#x}");
    }
}

/// OFT's block rotation: every fast path against the f64 reference (one f32 FMA chain of b terms
/// per output: budget 2e-6·Σ|x·R| + 1e-7), and each row the same to the bit in any batch, for
/// block sizes that take the two-vector, one-vector and scalar-tail paths.
#[test]
fn oft_rotate_matches_reference_and_is_batch_invariant() {
    let mut rng = Rng(21);
    for isa in fast_isas() {
        for threads in [1, 2] {
            let c = cpu(isa, threads);
            for (b, cols) in [(32, 576), (16, 96), (8, 64), (4, 12), (48, 96), (3, 9)] {
                let r = rng.vec(cols * b, 1.0);
                let n_max = 70;
                let x = rng.vec(n_max * cols, 1.0);
                let mut want = vec![0.0; x.len()];
                reference::oft_rotate(&x, &r, b, &mut want);
                let mut alone = vec![0.0; x.len()];
                for i in 0..n_max {
                    let row = i * cols..(i + 1) * cols;
                    c.oft_rotate(&x[row.clone()], &r, b, &mut alone[row]);
                }
                for (e, (g, w)) in alone.iter().zip(&want).enumerate() {
                    let (t, col) = (e / cols, e % cols);
                    let (k, j) = (col / b, col % b);
                    let mag: f32 = (0..b)
                        .map(|i| (x[t * cols + k * b + i] * r[(k * b + i) * b + j]).abs())
                        .sum();
                    assert!(
                        (g - w).abs() <= 2e-6 * mag + 1e-7,
                        "{isa:?} b={b} element {e}: {g} vs reference {w}"
                    );
                }
                for n in [2usize, 3, 5, 8, 33, 70] {
                    let start = n_max - n;
                    let rows = start * cols..(start + n) * cols;
                    let mut got = vec![f32::NAN; n * cols];
                    c.oft_rotate(&x[rows.clone()], &r, b, &mut got);
                    for (g, a) in got.iter().zip(&alone[rows]) {
                        assert_eq!(g.to_bits(), a.to_bits(), "{isa:?} t={threads} b={b} n={n}");
                    }
                }
            }
        }
    }
}

/// The general block-diagonal product (LoRA's Bᵀ: one block; odd shapes) against the reference,
/// and batch invariance, with 1 and 2 threads (the task split differs, the bits must not).
#[test]
fn block_matmul_matches_reference_and_is_batch_invariant() {
    let mut rng = Rng(22);
    for isa in fast_isas() {
        for threads in [1, 2] {
            let c = cpu(isa, threads);
            for (nb, k, m) in [
                (1, 16, 576),
                (1, 16, 1536),
                (1, 4, 37),
                (3, 5, 7),
                (2, 32, 48),
            ] {
                let mats = rng.vec(nb * k * m, 1.0);
                let n_max = 40;
                let x = rng.vec(n_max * nb * k, 1.0);
                let mut want = vec![0.0; n_max * nb * m];
                reference::block_matmul(&x, &mats, nb, k, m, &mut want);
                let mut all = vec![0.0; n_max * nb * m];
                c.block_matmul(&x, &mats, nb, k, m, &mut all);
                for (e, (g, w)) in all.iter().zip(&want).enumerate() {
                    let (t, col) = (e / (nb * m), e % (nb * m));
                    let (q, j) = (col / m, col % m);
                    let mag: f32 = (0..k)
                        .map(|i| (x[t * nb * k + q * k + i] * mats[(q * k + i) * m + j]).abs())
                        .sum();
                    assert!(
                        (g - w).abs() <= 2e-6 * mag + 1e-7,
                        "{isa:?} ({nb},{k},{m}) {e}"
                    );
                }
                for n in [1usize, 3, 8, 17] {
                    for start in [0, n_max - n] {
                        let mut got = vec![f32::NAN; n * nb * m];
                        c.block_matmul(
                            &x[start * nb * k..(start + n) * nb * k],
                            &mats,
                            nb,
                            k,
                            m,
                            &mut got,
                        );
                        let alone = &all[start * nb * m..(start + n) * nb * m];
                        assert!(
                            got.iter()
                                .zip(alone)
                                .all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{isa:?} t={threads} ({nb},{k},{m}) n={n} start={start}"
                        );
                    }
                }
            }
        }
    }
}
