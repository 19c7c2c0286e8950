//! Per-format block dequantization to f32, written once over the `Simd` trait: the `Format`
//! trait, the element formats and the 32-value block formats (the 256-value super-block ones are
//! `dequant_k`'s; `formats` picks one from a runtime type).

// Safety of every `unsafe fn` here: the CPU has the features of `S`, and pointers are valid for
// one block (`BB` bytes in, `BS` floats out) or the stated row length.
#![allow(clippy::missing_safety_doc)]

use super::simd::Simd;
use crate::quant::QuantType;

/// A block format known at compile time, so the matmul drivers monomorphize per format.
pub trait Format {
    const TY: QuantType;
    const BS: usize;
    const BB: usize;
    /// Dequantize one block at `src` into `BS` floats at `dst`.
    unsafe fn dequant<S: Simd>(src: *const u8, dst: *mut f32);

    /// Whether `decode32` is implemented (32-value blocks decoded straight into registers).
    const HAS_DECODE32: bool = false;
    /// Whether the f32 product pairs weight rows for small batches (`matmul::paired_rows`,
    /// through `decode32`); Q4_1 keeps its fused `dot_block` there.
    const PAIRED: bool = Self::HAS_DECODE32;

    /// Decode a 32-value block into `32 / LANES` vectors, in value order.
    #[inline(always)]
    unsafe fn decode32<S: Simd>(_src: *const u8, _out: &mut [S::V; 4]) {
        unreachable!("decode32 is only called when HAS_DECODE32")
    }

    /// Whether `codes16` is implemented (every super-block format: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
    /// IQ4_XS).
    const HAS_CODES16: bool = false;
    /// Whether a value is code·scale + min in one fma (else code·scale, one multiply).
    const CODES_MIN: bool = false;

    /// The block as 256 signed byte codes in value order with one scale (and, with `CODES_MIN`,
    /// one min) per 16 values, such that value v = fma(code, scale[v/16], min[v/16]) (or
    /// code·scale[v/16]) is `dequant`'s value to the bit. Decoded with AVX2 byte operations (every
    /// kernel ISA has them), 32 codes per few instructions, so products can stay in registers.
    #[inline(always)]
    unsafe fn codes16<S: Simd>(
        _src: *const u8,
        _codes: &mut [i8; 256],
        _scale: &mut [f32; 16],
        _min: &mut [f32; 16],
    ) {
        unreachable!("codes16 is only called when HAS_CODES16")
    }

    /// Fused dequantize-and-dot of one block against `N` activation rows (each pointer at this
    /// block's first value). Canonical order, shared by every matmul path so that a row's result
    /// does not depend on the batch around it: products are accumulated LANES values at a time,
    /// in value order, into `acc[i][0]` (`acc[i][1]` stays zero). The default goes through
    /// `codes16` where the format has it, else a stack buffer; the 32-value formats decode needs
    /// most override it to stay in registers.
    #[inline(always)]
    unsafe fn dot_block<S: Simd, const N: usize>(
        src: *const u8,
        x: &[*const f32; N],
        acc: &mut [[S::V; 2]; N],
    ) {
        if Self::HAS_CODES16 {
            return dot_by_codes::<S, Self, N>(src, x, acc);
        }
        let mut buf = [0.0f32; 256];
        Self::dequant::<S>(src, buf.as_mut_ptr());
        let mut c = 0;
        while c < Self::BS {
            let w = S::load(buf.as_ptr().add(c));
            for i in 0..N {
                acc[i][0] = S::fma(w, S::load(x[i].add(c)), acc[i][0]);
            }
            c += S::LANES;
        }
    }
}

/// 256 signed byte codes at `c8` (value order) dotted with N rows: value v's weight is
/// code·scale[v/16] (+ min[v/16] in one fma with MIN), products accumulated LANES values at a
/// time in value order (the canonical order).
#[inline(always)]
unsafe fn dot_codes16<S: Simd, const N: usize, const MIN: bool>(
    c8: *const u8,
    scale: &[f32; 16],
    min: &[f32; 16],
    x: &[*const f32; N],
    acc: &mut [[S::V; 2]; N],
) {
    for sub in 0..16 {
        let (s, m) = (S::splat(scale[sub]), S::splat(min[sub]));
        let mut c = 16 * sub;
        while c < 16 * sub + 16 {
            let w = code_values::<S>(c8.add(c), s, m, MIN);
            for i in 0..N {
                acc[i][0] = S::fma(w, S::load(x[i].add(c)), acc[i][0]);
            }
            c += S::LANES;
        }
    }
}

/// LANES codes at `c8` as `dequant`'s values: code·s, + m in one fma with `with_min` (a
/// format's `CODES_MIN`). Every path that reads `codes16` widens through here.
#[inline(always)]
pub(crate) unsafe fn code_values<S: Simd>(c8: *const u8, s: S::V, m: S::V, with_min: bool) -> S::V {
    let q = S::cvt(S::load_i8(c8));
    if with_min {
        S::fma(q, s, m)
    } else {
        S::mul(q, s)
    }
}

/// `Format::dot_block` through `codes16`: the codes dotted per 16-value sub-block, in the
/// canonical order (the values `dequant` gives, to the bit).
#[inline(always)]
unsafe fn dot_by_codes<S: Simd, F: Format + ?Sized, const N: usize>(
    src: *const u8,
    x: &[*const f32; N],
    acc: &mut [[S::V; 2]; N],
) {
    let mut codes = [0i8; 256];
    let (mut scale, mut min) = ([0.0f32; 16], [0.0f32; 16]);
    F::codes16::<S>(src, &mut codes, &mut scale, &mut min);
    let c8 = codes.as_ptr() as *const u8;
    if F::CODES_MIN {
        dot_codes16::<S, N, true>(c8, &scale, &min, x, acc);
    } else {
        dot_codes16::<S, N, false>(c8, &scale, &min, x, acc);
    }
}

pub struct F32;
pub struct F16;
pub struct BF16;
pub struct Q4_0;
pub struct Q4_1;
pub struct Q5_0;
pub struct Q5_1;
pub struct Q8_0;
pub struct IQ4NL;

/// 16 bytes of IQ4 nibbles (value j low, j+16 high) looked up in the codebook into 32 signed
/// bytes at `out`, in value order (`pshufb`: every kernel ISA has SSSE3).
#[inline(always)]
pub(crate) unsafe fn iq4_lookup(qs: *const u8, out: *mut i8) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        let table = _mm_loadu_si128(crate::quant::IQ4_VALUES.as_ptr() as *const __m128i);
        let b = _mm_loadu_si128(qs as *const __m128i);
        let nib = _mm_set1_epi8(0x0F);
        let lo = _mm_shuffle_epi8(table, _mm_and_si128(b, nib));
        let hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16::<4>(b), nib));
        _mm_storeu_si128(out as *mut __m128i, lo);
        _mm_storeu_si128(out.add(16) as *mut __m128i, hi);
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("x86_64 kernels only ({qs:?}, {out:?})")
}

/// 32 looked-up IQ4 values times `scale` (the reference's d·value: exact integers times one f32).
#[inline(always)]
pub(crate) unsafe fn iq4_scale<S: Simd>(qs: *const u8, scale: f32, dst: *mut f32) {
    let mut codes = [0i8; 32];
    iq4_lookup(qs, codes.as_mut_ptr());
    let (c8, sv) = (codes.as_ptr() as *const u8, S::splat(scale));
    let mut c = 0;
    while c < 32 {
        S::store(dst.add(c), S::mul(S::cvt(S::load_i8(c8.add(c))), sv));
        c += S::LANES;
    }
}

impl Format for IQ4NL {
    const TY: QuantType = QuantType::IQ4NL;
    const BS: usize = 32;
    const BB: usize = 18;
    #[inline(always)]
    unsafe fn dequant<S: Simd>(src: *const u8, dst: *mut f32) {
        iq4_scale::<S>(src.add(2), S::f16(src), dst);
    }
}

// Element formats are dequantized in runs of LANES elements: BS is the lane count's multiple 16
// so one "block" is 16 values; rows of these formats must have a multiple of 16 values.
impl Format for F32 {
    const TY: QuantType = QuantType::F32;
    const BS: usize = 16;
    const BB: usize = 64;
    #[inline(always)]
    unsafe fn dequant<S: Simd>(src: *const u8, dst: *mut f32) {
        std::ptr::copy_nonoverlapping(src as *const f32, dst, 16);
    }
}

impl Format for F16 {
    const TY: QuantType = QuantType::F16;
    const BS: usize = 16;
    const BB: usize = 32;
    #[inline(always)]
    unsafe fn dequant<S: Simd>(src: *const u8, dst: *mut f32) {
        let mut i = 0;
        while i < 16 {
            S::store(dst.add(i), S::load_f16(src.add(2 * i)));
            i += S::LANES;
        }
    }
}

impl Format for BF16 {
    const TY: QuantType = QuantType::BF16;
    const BS: usize = 16;
    const BB: usize = 32;
    #[inline(always)]
    unsafe fn dequant<S: Simd>(src: *const u8, dst: *mut f32) {
        let mut i = 0;
        while i < 16 {
            S::store(
                dst.add(i),
                S::cast(S::sll::<16>(S::load_u16(src.add(2 * i)))),
            );
            i += S::LANES;
        }
    }
}

impl Format for Q4_0 {
    const TY: QuantType = QuantType::Q4_0;
    const BS: usize = 32;
    const BB: usize = 18;
    #[inline(always)]
    unsafe fn dequant<S: Simd>(src: *const u8, dst: *mut f32) {
        let d = S::f16(src);
        let (vd, off) = (S::splat(d), S::splat(-8.0 * d));
        let qs = src.add(2);
        let mut c = 0;
        while c < 16 {
            let b = S::load_u8(qs.add(c));
            S::store(dst.add(c), S::fma(S::cvt(S::and_i(b, 0xF)), vd, off));
            S::store(dst.add(16 + c), S::fma(S::cvt(S::srl::<4>(b)), vd, off));
            c += S::LANES;
        }
    }
    #[inline(always)]
    unsafe fn dot_block<S: Simd, const N: usize>(
        src: *const u8,
        x: &[*const f32; N],
        acc: &mut [[S::V; 2]; N],
    ) {
        let d = S::f16(src);
        nibble_dot::<S, N>(src.add(2), S::splat(d), S::splat(-8.0 * d), x, acc)
    }
    const HAS_DECODE32: bool = true;
    #[inline(always)]
    unsafe fn decode32<S: Simd>(src: *const u8, out: &mut [S::V; 4]) {
        let d = S::f16(src);
        nibble_decode::<S>(src.add(2), S::splat(d), S::splat(-8.0 * d), out)
    }
}

impl Format for Q4_1 {
    const TY: QuantType = QuantType::Q4_1;
    const BS: usize = 32;
    const BB: usize = 20;
    #[inline(always)]
    unsafe fn dequant<S: Simd>(src: *const u8, dst: *mut f32) {
        let (vd, vm) = (S::splat(S::f16(src)), S::splat(S::f16(src.add(2))));
        let qs = src.add(4);
        let mut c = 0;
        while c < 16 {
            let b = S::load_u8(qs.add(c));
            S::store(dst.add(c), S::fma(S::cvt(S::and_i(b, 0xF)), vd, vm));
            S::store(dst.add(16 + c), S::fma(S::cvt(S::srl::<4>(b)), vd, vm));
            c += S::LANES;
        }
    }
    #[inline(always)]
    unsafe fn dot_block<S: Simd, const N: usize>(
        src: *const u8,
        x: &[*const f32; N],
        acc: &mut [[S::V; 2]; N],
    ) {
        nibble_dot::<S, N>(
            src.add(4),
            S::splat(S::f16(src)),
            S::splat(S::f16(src.add(2))),
            x,
            acc,
        )
    }
    const HAS_DECODE32: bool = true;
    const PAIRED: bool = false;
    #[inline(always)]
    unsafe fn decode32<S: Simd>(src: *const u8, out: &mut [S::V; 4]) {
        let (d, m) = (S::splat(S::f16(src)), S::splat(S::f16(src.add(2))));
        nibble_decode::<S>(src.add(4), d, m, out)
    }
}

/// Q5_0 and Q5_1 (the formats llama-quantize falls back to where a K-quant's 256 does not divide
/// a row): decoded value by value in the reference's arithmetic (one product, and Q5_1's sum,
/// each rounded once), then multiplied in the vector code like every format.
#[inline(always)]
unsafe fn dequant_q5(src: *const u8, dst: *mut f32, q5_1: bool) {
    let half = |p: *const u8| crate::quant::f16_to_f32(u16::from_le_bytes([*p, *p.add(1)]));
    let (d, m) = (half(src), if q5_1 { half(src.add(2)) } else { 0.0 });
    let at = if q5_1 { 4 } else { 2 };
    let qh = u32::from_le_bytes([
        *src.add(at),
        *src.add(at + 1),
        *src.add(at + 2),
        *src.add(at + 3),
    ]);
    let qs = src.add(at + 4);
    for j in 0..16 {
        let b = *qs.add(j);
        let q0 = (b & 0xF) as u32 | (((qh >> j) & 1) << 4);
        let q1 = (b >> 4) as u32 | (((qh >> (j + 16)) & 1) << 4);
        if q5_1 {
            *dst.add(j) = q0 as f32 * d + m;
            *dst.add(j + 16) = q1 as f32 * d + m;
        } else {
            *dst.add(j) = (q0 as i32 - 16) as f32 * d;
            *dst.add(j + 16) = (q1 as i32 - 16) as f32 * d;
        }
    }
}

impl Format for Q5_0 {
    const TY: QuantType = QuantType::Q5_0;
    const BS: usize = 32;
    const BB: usize = 22;
    #[inline(always)]
    unsafe fn dequant<S: Simd>(src: *const u8, dst: *mut f32) {
        dequant_q5(src, dst, false)
    }
}

impl Format for Q5_1 {
    const TY: QuantType = QuantType::Q5_1;
    const BS: usize = 32;
    const BB: usize = 24;
    #[inline(always)]
    unsafe fn dequant<S: Simd>(src: *const u8, dst: *mut f32) {
        dequant_q5(src, dst, true)
    }
}

impl Format for Q8_0 {
    const TY: QuantType = QuantType::Q8_0;
    const BS: usize = 32;
    const BB: usize = 34;
    #[inline(always)]
    unsafe fn dequant<S: Simd>(src: *const u8, dst: *mut f32) {
        let vd = S::splat(S::f16(src));
        let qs = src.add(2);
        let mut c = 0;
        while c < 32 {
            S::store(dst.add(c), S::mul(S::cvt(S::load_i8(qs.add(c))), vd));
            c += S::LANES;
        }
    }
    #[inline(always)]
    unsafe fn dot_block<S: Simd, const N: usize>(
        src: *const u8,
        x: &[*const f32; N],
        acc: &mut [[S::V; 2]; N],
    ) {
        let vd = S::splat(S::f16(src));
        let qs = src.add(2);
        let mut c = 0;
        while c < 32 {
            let w = S::mul(S::cvt(S::load_i8(qs.add(c))), vd);
            for i in 0..N {
                acc[i][0] = S::fma(w, S::load(x[i].add(c)), acc[i][0]);
            }
            c += S::LANES;
        }
    }
    const HAS_DECODE32: bool = true;
    #[inline(always)]
    unsafe fn decode32<S: Simd>(src: *const u8, out: &mut [S::V; 4]) {
        let vd = S::splat(S::f16(src));
        let mut c = 0;
        while c < 32 {
            out[c / S::LANES] = S::mul(S::cvt(S::load_i8(src.add(2 + c))), vd);
            c += S::LANES;
        }
    }
}

/// Dequantize a whole row of `n` values (n a multiple of `F::BS`).
#[inline(always)]
pub unsafe fn dequant_row<S: Simd, F: Format>(src: *const u8, dst: *mut f32, n: usize) {
    let nb = n / F::BS;
    for b in 0..nb {
        F::dequant::<S>(src.add(b * F::BB), dst.add(b * F::BS));
    }
    // Element formats (F32, F16, BF16) may end with a partial run of fewer than 16 values.
    let esize = F::TY.block_bytes();
    for i in nb * F::BS..n {
        let bytes = std::slice::from_raw_parts(src.add(i * esize), esize);
        crate::reference::dequantize_block(
            F::TY,
            bytes,
            std::slice::from_raw_parts_mut(dst.add(i), 1),
        );
    }
}

/// 32 nibbles (low nibbles are values 0..16, high nibbles 16..32) as `q * d + m`, dotted with N rows.
#[inline(always)]
unsafe fn nibble_dot<S: Simd, const N: usize>(
    qs: *const u8,
    d: S::V,
    m: S::V,
    x: &[*const f32; N],
    acc: &mut [[S::V; 2]; N],
) {
    // Value order into one accumulator (the canonical order, see `Format::dot_block`).
    let mut w = [S::zero(); 4];
    nibble_decode::<S>(qs, d, m, &mut w);
    let mut c = 0;
    while c < 32 {
        let wv = w[c / S::LANES];
        for i in 0..N {
            acc[i][0] = S::fma(wv, S::load(x[i].add(c)), acc[i][0]);
        }
        c += S::LANES;
    }
}

/// 32 nibbles as `q * d + m` into `32 / LANES` vectors in value order.
#[inline(always)]
unsafe fn nibble_decode<S: Simd>(qs: *const u8, d: S::V, m: S::V, out: &mut [S::V; 4]) {
    let mut c = 0;
    while c < 16 {
        let b = S::load_u8(qs.add(c));
        out[c / S::LANES] = S::fma(S::cvt(S::and_i(b, 0xF)), d, m);
        out[(16 + c) / S::LANES] = S::fma(S::cvt(S::srl::<4>(b)), d, m);
        c += S::LANES;
    }
}
