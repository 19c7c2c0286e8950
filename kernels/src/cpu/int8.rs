//! Int8 products (`Precision::Int8`, AVX512_VNNI's `vpdpbusd`): y = x · Wᵀ with the activations
//! quantized per block of 32 to int8 (llama.cpp's Q8 scheme) and dotted in integers with the
//! weights' own 4- or 8-bit codes, which are never converted to floats: the decode of a 4-bit
//! block is a shift and a mask, and one instruction does 64 multiply-adds. llama.cpp's approach
//! (`ggml_vec_dot_q4_1_q8_1`), with our contract: one arithmetic for a value y[i][r] whatever the
//! batch and the path — the layout and order `reference::int8` defines and emulates to the bit.
//!
//! Two blocks per 512-bit register, their 4-value groups alternating (lane L: block L%2, values
//! 4·(L/2)..): one two-source dword permute puts two blocks' codes there, so that each lane's
//! scale is a broadcast pair [d_b, d_b+1]. The activations are quantized once per product into
//! that layout, with per-lane scales and, for the signed formats, per-lane corrections:
//! `vpdpbusd` takes unsigned weights, so Q8_0 codes enter as q + 128 and Q4_0's as their raw
//! nibbles q, and the sum starts from −128 (−8) times the lane's activation codes summed — the
//! integer sum is exactly Σ w·x either way.
//!
//! One kernel serves decode and batches: per weight row, groups of up to 8 activation rows share
//! each decoded pair of blocks and its scales (X_BLOCK rows at a time stay in L2); a single
//! activation row (decode) goes with two weight rows at a time, which share its loads.
//!
//! Written by hand: no crate offers quantized-weight x int8 products with a fixed summation order.

// Safety of every `unsafe fn` here: the CPU has AVX-512F/BW/VL/DQ and AVX512_VNNI, and pointers
// are valid for the lengths and rows the `JobRef` states. Index loops over register arrays: an
// iterator's closure-free adapters would do, but the indices also address the activation rows.
#![allow(clippy::missing_safety_doc, clippy::needless_range_loop)]

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{
    block_bytes, pair_halves, q8_row_slots, quantize_rows, task, IQ4NL, Q4_0, Q4_1, Q8_0,
};

/// The formats these VNNI kernels take; the K-quants have VNNI kernels of their own
/// (`int8_kquant_vnni`, on AVX2's activation layout), IQ4_NL runs AVX2's on every CPU.
pub(crate) const VNNI_FORMATS: [crate::quant::QuantType; 3] = [
    crate::quant::QuantType::Q4_0,
    crate::quant::QuantType::Q4_1,
    crate::quant::QuantType::Q8_0,
];

/// How far ahead of a weight row's reads the kernels prefetch, in bytes. Decode streams the whole
/// model once per token, and on Zen 4 (2 cores, 2 MB pages) 640 bytes left the loads waiting on
/// the memory: 3072 made batch-1 decode 10-13% faster (`flywheel bench --precision int8 --batch
/// 1`, medians of 6 alternating runs: 640 bytes 175 tok/s, 2048 194, 4096 197).
pub(crate) const PREFETCH_AHEAD: usize = 3072;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::job::{JobRef, X_BLOCK};
    use super::super::simd::{Avx512, Simd};
    use super::PREFETCH_AHEAD;
    use crate::quant::QuantType;
    use crate::reference::q8_pairs;
    use std::arch::x86_64::*;

    /// The formats, as the kernels' const parameter.
    pub(crate) const Q4_0: u8 = 0;
    pub(crate) const Q4_1: u8 = 1;
    pub(crate) const Q8_0: u8 = 2;
    /// IQ4_NL (AVX2's kernels only): Q8_0's path with codes looked up in the codebook.
    pub(crate) const IQ4NL: u8 = 7;

    /// Dword L of a pair's codes: block L%2's dword L/2 (8-bit codes), or its dword (L/2)%4 of
    /// nibbles (4-bit: values 16.. are the high nibbles of the same bytes).
    static IDX_Q8: [i32; 16] = [0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23];
    static IDX_Q4: [i32; 16] = [0, 16, 1, 17, 2, 18, 3, 19, 0, 16, 1, 17, 2, 18, 3, 19];

    /// Per activation row, in f32 slots: codes (pairs × 64 bytes), per pair 16 lanes each of
    /// scales and corrections (i32: written for the signed formats only), and per block the
    /// scaled code sum (Q4_1's min term, written for Q4_1 only; blocks rounded up to 16).
    pub fn q8_row_slots(cols: usize) -> [usize; 4] {
        let np = q8_pairs(cols);
        [np * 16, np * 16, np * 16, (cols / 32).next_multiple_of(16)]
    }

    /// Rows of `cols` f32 values (cols a multiple of 32) quantized for products with weights in
    /// format `ty` (`reference::quantize_block_q8` per block, to the bit) into the layout above,
    /// at `dst` (n · Σ q8_row_slots slots). Returns the JobRef pointers (codes, scales,
    /// corrections, sums).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
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
            QuantType::Q8_0 => -128,
            _ => 0,
        };
        let idx = _mm512_loadu_si512(IDX_Q8.as_ptr() as *const _);
        let ones = _mm256_set1_epi8(1);
        for i in 0..n {
            let srow = s.add(i * ss);
            if ty == QuantType::Q4_1 {
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
                    if b >= nb {
                        continue;
                    }
                    let xb = x.add(i * cols + b * 32);
                    let (v0, v1) = (_mm512_loadu_ps(xb), _mm512_loadu_ps(xb.add(16)));
                    let amax =
                        _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
                    scale[h] = amax / 127.0;
                    let inv = if scale[h] != 0.0 { 1.0 / scale[h] } else { 0.0 };
                    let vinv = _mm512_set1_ps(inv);
                    // Nearest even: the default rounding mode.
                    let c0 = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, vinv)));
                    let c1 = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, vinv)));
                    codes[h] = _mm256_set_m128i(c1, c0);
                    sums[h] = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, codes[h]);
                    if ty == QuantType::Q4_1 {
                        // Zero-extended: a cast would leave the upper half undefined.
                        let total = _mm512_reduce_add_epi32(_mm512_zextsi256_si512(sums[h]));
                        *srow.add(b) = scale[h] * total as f32;
                    }
                }
                let at = i * np + p;
                let pair = _mm512_permutex2var_epi32(
                    _mm512_castsi256_si512(codes[0]),
                    idx,
                    _mm512_castsi256_si512(codes[1]),
                );
                _mm512_storeu_si512(q.add(at * 64) as *mut _, pair);
                let dl = _mm512_mask_blend_ps(
                    0xAAAA,
                    _mm512_set1_ps(scale[0]),
                    _mm512_set1_ps(scale[1]),
                );
                _mm512_storeu_ps(d.add(at * 16), dl);
                if off != 0 {
                    let lanes = _mm512_permutex2var_epi32(
                        _mm512_castsi256_si512(sums[0]),
                        idx,
                        _mm512_castsi256_si512(sums[1]),
                    );
                    let corr = _mm512_mullo_epi32(lanes, _mm512_set1_epi32(off));
                    _mm512_storeu_si512(c.add(at * 16) as *mut _, corr);
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
            // One activation row (decode): two weight rows at a time share its loads.
            let mut r = r0;
            if ie - ib == 1 {
                while r + 2 <= r1 {
                    rows::<FMT, 1, 2>(j, r, ib);
                    r += 2;
                }
            }
            for r in r..r1 {
                let mut i0 = ib;
                while i0 < ie {
                    match (ie - i0).min(8) {
                        1 => rows::<FMT, 1, 1>(j, r, i0),
                        2 => rows::<FMT, 2, 1>(j, r, i0),
                        3 => rows::<FMT, 3, 1>(j, r, i0),
                        4 => rows::<FMT, 4, 1>(j, r, i0),
                        5 => rows::<FMT, 5, 1>(j, r, i0),
                        6 => rows::<FMT, 6, 1>(j, r, i0),
                        7 => rows::<FMT, 7, 1>(j, r, i0),
                        _ => rows::<FMT, 8, 1>(j, r, i0),
                    }
                    i0 += 8;
                }
            }
            ib = ie;
        }
    }

    /// Block bytes of a format.
    #[inline(always)]
    pub(crate) fn block_bytes<const FMT: u8>() -> usize {
        match FMT {
            Q4_0 | IQ4NL => 18,
            Q4_1 => 20,
            _ => 34,
        }
    }

    /// Blocks 2p and 2p+1 of a weight row (2p+1 absent where `!two`: its activations are zero)
    /// as unsigned codes in the pair layout: 4-bit nibbles as they are, 8-bit codes + 128.
    #[inline(always)]
    unsafe fn load_pair<const FMT: u8>(w: *const u8, p: usize, two: bool) -> __m512i {
        let bb = block_bytes::<FMT>();
        let p0 = w.add(2 * p * bb);
        let p1 = if two { p0.add(bb) } else { p0 };
        if FMT == Q8_0 {
            let lo = _mm512_castsi256_si512(_mm256_loadu_si256(p0.add(2) as *const __m256i));
            let hi = _mm512_castsi256_si512(_mm256_loadu_si256(p1.add(2) as *const __m256i));
            let z =
                _mm512_permutex2var_epi32(lo, _mm512_loadu_si512(IDX_Q8.as_ptr() as *const _), hi);
            _mm512_xor_si512(z, _mm512_set1_epi8(-128))
        } else {
            let at = if FMT == Q4_0 { 2 } else { 4 };
            let lo = _mm512_castsi128_si512(_mm_loadu_si128(p0.add(at) as *const __m128i));
            let hi = _mm512_castsi128_si512(_mm_loadu_si128(p1.add(at) as *const __m128i));
            let z =
                _mm512_permutex2var_epi32(lo, _mm512_loadu_si512(IDX_Q4.as_ptr() as *const _), hi);
            // Lanes 8.. hold values 16.. of each block: the high nibbles.
            let shift = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(4));
            _mm512_and_si512(_mm512_srlv_epi16(z, shift), _mm512_set1_epi8(0x0F))
        }
    }

    /// The halves d_2p | d_2p+1 << 16 of blocks 2p and 2p+1's scales (0 where absent), and
    /// Q4_1's mins m_2p | m_2p+1 << 16: plain loads, shared with the AVX2 kernels.
    #[inline(always)]
    pub(crate) unsafe fn pair_halves<const FMT: u8>(
        w: *const u8,
        p: usize,
        two: bool,
    ) -> (u32, u32) {
        let bb = block_bytes::<FMT>();
        let p0 = w.add(2 * p * bb);
        if FMT == Q4_1 {
            let dm0 = (p0 as *const u32).read_unaligned();
            let dm1 = if two {
                (p0.add(bb) as *const u32).read_unaligned()
            } else {
                0
            };
            (
                (dm0 & 0xFFFF) | (dm1 << 16),
                (dm0 >> 16) | (dm1 & 0xFFFF_0000),
            )
        } else {
            let d0 = (p0 as *const u16).read_unaligned() as u32;
            let d1 = if two {
                (p0.add(bb) as *const u16).read_unaligned() as u32
            } else {
                0
            };
            (d0 | (d1 << 16), 0)
        }
    }

    /// The scales of blocks 2p and 2p+1 as f32 lanes [d_2p, d_2p+1] × 8 (`pair_halves`
    /// broadcast and converted), and Q4_1's mins as halves.
    #[inline(always)]
    unsafe fn pair_scales<const FMT: u8>(w: *const u8, p: usize, two: bool) -> (__m512, u32) {
        let (d, m) = pair_halves::<FMT>(w, p, two);
        (_mm512_cvtph_ps(_mm256_set1_epi32(d as i32)), m)
    }

    /// y[i0..i0+N][r..r+W]: each pair of weight blocks and its scales decoded once for the N
    /// activation rows, and the activations loaded once for the W weight rows; Q4_1's mins
    /// collected as halves in a register over 16 blocks, converted once.
    #[inline(always)]
    unsafe fn rows<const FMT: u8, const N: usize, const W: usize>(j: &JobRef, r: usize, i0: usize) {
        let nb = j.cols / 32;
        let np = q8_pairs(j.cols);
        let nb16 = nb.next_multiple_of(16);
        let pair_bytes = 2 * block_bytes::<FMT>();
        let w: [*const u8; W] = std::array::from_fn(|k| j.w.add((r + k) * j.row_bytes));
        let mut acc = [[_mm512_setzero_ps(); N]; W];
        let mut mins = [[_mm512_setzero_ps(); N]; W];
        let mut g = 0;
        while g < nb {
            let mut halves = [_mm256_setzero_si256(); W];
            let p_end = (g / 2 + 8).min(np);
            for p in g / 2..p_end {
                let two = 2 * p + 1 < nb;
                let mut wv = [_mm512_setzero_si512(); W];
                let mut dw = [_mm512_setzero_ps(); W];
                for k in 0..W {
                    _mm_prefetch::<_MM_HINT_T0>(
                        w[k].add(p * pair_bytes + PREFETCH_AHEAD) as *const i8
                    );
                    wv[k] = load_pair::<FMT>(w[k], p, two);
                    let (d, m) = pair_scales::<FMT>(w[k], p, two);
                    dw[k] = d;
                    halves[k] = _mm256_mask_set1_epi32(halves[k], 1 << (p % 8), m as i32);
                }
                for i in 0..N {
                    let at = ((i0 + i) * np + p) * 16;
                    let start = if FMT == Q4_1 {
                        _mm512_setzero_si512()
                    } else {
                        _mm512_loadu_si512(j.xc.add(at) as *const _)
                    };
                    let x = _mm512_loadu_si512(j.xq.add(at * 4) as *const _);
                    let xd = _mm512_loadu_ps(j.xd.add(at));
                    for k in 0..W {
                        let isum = _mm512_dpbusd_epi32(start, wv[k], x);
                        let sc = _mm512_mul_ps(dw[k], xd);
                        acc[k][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), sc, acc[k][i]);
                    }
                }
            }
            if FMT == Q4_1 {
                for k in 0..W {
                    let m16 = _mm512_cvtph_ps(halves[k]);
                    for i in 0..N {
                        let s = _mm512_loadu_ps(j.xs.add((i0 + i) * nb16 + g));
                        mins[k][i] = _mm512_fmadd_ps(m16, s, mins[k][i]);
                    }
                }
            }
            g += 16;
        }
        for k in 0..W {
            for i in 0..N {
                let v = if FMT == Q4_1 {
                    _mm512_add_ps(acc[k][i], mins[k][i])
                } else {
                    acc[k][i]
                };
                *j.y.add((i0 + i) * j.rows + r + k) = Avx512::reduce_add(v);
            }
        }
    }
}
