//! The trainer's backward on the GPU (`cuda/backward.cuh`): the input gradient of a frozen
//! product, dx = dy · W, for every storage format, against f64 sums over the CPU's dequantized
//! values, and each token's row the same bits alone as in its batch.

use super::{close, dequantize, gpu};
use crate::common::Rng;
use flywheel_kernels::quant::quantize::quantize;
use flywheel_kernels::QuantType;

#[test]
fn linear_backward_is_dy_times_w_for_every_format() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(47);
    for ty in QuantType::ALL {
        let cols = if ty.block_size() == 256 { 512 } else { 96 };
        // 300 rows: two passes of 256 (the second partial).
        for rows in [67usize, 300] {
            let w = quantize(ty, &rng.vec(rows * cols, 1.0));
            let wf = dequantize(ty, &w, rows, cols);
            let dw = g.matrix(ty, rows, cols, &w).unwrap();
            for n in [1usize, 5, 13] {
                let dy = rng.vec(n * rows, 1.0);
                let (mut want, mut mag) = (vec![0f32; n * cols], vec![0f32; n * cols]);
                for t in 0..n {
                    for c in 0..cols {
                        let (mut s, mut m) = (0f64, 0f64);
                        for i in 0..rows {
                            let p = dy[t * rows + i] as f64 * wf[i * cols + c] as f64;
                            s += p;
                            m += p.abs();
                        }
                        want[t * cols + c] = s as f32;
                        mag[t * cols + c] = m as f32;
                    }
                }
                let ddy = g.upload(&dy).unwrap();
                let mut ddx = g.zeros::<f32>(n * cols).unwrap();
                g.linear_backward(&dw, &ddy, n, &mut ddx).unwrap();
                let got = g.download(&ddx).unwrap();
                close(&got, &want, |i| 1e-5 * mag[i] + 1e-6)
                    .unwrap_or_else(|e| panic!("{} {rows}×{cols}, n={n}: {e}", ty.name()));
                for t in [0, n / 2, n - 1] {
                    let one = g.upload(&dy[t * rows..(t + 1) * rows]).unwrap();
                    let mut d1 = g.zeros::<f32>(cols).unwrap();
                    g.linear_backward(&dw, &one, 1, &mut d1).unwrap();
                    assert_eq!(
                        g.download(&d1).unwrap(),
                        &got[t * cols..(t + 1) * cols],
                        "{} {rows}×{cols}: token {t} of {n} differs from itself alone",
                        ty.name()
                    );
                }
            }
            // Buffers shorter than the shapes say are refused.
            let short = g.zeros::<f32>(rows - 1).unwrap();
            let mut dx = g.zeros::<f32>(cols).unwrap();
            assert!(g.linear_backward(&dw, &short, 1, &mut dx).is_err());
        }
    }
}
