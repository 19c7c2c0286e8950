//! Backward kernels: each fast path against its scalar twin, and each twin against central
//! finite differences of the forward written in f64 here (L = Σ dy ⊙ f(x), so dL/dx is the
//! backward's output).

mod common;

use common::Rng;
use flywheel_kernels::cpu::ops::rope_table;
use flywheel_kernels::quant::quantize::quantize;
use flywheel_kernels::reference::{self, AttnOpts};
use flywheel_kernels::{Cpu, Isa, QuantType, RopeLayout, ThreadPool};
use std::time::Duration;

fn cpus() -> Vec<Cpu> {
    let mut v = Vec::new();
    for isa in Isa::tested() {
        for t in [1, 2] {
            v.push(Cpu::new(isa, ThreadPool::new(t, Duration::from_micros(50))));
        }
    }
    v
}

/// Central differences of `f` (f64 in, f64 out) at x, dotted with dy: dL/dx_k.
fn numeric(x: &[f32], dy: &[f32], f: &dyn Fn(&[f64]) -> Vec<f64>) -> Vec<f64> {
    let x64: Vec<f64> = x.iter().map(|v| *v as f64).collect();
    (0..x.len())
        .map(|k| {
            let h = 1e-6;
            let (mut a, mut b) = (x64.clone(), x64.clone());
            a[k] += h;
            b[k] -= h;
            let (fa, fb) = (f(&a), f(&b));
            fa.iter()
                .zip(&fb)
                .zip(dy)
                .map(|((p, q), g)| (p - q) / (2.0 * h) * *g as f64)
                .sum()
        })
        .collect()
}

fn close(got: &[f32], want: &[f64], tol: f64, what: &str) {
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (*g as f64 - w).abs() <= tol * (1.0 + w.abs()),
            "{what} [{k}]: {g} vs {w}"
        );
    }
}

#[test]
fn linear_backward_is_dy_times_w_for_every_format() {
    let mut rng = Rng(31);
    for ty in QuantType::ALL {
        let cols = match ty.block_size() {
            1 => 100,
            32 => 576,
            _ => 512,
        };
        // 300 rows: several weight tiles (256 rows for 32-value blocks); 70 dy rows: two
        // activation blocks.
        for (rows, ns) in [(37usize, &[1usize, 3, 17][..]), (300, &[70][..])] {
            let wf = rng.vec(rows * cols, 1.0);
            let w = quantize(ty, &wf);
            let mut wd = vec![0.0f32; rows * cols];
            reference::dequantize_row(ty, &w, &mut wd);
            for &n in ns {
                let dy = rng.vec(n * rows, 1.0);
                let mut want = vec![0.0; n * cols];
                reference::linear_backward(ty, &w, rows, cols, &dy, &mut want);
                // The twin against finite differences of y = x·Wᵀ (f64, dequantized W): on a few
                // columns (the function is linear; this checks the transpose is the right one).
                if n == 3 {
                    let x = rng.vec(cols, 1.0);
                    for c in [0, cols / 2, cols - 1] {
                        let f = |xs: &[f64]| -> Vec<f64> {
                            (0..rows)
                                .map(|r| (0..cols).map(|k| wd[r * cols + k] as f64 * xs[k]).sum())
                                .collect()
                        };
                        let num = numeric(&x, &dy[..rows], &f)[c];
                        assert!(
                            (want[c] as f64 - num).abs() < 1e-4 * (1.0 + num.abs()),
                            "{ty:?} col {c}"
                        );
                    }
                }
                for c in cpus() {
                    let mut got = vec![f32::NAN; n * cols];
                    c.linear_backward(ty, &w, rows, cols, &dy, &mut got);
                    for (k, (g, w_)) in got.iter().zip(&want).enumerate() {
                        let (i, col) = (k / cols, k % cols);
                        let mag: f32 = (0..rows)
                            .map(|r| (dy[i * rows + r] * wd[r * cols + col]).abs())
                            .sum();
                        assert!(
                            (g - w_).abs() <= 2e-6 * mag + 1e-6,
                            "{ty:?} {:?} n={n} [{k}]: {g} vs {w_}",
                            c.isa
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn rmsnorm_backward_matches_finite_differences() {
    let mut rng = Rng(32);
    let (d, rows, eps) = (48, 3, 1e-5f32);
    let x = rng.vec(rows * d, 2.0);
    let g = rng.vec(d, 1.0);
    let dy = rng.vec(rows * d, 1.0);
    let mut want = vec![0.0; x.len()];
    reference::rmsnorm_backward(&x, &g, eps, &dy, &mut want);
    let f = |xs: &[f64]| -> Vec<f64> {
        xs.chunks(d)
            .flat_map(|r| {
                let inv =
                    1.0 / (r.iter().map(|v| v * v).sum::<f64>() / d as f64 + eps as f64).sqrt();
                r.iter()
                    .zip(&g)
                    .map(move |(v, w)| v * inv * *w as f64)
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    close(&want, &numeric(&x, &dy, &f), 1e-5, "rmsnorm twin");
    for c in cpus() {
        let mut got = vec![0.0; x.len()];
        c.rmsnorm_backward(&x, &g, eps, &dy, &mut got);
        close(
            &got,
            &want.iter().map(|v| *v as f64).collect::<Vec<_>>(),
            1e-5,
            "rmsnorm fast",
        );
    }
}

#[test]
fn rope_backward_matches_finite_differences() {
    for layout in [RopeLayout::Adjacent, RopeLayout::Neox] {
        rope_backward_case(layout);
    }
}

fn rope_backward_case(layout: RopeLayout) {
    let mut rng = Rng(33);
    let (heads, hd, rope_dim) = (3, 16, 12);
    let positions = [0u32, 5, 77];
    let table = rope_table(&positions, rope_dim, 10000.0, None);
    let x = rng.vec(positions.len() * heads * hd, 1.0);
    let dy = rng.vec(x.len(), 1.0);
    let mut want = dy.clone();
    reference::rope_backward(&mut want, &table, heads, hd, rope_dim, layout);
    // The pairs written out, not taken from the kernels' `pair`.
    let pair = |i: usize| match layout {
        RopeLayout::Adjacent => (2 * i, 2 * i + 1),
        RopeLayout::Neox => (i, i + rope_dim / 2),
    };
    let f = |xs: &[f64]| -> Vec<f64> {
        let mut y = xs.to_vec();
        for (t, r) in y.chunks_mut(heads * hd).enumerate() {
            for h in r.chunks_mut(hd) {
                for i in 0..rope_dim / 2 {
                    let th = positions[t] as f64 * 10000f64.powf(-2.0 * i as f64 / rope_dim as f64);
                    let (p, q) = pair(i);
                    let (a, b) = (h[p], h[q]);
                    h[p] = a * th.cos() - b * th.sin();
                    h[q] = a * th.sin() + b * th.cos();
                }
            }
        }
        y
    };
    close(&want, &numeric(&x, &dy, &f), 1e-5, "rope twin");
    for c in cpus() {
        let mut got = dy.clone();
        c.rope_backward(&mut got, &table, heads, hd, rope_dim, layout);
        close(
            &got,
            &want.iter().map(|v| *v as f64).collect::<Vec<_>>(),
            1e-6,
            "rope fast",
        );
    }
}

#[test]
fn swiglu_backward_matches_finite_differences() {
    let mut rng = Rng(34);
    let n = 40;
    let (gate, up, da) = (rng.vec(n, 4.0), rng.vec(n, 2.0), rng.vec(n, 1.0));
    let (mut dg, mut du) = (vec![0.0; n], vec![0.0; n]);
    reference::swiglu_backward(&gate, &up, &da, &mut dg, &mut du);
    let silu = |g: f64| g / (1.0 + (-g).exp());
    let fg = |gs: &[f64]| -> Vec<f64> {
        gs.iter()
            .zip(&up)
            .map(|(g, u)| silu(*g) * *u as f64)
            .collect()
    };
    let fu = |us: &[f64]| -> Vec<f64> {
        us.iter()
            .zip(&gate)
            .map(|(u, g)| silu(*g as f64) * u)
            .collect()
    };
    close(&dg, &numeric(&gate, &da, &fg), 1e-5, "swiglu dgate twin");
    close(&du, &numeric(&up, &da, &fu), 1e-5, "swiglu dup twin");
    for c in cpus() {
        let (mut g2, mut u2) = (vec![0.0; n], vec![0.0; n]);
        c.swiglu_backward(&gate, &up, &da, &mut g2, &mut u2);
        close(
            &g2,
            &dg.iter().map(|v| *v as f64).collect::<Vec<_>>(),
            1e-5,
            "swiglu fast dg",
        );
        close(
            &u2,
            &du.iter().map(|v| *v as f64).collect::<Vec<_>>(),
            1e-5,
            "swiglu fast du",
        );
    }
}

#[test]
fn block_outer_accumulates_like_the_reference() {
    let mut rng = Rng(35);
    for (nb, k, m, n) in [
        (18, 32, 32, 5),
        (1, 16, 576, 9),
        (3, 5, 7, 4),
        (1, 4, 300, 2),
    ] {
        let x = rng.vec(n * nb * k, 1.0);
        let dy = rng.vec(n * nb * m, 1.0);
        let init = rng.vec(nb * k * m, 1.0);
        let mut want = init.clone();
        reference::block_outer(&x, &dy, nb, k, m, &mut want);
        for c in cpus() {
            let mut got = init.clone();
            c.block_outer(&x, &dy, nb, k, m, &mut got);
            close(
                &got,
                &want.iter().map(|v| *v as f64).collect::<Vec<_>>(),
                2e-6 * n as f64,
                "block_outer",
            );
        }
    }
}

#[test]
fn attention_backward_matches_finite_differences() {
    for window in [None, Some(1), Some(3)] {
        attention_backward_fd(window.into());
    }
    // Gemma 2's soft-capping, with and without a window.
    for window in [None, Some(3)] {
        attention_backward_fd(AttnOpts {
            window,
            softcap: Some(0.7),
        });
    }
}

fn attention_backward_fd(opts: AttnOpts) {
    let window = opts.window;
    let mut rng = Rng(36);
    let (h, hkv, d, t) = (4, 2, 8, 6);
    let scale = 1.0 / (d as f32).sqrt();
    let (q, k, v) = (
        rng.vec(t * h * d, 1.0),
        rng.vec(t * hkv * d, 1.0),
        rng.vec(t * hkv * d, 1.0),
    );
    let dout = rng.vec(t * h * d, 1.0);
    let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
    reference::attention_backward_windowed(
        &q,
        &k,
        &v,
        &dout,
        (h, hkv, d),
        scale,
        opts,
        &mut dq,
        &mut dk,
        &mut dv,
    );
    // The forward in f64: out (t, h·d), causal softmax attention with GQA, over the window, the
    // scores soft-capped.
    let cap = |x: f64| opts.softcap.map_or(x, |c| c as f64 * (x / c as f64).tanh());
    let lo = |i: usize| (i + 1).saturating_sub(window.unwrap_or(usize::MAX));
    let fwd = |q: &[f64], k: &[f64], v: &[f64]| -> Vec<f64> {
        let mut out = vec![0.0; t * h * d];
        for hh in 0..h {
            let g = hh / (h / hkv);
            for i in 0..t {
                let s: Vec<f64> = (lo(i)..=i)
                    .map(|j| {
                        (0..d)
                            .map(|c| q[i * h * d + hh * d + c] * k[j * hkv * d + g * d + c])
                            .sum::<f64>()
                            * scale as f64
                    })
                    .map(cap)
                    .collect();
                let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|x| (x - mx).exp()).sum();
                for j in lo(i)..=i {
                    let p = (s[j - lo(i)] - mx).exp() / z;
                    for c in 0..d {
                        out[i * h * d + hh * d + c] += p * v[j * hkv * d + g * d + c];
                    }
                }
            }
        }
        out
    };
    let f64s = |x: &[f32]| x.iter().map(|v| *v as f64).collect::<Vec<f64>>();
    let (q64, k64, v64) = (f64s(&q), f64s(&k), f64s(&v));
    close(
        &dq,
        &numeric(&q, &dout, &|x| fwd(x, &k64, &v64)),
        1e-5,
        "dq twin",
    );
    close(
        &dk,
        &numeric(&k, &dout, &|x| fwd(&q64, x, &v64)),
        1e-5,
        "dk twin",
    );
    close(
        &dv,
        &numeric(&v, &dout, &|x| fwd(&q64, &k64, x)),
        1e-5,
        "dv twin",
    );
    for c in cpus() {
        let (mut a, mut b, mut e) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
        c.attention_backward_windowed(
            &q, &k, &v, &dout, h, hkv, d, scale, opts, &mut a, &mut b, &mut e,
        );
        close(&a, &f64s(&dq), 1e-5, "dq fast");
        close(&b, &f64s(&dk), 1e-5, "dk fast");
        close(&e, &f64s(&dv), 1e-5, "dv fast");
    }
}

/// Queries at the last rows of K/V (a shared prefix's own queries handled elsewhere) equal the
/// whole-sequence backward with the prefix rows' dout zero; the fast kernels match the twin.
#[test]
fn attention_backward_with_a_prefix_matches_the_whole_sequence() {
    let mut rng = Rng(37);
    let (h, hkv, d, n, off) = (6, 2, 8, 11, 5);
    let t = n - off;
    let scale = 1.0 / (d as f32).sqrt();
    let (q, k, v) = (
        rng.vec(n * h * d, 1.0),
        rng.vec(n * hkv * d, 1.0),
        rng.vec(n * hkv * d, 1.0),
    );
    let mut dout = rng.vec(n * h * d, 1.0);
    dout[..off * h * d].fill(0.0);
    let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
    reference::attention_backward(
        &q, &k, &v, &dout, h, hkv, d, scale, &mut dq, &mut dk, &mut dv,
    );
    let f64s = |x: &[f32]| x.iter().map(|v| *v as f64).collect::<Vec<f64>>();
    let (qs, ds) = (&q[off * h * d..], &dout[off * h * d..]);
    let (mut a, mut b, mut e) = (vec![0.0; qs.len()], vec![7.0; k.len()], vec![7.0; v.len()]);
    reference::attention_backward(qs, &k, &v, ds, h, hkv, d, scale, &mut a, &mut b, &mut e);
    close(&a, &f64s(&dq[off * h * d..]), 1e-6, "dq twin with prefix");
    close(&b, &f64s(&dk), 1e-6, "dk twin with prefix");
    close(&e, &f64s(&dv), 1e-6, "dv twin with prefix");
    for c in cpus() {
        let (mut a2, mut b2, mut e2) =
            (vec![0.0; qs.len()], vec![7.0; k.len()], vec![7.0; v.len()]);
        c.attention_backward(qs, &k, &v, ds, h, hkv, d, scale, &mut a2, &mut b2, &mut e2);
        close(&a2, &f64s(&a), 1e-5, "dq fast with prefix");
        close(&b2, &f64s(&b), 1e-5, "dk fast with prefix");
        close(&e2, &f64s(&e), 1e-5, "dv fast with prefix");
        assert_eq!(t, a2.len() / (h * d));
    }
}

/// Model-sized heads (and every tail of the tiled kernel: query blocks, key vectors, head sizes
/// of one to eight vectors, or none for the row kernel): the fast kernels match the twin, with
/// and without a prefix, with 1 and 2 threads.
#[test]
fn attention_backward_tiled_matches_the_twin_at_model_sizes() {
    let mut rng = Rng(38);
    for (h, hkv, d, n, off) in [
        (9, 3, 64, 70, 0),
        (9, 3, 64, 70, 23),
        (4, 4, 16, 37, 5),
        (2, 1, 128, 19, 0),
        (3, 1, 12, 9, 2),
    ] {
        let t = n - off;
        let scale = 1.0 / (d as f32).sqrt();
        let q = rng.vec(t * h * d, 1.5);
        let (k, v) = (rng.vec(n * hkv * d, 1.5), rng.vec(n * hkv * d, 1.0));
        let dout = rng.vec(t * h * d, 1.0);
        for opts in [
            None.into(),
            Some(5).into(),
            Some(17).into(),
            AttnOpts {
                window: None,
                softcap: Some(0.5),
            },
            AttnOpts {
                window: Some(5),
                softcap: Some(0.5),
            },
        ] {
            let window: AttnOpts = opts;
            let (mut dq, mut dk, mut dv) =
                (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
            reference::attention_backward_windowed(
                &q,
                &k,
                &v,
                &dout,
                (h, hkv, d),
                scale,
                window,
                &mut dq,
                &mut dk,
                &mut dv,
            );
            let f64s = |x: &[f32]| x.iter().map(|v| *v as f64).collect::<Vec<f64>>();
            for c in cpus() {
                let (mut a, mut b, mut e) =
                    (vec![7.0; q.len()], vec![7.0; k.len()], vec![7.0; v.len()]);
                c.attention_backward_windowed(
                    &q, &k, &v, &dout, h, hkv, d, scale, window, &mut a, &mut b, &mut e,
                );
                let what = format!("{:?} h={h} d={d} n={n} off={off} window {window:?}", c.isa);
                close(&a, &f64s(&dq), 2e-5, &format!("dq {what}"));
                close(&b, &f64s(&dk), 2e-5, &format!("dk {what}"));
                close(&e, &f64s(&dv), 2e-5, &format!("dv {what}"));
            }
        }
    }
}

#[test]
fn geglu_forward_and_backward_match_the_reference_and_finite_differences() {
    let mut rng = Rng(36);
    let n = 40;
    let (mut gate, up, da) = (rng.vec(n, 4.0), rng.vec(n, 2.0), rng.vec(n, 1.0));
    // Far tails (the vector path's exp saturates there), in the vector part and the scalar tail.
    for (i, v) in [
        (3, -30.0),
        (7, -11.0),
        (12, 9.5),
        (17, 40.0),
        (38, -25.0),
        (39, 15.0),
    ] {
        gate[i] = v;
    }
    let gelu =
        |g: f64| 0.5 * g * (1.0 + (0.797_884_560_802_865_4 * (g + 0.044715 * g * g * g)).tanh());
    let (mut dg, mut du) = (vec![0.0; n], vec![0.0; n]);
    reference::geglu_backward(&gate, &up, &da, &mut dg, &mut du);
    let fg = |gs: &[f64]| -> Vec<f64> {
        gs.iter()
            .zip(&up)
            .map(|(g, u)| gelu(*g) * *u as f64)
            .collect()
    };
    let fu = |us: &[f64]| -> Vec<f64> {
        us.iter()
            .zip(&gate)
            .map(|(u, g)| gelu(*g as f64) * u)
            .collect()
    };
    close(&dg, &numeric(&gate, &da, &fg), 1e-5, "geglu dgate twin");
    close(&du, &numeric(&up, &da, &fu), 1e-5, "geglu dup twin");
    let mut want = vec![0.0; n];
    reference::geglu(&gate, &up, &mut want);
    let want64: Vec<f64> = gate
        .iter()
        .zip(&up)
        .map(|(g, u)| gelu(*g as f64) * *u as f64)
        .collect();
    close(&want, &want64, 1e-6, "geglu twin");
    for c in cpus() {
        let mut got = vec![0.0; n];
        c.geglu(&gate, &up, &mut got);
        close(&got, &want64, 1e-5, "geglu fast");
        let (mut g2, mut u2) = (vec![0.0; n], vec![0.0; n]);
        c.geglu_backward(&gate, &up, &da, &mut g2, &mut u2);
        let f64s = |v: &[f32]| v.iter().map(|x| *x as f64).collect::<Vec<_>>();
        close(&g2, &f64s(&dg), 1e-5, "geglu fast dg");
        close(&u2, &f64s(&du), 1e-5, "geglu fast du");
    }
}
