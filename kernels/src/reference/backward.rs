//! Scalar twins of the backward kernels (`cpu::backward`, `cpu::attention_backward`, the adapter
//! gradients): plain loops, sums in f64.

#![allow(clippy::needless_range_loop)]

use super::*;

/// dx (n, cols) = dy (n, rows) · W (the input gradient of a frozen linear), sums in f64.
pub fn linear_backward(
    ty: QuantType,
    w: &[u8],
    rows: usize,
    cols: usize,
    dy: &[f32],
    dx: &mut [f32],
) {
    let n = dy.len() / rows;
    let rb = ty.row_bytes(cols).expect("whole blocks");
    let mut acc = vec![0.0f64; n * cols];
    let mut wrow = vec![0.0f32; cols];
    for r in 0..rows {
        dequantize_row(ty, &w[r * rb..(r + 1) * rb], &mut wrow);
        for i in 0..n {
            let g = dy[i * rows + r] as f64;
            for c in 0..cols {
                acc[i * cols + c] += g * wrow[c] as f64;
            }
        }
    }
    for (d, a) in dx.iter_mut().zip(acc) {
        *d = a as f32;
    }
}

/// RMSNorm backward (g frozen), in f64: dx = u/r − x·(u·x)/(n·r³), u = g ⊙ dy.
pub fn rmsnorm_backward(x: &[f32], weight: &[f32], eps: f32, dy: &[f32], dx: &mut [f32]) {
    let d = weight.len();
    for ((xr, gr), or) in x.chunks(d).zip(dy.chunks(d)).zip(dx.chunks_mut(d)) {
        let ms = xr.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / d as f64;
        let inv = 1.0 / (ms + eps as f64).sqrt();
        let ux: f64 = (0..d)
            .map(|c| weight[c] as f64 * gr[c] as f64 * xr[c] as f64)
            .sum();
        for c in 0..d {
            or[c] = (weight[c] as f64 * gr[c] as f64 * inv
                - xr[c] as f64 * ux * inv.powi(3) / d as f64) as f32;
        }
    }
}

/// RoPE backward in place (each pair turned by −θ), in f64.
pub fn rope_backward(
    dy: &mut [f32],
    table: &[f32],
    n_heads: usize,
    head_dim: usize,
    rope_dim: usize,
    layout: RopeLayout,
) {
    let row = n_heads * head_dim;
    for (t, r) in dy.chunks_mut(row).enumerate() {
        for h in r.chunks_mut(head_dim) {
            for i in 0..rope_dim / 2 {
                let (c, s) = (
                    table[t * rope_dim + 2 * i] as f64,
                    table[t * rope_dim + 2 * i + 1] as f64,
                );
                let (p, q) = layout.pair(i, rope_dim);
                let (a, b) = (h[p] as f64, h[q] as f64);
                h[p] = (a * c + b * s) as f32;
                h[q] = (-a * s + b * c) as f32;
            }
        }
    }
}

/// SwiGLU backward in f64: du = da·silu(g), dg = da·u·σ(g)(1 + g(1 − σ(g))).
pub fn swiglu_backward(gate: &[f32], up: &[f32], da: &[f32], dgate: &mut [f32], dup: &mut [f32]) {
    for i in 0..gate.len() {
        let g = gate[i] as f64;
        let s = 1.0 / (1.0 + (-g).exp());
        dup[i] = (da[i] as f64 * g * s) as f32;
        dgate[i] = (da[i] as f64 * up[i] as f64 * s * (1.0 + g * (1.0 - s))) as f32;
    }
}

/// `g[q][i][j] += Σ_t x[t][q*k + i] · dy[t][q*m + j]`, sums in f64.
pub fn block_outer(x: &[f32], dy: &[f32], nb: usize, k: usize, m: usize, g: &mut [f32]) {
    let n = x.len() / (nb * k);
    for q in 0..nb {
        for i in 0..k {
            for j in 0..m {
                let mut acc = g[(q * k + i) * m + j] as f64;
                for t in 0..n {
                    acc += x[t * nb * k + q * k + i] as f64 * dy[t * nb * m + q * m + j] as f64;
                }
                g[(q * k + i) * m + j] = acc as f32;
            }
        }
    }
}

/// Causal GQA attention backward (queries at the last t of n positions), in f64; see
/// `cpu::backward::attention_backward`.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dout: &[f32],
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    scale: f32,
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
) {
    let heads = (n_heads, n_kv_heads, head_dim);
    attention_backward_windowed(q, k, v, dout, heads, scale, None, dq, dk, dv)
}

/// `attention_backward` through a sliding window and with soft-capping as `opts` says
/// (`AttnOpts`): with a cap c the scores are c·tanh(s / c), whose derivative 1 − tanh² scales dS.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_windowed(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dout: &[f32],
    (n_heads, n_kv_heads, head_dim): (usize, usize, usize),
    scale: f32,
    opts: impl Into<crate::reference::AttnOpts>,
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
) {
    let crate::reference::AttnOpts { window, softcap } = opts.into();
    let (qd, kvd) = (n_heads * head_dim, n_kv_heads * head_dim);
    let t = q.len() / qd;
    let off = k.len() / kvd - t;
    let group = n_heads / n_kv_heads;
    let mut dk64 = vec![0.0f64; dk.len()];
    let mut dv64 = vec![0.0f64; dv.len()];
    let sc = scale as f64;
    for h in 0..n_heads {
        let (qc, kc) = (h * head_dim, (h / group) * head_dim);
        for i in 0..t {
            let qi = |c: usize| q[i * qd + qc + c] as f64;
            let di = |c: usize| dout[i * qd + qc + c] as f64;
            let lo = (off + i + 1).saturating_sub(window.unwrap_or(usize::MAX));
            // Scores of keys lo..=off+i, indexed from 0, and d(capped)/d(score) of each.
            let raw: Vec<f64> = (lo..=off + i)
                .map(|j| {
                    sc * (0..head_dim)
                        .map(|c| qi(c) * k[j * kvd + kc + c] as f64)
                        .sum::<f64>()
                })
                .collect();
            let (s, slope): (Vec<f64>, Vec<f64>) = raw
                .iter()
                .map(|&x| match softcap {
                    Some(c) => {
                        let t = (x / c as f64).tanh();
                        (c as f64 * t, 1.0 - t * t)
                    }
                    None => (x, 1.0),
                })
                .unzip();
            let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - mx).exp()).collect();
            let z: f64 = e.iter().sum();
            let p: Vec<f64> = e.iter().map(|x| x / z).collect();
            let o: Vec<f64> = (0..head_dim)
                .map(|c| {
                    (lo..=off + i)
                        .map(|j| p[j - lo] * v[j * kvd + kc + c] as f64)
                        .sum()
                })
                .collect();
            let dot_do: f64 = (0..head_dim).map(|c| di(c) * o[c]).sum();
            for c in 0..head_dim {
                dq[i * qd + qc + c] = 0.0;
            }
            let mut dqi = vec![0.0f64; head_dim];
            for j in lo..=off + i {
                let dp: f64 = (0..head_dim)
                    .map(|c| di(c) * v[j * kvd + kc + c] as f64)
                    .sum();
                let pj = p[j - lo];
                let ds = pj * (dp - dot_do) * slope[j - lo] * sc;
                for c in 0..head_dim {
                    dqi[c] += ds * k[j * kvd + kc + c] as f64;
                    dk64[j * kvd + kc + c] += ds * qi(c);
                    dv64[j * kvd + kc + c] += pj * di(c);
                }
            }
            for c in 0..head_dim {
                dq[i * qd + qc + c] = dqi[c] as f32;
            }
        }
    }
    for (d, s) in dk.iter_mut().zip(dk64) {
        *d = s as f32;
    }
    for (d, s) in dv.iter_mut().zip(dv64) {
        *d = s as f32;
    }
}

/// The backward of `geglu` (f64): dgate = da·up·gelu'(gate), dup = da·gelu(gate).
pub fn geglu_backward(gate: &[f32], up: &[f32], da: &[f32], dgate: &mut [f32], dup: &mut [f32]) {
    for i in 0..gate.len() {
        let g = gate[i] as f64;
        let t = (GELU_C * (g + 0.044715 * g * g * g)).tanh();
        let d = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * GELU_C * (1.0 + 3.0 * 0.044715 * g * g);
        dup[i] = (da[i] as f64 * 0.5 * g * (1.0 + t)) as f32;
        dgate[i] = (da[i] as f64 * up[i] as f64 * d) as f32;
    }
}
