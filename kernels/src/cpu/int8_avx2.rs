//! Int8 products (`Precision::Int8`) on AVX2 alone (Zen 3 and other CPUs without VNNI), equal to
//! the bit to the AVX-512 VNNI kernels (`cpu::int8`) and so to `reference::matmul_int8`: the same
//! activation layout, the same exact integer sums, the same f32 lanes — the 16 lanes of a pair
//! held as two 256-bit halves, summed at the end in the AVX-512 `reduce_add` order (lane l plus
//! lane l+8 first, which is adding the halves).
//!
//! Without `vpdpbusd` each lane's four products are summed by `vpmaddubsw` (u8 x i8 pairs into
//! saturating i16) and `vpmaddwd` by ones: exact while a pair of products fits i16, which holds
//! for 4-bit codes (15·127·2), Q6_K's 6-bit ones (63·127·2) and for Q8_0 taken as |w| with x
//! negated where w < 0 (128·127·2), not for Q8_0's codes + 128 the VNNI kernels use.
//!
//! The super-block formats' kernels are `int8_kquant`'s (on the same activations and lanes).
//!
//! Written by hand: no crate offers quantized-weight x int8 products with a fixed summation order.

// Safety of every `unsafe fn` here: the CPU has AVX2, FMA and F16C, and pointers are valid for
// the lengths and rows the `JobRef` states.
#![allow(clippy::missing_safety_doc, clippy::needless_range_loop)]

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{interleave, iq4_values, quantize_rows, task};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::int8::{block_bytes, pair_halves, q8_row_slots, IQ4NL, Q4_0, Q4_1, Q8_0};
    use super::super::job::{JobRef, X_BLOCK};
    use super::super::simd::{Avx2, Simd};
    use crate::quant::QuantType;
    use crate::reference::{int8_has_min, q8_pairs};
    use std::arch::x86_64::*;

    /// 16 bytes of IQ4 nibbles (value k: byte k % 16, high nibble for k ≥ 16) as the codebook's
    /// 32 signed values, in value order.
    #[inline(always)]
    pub(crate) unsafe fn iq4_values(qs: *const u8) -> __m256i {
        let b = _mm_loadu_si128(qs as *const __m128i);
        let nib = _mm_set1_epi8(0x0F);
        let idx = _mm256_set_m128i(
            _mm_and_si128(_mm_srli_epi16::<4>(b), nib),
            _mm_and_si128(b, nib),
        );
        let t = _mm_loadu_si128(crate::quant::IQ4_VALUES.as_ptr() as *const __m128i);
        _mm256_shuffle_epi8(_mm256_set_m128i(t, t), idx)
    }
    /// One block's 32 codes in value order, its scale, and the sums of its 8 groups of 4 codes.
    #[inline(always)]
    unsafe fn quantize_block(xb: *const f32) -> (__m256i, f32, __m256i) {
        let sign = _mm256_set1_ps(-0.0);
        let v: [__m256; 4] = [
            _mm256_loadu_ps(xb),
            _mm256_loadu_ps(xb.add(8)),
            _mm256_loadu_ps(xb.add(16)),
            _mm256_loadu_ps(xb.add(24)),
        ];
        let mut m = _mm256_andnot_ps(sign, v[0]);
        for k in 1..4 {
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[k]));
        }
        let amax = Avx2::reduce_max(m);
        let scale = amax / 127.0;
        let inv = _mm256_set1_ps(if scale != 0.0 { 1.0 / scale } else { 0.0 });
        // Nearest even: the default rounding mode.
        let q: [__m256i; 4] = [
            _mm256_cvtps_epi32(_mm256_mul_ps(v[0], inv)),
            _mm256_cvtps_epi32(_mm256_mul_ps(v[1], inv)),
            _mm256_cvtps_epi32(_mm256_mul_ps(v[2], inv)),
            _mm256_cvtps_epi32(_mm256_mul_ps(v[3], inv)),
        ];
        // Packing interleaves 128-bit lanes; the dword permute puts the values back in order.
        let w = _mm256_packs_epi16(
            _mm256_packs_epi32(q[0], q[1]),
            _mm256_packs_epi32(q[2], q[3]),
        );
        let codes = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        let sums = _mm256_madd_epi16(
            _mm256_maddubs_epi16(_mm256_set1_epi8(1), codes),
            _mm256_set1_epi16(1),
        );
        (codes, scale, sums)
    }

    /// Dwords of blocks b (`a`) and b+1 (`b`) alternating: lanes 0..8 of a pair, then 8..16.
    #[inline(always)]
    pub(crate) unsafe fn interleave(a: __m256i, b: __m256i) -> (__m256i, __m256i) {
        let (lo, hi) = (_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
        (
            _mm256_permute2x128_si256::<0x20>(lo, hi),
            _mm256_permute2x128_si256::<0x31>(lo, hi),
        )
    }

    /// `cpu::int8::quantize_rows` on AVX2: the same layout, to the bit.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn quantize_rows(
        x: *const f32,
        n: usize,
        cols: usize,
        ty: QuantType,
        dst: *mut f32,
    ) -> (*const i8, *const f32, *const i32, *const f32) {
        let np = q8_pairs(cols);
        let nb = cols / 32;
        let [sq, sd, sc, ss] = q8_row_slots(cols);
        let (q, d) = (dst as *mut i8, dst.add(n * sq));
        let (c, s) = (d.add(n * sd) as *mut i32, d.add(n * (sd + sc)));
        let off = match ty {
            QuantType::Q4_0 => -8,
            QuantType::Q3K => -4,
            QuantType::Q6K => -32,
            QuantType::Q8_0 => -128,
            _ => 0,
        };
        let min = int8_has_min(ty);
        for i in 0..n {
            let srow = s.add(i * ss);
            if min {
                for b in 0..ss {
                    *srow.add(b) = 0.0;
                }
            }
            for p in 0..np {
                let mut codes = [_mm256_setzero_si256(); 2];
                let mut sums = [_mm256_setzero_si256(); 2];
                let mut scale = [0.0f32; 2];
                for h in 0..2 {
                    let b = 2 * p + h;
                    if b < nb {
                        (codes[h], scale[h], sums[h]) = quantize_block(x.add(i * cols + b * 32));
                        if min {
                            // Exact: eight sums of at most 508 in magnitude.
                            let total = Avx2::reduce_add(_mm256_cvtepi32_ps(sums[h]));
                            *srow.add(b) = scale[h] * total;
                        }
                    }
                }
                let at = i * np + p;
                let (c0, c1) = interleave(codes[0], codes[1]);
                _mm256_storeu_si256(q.add(at * 64) as *mut __m256i, c0);
                _mm256_storeu_si256(q.add(at * 64 + 32) as *mut __m256i, c1);
                let dl =
                    _mm256_blend_ps::<0xAA>(_mm256_set1_ps(scale[0]), _mm256_set1_ps(scale[1]));
                _mm256_storeu_ps(d.add(at * 16), dl);
                _mm256_storeu_ps(d.add(at * 16 + 8), dl);
                if off != 0 {
                    let (l0, l1) = interleave(sums[0], sums[1]);
                    let k = _mm256_set1_epi32(off);
                    let cp = c.add(at * 16);
                    _mm256_storeu_si256(cp as *mut __m256i, _mm256_mullo_epi32(l0, k));
                    _mm256_storeu_si256(cp.add(8) as *mut __m256i, _mm256_mullo_epi32(l1, k));
                }
            }
        }
        (
            q as *const i8,
            d as *const f32,
            c as *const i32,
            s as *const f32,
        )
    }

    /// Rows r0..r1 of the product, every activation row.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn task(j: &JobRef, r0: usize, r1: usize) {
        match j.ty {
            QuantType::Q4_0 => task_fmt::<Q4_0>(j, r0, r1),
            QuantType::Q4_1 => task_fmt::<Q4_1>(j, r0, r1),
            QuantType::Q8_0 => task_fmt::<Q8_0>(j, r0, r1),
            QuantType::IQ4NL => task_fmt::<IQ4NL>(j, r0, r1),
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
                    match (ie - i0).min(4) {
                        1 => rows::<FMT, 1>(j, r, i0),
                        2 => rows::<FMT, 2>(j, r, i0),
                        3 => rows::<FMT, 3>(j, r, i0),
                        _ => rows::<FMT, 4>(j, r, i0),
                    }
                    i0 += 4;
                }
            }
            ib = ie;
        }
    }

    /// Blocks 2p and 2p+1 of a weight row in the pair layout as two halves of unsigned codes
    /// (4-bit: raw nibbles; Q8_0: |w|) and, for Q8_0, the bytes where w < 0 (all ones).
    #[inline(always)]
    unsafe fn load_pair<const FMT: u8>(
        w: *const u8,
        p: usize,
        two: bool,
    ) -> ([__m256i; 2], [__m256i; 2]) {
        let bb = block_bytes::<FMT>();
        let p0 = w.add(2 * p * bb);
        let p1 = if two { p0.add(bb) } else { p0 };
        if FMT == Q8_0 || FMT == IQ4NL {
            let a = signed_codes::<FMT>(p0);
            let b = if two {
                signed_codes::<FMT>(p1)
            } else {
                _mm256_setzero_si256()
            };
            let (c0, c1) = interleave(a, b);
            let z = _mm256_setzero_si256();
            (
                [_mm256_abs_epi8(c0), _mm256_abs_epi8(c1)],
                [_mm256_cmpgt_epi8(z, c0), _mm256_cmpgt_epi8(z, c1)],
            )
        } else {
            let at = if FMT == Q4_0 { 2 } else { 4 };
            let a = _mm_loadu_si128(p0.add(at) as *const __m128i);
            let b = _mm_loadu_si128(p1.add(at) as *const __m128i);
            let z = _mm256_set_m128i(_mm_unpackhi_epi32(a, b), _mm_unpacklo_epi32(a, b));
            let nib = _mm256_set1_epi8(0x0F);
            let lo = _mm256_and_si256(z, nib);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(z), nib);
            ([lo, hi], [_mm256_setzero_si256(); 2])
        }
    }

    /// A block's 32 signed codes: Q8_0's bytes, or IQ4_NL's looked up in the codebook.
    #[inline(always)]
    unsafe fn signed_codes<const FMT: u8>(block: *const u8) -> __m256i {
        if FMT == Q8_0 {
            _mm256_loadu_si256(block.add(2) as *const __m256i)
        } else {
            iq4_values(block.add(2))
        }
    }

    /// The scales of blocks 2p and 2p+1 as lanes [d_2p, d_2p+1] × 4, and Q4_1's mins as halves.
    #[inline(always)]
    unsafe fn pair_scales<const FMT: u8>(w: *const u8, p: usize, two: bool) -> (__m256, u32) {
        let (d, m) = pair_halves::<FMT>(w, p, two);
        (_mm256_cvtph_ps(_mm_set1_epi32(d as i32)), m)
    }

    /// y[i0..i0+N][r], as `cpu::int8`'s `rows` computes it.
    #[inline(always)]
    unsafe fn rows<const FMT: u8, const N: usize>(j: &JobRef, r: usize, i0: usize) {
        let w = j.w.add(r * j.row_bytes);
        let nb = j.cols / 32;
        let np = q8_pairs(j.cols);
        let nb16 = nb.next_multiple_of(16);
        let pair_bytes = 2 * block_bytes::<FMT>();
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_ps(); 2]; N];
        let mut mins = [[_mm256_setzero_ps(); 2]; N];
        let mut g = 0;
        while g < nb {
            let mut halves = [0u32; 8];
            let p_end = (g / 2 + 8).min(np);
            for p in g / 2..p_end {
                _mm_prefetch::<_MM_HINT_T0>(
                    w.add(p * pair_bytes + crate::cpu::int8::PREFETCH_AHEAD) as *const i8,
                );
                let two = 2 * p + 1 < nb;
                let (wv, neg) = load_pair::<FMT>(w, p, two);
                let (dw, m) = pair_scales::<FMT>(w, p, two);
                halves[p % 8] = m;
                for i in 0..N {
                    let at = ((i0 + i) * np + p) * 16;
                    for h in 0..2 {
                        let mut x = _mm256_loadu_si256(j.xq.add(at * 4 + 32 * h) as *const _);
                        if FMT == Q8_0 || FMT == IQ4NL {
                            // x negated where w < 0: (x ^ m) - m.
                            x = _mm256_sub_epi8(_mm256_xor_si256(x, neg[h]), neg[h]);
                        }
                        let mut isum = _mm256_madd_epi16(_mm256_maddubs_epi16(wv[h], x), ones);
                        if FMT == Q4_0 {
                            let c = _mm256_loadu_si256(j.xc.add(at + 8 * h) as *const _);
                            isum = _mm256_add_epi32(isum, c);
                        }
                        let sc = _mm256_mul_ps(dw, _mm256_loadu_ps(j.xd.add(at + 8 * h)));
                        acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), sc, acc[i][h]);
                    }
                }
            }
            if FMT == Q4_1 {
                let hv = _mm256_loadu_si256(halves.as_ptr() as *const __m256i);
                let m16 = [
                    _mm256_cvtph_ps(_mm256_castsi256_si128(hv)),
                    _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(hv)),
                ];
                for i in 0..N {
                    for h in 0..2 {
                        let s = _mm256_loadu_ps(j.xs.add((i0 + i) * nb16 + g + 8 * h));
                        mins[i][h] = _mm256_fmadd_ps(m16[h], s, mins[i][h]);
                    }
                }
            }
            g += 16;
        }
        for i in 0..N {
            let v = if FMT == Q4_1 {
                [
                    _mm256_add_ps(acc[i][0], mins[i][0]),
                    _mm256_add_ps(acc[i][1], mins[i][1]),
                ]
            } else {
                acc[i]
            };
            *j.y.add((i0 + i) * j.rows + r) = Avx2::reduce_add(_mm256_add_ps(v[0], v[1]));
        }
    }
}
