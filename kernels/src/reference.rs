//! Scalar reference of every op: plain loops, no SIMD, no threads, sums in f64. The truth every
//! fast path is tested against, and what `--reference-kernels` runs.

// Plain index loops are the point of the reference: they read like the math.
#![allow(clippy::needless_range_loop)]

use crate::quant::{bf16_to_f32, f16_to_f32, QuantType, QK};

/// Which dims of a head RoPE turns together (pair `i` turns by frequency `i` either way).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeLayout {
    /// (x[2i], x[2i+1]): llama.cpp's LLaMA layout (its converter permuted q/k rows for it).
    Adjacent,
    /// (x[i], x[i + rope_dim/2]): GPT-NeoX's, as Qwen, Gemma and Hugging Face's weights use.
    Neox,
}

impl RopeLayout {
    /// The two dims of pair `i` of `rope_dim`.
    #[inline(always)]
    pub fn pair(self, i: usize, rope_dim: usize) -> (usize, usize) {
        match self {
            RopeLayout::Adjacent => (2 * i, 2 * i + 1),
            RopeLayout::Neox => (i, i + rope_dim / 2),
        }
    }
}

fn rd16(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// Dequantize one block of `ty` from `src` (exactly `ty.block_bytes()` bytes) into `dst`
/// (exactly `ty.block_size()` values).
pub fn dequantize_block(ty: QuantType, src: &[u8], dst: &mut [f32]) {
    match ty {
        QuantType::F32 => dst[0] = f32::from_le_bytes([src[0], src[1], src[2], src[3]]),
        QuantType::F16 => dst[0] = rd16(src, 0),
        QuantType::BF16 => dst[0] = bf16_to_f32(u16::from_le_bytes([src[0], src[1]])),
        QuantType::Q4_0 => {
            let d = rd16(src, 0);
            let qs = &src[2..18];
            for j in 0..QK / 2 {
                dst[j] = ((qs[j] & 0xF) as i32 - 8) as f32 * d;
                dst[j + QK / 2] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
            }
        }
        QuantType::Q4_1 => {
            let (d, m) = (rd16(src, 0), rd16(src, 2));
            let qs = &src[4..20];
            for j in 0..QK / 2 {
                dst[j] = (qs[j] & 0xF) as f32 * d + m;
                dst[j + QK / 2] = (qs[j] >> 4) as f32 * d + m;
            }
        }
        QuantType::Q8_0 => {
            let d = rd16(src, 0);
            for j in 0..QK {
                dst[j] = (src[2 + j] as i8) as f32 * d;
            }
        }
        QuantType::Q4K => {
            let (d, dmin) = (rd16(src, 0), rd16(src, 2));
            let scales = &src[4..16];
            let qs = &src[16..144];
            for c in 0..4 {
                let (sc1, m1) = scale_min_k4(2 * c, scales);
                let (sc2, m2) = scale_min_k4(2 * c + 1, scales);
                let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
                let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
                let q = &qs[32 * c..32 * c + 32];
                for l in 0..32 {
                    dst[64 * c + l] = d1 * (q[l] & 0xF) as f32 - m1;
                    dst[64 * c + 32 + l] = d2 * (q[l] >> 4) as f32 - m2;
                }
            }
        }
        QuantType::Q6K => {
            let ql_all = &src[0..128];
            let qh_all = &src[128..192];
            let sc_all = &src[192..208];
            let d = rd16(src, 208);
            for half in 0..2 {
                let ql = &ql_all[64 * half..];
                let qh = &qh_all[32 * half..];
                let sc = &sc_all[8 * half..];
                let y = &mut dst[128 * half..];
                for l in 0..32 {
                    let is = l / 16;
                    let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                    let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                    let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                    let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                    y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                    y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                    y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                    y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                }
            }
        }
    }
}

/// The 6-bit scale and min of sub-block `j` of a Q4_K block (llama.cpp's `get_scale_min_k4`).
pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Dequantize a row of `dst.len()` values.
pub fn dequantize_row(ty: QuantType, src: &[u8], dst: &mut [f32]) {
    let (bs, bb) = (ty.block_size(), ty.block_bytes());
    for (i, out) in dst.chunks_mut(bs).enumerate() {
        dequantize_block(ty, &src[i * bb..(i + 1) * bb], out);
    }
}

/// `y[i][r] = sum_c W[r][c] * x[i][c]`: W is `rows` rows of `cols` values in format `ty`,
/// x is (n, cols), y is (n, rows).
pub fn matmul(ty: QuantType, w: &[u8], rows: usize, cols: usize, x: &[f32], y: &mut [f32]) {
    let n = x.len() / cols;
    let rb = ty
        .row_bytes(cols)
        .expect("cols must be a whole number of blocks");
    let mut wrow = vec![0.0f32; cols];
    for r in 0..rows {
        dequantize_row(ty, &w[r * rb..(r + 1) * rb], &mut wrow);
        for i in 0..n {
            let xi = &x[i * cols..(i + 1) * cols];
            let mut acc = 0.0f64;
            for c in 0..cols {
                acc += wrow[c] as f64 * xi[c] as f64;
            }
            y[i * rows + r] = acc as f32;
        }
    }
}

/// `x` rounded to BF16 as AVX512_BF16 rounds (`vcvtne2ps2bf16`): to nearest even, denormals to
/// signed zero, NaN quieted; returned as the f32 it stands for.
pub fn bf16_round(x: f32) -> f32 {
    let b = x.to_bits();
    if x.is_nan() {
        return f32::from_bits((b | 0x0040_0000) & 0xffff_0000);
    }
    if b & 0x7f80_0000 == 0 {
        return f32::from_bits(b & 0x8000_0000);
    }
    let lsb = (b >> 16) & 1;
    f32::from_bits(b.wrapping_add(0x7fff + lsb) & 0xffff_0000)
}

/// Denormal results flushed to signed zero (AVX512_BF16's dot products).
fn ftz(x: f32) -> f32 {
    if x != 0.0 && x.is_subnormal() {
        f32::from_bits(x.to_bits() & 0x8000_0000)
    } else {
        x
    }
}

/// The BF16 product (`Precision::Bf16`) emulated to the bit: weights dequantized then rounded,
/// activations rounded (`bf16_round`); per 32 columns, lane j of 16 adds the products of columns
/// 2j+1 then 2j (`vdpbf16ps`: f32 adds, denormals flushed), columns in order; then the lanes are
/// summed in the AVX-512 `reduce_add` order (j + j+8, then + j+4, then + j+2, then + j+1).
/// `cols` a multiple of 32.
pub fn matmul_bf16(ty: QuantType, w: &[u8], rows: usize, cols: usize, x: &[f32], y: &mut [f32]) {
    assert!(
        cols.is_multiple_of(32),
        "BF16 products take rows of 32k values"
    );
    let n = x.len() / cols;
    let rb = ty
        .row_bytes(cols)
        .expect("cols must be a whole number of blocks");
    let xb: Vec<f32> = x.iter().map(|&v| bf16_round(v)).collect();
    let mut wrow = vec![0.0f32; cols];
    for r in 0..rows {
        dequantize_row(ty, &w[r * rb..(r + 1) * rb], &mut wrow);
        for v in wrow.iter_mut() {
            *v = bf16_round(*v);
        }
        for i in 0..n {
            let xi = &xb[i * cols..(i + 1) * cols];
            let mut lane = [0.0f32; 16];
            for c in (0..cols).step_by(32) {
                for (l, acc) in lane.iter_mut().enumerate() {
                    for e in [2 * l + 1, 2 * l] {
                        *acc = ftz(*acc + ftz(wrow[c + e] * xi[c + e]));
                    }
                }
            }
            let h: [f32; 8] = std::array::from_fn(|l| lane[l] + lane[l + 8]);
            let q: [f32; 4] = std::array::from_fn(|l| h[l] + h[l + 4]);
            let p: [f32; 2] = std::array::from_fn(|l| q[l] + q[l + 2]);
            y[i * rows + r] = p[0] + p[1];
        }
    }
}

/// The BF16 input gradient (`Precision::Bf16`) emulated to the bit: dx[i][c] sums, per pair of
/// weight rows (2p, 2p+1) in order, W[2p+1][c]·dy[i][2p+1] then W[2p][c]·dy[i][2p] (f32 adds,
/// denormals flushed), weights and dy rounded to BF16 (`bf16_round`); an odd last row pairs with
/// zero. `cols` a multiple of 16.
pub fn linear_backward_bf16(
    ty: QuantType,
    w: &[u8],
    rows: usize,
    cols: usize,
    dy: &[f32],
    dx: &mut [f32],
) {
    let n = dy.len() / rows;
    let rb = ty.row_bytes(cols).expect("whole blocks");
    let mut wm = vec![0.0f32; rows * cols];
    for r in 0..rows {
        dequantize_row(
            ty,
            &w[r * rb..(r + 1) * rb],
            &mut wm[r * cols..(r + 1) * cols],
        );
    }
    for v in wm.iter_mut() {
        *v = bf16_round(*v);
    }
    for i in 0..n {
        let g: Vec<f32> = dy[i * rows..(i + 1) * rows]
            .iter()
            .map(|&v| bf16_round(v))
            .collect();
        for c in 0..cols {
            let mut acc = 0.0f32;
            for p in 0..rows.div_ceil(2) {
                for r in [2 * p + 1, 2 * p] {
                    if r < rows {
                        acc = ftz(acc + ftz(wm[r * cols + c] * g[r]));
                    } else {
                        acc = ftz(acc + 0.0);
                    }
                }
            }
            dx[i * cols + c] = acc;
        }
    }
}

/// OFT's block-diagonal rotation: `out[t][k*b + j] = Σ_i x[t][k*b + i] · R_k[i][j]` with `r` holding
/// the cols/b blocks of b×b row-major (R_k[i][j] at `r[(k*b + i)*b + j]`); sums in f64.
pub fn oft_rotate(x: &[f32], r: &[f32], b: usize, out: &mut [f32]) {
    let cols = r.len() / b;
    for (xr, or) in x.chunks(cols).zip(out.chunks_mut(cols)) {
        for k in 0..cols / b {
            for j in 0..b {
                let mut acc = 0.0f64;
                for i in 0..b {
                    acc += xr[k * b + i] as f64 * r[(k * b + i) * b + j] as f64;
                }
                or[k * b + j] = acc as f32;
            }
        }
    }
}

/// Block-diagonal product: `out[t][q*m + j] = Σ_i x[t][q*k + i] · M_q[i][j]` for nb blocks M_q
/// (k, m) row-major in `mats`; sums in f64.
pub fn block_matmul(x: &[f32], mats: &[f32], nb: usize, k: usize, m: usize, out: &mut [f32]) {
    for (xr, or) in x.chunks(nb * k).zip(out.chunks_mut(nb * m)) {
        for q in 0..nb {
            for j in 0..m {
                let mut acc = 0.0f64;
                for i in 0..k {
                    acc += xr[q * k + i] as f64 * mats[(q * k + i) * m + j] as f64;
                }
                or[q * m + j] = acc as f32;
            }
        }
    }
}

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

/// `attention_backward` where query i sees only the `window` keys up to its own position.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_windowed(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dout: &[f32],
    (n_heads, n_kv_heads, head_dim): (usize, usize, usize),
    scale: f32,
    window: Option<usize>,
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
) {
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
            // Scores of keys lo..=off+i, indexed from 0.
            let s: Vec<f64> = (lo..=off + i)
                .map(|j| {
                    sc * (0..head_dim)
                        .map(|c| qi(c) * k[j * kvd + kc + c] as f64)
                        .sum::<f64>()
                })
                .collect();
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
                let ds = pj * (dp - dot_do) * sc;
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

/// RMSNorm of each row of `x` (rows of `weight.len()` values): out = x / sqrt(mean(x^2) + eps) * weight.
pub fn rmsnorm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    for (xr, or) in x.chunks(d).zip(out.chunks_mut(d)) {
        let ss = xr.iter().map(|v| (*v as f64) * (*v as f64)).sum::<f64>() / d as f64;
        let scale = (1.0 / (ss + eps as f64).sqrt()) as f32;
        for c in 0..d {
            or[c] = xr[c] * scale * weight[c];
        }
    }
}

/// RoPE: for each row t (n_heads heads of head_dim), pair i of the first `rope_dim` dims (in
/// `layout`: adjacent (2i, 2i+1) as llama.cpp's LLaMA, or (i, i + rope_dim/2) as GPT-NeoX)
/// turns by positions[t] * base^(-2i/rope_dim).
pub fn rope(
    x: &mut [f32],
    positions: &[u32],
    n_heads: usize,
    head_dim: usize,
    rope_dim: usize,
    base: f32,
    layout: RopeLayout,
) {
    let row = n_heads * head_dim;
    for (t, xr) in x.chunks_mut(row).enumerate() {
        let pos = positions[t] as f64;
        for h in 0..n_heads {
            let xh = &mut xr[h * head_dim..(h + 1) * head_dim];
            for i in 0..rope_dim / 2 {
                let theta = pos * (base as f64).powf(-2.0 * i as f64 / rope_dim as f64);
                let (s, c) = (theta.sin() as f32, theta.cos() as f32);
                let (p, q) = layout.pair(i, rope_dim);
                let (a, b) = (xh[p], xh[q]);
                xh[p] = a * c - b * s;
                xh[q] = a * s + b * c;
            }
        }
    }
}

/// out = silu(gate) * up, elementwise.
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for i in 0..out.len() {
        let g = gate[i];
        out[i] = g / (1.0 + (-g).exp()) * up[i];
    }
}

/// √(2/π), GELU's tanh approximation's constant.
const GELU_C: f64 = 0.797_884_560_802_865_4;

/// GeGLU with the tanh GELU (Gemma's `gelu_pytorch_tanh`): out = gelu(gate) · up, in f64.
pub fn geglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for i in 0..out.len() {
        let g = gate[i] as f64;
        let t = (GELU_C * (g + 0.044715 * g * g * g)).tanh();
        out[i] = (0.5 * g * (1.0 + t) * up[i] as f64) as f32;
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

/// In-place softmax of one row (sum in f64).
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f64;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v as f64;
    }
    for v in x.iter_mut() {
        *v = (*v as f64 / sum) as f32;
    }
}

/// In-place log-softmax of one row (sums in f64, so it can serve as the truth).
pub fn log_softmax(x: &mut [f32]) {
    let max = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = x.iter().map(|v| ((*v - max) as f64).exp()).sum();
    let lse = max + sum.ln() as f32;
    for v in x.iter_mut() {
        *v -= lse;
    }
}

/// `dz[v] = −scale·exp(lp[v])`; returns the entropy −Σ exp(lp)·lp (f64 sums; log-probs below
/// −87.3 count as probability 0, as in the SIMD kernels).
pub fn softmax_backward_row(lp: &[f32], scale: f32, dz: &mut [f32]) -> f64 {
    let mut entropy = 0.0f64;
    for (d, &x) in dz.iter_mut().zip(lp) {
        let x = x.max(-87.3) as f64;
        let e = x.exp();
        *d = (-(scale as f64) * e) as f32;
        entropy -= e * x;
    }
    entropy
}

/// One layer's paged KV storage. V: block `b`, slot `s` holds its `kv_dim` values at
/// `(b * block_size + s) * kv_dim`. K is stored transposed within each block, `[kv_dim][block_size]`:
/// value `c` of slot `s` is at `b * block_size * kv_dim + c * block_size + s`, so that attention
/// scores a whole block of keys with vector FMAs and no horizontal sums.
#[derive(Clone, Copy)]
pub struct PagedKv<'a> {
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub block_size: usize,
    pub kv_dim: usize,
}

impl PagedKv<'_> {
    /// Offset of the V row of position `pos` of a sequence with `block_table`.
    #[inline]
    pub fn v_offset(&self, block_table: &[u32], pos: usize) -> usize {
        (block_table[pos / self.block_size] as usize * self.block_size + pos % self.block_size)
            * self.kv_dim
    }

    /// Offset of K value `c` of position `pos`.
    #[inline]
    pub fn k_index(&self, block_table: &[u32], pos: usize, c: usize) -> usize {
        block_table[pos / self.block_size] as usize * self.block_size * self.kv_dim
            + c * self.block_size
            + pos % self.block_size
    }
}

/// The query tokens of one sequence in a packed batch: rows `q_start..q_start+q_len`, the first at
/// position `first_pos`; each attends causally to positions `0..=its own` through `block_table`.
#[derive(Clone, Copy, Debug)]
pub struct AttnSeq<'a> {
    pub q_start: usize,
    pub q_len: usize,
    pub first_pos: usize,
    pub block_table: &'a [u32],
}

/// Causal grouped-query attention over paged KV. q and out are (num_tokens, n_heads * head_dim).
#[allow(clippy::too_many_arguments)]
pub fn attention(
    q: &[f32],
    out: &mut [f32],
    seqs: &[AttnSeq],
    kv: PagedKv,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    scale: f32,
) {
    attention_windowed(q, out, seqs, kv, n_heads, n_kv_heads, head_dim, scale, None)
}

/// `attention` where a query at position p sees only keys p − window + 1 ..= p when `window`
/// is given (a sliding-window layer).
#[allow(clippy::too_many_arguments)]
pub fn attention_windowed(
    q: &[f32],
    out: &mut [f32],
    seqs: &[AttnSeq],
    kv: PagedKv,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    scale: f32,
    window: Option<usize>,
) {
    let qdim = n_heads * head_dim;
    let group = n_heads / n_kv_heads;
    for s in seqs {
        for i in 0..s.q_len {
            let t = s.q_start + i;
            let n_ctx = s.first_pos + i + 1;
            let lo = n_ctx.saturating_sub(window.unwrap_or(usize::MAX));
            for h in 0..n_heads {
                let kvh = h / group;
                let qh = &q[t * qdim + h * head_dim..][..head_dim];
                let mut scores = vec![0.0f32; n_ctx - lo];
                for (p, sc) in (lo..).zip(scores.iter_mut()) {
                    let dot: f64 = (0..head_dim)
                        .map(|d| {
                            qh[d] as f64
                                * kv.k[kv.k_index(s.block_table, p, kvh * head_dim + d)] as f64
                        })
                        .sum();
                    *sc = (dot * scale as f64) as f32;
                }
                softmax(&mut scores);
                let mut acc = vec![0.0f64; head_dim];
                for (p, w) in (lo..).zip(scores.iter()) {
                    let off = kv.v_offset(s.block_table, p) + kvh * head_dim;
                    for d in 0..head_dim {
                        acc[d] += *w as f64 * kv.v[off + d] as f64;
                    }
                }
                let oh = &mut out[t * qdim + h * head_dim..][..head_dim];
                for d in 0..head_dim {
                    oh[d] = acc[d] as f32;
                }
            }
        }
    }
}
