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

/// RMSNorm's, SwiGLU's, GeGLU's and RoPE's backward on the GPU against the reference's f64
/// arithmetic (`reference::*_backward`), within f32 rounding of each term; RoPE's backward
/// undoes its forward (both layouts, a partial rotary dimension).
#[test]
fn row_and_elementwise_backwards_match_the_reference() {
    use flywheel_kernels::reference::{self, RopeLayout};
    let Some(g) = gpu() else { return };
    let mut rng = Rng(53);
    for d in [64usize, 576, 2880] {
        let rows = 5;
        let (x, w, dy) = (
            rng.vec(rows * d, 2.0),
            rng.vec(d, 1.0),
            rng.vec(rows * d, 1.0),
        );
        let mut want = vec![0f32; rows * d];
        reference::rmsnorm_backward(&x, &w, 1e-5, &dy, &mut want);
        // Each value's two terms' size, in f64.
        let mut mag = vec![0f32; rows * d];
        for r in 0..rows {
            let xr = &x[r * d..(r + 1) * d];
            let ms = xr.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / d as f64;
            let inv = 1.0 / (ms + 1e-5).sqrt();
            let ux: f64 = (0..d)
                .map(|c| (w[c] as f64 * dy[r * d + c] as f64 * xr[c] as f64).abs())
                .sum();
            for c in 0..d {
                mag[r * d + c] = ((w[c] as f64 * dy[r * d + c] as f64 * inv).abs()
                    + (xr[c] as f64 * ux * inv.powi(3) / d as f64).abs())
                    as f32;
            }
        }
        let (dxx, dw, ddy) = (
            g.upload(&x).unwrap(),
            g.upload(&w).unwrap(),
            g.upload(&dy).unwrap(),
        );
        let mut out = g.zeros::<f32>(rows * d).unwrap();
        g.rmsnorm_backward(&dxx, &dw, 1e-5, &ddy, rows, &mut out)
            .unwrap();
        close(&g.download(&out).unwrap(), &want, |i| 2e-5 * mag[i] + 1e-7)
            .unwrap_or_else(|e| panic!("rmsnorm_backward, width {d}: {e}"));
    }
    let n = 3000;
    let (gate, up, da) = (rng.vec(n, 6.0), rng.vec(n, 2.0), rng.vec(n, 1.0));
    let (dg, du, dd) = (
        g.upload(&gate).unwrap(),
        g.upload(&up).unwrap(),
        g.upload(&da).unwrap(),
    );
    for gelu in [false, true] {
        let (mut wg, mut wu) = (vec![0f32; n], vec![0f32; n]);
        if gelu {
            reference::geglu_backward(&gate, &up, &da, &mut wg, &mut wu);
        } else {
            reference::swiglu_backward(&gate, &up, &da, &mut wg, &mut wu);
        }
        let (mut og, mut ou) = (g.zeros::<f32>(n).unwrap(), g.zeros::<f32>(n).unwrap());
        g.glu_backward(gelu, &dg, &du, &dd, n, &mut og, &mut ou)
            .unwrap();
        let tol = |want: &[f32]| {
            let want = want.to_vec();
            move |i: usize| 1e-5 * want[i].abs() + 1e-6
        };
        close(&g.download(&og).unwrap(), &wg, tol(&wg))
            .unwrap_or_else(|e| panic!("gelu {gelu}: dgate {e}"));
        close(&g.download(&ou).unwrap(), &wu, tol(&wu))
            .unwrap_or_else(|e| panic!("gelu {gelu}: dup {e}"));
    }
    let (t, heads, hd, rd) = (4usize, 3usize, 64usize, 32usize);
    let table: Vec<f32> = (0..t * rd / 2)
        .flat_map(|i| {
            let a = 0.37 * i as f32;
            [a.cos(), a.sin()]
        })
        .collect();
    let dt = g.upload(&table).unwrap();
    for layout in [RopeLayout::Adjacent, RopeLayout::Neox] {
        let x = rng.vec(t * heads * hd, 1.0);
        let mut want = x.clone();
        reference::rope_backward(&mut want, &table, heads, hd, rd, layout);
        let mut dxv = g.upload(&x).unwrap();
        g.rope_backward(&mut dxv, &dt, t, heads, hd, rd, layout)
            .unwrap();
        let got = g.download(&dxv).unwrap();
        close(&got, &want, |i| 1e-6 * (want[i].abs() + 1.0))
            .unwrap_or_else(|e| panic!("rope_backward {layout:?}: {e}"));
        // Turned forward again: the input back.
        g.rope(&mut dxv, &dt, t, heads, hd, rd, layout).unwrap();
        close(&g.download(&dxv).unwrap(), &x, |_| 1e-5)
            .unwrap_or_else(|e| panic!("rope after its backward {layout:?}: {e}"));
    }
}

/// Attention's backward on the GPU against the reference's f64 (`attention_backward_windowed`):
/// grouped heads (2 a KV head), keys of a prefix before the queries, with and without a sliding
/// window and a soft-cap, head dimensions 64 and 128; within 2e-5 of each gradient's largest.
#[test]
fn attention_backward_matches_the_reference() {
    use flywheel_kernels::reference::{self, AttnOpts};
    let Some(g) = gpu() else { return };
    let mut rng = Rng(59);
    for (hd, t, off, window, softcap) in [
        (64usize, 7usize, 0usize, None, None),
        (64, 9, 5, Some(4usize), None),
        (128, 6, 3, None, Some(5.0f32)),
        (64, 12, 20, Some(7), Some(30.0)),
    ] {
        let (heads, kv_heads) = (4usize, 2usize);
        let (qd, kvd, keys) = (heads * hd, kv_heads * hd, off + t);
        let q = rng.vec(t * qd, 1.0);
        let k = rng.vec(keys * kvd, 1.0);
        let v = rng.vec(keys * kvd, 1.0);
        let dout = rng.vec(t * qd, 1.0);
        let scale = 1.0 / (hd as f32).sqrt();
        let opts = AttnOpts { window, softcap };
        let (mut wq, mut wk, mut wv) = (
            vec![0f32; t * qd],
            vec![0f32; keys * kvd],
            vec![0f32; keys * kvd],
        );
        reference::attention_backward_windowed(
            &q,
            &k,
            &v,
            &dout,
            (heads, kv_heads, hd),
            scale,
            opts,
            &mut wq,
            &mut wk,
            &mut wv,
        );
        let up = |x: &[f32]| g.upload(x).unwrap();
        let (dq_, dk_, dv_, dd_) = (up(&q), up(&k), up(&v), up(&dout));
        let (mut gq, mut gk, mut gv) = (
            g.zeros::<f32>(t * qd).unwrap(),
            g.zeros::<f32>(keys * kvd).unwrap(),
            g.zeros::<f32>(keys * kvd).unwrap(),
        );
        g.attention_backward(
            (&dq_, &dk_, &dv_, &dd_),
            t,
            off,
            (heads, kv_heads, hd),
            scale,
            opts,
            (&mut gq, &mut gk, &mut gv),
        )
        .unwrap();
        for (name, got, want) in [
            ("dq", g.download(&gq).unwrap(), wq),
            ("dk", g.download(&gk).unwrap(), wk),
            ("dv", g.download(&gv).unwrap(), wv),
        ] {
            let top = want.iter().fold(0f32, |m, x| m.max(x.abs()));
            close(&got, &want, |_| 2e-5 * top + 1e-7).unwrap_or_else(|e| {
                panic!("{name}, head_dim {hd}, t {t} after {off}, {opts:?}: {e}")
            });
        }
    }
    // Shapes the kernels do not take are refused.
    let z = g.zeros::<f32>(4096).unwrap();
    let (mut a, mut b, mut c) = (
        g.zeros::<f32>(4096).unwrap(),
        g.zeros::<f32>(4096).unwrap(),
        g.zeros::<f32>(4096).unwrap(),
    );
    for (heads, kv, hd) in [(4, 3, 64), (4, 2, 48), (2, 2, 288)] {
        let r = g.attention_backward(
            (&z, &z, &z, &z),
            2,
            0,
            (heads, kv, hd),
            1.0,
            AttnOpts::default(),
            (&mut a, &mut b, &mut c),
        );
        assert!(r.is_err(), "{heads} heads, {kv} KV heads of {hd}");
    }
}
