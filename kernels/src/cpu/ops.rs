//! Elementwise and row ops (RMSNorm, RoPE, SwiGLU, log-softmax), each generic over the ISA, each
//! with its twin in `reference`. Attention lives in `attention.rs`.

use super::isa::Isa;
use super::matmul::dot;
use super::simd::{exp, Avx2, Avx512, Simd};
use crate::reference;
pub use crate::reference::RopeLayout;

/// out = x / rms(x) * weight for each row of `weight.len()` values.
pub fn rmsnorm(isa: Isa, x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    assert_eq!(x.len(), out.len());
    assert_eq!(x.len() % weight.len(), 0);
    match isa {
        Isa::Reference => reference::rmsnorm(x, weight, eps, out),
        // SAFETY: the ISA was detected at start-up; sizes checked above.
        Isa::Avx512 => unsafe { rmsnorm_avx512(x, weight, eps, out) },
        Isa::Avx2 => unsafe { rmsnorm_avx2(x, weight, eps, out) },
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn rmsnorm_avx512(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    rmsnorm_g::<Avx512>(x, w, eps, out)
}
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rmsnorm_avx2(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    rmsnorm_g::<Avx2>(x, w, eps, out)
}

#[inline(always)]
unsafe fn rmsnorm_g<S: Simd>(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    let l = S::LANES;
    for (xr, or) in x.chunks(d).zip(out.chunks_mut(d)) {
        let ss = dot::<S>(xr.as_ptr(), xr.as_ptr(), d) / d as f32;
        let scale = 1.0 / (ss + eps).sqrt();
        let vs = S::splat(scale);
        let mut c = 0;
        while c + l <= d {
            let v = S::mul(
                S::mul(S::load(xr.as_ptr().add(c)), vs),
                S::load(w.as_ptr().add(c)),
            );
            S::store(or.as_mut_ptr().add(c), v);
            c += l;
        }
        while c < d {
            or[c] = xr[c] * scale * w[c];
            c += 1;
        }
    }
}

/// The RoPE table for `positions`: per token, `rope_dim / 2` pairs (cos, sin) of
/// pos * base^(-2i/rope_dim) / factors[i] (Llama 3's frequency factors, `rope_freqs`; 1 without),
/// computed in f64. Shared by every layer and head of a forward pass.
pub fn rope_table(
    positions: &[u32],
    rope_dim: usize,
    base: f32,
    factors: Option<&[f32]>,
) -> Vec<f32> {
    let half = rope_dim / 2;
    let freqs: Vec<f64> = (0..half)
        .map(|i| {
            let f = factors.map_or(1.0, |f| f[i] as f64);
            (base as f64).powf(-2.0 * i as f64 / rope_dim as f64) / f
        })
        .collect();
    let mut t = Vec::with_capacity(positions.len() * rope_dim);
    for &p in positions {
        for f in &freqs {
            let th = p as f64 * f;
            t.push(th.cos() as f32);
            t.push(th.sin() as f32);
        }
    }
    t
}

/// Rotate the pairs of `layout` of the first `rope_dim` dims of every head of every row by the
/// table from `rope_table` (scalar: it is a small part of the work).
pub fn rope(
    x: &mut [f32],
    table: &[f32],
    n_heads: usize,
    head_dim: usize,
    rope_dim: usize,
    layout: RopeLayout,
) {
    let row = n_heads * head_dim;
    for (t, xr) in x.chunks_mut(row).enumerate() {
        let tab = &table[t * rope_dim..(t + 1) * rope_dim];
        for xh in xr.chunks_mut(head_dim) {
            for i in 0..rope_dim / 2 {
                let (c, s) = (tab[2 * i], tab[2 * i + 1]);
                let (p, q) = layout.pair(i, rope_dim);
                let (a, b) = (xh[p], xh[q]);
                xh[p] = a * c - b * s;
                xh[q] = a * s + b * c;
            }
        }
    }
}

/// out = silu(gate) * up.
/// GeGLU with the tanh GELU: out = gelu(gate) · up, through ½(1 + tanh(v)) = 1/(1 + e^(−2v)) so
/// that it is SwiGLU's vector code with a cubic inside (with a scalar tanh per element, the
/// Gemma 3 bench model's pp512 was 1220 tok/s; vectorised, 2035 — README, Model families).
pub fn geglu(isa: Isa, gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(gate.len() == out.len() && up.len() == out.len());
    match isa {
        Isa::Reference => reference::geglu(gate, up, out),
        // SAFETY: the ISA was detected at start-up; sizes checked above.
        Isa::Avx512 => unsafe { geglu_avx512(gate, up, out) },
        Isa::Avx2 => unsafe { geglu_avx2(gate, up, out) },
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn geglu_avx512(g: &[f32], u: &[f32], out: &mut [f32]) {
    geglu_g::<Avx512>(g, u, out)
}
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn geglu_avx2(g: &[f32], u: &[f32], out: &mut [f32]) {
    geglu_g::<Avx2>(g, u, out)
}

#[inline(always)]
unsafe fn geglu_g<S: Simd>(g: &[f32], u: &[f32], out: &mut [f32]) {
    let l = S::LANES;
    let n = out.len();
    let (one, k1, k3) = (S::splat(1.0), S::splat(-2.0 * GELU_C), S::splat(0.044715));
    let mut i = 0;
    while i + l <= n {
        let gv = S::load(g.as_ptr().add(i));
        // −2v = −2c(g + 0.044715 g³)
        let g3 = S::mul(S::mul(gv, gv), gv);
        let e = exp::<S>(S::mul(k1, S::fma(k3, g3, gv)));
        let v = S::mul(S::div(gv, S::add(one, e)), S::load(u.as_ptr().add(i)));
        S::store(out.as_mut_ptr().add(i), v);
        i += l;
    }
    for j in i..n {
        let x = g[j];
        let t = (GELU_C * (x + 0.044715 * x * x * x)).tanh();
        out[j] = 0.5 * x * (1.0 + t) * u[j];
    }
}

/// √(2/π).
pub(crate) const GELU_C: f32 = 0.797_884_6;

pub fn swiglu(isa: Isa, gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(gate.len() == out.len() && up.len() == out.len());
    match isa {
        Isa::Reference => reference::swiglu(gate, up, out),
        // SAFETY: the ISA was detected at start-up; sizes checked above.
        Isa::Avx512 => unsafe { swiglu_avx512(gate, up, out) },
        Isa::Avx2 => unsafe { swiglu_avx2(gate, up, out) },
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn swiglu_avx512(g: &[f32], u: &[f32], out: &mut [f32]) {
    swiglu_g::<Avx512>(g, u, out)
}
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn swiglu_avx2(g: &[f32], u: &[f32], out: &mut [f32]) {
    swiglu_g::<Avx2>(g, u, out)
}

#[inline(always)]
unsafe fn swiglu_g<S: Simd>(g: &[f32], u: &[f32], out: &mut [f32]) {
    let l = S::LANES;
    let n = out.len();
    let one = S::splat(1.0);
    let mut i = 0;
    while i + l <= n {
        let gv = S::load(g.as_ptr().add(i));
        let e = exp::<S>(S::sub(S::zero(), gv));
        let v = S::mul(S::div(gv, S::add(one, e)), S::load(u.as_ptr().add(i)));
        S::store(out.as_mut_ptr().add(i), v);
        i += l;
    }
    reference::swiglu(&g[i..], &u[i..], &mut out[i..]);
}

/// In-place log-softmax of one row (logits to log-probs).
pub fn log_softmax(isa: Isa, x: &mut [f32]) {
    match isa {
        Isa::Reference => reference::log_softmax(x),
        // SAFETY: the ISA was detected at start-up.
        Isa::Avx512 => unsafe { log_softmax_avx512(x) },
        Isa::Avx2 => unsafe { log_softmax_avx2(x) },
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn log_softmax_avx512(x: &mut [f32]) {
    log_softmax_g::<Avx512>(x)
}
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn log_softmax_avx2(x: &mut [f32]) {
    log_softmax_g::<Avx2>(x)
}

#[inline(always)]
unsafe fn log_softmax_g<S: Simd>(x: &mut [f32]) {
    let l = S::LANES;
    let n = x.len();
    let p = x.as_mut_ptr();
    let max = max_of::<S>(p, n);
    let vm = S::splat(max);
    let mut vsum = S::zero();
    let mut i = 0;
    while i + l <= n {
        vsum = S::add(vsum, exp::<S>(S::sub(S::load(p.add(i)), vm)));
        i += l;
    }
    let mut sum = S::reduce_add(vsum) as f64;
    for v in &x[i..] {
        sum += ((*v - max) as f64).exp();
    }
    let lse = max + sum.ln() as f32;
    for v in x.iter_mut() {
        *v -= lse;
    }
}

/// The softmax part of the gradient of a log-prob row: `dz[v] = −scale·exp(lp[v])` for one row of
/// log-probs `lp` (d log p(token)/dz is `scale·(onehot − softmax)`, the caller adds the one-hot);
/// returns the row's entropy −Σ exp(lp)·lp. One pass, so that the training forward gets the LM
/// head's gradient direction and the entropy from one exp per logit.
pub fn softmax_backward_row(isa: Isa, lp: &[f32], scale: f32, dz: &mut [f32]) -> f64 {
    assert_eq!(lp.len(), dz.len());
    match isa {
        Isa::Reference => reference::softmax_backward_row(lp, scale, dz),
        // SAFETY: the ISA was detected at start-up.
        Isa::Avx512 => unsafe { softmax_backward_row_avx512(lp, scale, dz) },
        Isa::Avx2 => unsafe { softmax_backward_row_avx2(lp, scale, dz) },
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn softmax_backward_row_avx512(lp: &[f32], scale: f32, dz: &mut [f32]) -> f64 {
    softmax_backward_row_g::<Avx512>(lp, scale, dz)
}
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn softmax_backward_row_avx2(lp: &[f32], scale: f32, dz: &mut [f32]) -> f64 {
    softmax_backward_row_g::<Avx2>(lp, scale, dz)
}

#[inline(always)]
unsafe fn softmax_backward_row_g<S: Simd>(lp: &[f32], scale: f32, dz: &mut [f32]) -> f64 {
    let l = S::LANES;
    let n = lp.len();
    let (p, d) = (lp.as_ptr(), dz.as_mut_ptr());
    let vs = S::splat(-scale);
    // Below exp's clamp a probability is 0: its log-prob is clamped too, so 0·(−inf) stays 0.
    let floor = S::splat(-87.3);
    let mut ent = S::zero();
    let mut i = 0;
    while i + l <= n {
        let x = S::max(S::load(p.add(i)), floor);
        let e = exp::<S>(x);
        S::store(d.add(i), S::mul(e, vs));
        ent = S::fma(e, x, ent);
        i += l;
    }
    let mut entropy = -(S::reduce_add(ent) as f64);
    while i < n {
        let x = (*p.add(i)).max(-87.3);
        let e = x.exp();
        *d.add(i) = -scale * e;
        entropy -= (e * x) as f64;
        i += 1;
    }
    entropy
}

/// The largest of the `n` values at `p`.
#[inline(always)]
pub(crate) unsafe fn max_of<S: Simd>(p: *const f32, n: usize) -> f32 {
    let l = S::LANES;
    let mut vmax = S::splat(f32::NEG_INFINITY);
    let mut i = 0;
    while i + l <= n {
        vmax = S::max(vmax, S::load(p.add(i)));
        i += l;
    }
    let mut max = S::reduce_max(vmax);
    while i < n {
        max = max.max(*p.add(i));
        i += 1;
    }
    max
}

/// Replace the `n` scores at `p` by exp(score - max); return their sum.
#[inline(always)]
pub(crate) unsafe fn exp_shifted<S: Simd>(p: *mut f32, n: usize, max: f32) -> f32 {
    let l = S::LANES;
    let vm = S::splat(max);
    let mut vsum = S::zero();
    let mut i = 0;
    while i + l <= n {
        let e = exp::<S>(S::sub(S::load(p.add(i)), vm));
        S::store(p.add(i), e);
        vsum = S::add(vsum, e);
        i += l;
    }
    let mut sum = S::reduce_add(vsum);
    while i < n {
        let e = (*p.add(i) - max).exp();
        *p.add(i) = e;
        sum += e;
        i += 1;
    }
    sum
}

/// `x` rounded to IEEE halves (round to nearest even), in place and as their bits in `out`: the
/// KV cache's f16 storage, so that what the attention reads back is what was computed with.
/// F16C's conversion where the CPU has AVX2 (every SIMD path here), the scalar one otherwise
/// (the same bits: `to_f16_matches_the_scalar_conversion`).
pub fn round_to_f16(isa: Isa, x: &mut [f32], out: &mut [reference::F16]) {
    assert_eq!(x.len(), out.len());
    let mut i = 0;
    if isa != Isa::Reference {
        // SAFETY: AVX2 and F16C are present on every SIMD ISA; 8 values at a time in bounds.
        unsafe { i = round_to_f16_f16c(x, out) };
    }
    for j in i..x.len() {
        let h = crate::quant::f32_to_f16(x[j]);
        out[j] = reference::F16(h);
        x[j] = crate::quant::f16_to_f32(h);
    }
}

/// The whole vectors of 8; returns how many were done.
#[target_feature(enable = "avx2,f16c")]
unsafe fn round_to_f16_f16c(x: &mut [f32], out: &mut [reference::F16]) -> usize {
    use std::arch::x86_64::*;
    let n = x.len() / 8 * 8;
    for i in (0..n).step_by(8) {
        let v = _mm256_loadu_ps(x.as_ptr().add(i));
        let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
        _mm_storeu_si128(out.as_mut_ptr().add(i) as *mut __m128i, h);
        _mm256_storeu_ps(x.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
    }
    n
}
