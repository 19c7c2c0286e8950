//! Scalar reference of every op: plain loops, no SIMD, no threads, sums in f64. The truth every
//! fast path is tested against, and what `--reference-kernels` runs.

// Plain index loops are the point of the reference: they read like the math.
#![allow(clippy::needless_range_loop)]

use crate::quant::{bf16_to_f32, f16_to_f32, QuantType, IQ4_VALUES, QK};

// The backward ops' twins, the BF16 and int8 products' emulation and a token's draw, in files of
// their own; their paths stay `reference::*`.
mod backward;
mod bf16;
mod draw;
mod int8;
pub use backward::*;
pub use bf16::*;
pub use draw::*;
pub use int8::*;

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
        QuantType::Q5_0 | QuantType::Q5_1 => {
            // ggml's dequantize_row_q5_0/q5_1: bit 4 of value j is bit j of qh.
            let q5_1 = ty == QuantType::Q5_1;
            let (d, m) = (rd16(src, 0), if q5_1 { rd16(src, 2) } else { 0.0 });
            let at = if q5_1 { 4 } else { 2 };
            let qh = u32::from_le_bytes([src[at], src[at + 1], src[at + 2], src[at + 3]]);
            let qs = &src[at + 4..at + 20];
            for j in 0..QK / 2 {
                let h0 = ((qh >> j) & 1) << 4;
                let h1 = ((qh >> (j + 16)) & 1) << 4;
                let (q0, q1) = ((qs[j] & 0xF) as u32 | h0, (qs[j] >> 4) as u32 | h1);
                if q5_1 {
                    dst[j] = q0 as f32 * d + m;
                    dst[j + QK / 2] = q1 as f32 * d + m;
                } else {
                    dst[j] = (q0 as i32 - 16) as f32 * d;
                    dst[j + QK / 2] = (q1 as i32 - 16) as f32 * d;
                }
            }
        }
        QuantType::Q8_0 => {
            let d = rd16(src, 0);
            for j in 0..QK {
                dst[j] = (src[2 + j] as i8) as f32 * d;
            }
        }
        QuantType::Q2K => {
            // llama.cpp's order: (d·sc)·q − dmin·m.
            let (d, dmin) = (rd16(src, 80), rd16(src, 82));
            for v in 0..256 {
                let sc = src[v / 16];
                let (h, shift, l) = (v / 128, 2 * ((v % 128) / 32), v % 32);
                let q = (src[16 + 32 * h + l] >> shift) & 3;
                dst[v] = d * (sc & 0xF) as f32 * q as f32 - dmin * (sc >> 4) as f32;
            }
        }
        QuantType::Q3K => {
            let d = rd16(src, 108);
            let sc = &src[96..108];
            for v in 0..256 {
                let k = v / 16;
                let lo = (sc[k % 8] >> (4 * (k / 8))) & 0xF;
                let hi = (sc[8 + k % 4] >> (2 * (k / 4))) & 3;
                let scale = (lo | (hi << 4)) as i32 - 32;
                let (h, shift, l) = (v / 128, 2 * ((v % 128) / 32), v % 32);
                let low = ((src[32 + 32 * h + l] >> shift) & 3) as i32;
                let high = ((src[l] >> (v / 32)) & 1) as i32;
                dst[v] = d * scale as f32 * (low - 4 * (1 - high)) as f32;
            }
        }
        QuantType::Q5K => {
            let (d, dmin) = (rd16(src, 0), rd16(src, 2));
            let (scales, qh, qs) = (&src[4..16], &src[16..48], &src[48..176]);
            for j in 0..8 {
                let (sc, m) = scale_min_k4(j, scales);
                let (dj, mj) = (d * sc as f32, dmin * m as f32);
                for l in 0..32 {
                    let low = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0xF;
                    let q = low | (((qh[l] >> j) & 1) << 4);
                    dst[32 * j + l] = dj * q as f32 - mj;
                }
            }
        }
        QuantType::IQ4NL => {
            let d = rd16(src, 0);
            for v in 0..32 {
                let code = (src[2 + v % 16] >> (4 * (v / 16))) & 0xF;
                dst[v] = d * IQ4_VALUES[code as usize] as f32;
            }
        }
        QuantType::IQ4XS => {
            let d = rd16(src, 0);
            let sh = u16::from_le_bytes([src[2], src[3]]);
            for j in 0..8 {
                let lo = (src[4 + j / 2] >> (4 * (j % 2))) & 0xF;
                let hi = ((sh >> (2 * j)) & 3) as u8;
                let dj = d * ((lo | (hi << 4)) as i32 - 32) as f32;
                for l in 0..32 {
                    let code = (src[8 + 16 * j + l % 16] >> (4 * (l / 16))) & 0xF;
                    dst[32 * j + l] = dj * IQ4_VALUES[code as usize] as f32;
                }
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

/// In-place log-probs of one row from the log-sum-exp `lse` of x·inv computed elsewhere (the GPU
/// draw's, `Gpu::normalize`): each x·inv − lse, the product and the difference each rounded once,
/// as the device rounds them (`fw_mul`, `fw_sub`; Rust fuses neither into a multiply-add), so
/// that the row's log-probs are the device's bit for bit.
pub fn log_softmax_with(x: &mut [f32], inv: f32, lse: f32) {
    x.iter_mut().for_each(|v| *v = *v * inv - lse);
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
///
/// The values are f32, or IEEE halves ([`F16`]: half the memory; the cache's writer rounds K and
/// V to halves first, so that what is stored is exactly what the model computed with).
#[derive(Clone, Copy)]
pub struct PagedKv<'a, E: KvElem = f32> {
    pub k: &'a [E],
    pub v: &'a [E],
    pub block_size: usize,
    pub kv_dim: usize,
}

/// An element of the KV cache: f32, or an IEEE half.
pub trait KvElem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
}

impl KvElem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

/// An IEEE half's bits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct F16(pub u16);

impl KvElem for F16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        crate::quant::f16_to_f32(self.0)
    }
}

impl<E: KvElem> PagedKv<'_, E> {
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

/// What a layer's attention does beyond causal softmax(scale·q·k): a sliding window of keys (a
/// query at position p sees p − window + 1 ..= p), and Gemma 2's soft-capping of the scaled
/// scores, s → cap·tanh(s / cap). An `Option<usize>` converts to a window alone.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AttnOpts {
    pub window: Option<usize>,
    pub softcap: Option<f32>,
}

impl From<Option<usize>> for AttnOpts {
    fn from(window: Option<usize>) -> AttnOpts {
        AttnOpts {
            window,
            softcap: None,
        }
    }
}

/// Soft-capping of one scaled score: the same f32 operations on every CPU path, so that the
/// reference, the SIMD kernels and the training backward agree on it.
#[inline]
pub fn softcap(s: f32, cap: f32) -> f32 {
    cap * (s / cap).tanh()
}

/// Causal grouped-query attention over paged KV. q and out are (num_tokens, n_heads * head_dim).
#[allow(clippy::too_many_arguments)]
pub fn attention<E: KvElem>(
    q: &[f32],
    out: &mut [f32],
    seqs: &[AttnSeq],
    kv: PagedKv<E>,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    scale: f32,
) {
    attention_windowed(q, out, seqs, kv, n_heads, n_kv_heads, head_dim, scale, None)
}

/// `attention` through a sliding window and with soft-capping as `opts` says (`AttnOpts`).
#[allow(clippy::too_many_arguments)]
pub fn attention_windowed<E: KvElem>(
    q: &[f32],
    out: &mut [f32],
    seqs: &[AttnSeq],
    kv: PagedKv<E>,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    scale: f32,
    opts: impl Into<AttnOpts>,
) {
    let AttnOpts {
        window,
        softcap: cap,
    } = opts.into();
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
                                * kv.k[kv.k_index(s.block_table, p, kvh * head_dim + d)].to_f32()
                                    as f64
                        })
                        .sum();
                    *sc = (dot * scale as f64) as f32;
                    if let Some(c) = cap {
                        *sc = softcap(*sc, c);
                    }
                }
                softmax(&mut scores);
                let mut acc = vec![0.0f64; head_dim];
                for (p, w) in (lo..).zip(scores.iter()) {
                    let off = kv.v_offset(s.block_table, p) + kvh * head_dim;
                    for d in 0..head_dim {
                        acc[d] += *w as f64 * kv.v[off + d].to_f32() as f64;
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
