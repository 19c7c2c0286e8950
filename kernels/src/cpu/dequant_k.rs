//! The super-block formats (256 values: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS): their
//! dequantization and their blocks as byte codes with a scale (and min) per 16 values, decoded
//! with AVX2 operations (`Format::codes16`: the f32 product's `dot_block` and the BF16 product's
//! batch-1 path widen them in registers).

// Safety of every `unsafe fn` here: the CPU has the features of `S`, and pointers are valid for
// one block (`BB` bytes in, `BS` floats out).
#![allow(clippy::missing_safety_doc)]

use super::dequant::{iq4_lookup, iq4_scale, Format};
use super::simd::Simd;
use crate::quant::QuantType;
use crate::reference::scale_min_k4;

pub struct Q2K;
pub struct Q3K;
pub struct Q4K;
pub struct Q5K;
pub struct Q6K;
pub struct IQ4XS;

impl Format for Q2K {
    const TY: QuantType = QuantType::Q2K;
    const BS: usize = 256;
    const BB: usize = 84;
    /// Byte l of half h holds values 128h + 32s + l at bits 2s; (d·sc)·q is exact, so one fma
    /// equals the reference's product then difference.
    #[inline(always)]
    unsafe fn dequant<S: Simd>(src: *const u8, dst: *mut f32) {
        let (d, dmin) = (S::f16(src.add(80)), S::f16(src.add(82)));
        for h in 0..2 {
            let mut l = 0;
            while l < 32 {
                let mut b = S::load_u8(src.add(16 + 32 * h + l));
                for s in 0..4 {
                    let v = 128 * h + 32 * s + l;
                    let sc = *src.add(v / 16);
                    let dl = S::splat(d * (sc & 0xF) as f32);
                    let ml = S::splat(-(dmin * (sc >> 4) as f32));
                    S::store(dst.add(v), S::fma(S::cvt(S::and_i(b, 3)), dl, ml));
                    b = S::srl::<2>(b);
                }
                l += S::LANES;
            }
        }
    }
    const HAS_CODES16: bool = true;
    const CODES_MIN: bool = true;
    /// The 2-bit codes split into bytes (four shifts and masks per 128 values); 4-bit scales and
    /// mins per 16 values.
    #[inline(always)]
    unsafe fn codes16<S: Simd>(
        src: *const u8,
        codes: &mut [i8; 256],
        scale: &mut [f32; 16],
        min: &mut [f32; 16],
    ) {
        #[cfg(target_arch = "x86_64")]
        for h in 0..2 {
            store_groups(two_bit_groups(src.add(16 + 32 * h)), codes, 128 * h);
        }
        let (d, dmin) = (S::f16(src.add(80)), S::f16(src.add(82)));
        for k in 0..16 {
            let sc = *src.add(k);
            scale[k] = d * (sc & 0xF) as f32;
            min[k] = -(dmin * (sc >> 4) as f32);
        }
    }
}

impl Format for Q3K {
    const TY: QuantType = QuantType::Q3K;
    const BS: usize = 256;
    const BB: usize = 110;
    /// Q2_K's low bits (after 32 bytes of high bits: value v's in bit v/32 of byte v%32), codes
    /// q = low + 4·high − 4, 6-bit scales − 32; (d·sc)·q exact.
    #[inline(always)]
    unsafe fn dequant<S: Simd>(src: *const u8, dst: *mut f32) {
        let d = S::f16(src.add(108));
        let sc = std::slice::from_raw_parts(src.add(96), 12);
        let mut dl = [0.0f32; 16];
        for (k, v) in dl.iter_mut().enumerate() {
            let lo = (sc[k % 8] >> (4 * (k / 8))) & 0xF;
            let hi = (sc[8 + k % 4] >> (2 * (k / 4))) & 3;
            *v = d * ((lo | (hi << 4)) as i32 - 32) as f32;
        }
        let mut l = 0;
        while l < 32 {
            let mut hm = S::load_u8(src.add(l));
            for h in 0..2 {
                let mut b = S::load_u8(src.add(32 + 32 * h + l));
                for s in 0..4 {
                    let v = 128 * h + 32 * s + l;
                    let q = S::or_i(S::and_i(b, 3), S::sll::<2>(S::and_i(hm, 1)));
                    let q = S::add_i(q, S::splat_i(-4));
                    S::store(dst.add(v), S::mul(S::cvt(q), S::splat(dl[v / 16])));
                    b = S::srl::<2>(b);
                    hm = S::srl::<1>(hm);
                }
            }
            l += S::LANES;
        }
    }
    const HAS_CODES16: bool = true;
    /// Codes low + 4·high − 4 formed as bytes (the high bit of group g is bit g of `hmask`'s
    /// bytes); 6-bit scales − 32 per 16 values.
    #[inline(always)]
    unsafe fn codes16<S: Simd>(
        src: *const u8,
        codes: &mut [i8; 256],
        scale: &mut [f32; 16],
        _min: &mut [f32; 16],
    ) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::*;
            let hm = _mm256_loadu_si256(src as *const __m256i);
            let four = _mm256_set1_epi8(4);
            for h in 0..2 {
                let mut g = two_bit_groups(src.add(32 + 32 * h));
                for (s, low) in g.iter_mut().enumerate() {
                    let bit = _mm256_set1_epi8((1u8 << (4 * h + s)) as i8);
                    let set = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit);
                    let high4 = _mm256_and_si256(set, four);
                    *low = _mm256_sub_epi8(_mm256_add_epi8(*low, high4), four);
                }
                store_groups(g, codes, 128 * h);
            }
        }
        let d = S::f16(src.add(108));
        let sc = std::slice::from_raw_parts(src.add(96), 12);
        for (k, v) in scale.iter_mut().enumerate() {
            let lo = (sc[k % 8] >> (4 * (k / 8))) & 0xF;
            let hi = (sc[8 + k % 4] >> (2 * (k / 4))) & 3;
            *v = d * ((lo | (hi << 4)) as i32 - 32) as f32;
        }
    }
}

/// 32 bytes of 2-bit codes (byte l holds values l, l+32, l+64, l+96 at bits 0, 2, 4, 6) as four
/// groups of 32 code bytes in value order.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn two_bit_groups(q: *const u8) -> [std::arch::x86_64::__m256i; 4] {
    use std::arch::x86_64::*;
    let b = _mm256_loadu_si256(q as *const __m256i);
    let m = _mm256_set1_epi8(3);
    [
        _mm256_and_si256(b, m),
        _mm256_and_si256(_mm256_srli_epi16::<2>(b), m),
        _mm256_and_si256(_mm256_srli_epi16::<4>(b), m),
        _mm256_and_si256(_mm256_srli_epi16::<6>(b), m),
    ]
}

/// Q4_K's and Q5_K's header (d, dmin, twelve bytes of 6-bit scales and mins per 32 values) as
/// `codes16`'s scales and mins per 16 values: d·sc and −dmin·m, given for both halves.
#[inline(always)]
unsafe fn k4_scales<S: Simd>(src: *const u8, scale: &mut [f32; 16], min: &mut [f32; 16]) {
    let (d, dmin) = (S::f16(src), S::f16(src.add(2)));
    let scales = std::slice::from_raw_parts(src.add(4), 12);
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, scales);
        (scale[2 * j], scale[2 * j + 1]) = (d * sc as f32, d * sc as f32);
        (min[2 * j], min[2 * j + 1]) = (-dmin * m as f32, -dmin * m as f32);
    }
}

/// Four groups of 32 codes stored at `codes[at..at + 128]`, in order.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn store_groups(g: [std::arch::x86_64::__m256i; 4], codes: &mut [i8; 256], at: usize) {
    use std::arch::x86_64::*;
    for (k, v) in g.into_iter().enumerate() {
        _mm256_storeu_si256(codes.as_mut_ptr().add(at + 32 * k) as *mut __m256i, v);
    }
}

/// Bytes of `q` (32 of them) ORed with 16 where bit `bit` of the matching byte of `qh` is set:
/// a fifth code bit on top of a nibble.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn with_bit4(
    q: std::arch::x86_64::__m256i,
    qh: std::arch::x86_64::__m256i,
    bit: u32,
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    let b = _mm256_set1_epi8((1u8 << bit) as i8);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, b), b);
    _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(16)))
}

impl Format for IQ4XS {
    const TY: QuantType = QuantType::IQ4XS;
    const BS: usize = 256;
    const BB: usize = 136;
    #[inline(always)]
    unsafe fn dequant<S: Simd>(src: *const u8, dst: *mut f32) {
        let d = S::f16(src);
        let sh = u16::from_le_bytes([*src.add(2), *src.add(3)]);
        for j in 0..8 {
            let lo = (*src.add(4 + j / 2) >> (4 * (j % 2))) & 0xF;
            let hi = ((sh >> (2 * j)) & 3) as u8;
            let dj = d * ((lo | (hi << 4)) as i32 - 32) as f32;
            iq4_scale::<S>(src.add(8 + 16 * j), dj, dst.add(32 * j));
        }
    }
    const HAS_CODES16: bool = true;
    /// The codebook's values as codes; one scale per 32 values (given for both halves).
    #[inline(always)]
    unsafe fn codes16<S: Simd>(
        src: *const u8,
        codes: &mut [i8; 256],
        scale: &mut [f32; 16],
        _min: &mut [f32; 16],
    ) {
        let d = S::f16(src);
        let sh = u16::from_le_bytes([*src.add(2), *src.add(3)]);
        for j in 0..8 {
            let lo = (*src.add(4 + j / 2) >> (4 * (j % 2))) & 0xF;
            let hi = ((sh >> (2 * j)) & 3) as u8;
            let dj = d * ((lo | (hi << 4)) as i32 - 32) as f32;
            (scale[2 * j], scale[2 * j + 1]) = (dj, dj);
            iq4_lookup(src.add(8 + 16 * j), codes.as_mut_ptr().add(32 * j));
        }
    }
}

impl Format for Q5K {
    const TY: QuantType = QuantType::Q5K;
    const BS: usize = 256;
    const BB: usize = 176;
    /// Q4_K's decoding with the fifth bit from `qh` (bit j of byte l: value l of sub-block j);
    /// q·(d·sc) is exact, so one fma equals the reference's product then difference.
    #[inline(always)]
    unsafe fn dequant<S: Simd>(src: *const u8, dst: *mut f32) {
        let (d, dmin) = (S::f16(src), S::f16(src.add(2)));
        let scales = std::slice::from_raw_parts(src.add(4), 12);
        let (qh, qs) = (src.add(16), src.add(48));
        let mut dm = [(S::zero(), S::zero()); 8];
        for (j, v) in dm.iter_mut().enumerate() {
            let (sc, m) = scale_min_k4(j, scales);
            *v = (S::splat(d * sc as f32), S::splat(-dmin * m as f32));
        }
        let mut l = 0;
        while l < 32 {
            let mut h = S::load_u8(qh.add(l));
            for c in 0..4 {
                let b = S::load_u8(qs.add(32 * c + l));
                let lo = S::or_i(S::and_i(b, 0xF), S::sll::<4>(S::and_i(h, 1)));
                let hi = S::or_i(S::srl::<4>(b), S::sll::<4>(S::and_i(S::srl::<1>(h), 1)));
                let ((d1, m1), (d2, m2)) = (dm[2 * c], dm[2 * c + 1]);
                S::store(dst.add(64 * c + l), S::fma(S::cvt(lo), d1, m1));
                S::store(dst.add(64 * c + 32 + l), S::fma(S::cvt(hi), d2, m2));
                h = S::srl::<2>(h);
            }
            l += S::LANES;
        }
    }
    const HAS_CODES16: bool = true;
    const CODES_MIN: bool = true;
    /// Nibbles split into bytes with the fifth bit from `qh` on top; 6-bit scales and mins per
    /// 32 values (given for both halves).
    #[inline(always)]
    unsafe fn codes16<S: Simd>(
        src: *const u8,
        codes: &mut [i8; 256],
        scale: &mut [f32; 16],
        min: &mut [f32; 16],
    ) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::*;
            let qh = _mm256_loadu_si256(src.add(16) as *const __m256i);
            let nib = _mm256_set1_epi8(0x0F);
            for c in 0..4 {
                let b = _mm256_loadu_si256(src.add(48 + 32 * c) as *const __m256i);
                let lo = with_bit4(_mm256_and_si256(b, nib), qh, 2 * c as u32);
                let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(b), nib);
                let hi = with_bit4(hi, qh, 2 * c as u32 + 1);
                let out = codes.as_mut_ptr().add(64 * c) as *mut __m256i;
                _mm256_storeu_si256(out, lo);
                _mm256_storeu_si256(out.add(1), hi);
            }
        }
        k4_scales::<S>(src, scale, min);
    }
}

impl Format for Q4K {
    const TY: QuantType = QuantType::Q4K;
    const BS: usize = 256;
    const BB: usize = 144;
    #[inline(always)]
    unsafe fn dequant<S: Simd>(src: *const u8, dst: *mut f32) {
        let (d, dmin) = (S::f16(src), S::f16(src.add(2)));
        let scales = std::slice::from_raw_parts(src.add(4), 12);
        let qs = src.add(16);
        for c in 0..4 {
            let (sc1, m1) = scale_min_k4(2 * c, scales);
            let (sc2, m2) = scale_min_k4(2 * c + 1, scales);
            let (d1, m1) = (S::splat(d * sc1 as f32), S::splat(-dmin * m1 as f32));
            let (d2, m2) = (S::splat(d * sc2 as f32), S::splat(-dmin * m2 as f32));
            let q = qs.add(32 * c);
            let y = dst.add(64 * c);
            let mut l = 0;
            while l < 32 {
                let b = S::load_u8(q.add(l));
                S::store(y.add(l), S::fma(S::cvt(S::and_i(b, 0xF)), d1, m1));
                S::store(y.add(32 + l), S::fma(S::cvt(S::srl::<4>(b)), d2, m2));
                l += S::LANES;
            }
        }
    }

    const HAS_CODES16: bool = true;
    const CODES_MIN: bool = true;
    /// The nibbles split into bytes with two AVX2 operations per 64 values; 6-bit scales and
    /// mins per 32 values (given for both halves).
    #[inline(always)]
    unsafe fn codes16<S: Simd>(
        src: *const u8,
        codes: &mut [i8; 256],
        scale: &mut [f32; 16],
        min: &mut [f32; 16],
    ) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::*;
            let nib = _mm256_set1_epi8(0x0F);
            for c in 0..4 {
                let b = _mm256_loadu_si256(src.add(16 + 32 * c) as *const __m256i);
                let out = codes.as_mut_ptr().add(64 * c) as *mut __m256i;
                _mm256_storeu_si256(out, _mm256_and_si256(b, nib));
                _mm256_storeu_si256(out.add(1), _mm256_and_si256(_mm256_srli_epi16::<4>(b), nib));
            }
        }
        k4_scales::<S>(src, scale, min);
    }
}

impl Format for Q6K {
    const TY: QuantType = QuantType::Q6K;
    const BS: usize = 256;
    const BB: usize = 210;
    #[inline(always)]
    unsafe fn dequant<S: Simd>(src: *const u8, dst: *mut f32) {
        let d = S::f16(src.add(208));
        let k32 = S::splat(32.0);
        for half in 0..2 {
            let ql = src.add(64 * half);
            let qh = src.add(128 + 32 * half);
            let sc = src.add(192 + 8 * half) as *const i8;
            let y = dst.add(128 * half);
            let mut l = 0;
            while l < 32 {
                let is = l / 16;
                let a = S::load_u8(ql.add(l));
                let b = S::load_u8(ql.add(l + 32));
                let h = S::load_u8(qh.add(l));
                let q1 = S::or_i(S::and_i(a, 0xF), S::sll::<4>(S::and_i(h, 3)));
                let q2 = S::or_i(S::and_i(b, 0xF), S::sll::<4>(S::and_i(S::srl::<2>(h), 3)));
                let q3 = S::or_i(S::srl::<4>(a), S::sll::<4>(S::and_i(S::srl::<4>(h), 3)));
                let q4 = S::or_i(S::srl::<4>(b), S::sll::<4>(S::srl::<6>(h)));
                let s0 = S::splat(d * *sc.add(is) as f32);
                let s2 = S::splat(d * *sc.add(is + 2) as f32);
                let s4 = S::splat(d * *sc.add(is + 4) as f32);
                let s6 = S::splat(d * *sc.add(is + 6) as f32);
                S::store(y.add(l), S::mul(S::sub(S::cvt(q1), k32), s0));
                S::store(y.add(l + 32), S::mul(S::sub(S::cvt(q2), k32), s2));
                S::store(y.add(l + 64), S::mul(S::sub(S::cvt(q3), k32), s4));
                S::store(y.add(l + 96), S::mul(S::sub(S::cvt(q4), k32), s6));
                l += S::LANES;
            }
        }
    }

    const HAS_CODES16: bool = true;
    /// The super-block's 256 codes q − 32 as bytes (`q6k_groups`, 32 values per few
    /// instructions); 8-bit scales per 16 values ((q − 32)·(d·sc): exact integers times one f32).
    #[inline(always)]
    unsafe fn codes16<S: Simd>(
        src: *const u8,
        codes: &mut [i8; 256],
        scale: &mut [f32; 16],
        _min: &mut [f32; 16],
    ) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::*;
            let k32 = _mm256_set1_epi8(32);
            for hh in 0..2 {
                let g = q6k_groups(src, hh).map(|q| _mm256_sub_epi8(q, k32));
                store_groups(g, codes, 128 * hh);
            }
        }
        let d = S::f16(src.add(208));
        let sc = src.add(192) as *const i8;
        for (k, v) in scale.iter_mut().enumerate() {
            *v = d * *sc.add(k) as f32;
        }
    }
}

/// Half `hh` (values 128·hh..128·hh+128) of a Q6_K super-block at `sb` as 6-bit codes q (0..64),
/// four groups of 32 bytes in value order: group g is ql's low (g < 2) or high nibbles of bytes
/// 32·(g%2).., with qh's bits 2g..2g+2 on top (`reference::dequantize_block`'s layout).
/// AVX2 byte operations (every kernel ISA has them).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn q6k_groups(sb: *const u8, hh: usize) -> [std::arch::x86_64::__m256i; 4] {
    use std::arch::x86_64::*;
    let a = _mm256_loadu_si256(sb.add(64 * hh) as *const __m256i);
    let b = _mm256_loadu_si256(sb.add(64 * hh + 32) as *const __m256i);
    let h = _mm256_loadu_si256(sb.add(128 + 32 * hh) as *const __m256i);
    let (nib, top) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30));
    let (lo_a, lo_b) = (_mm256_and_si256(a, nib), _mm256_and_si256(b, nib));
    let hi_a = _mm256_and_si256(_mm256_srli_epi16::<4>(a), nib);
    let hi_b = _mm256_and_si256(_mm256_srli_epi16::<4>(b), nib);
    // 16-bit shifts: the bits that cross into a neighbouring byte are masked off.
    [
        _mm256_or_si256(lo_a, _mm256_and_si256(_mm256_slli_epi16::<4>(h), top)),
        _mm256_or_si256(lo_b, _mm256_and_si256(_mm256_slli_epi16::<2>(h), top)),
        _mm256_or_si256(hi_a, _mm256_and_si256(h, top)),
        _mm256_or_si256(hi_b, _mm256_and_si256(_mm256_srli_epi16::<2>(h), top)),
    ]
}
