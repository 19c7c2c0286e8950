//! Int8 products for the super-block formats (Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS) on AVX512_VNNI,
//! equal to the bit to `reference::matmul_int8` and to AVX2's kernels (`int8_kquant`): the same
//! decoded super-blocks, activation layout and loops (`task_k`), with one 512-bit `vpdpbusd` per
//! pair of blocks and activation row where AVX2 takes two `vpmaddubsw` + `vpmaddwd` and two
//! conversions and FMAs. The integer sums are the same (AVX2's never saturate: |w| < 128, and a
//! pair of products stays under 2^15), and each lane's f32 arithmetic is the same operations in
//! the same order: lanes 0..8 of a 512-bit sum are AVX2's first half, 8..16 its second.
//!
//! Measured on a Zen 4 (EPYC, family 25 model 17; one thread; `ISAS=avx2,avx512 PRECISION=int8
//! FORMATS=q4_k,q6_k SHAPES=2048x8192,8192x2048 matmul_bench N`, alternating, medians of 7):
//! batch 1 1.11-1.16x AVX2's (Q4_K) and 1.19-1.31x (Q6_K), batch 64 1.0x and 1.13-1.29x (60-85
//! GFLOP/s). By count (not profiled), instructions bound them rather than `vpdpbusd`: per 64
//! products a row also takes its block scales' load and product, a conversion and an FMA (the
//! reference sums in f32 per 4-value lane). llama.cpp's Q8_K activations (one scale per 256 values, sub-block scales
//! applied in integers) do one f32 FMA per super-block; matching it is another int8 contract for
//! the K-quants (the reference, AVX2's and these kernels together).
//!
//! Written by hand: no crate offers quantized-weight x int8 products with a fixed summation order.

// Safety of every `unsafe fn` here: the CPU has AVX-512F/BW/VL/DQ and AVX512_VNNI, and pointers
// are valid for the lengths and rows the `JobRef` states. Index loops: the index also addresses
// the activation rows.
#![allow(clippy::missing_safety_doc, clippy::needless_range_loop)]

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::task;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::int8_kquant::{task_k, KBlock, KDot, IQ4XS, Q3K, Q4K, Q5K, Q6K};
    use super::super::job::JobRef;
    use crate::quant::QuantType;
    use std::arch::x86_64::*;

    /// VNNI's dot: a pair of blocks (both halves) and an activation row in one `vpdpbusd`.
    struct VnniK;

    /// Two 256-bit halves as one register (`a` in lanes 0..8).
    #[inline(always)]
    unsafe fn join_i(a: __m256i, b: __m256i) -> __m512i {
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b)
    }

    #[inline(always)]
    unsafe fn join_ps(a: __m256, b: __m256) -> __m512 {
        _mm512_insertf32x8::<1>(_mm512_castps256_ps512(a), b)
    }

    impl KDot for VnniK {
        type Acc = __m512;

        #[inline(always)]
        unsafe fn zero() -> __m512 {
            _mm512_setzero_ps()
        }

        #[inline(always)]
        unsafe fn dot<const FMT: u8, const N: usize>(
            kb: &KBlock,
            j: &JobRef,
            s: usize,
            i0: usize,
            acc: &mut [__m512; N],
        ) {
            let np = j.cols / 64;
            for pp in 0..4 {
                let p = 4 * s + pp;
                let mut w = join_i(kb.codes[pp][0], kb.codes[pp][1]);
                // IQ4_XS: |w| · (x negated where w < 0), as AVX2's `vpsignb` (no zero in the
                // codebook).
                let neg = _mm512_movepi8_mask(w);
                if FMT == IQ4XS {
                    w = _mm512_abs_epi8(w);
                }
                let scales = join_ps(kb.scales[pp][0], kb.scales[pp][1]);
                for i in 0..N {
                    let at = ((i0 + i) * np + p) * 16;
                    // The activations' scales are the same in both halves: lanes [d_b, d_b+1]×4.
                    let xd = _mm512_broadcast_f32x8(_mm256_loadu_ps(j.xd.add(at)));
                    let sc = _mm512_mul_ps(scales, xd);
                    let mut x = _mm512_loadu_si512(j.xq.add(at * 4) as *const _);
                    if FMT == IQ4XS {
                        x = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
                    }
                    // Q6_K's and Q3_K's codes are offset: the activations' corrections first.
                    let start = if FMT == Q6K || FMT == Q3K {
                        _mm512_loadu_si512(j.xc.add(at) as *const _)
                    } else {
                        _mm512_setzero_si512()
                    };
                    let isum = _mm512_dpbusd_epi32(start, w, x);
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), sc, acc[i]);
                }
            }
        }

        #[inline(always)]
        unsafe fn halves(acc: &__m512) -> [__m256; 2] {
            [
                _mm512_castps512_ps256(*acc),
                _mm512_extractf32x8_ps::<1>(*acc),
            ]
        }
    }

    /// Rows r0..r1 of the product, every activation row.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn task(j: &JobRef, r0: usize, r1: usize) {
        match j.ty {
            QuantType::Q4K => task_k::<VnniK, Q4K>(j, r0, r1),
            QuantType::Q6K => task_k::<VnniK, Q6K>(j, r0, r1),
            QuantType::Q5K => task_k::<VnniK, Q5K>(j, r0, r1),
            QuantType::Q3K => task_k::<VnniK, Q3K>(j, r0, r1),
            QuantType::IQ4XS => task_k::<VnniK, IQ4XS>(j, r0, r1),
            ty => unreachable!("no super-block int8 products for {ty:?}"),
        }
    }
}
