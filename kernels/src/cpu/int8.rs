//! Int8 products (`Precision::Int8`, AVX512_VNNI's `vpdpbusd`): y = x · Wᵀ with the activations
//! quantized per block of 32 to int8 (llama.cpp's Q8 scheme) and dotted in integers with the
//! weights' own 4- or 8-bit codes, which are never converted to floats: the decode of a 4-bit
//! block is a shift and a mask, and one instruction does 64 multiply-adds. llama.cpp's approach
//! (`ggml_vec_dot_q4_1_q8_1`), with our contract: one arithmetic for a value y[i][r] whatever the
//! batch and the path — the layout and order `reference::int8` defines and emulates to the bit.
//!
//! Two blocks per 512-bit register: the activations are stored pairwise interleaved (x_b[0..16],
//! x_b+1[0..16], x_b[16..32], x_b+1[16..32]), which is the order the nibbles of two Q4 blocks
//! come out of one variable shift, so the weights need no shuffle. Q4_0 and Q8_0 codes are signed:
//! `vpdpbusd` takes |w| as unsigned and x negated where w < 0.
//!
//! One kernel serves decode and batches: per weight row, groups of up to 8 activation rows share
//! each decoded pair of blocks (X_BLOCK rows at a time stay in L2).
//!
//! Written by hand: no crate offers quantized-weight x int8 products with a fixed summation order.

// Safety of every `unsafe fn` here: the CPU has AVX-512F/BW/VL/DQ and AVX512_VNNI, and pointers
// are valid for the lengths and rows the `JobRef` states.
#![allow(clippy::missing_safety_doc)]

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{quantize_rows, task};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::matmul::{JobRef, X_BLOCK};
    use super::super::simd::{Avx512, Simd};
    use crate::quant::QuantType;
    use crate::reference::q8_pairs;
    use std::arch::x86_64::*;

    const Q4_0: u8 = 0;
    const Q4_1: u8 = 1;
    const Q8_0: u8 = 2;

    /// Lane L of a pair takes the scale of block (L/4)%2 (`IDX_D`) and its min (`IDX_M`) from
    /// [d0, m0, d1, m1].
    static IDX_D: [i32; 16] = [0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2];
    static IDX_M: [i32; 16] = [1, 1, 1, 1, 3, 3, 3, 3, 1, 1, 1, 1, 3, 3, 3, 3];

    /// Rows of `cols` f32 values (cols a multiple of 32) quantized into the pair layout of
    /// `reference::quantize_rows_q8`, equal to it to the bit.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn quantize_rows(
        x: *const f32,
        n: usize,
        cols: usize,
        q: *mut i8,
        d: *mut f32,
        s: *mut f32,
    ) {
        let np = q8_pairs(cols);
        let nb = cols / 32;
        let ones = _mm_set1_epi8(1);
        for i in 0..n {
            for p in 0..np {
                let at = i * np + p;
                let (qp, dp, sp) = (q.add(at * 64), d.add(at * 16), s.add(at * 16));
                for half in 0..2 {
                    let b = 2 * p + half;
                    if b >= nb {
                        _mm_storeu_si128(qp.add(half * 16) as *mut __m128i, _mm_setzero_si128());
                        _mm_storeu_si128(qp.add(32 + half * 16) as *mut __m128i, _mm_setzero_si128());
                        for lanes in [half * 4, 8 + half * 4] {
                            _mm_storeu_ps(dp.add(lanes), _mm_setzero_ps());
                            _mm_storeu_ps(sp.add(lanes), _mm_setzero_ps());
                        }
                        continue;
                    }
                    let xb = x.add(i * cols + b * 32);
                    let (v0, v1) = (_mm512_loadu_ps(xb), _mm512_loadu_ps(xb.add(16)));
                    let amax = _mm512_reduce_max_ps(_mm512_max_ps(
                        _mm512_abs_ps(v0),
                        _mm512_abs_ps(v1),
                    ));
                    let scale = amax / 127.0;
                    let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
                    let vinv = _mm512_set1_ps(inv);
                    for (k, v) in [v0, v1].into_iter().enumerate() {
                        // Nearest even: the default rounding mode.
                        let c = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v, vinv)));
                        _mm_storeu_si128(qp.add(32 * k + half * 16) as *mut __m128i, c);
                        let sums = _mm_cvtepi32_ps(_mm_dpbusd_epi32(_mm_setzero_si128(), ones, c));
                        let lanes = 8 * k + half * 4;
                        _mm_storeu_ps(dp.add(lanes), _mm_set1_ps(scale));
                        _mm_storeu_ps(sp.add(lanes), _mm_mul_ps(_mm_set1_ps(scale), sums));
                    }
                }
            }
        }
    }

    /// Rows r0..r1 of the product, every activation row.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn task(j: &JobRef, r0: usize, r1: usize) {
        match j.ty {
            QuantType::Q4_0 => task_fmt::<Q4_0>(j, r0, r1),
            QuantType::Q4_1 => task_fmt::<Q4_1>(j, r0, r1),
            QuantType::Q8_0 => task_fmt::<Q8_0>(j, r0, r1),
            ty => unreachable!("no int8 products for {ty:?}"),
        }
    }

    // No closures below: they would not inherit the target features.
    #[inline(always)]
    unsafe fn task_fmt<const FMT: u8>(j: &JobRef, r0: usize, r1: usize) {
        let mut ib = 0;
        while ib < j.n {
            let ie = (ib + X_BLOCK).min(j.n);
            for r in r0..r1 {
                let mut i0 = ib;
                while i0 < ie {
                    match (ie - i0).min(8) {
                        1 => rows::<FMT, 1>(j, r, i0),
                        2 => rows::<FMT, 2>(j, r, i0),
                        3 => rows::<FMT, 3>(j, r, i0),
                        4 => rows::<FMT, 4>(j, r, i0),
                        5 => rows::<FMT, 5>(j, r, i0),
                        6 => rows::<FMT, 6>(j, r, i0),
                        7 => rows::<FMT, 7>(j, r, i0),
                        _ => rows::<FMT, 8>(j, r, i0),
                    }
                    i0 += 8;
                }
            }
            ib = ie;
        }
    }

    /// Blocks b and b+1 of a weight row (b+1 absent where `!two`: zero scale and min): the codes
    /// in the pair layout (unsigned: |w| where signed), the lanes where w < 0, and per lane the
    /// block's scale and min.
    #[inline(always)]
    unsafe fn load_pair<const FMT: u8>(
        w: *const u8,
        b: usize,
        two: bool,
    ) -> (__m512i, __mmask64, __m512, __m512) {
        let bb = match FMT {
            Q4_0 => 18,
            Q4_1 => 20,
            _ => 34,
        };
        let p0 = w.add(b * bb);
        let p1 = if two { p0.add(bb) } else { p0 };
        let codes = if FMT == Q8_0 {
            let y0 = _mm256_loadu_si256(p0.add(2) as *const __m256i);
            let y1 = if two {
                _mm256_loadu_si256(p1.add(2) as *const __m256i)
            } else {
                _mm256_setzero_si256()
            };
            let z = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(y0), y1);
            // 128-bit quarters [b lo, b hi, b+1 lo, b+1 hi] -> [b lo, b+1 lo, b hi, b+1 hi].
            _mm512_shuffle_i64x2::<0b11_01_10_00>(z, z)
        } else {
            let at = if FMT == Q4_0 { 2 } else { 4 };
            let lo = _mm_loadu_si128(p0.add(at) as *const __m128i);
            let hi = _mm_loadu_si128(p1.add(at) as *const __m128i);
            let y = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(lo), hi);
            let z = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(y), y);
            let shift = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(4));
            let nib = _mm512_and_si512(_mm512_srlv_epi16(z, shift), _mm512_set1_epi8(0x0F));
            if FMT == Q4_0 {
                _mm512_sub_epi8(nib, _mm512_set1_epi8(8))
            } else {
                nib
            }
        };
        let (wv, neg) = if FMT == Q4_1 {
            (codes, 0)
        } else {
            (_mm512_abs_epi8(codes), _mm512_movepi8_mask(codes))
        };
        // [d0, m0, d1, m1] as halves (Q4_1 keeps d and m side by side; the others have no min).
        let (h0, h1) = if FMT == Q4_1 {
            (
                (p0 as *const u32).read_unaligned(),
                if two {
                    (p1 as *const u32).read_unaligned()
                } else {
                    0
                },
            )
        } else {
            (
                (p0 as *const u16).read_unaligned() as u32,
                if two {
                    (p1 as *const u16).read_unaligned() as u32
                } else {
                    0
                },
            )
        };
        let dm = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_set_epi32(0, 0, h1 as i32, h0 as i32)));
        let dw = _mm512_permutexvar_ps(_mm512_loadu_si512(IDX_D.as_ptr() as *const _), dm);
        let m = if FMT == Q4_1 {
            _mm512_permutexvar_ps(_mm512_loadu_si512(IDX_M.as_ptr() as *const _), dm)
        } else {
            _mm512_setzero_ps()
        };
        (wv, neg, dw, m)
    }

    /// y[i0..i0+N][r]: each pair of weight blocks decoded once for the N activation rows.
    #[inline(always)]
    unsafe fn rows<const FMT: u8, const N: usize>(j: &JobRef, r: usize, i0: usize) {
        let w = j.w.add(r * j.row_bytes);
        let nb = j.cols / 32;
        let np = q8_pairs(j.cols);
        let pair_bytes = 2 * j.row_bytes / nb;
        let mut acc = [_mm512_setzero_ps(); N];
        for p in 0..np {
            _mm_prefetch::<_MM_HINT_T0>(w.add(p * pair_bytes + 640) as *const i8);
            let (wv, neg, dw, m) = load_pair::<FMT>(w, 2 * p, 2 * p + 1 < nb);
            for (i, a) in acc.iter_mut().enumerate() {
                let at = (i0 + i) * np + p;
                let mut xv = _mm512_loadu_si512(j.xq.add(at * 64) as *const _);
                if FMT != Q4_1 {
                    xv = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
                }
                let isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv);
                let sc = _mm512_mul_ps(dw, _mm512_loadu_ps(j.xd.add(at * 16)));
                *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), sc, *a);
                if FMT == Q4_1 {
                    *a = _mm512_fmadd_ps(m, _mm512_loadu_ps(j.xs.add(at * 16)), *a);
                }
            }
        }
        for (i, a) in acc.iter().enumerate() {
            *j.y.add((i0 + i) * j.rows + r) = Avx512::reduce_add(*a);
        }
    }
}
