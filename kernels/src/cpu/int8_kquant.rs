//! Int8 products (`Precision::Int8`) for the super-block formats (Q3_K, Q4_K, Q5_K, Q6_K,
//! IQ4_XS) on AVX2, equal to the bit to `reference::matmul_int8`: the activations quantized and
//! laid out as `int8_avx2` does, the same lanes. Their loops (`task_k`) are shared with the VNNI
//! kernels (`int8_kquant_vnni`), which differ only in the dot (`KDot`): one super-block of 256 weights is decoded at a
//! time — its integer scales (and mins) into f32 lanes once, then four pairs of blocks into the
//! pair layout with byte shifts and masks, each dotted with every activation row of the group; in
//! batches each weight row is decoded once per X_BLOCK activation rows into a panel.
//!
//! Written by hand: no crate offers quantized-weight x int8 products with a fixed summation order.

// Safety of every `unsafe fn` here: the CPU has AVX2, FMA and F16C, and pointers are valid for
// the lengths and rows the `JobRef` states.
#![allow(clippy::missing_safety_doc, clippy::needless_range_loop)]

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::task;
#[cfg(target_arch = "x86_64")]
pub(super) use x86::{task_k, KBlock, KDot, IQ4XS, Q3K, Q4K, Q5K, Q6K};

/// The formats these kernels take.
pub(crate) const FORMATS: [crate::quant::QuantType; 5] = [
    crate::quant::QuantType::Q3K,
    crate::quant::QuantType::Q4K,
    crate::quant::QuantType::Q5K,
    crate::quant::QuantType::Q6K,
    crate::quant::QuantType::IQ4XS,
];

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::dequant_k::{q6k_groups, two_bit_groups};
    use super::super::int8_avx2::{interleave, iq4_values};
    use super::super::job::{JobRef, X_BLOCK};
    use super::super::simd::{Avx2, Simd};
    use crate::quant::QuantType;
    use std::arch::x86_64::*;

    /// The K-quant formats, as the kernels' const parameter (after `cpu::int8`'s).
    pub(in crate::cpu) const Q4K: u8 = 3;
    pub(in crate::cpu) const Q6K: u8 = 4;
    pub(in crate::cpu) const Q5K: u8 = 5;
    pub(in crate::cpu) const Q3K: u8 = 6;
    pub(in crate::cpu) const IQ4XS: u8 = 8;

    /// Bytes of a super-block of the K-quant format FMT.
    #[inline(always)]
    fn k_bytes<const FMT: u8>() -> usize {
        match FMT {
            Q4K => 144,
            Q5K => 176,
            Q3K => 110,
            IQ4XS => 136,
            _ => 210,
        }
    }

    /// `to` in each byte of `v` whose bit k is set, else 0.
    #[inline(always)]
    unsafe fn bit_to(v: __m256i, k: usize, to: i8) -> __m256i {
        let bit = _mm256_set1_epi8((1u8 << k) as i8);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
        _mm256_and_si256(set, _mm256_set1_epi8(to))
    }

    /// Rows r0..r1 of the product, every activation row.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn task(j: &JobRef, r0: usize, r1: usize) {
        match j.ty {
            QuantType::Q4K => task_k::<Avx2K, Q4K>(j, r0, r1),
            QuantType::Q6K => task_k::<Avx2K, Q6K>(j, r0, r1),
            QuantType::Q5K => task_k::<Avx2K, Q5K>(j, r0, r1),
            QuantType::Q3K => task_k::<Avx2K, Q3K>(j, r0, r1),
            QuantType::IQ4XS => task_k::<Avx2K, IQ4XS>(j, r0, r1),
            ty => unreachable!("no super-block int8 products for {ty:?}"),
        }
    }

    /// The scales of the 8 blocks of a Q4_K super-block (d·sc) and their mins (−(dmin·m)), as f32
    /// lanes j = 0..8 (`reference::scale_min_k4`, four blocks per 32-bit word).
    #[inline(always)]
    unsafe fn q4k_scales(sb: *const u8) -> (__m256, __m256) {
        let d = _mm256_set1_ps(crate::quant::f16_to_f32(
            (sb as *const u16).read_unaligned(),
        ));
        let dmin = _mm256_set1_ps(crate::quant::f16_to_f32(
            (sb.add(2) as *const u16).read_unaligned(),
        ));
        let q = sb.add(4) as *const u32;
        let (a, b, c) = (
            q.read_unaligned(),
            q.add(1).read_unaligned(),
            q.add(2).read_unaligned(),
        );
        let (six, four, two) = (0x3F3F_3F3Fu32, 0x0F0F_0F0Fu32, 0x0303_0303u32);
        let sc_lo = a & six;
        let sc_hi = (c & four) | (((a >> 6) & two) << 4);
        let m_lo = b & six;
        let m_hi = ((c >> 4) & four) | (((b >> 6) & two) << 4);
        let scales = _mm256_mul_ps(d, byte_lanes(sc_lo, sc_hi));
        let mins = _mm256_xor_ps(
            _mm256_mul_ps(dmin, byte_lanes(m_lo, m_hi)),
            _mm256_set1_ps(-0.0),
        );
        (scales, mins)
    }

    /// The 8 bytes of `lo` then `hi` as f32 lanes.
    #[inline(always)]
    unsafe fn byte_lanes(lo: u32, hi: u32) -> __m256 {
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(
            0, 0, hi as i32, lo as i32,
        )))
    }

    /// The low nibbles of bytes.
    #[inline(always)]
    unsafe fn low_nibbles(v: __m256i) -> __m256i {
        _mm256_and_si256(v, _mm256_set1_epi8(0x0F))
    }

    /// The high nibbles of bytes.
    #[inline(always)]
    unsafe fn high_nibbles(v: __m256i) -> __m256i {
        _mm256_and_si256(_mm256_srli_epi16::<4>(v), _mm256_set1_epi8(0x0F))
    }

    /// Pair `pp` (blocks 2pp, 2pp+1) of Q4_K's (or Q5_K's) nibbles at `qs`: the low and high
    /// nibbles of the same 32 bytes, in value order.
    #[inline(always)]
    unsafe fn q4k_nibbles(qs: *const u8, pp: usize) -> (__m256i, __m256i) {
        let b = _mm256_loadu_si256(qs.add(32 * pp) as *const __m256i);
        (low_nibbles(b), high_nibbles(b))
    }

    /// Half `hh` (pairs 2hh and 2hh+1) of a Q3_K super-block in the pair layout: codes
    /// low + 4·high (0..8; the −4 comes with the activations' corrections).
    #[inline(always)]
    unsafe fn q3k_half(sb: *const u8, hh: usize) -> [(__m256i, __m256i); 2] {
        let hm = _mm256_loadu_si256(sb as *const __m256i);
        let g = two_bit_groups(sb.add(32 + 32 * hh));
        let mut c = g;
        for (s, v) in c.iter_mut().enumerate() {
            *v = _mm256_or_si256(*v, bit_to(hm, 4 * hh + s, 4));
        }
        [interleave(c[0], c[1]), interleave(c[2], c[3])]
    }

    /// The 16 sub-block scales d·(sc − 32) of a Q3_K super-block as two f32 vectors.
    #[inline(always)]
    unsafe fn q3k_scales(sb: *const u8) -> [__m256; 2] {
        let d = _mm256_set1_ps(crate::quant::f16_to_f32(
            (sb.add(108) as *const u16).read_unaligned(),
        ));
        let sc = sb.add(96);
        let mut v = [0i8; 16];
        for (k, x) in v.iter_mut().enumerate() {
            let lo = (*sc.add(k % 8) >> (4 * (k / 8))) & 0xF;
            let hi = (*sc.add(8 + k % 4) >> (2 * (k / 4))) & 3;
            *x = (lo | (hi << 4)) as i8 - 32;
        }
        let b = _mm_loadu_si128(v.as_ptr() as *const __m128i);
        [
            _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b))),
            _mm256_mul_ps(
                d,
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(b, b))),
            ),
        ]
    }

    /// Half `hh` (128 values, pairs 2hh and 2hh+1) of a Q6_K super-block in the pair layout:
    /// 6-bit codes q (the −32 comes with the activations' corrections).
    #[inline(always)]
    unsafe fn q6k_half(sb: *const u8, hh: usize) -> [(__m256i, __m256i); 2] {
        let [g0, g1, g2, g3] = q6k_groups(sb, hh);
        [interleave(g0, g1), interleave(g2, g3)]
    }

    /// The 16 sub-block scales d·sc of a Q6_K super-block as two f32 vectors (sub-blocks 0..8,
    /// 8..16).
    #[inline(always)]
    unsafe fn q6k_scales(sb: *const u8) -> [__m256; 2] {
        let d = _mm256_set1_ps(crate::quant::f16_to_f32(
            (sb.add(208) as *const u16).read_unaligned(),
        ));
        let sc = _mm_loadu_si128(sb.add(192) as *const __m128i);
        [
            _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))),
            _mm256_mul_ps(
                d,
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(sc, sc))),
            ),
        ]
    }

    /// A decoded K-quant super-block: per pair of blocks its two code halves in the pair layout
    /// and its scales per lane; Q4_K's mins per block (lanes 0..8).
    #[derive(Clone, Copy)]
    pub(in crate::cpu) struct KBlock {
        pub codes: [[__m256i; 2]; 4],
        pub scales: [[__m256; 2]; 4],
        pub mins: __m256,
    }

    /// f32 slots of a row of `cols` values decoded (`KBlock`s).
    fn k_panel_slots(cols: usize) -> usize {
        cols / 256 * (std::mem::size_of::<KBlock>() / 4)
    }

    /// Super-block `sb` of format FMT decoded: its scales (and mins) into f32 lanes once, each
    /// pair of blocks into the pair layout.
    #[inline(always)]
    unsafe fn decode_k<const FMT: u8>(sb: *const u8) -> KBlock {
        let mut k = KBlock {
            codes: [[_mm256_setzero_si256(); 2]; 4],
            scales: [[_mm256_setzero_ps(); 2]; 4],
            mins: _mm256_setzero_ps(),
        };
        if FMT == IQ4XS {
            // Signed codebook values (dot_k takes |w| and x negated where w < 0); a scale per
            // block, d·(sc − 32).
            let d = crate::quant::f16_to_f32((sb as *const u16).read_unaligned());
            let sh = (sb.add(2) as *const u16).read_unaligned();
            let mut v = [0i32; 8];
            for (j, x) in v.iter_mut().enumerate() {
                let lo = (*sb.add(4 + j / 2) >> (4 * (j % 2))) & 0xF;
                let hi = ((sh >> (2 * j)) & 3) as u8;
                *x = (lo | (hi << 4)) as i32 - 32;
            }
            let sc = _mm256_mul_ps(
                _mm256_set1_ps(d),
                _mm256_cvtepi32_ps(_mm256_loadu_si256(v.as_ptr() as *const __m256i)),
            );
            for pp in 0..4 {
                let a = iq4_values(sb.add(8 + 32 * pp));
                let b = iq4_values(sb.add(8 + 32 * pp + 16));
                let (c0, c1) = interleave(a, b);
                k.codes[pp] = [c0, c1];
                let idx = _mm256_setr_epi32(0, 1, 0, 1, 0, 1, 0, 1);
                let idx = _mm256_add_epi32(idx, _mm256_set1_epi32(2 * pp as i32));
                let v = _mm256_permutevar8x32_ps(sc, idx);
                k.scales[pp] = [v, v];
            }
        } else if FMT == Q4K || FMT == Q5K {
            let (sc, m) = q4k_scales(sb);
            k.mins = m;
            let qh = _mm256_loadu_si256(sb.add(16) as *const __m256i);
            for pp in 0..4 {
                let (mut lo, mut hi) = if FMT == Q4K {
                    q4k_nibbles(sb.add(16), pp)
                } else {
                    q4k_nibbles(sb.add(48), pp)
                };
                if FMT == Q5K {
                    // The fifth bit of block j: bit j of qh's bytes.
                    lo = _mm256_or_si256(lo, bit_to(qh, 2 * pp, 0x10));
                    hi = _mm256_or_si256(hi, bit_to(qh, 2 * pp + 1, 0x10));
                }
                let (c0, c1) = interleave(lo, hi);
                k.codes[pp] = [c0, c1];
                let idx = _mm256_setr_epi32(0, 1, 0, 1, 0, 1, 0, 1);
                let idx = _mm256_add_epi32(idx, _mm256_set1_epi32(2 * pp as i32));
                let v = _mm256_permutevar8x32_ps(sc, idx);
                k.scales[pp] = [v, v];
            }
        } else {
            // Q6_K and Q3_K: 16 sub-block scales, codes by halves of 128 values.
            let sc = if FMT == Q6K {
                q6k_scales(sb)
            } else {
                q3k_scales(sb)
            };
            for hh in 0..2 {
                let half = if FMT == Q6K {
                    q6k_half(sb, hh)
                } else {
                    q3k_half(sb, hh)
                };
                for q in 0..2 {
                    let pp = 2 * hh + q;
                    k.codes[pp] = [half[q].0, half[q].1];
                    // Lanes even: block 2pp's sub-block, odd: block 2pp+1's (2 further).
                    let base = 4 * q as i32;
                    let idx = _mm256_setr_epi32(0, 2, 0, 2, 0, 2, 0, 2);
                    let i0v = _mm256_add_epi32(idx, _mm256_set1_epi32(base));
                    let i1v = _mm256_add_epi32(idx, _mm256_set1_epi32(base + 1));
                    k.scales[pp] = [
                        _mm256_permutevar8x32_ps(sc[hh], i0v),
                        _mm256_permutevar8x32_ps(sc[hh], i1v),
                    ];
                }
            }
        }
        k
    }

    /// How a K-quant kernel dots decoded super-blocks with activation rows and sums the lanes:
    /// AVX2's (`Avx2K`, below) or VNNI's (`int8_kquant_vnni`). Both keep the lanes and the order
    /// of `reference::matmul_int8`: per lane L of the 16 of a pair, the integer dot of its four
    /// values, times its scales, added into L's sum pair after pair; Q4_K's and Q5_K's mins in
    /// lanes of their own; then lanes 0..8 + 8..16 and `Avx2::reduce_add`.
    /// Activation rows dotted together with one decoded super-block. (8 made VNNI's batches
    /// 0.46-0.71x as fast as 4 in one `ISAS=avx2,avx512 matmul_bench 64` run on a Zen 4 with a
    /// build beside it; spilled sums and mins are the likely cause, not checked.)
    const GROUP: usize = 4;

    pub(in crate::cpu) trait KDot {
        /// One activation row's lane sums.
        type Acc: Copy;
        unsafe fn zero() -> Self::Acc;
        /// Super-block `s` (`kb`) dotted with activation rows i0..i0+N into their lane sums
        /// (pairs in order).
        unsafe fn dot<const FMT: u8, const N: usize>(
            kb: &KBlock,
            j: &JobRef,
            s: usize,
            i0: usize,
            acc: &mut [Self::Acc; N],
        );
        /// Lanes 0..8 and 8..16 of a row's sums.
        unsafe fn halves(acc: &Self::Acc) -> [__m256; 2];
    }

    /// AVX2's: per half of a pair, `vpmaddubsw` + `vpmaddwd` (no saturation: |w| < 128 and
    /// pairs of w·x stay under 2^15).
    pub(in crate::cpu) struct Avx2K;

    impl KDot for Avx2K {
        type Acc = [__m256; 2];

        #[inline(always)]
        unsafe fn zero() -> [__m256; 2] {
            [_mm256_setzero_ps(); 2]
        }

        #[inline(always)]
        unsafe fn dot<const FMT: u8, const N: usize>(
            kb: &KBlock,
            j: &JobRef,
            s: usize,
            i0: usize,
            acc: &mut [[__m256; 2]; N],
        ) {
            let np = j.cols / 64;
            let ones = _mm256_set1_epi16(1);
            for pp in 0..4 {
                let p = 4 * s + pp;
                for i in 0..N {
                    let at = ((i0 + i) * np + p) * 16;
                    // The activations' scales are the same in both halves (lanes [d_b, d_b+1] ×
                    // 4), and so are Q4_K's and Q5_K's weight scales: one product serves both.
                    let xd = _mm256_loadu_ps(j.xd.add(at));
                    let sc0 = _mm256_mul_ps(kb.scales[pp][0], xd);
                    let sc = [
                        sc0,
                        if FMT == Q4K || FMT == Q5K || FMT == IQ4XS {
                            sc0
                        } else {
                            _mm256_mul_ps(kb.scales[pp][1], xd)
                        },
                    ];
                    for h in 0..2 {
                        let mut x = _mm256_loadu_si256(j.xq.add(at * 4 + 32 * h) as *const _);
                        let mut w = kb.codes[pp][h];
                        if FMT == IQ4XS {
                            // |w| · (x negated where w < 0): the codebook has no zero.
                            x = _mm256_sign_epi8(x, w);
                            w = _mm256_abs_epi8(w);
                        }
                        let mut isum = _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);
                        if FMT == Q6K || FMT == Q3K {
                            let c = _mm256_loadu_si256(j.xc.add(at + 8 * h) as *const _);
                            isum = _mm256_add_epi32(isum, c);
                        }
                        acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), sc[h], acc[i][h]);
                    }
                }
            }
        }

        #[inline(always)]
        unsafe fn halves(acc: &[__m256; 2]) -> [__m256; 2] {
            *acc
        }
    }

    /// Q4_K's and Q5_K's mins of super-block `s` into lanes of their own (blocks b%16: 8 lanes
    /// per super-block, even and odd super-blocks apart).
    #[inline(always)]
    unsafe fn mins_k<const FMT: u8, const N: usize>(
        kb: &KBlock,
        j: &JobRef,
        s: usize,
        i0: usize,
        mins: &mut [[__m256; 2]; N],
    ) {
        if FMT == Q4K || FMT == Q5K {
            let nb16 = (j.cols / 32).next_multiple_of(16);
            for i in 0..N {
                let sv = _mm256_loadu_ps(j.xs.add((i0 + i) * nb16 + 8 * s));
                mins[i][s % 2] = _mm256_fmadd_ps(kb.mins, sv, mins[i][s % 2]);
            }
        }
    }

    /// y[i0..i0+N][r] from the lanes: A + B (Q4_K), then summed in the `reduce_add` order.
    #[inline(always)]
    unsafe fn finish_k<D: KDot, const FMT: u8, const N: usize>(
        acc: &[D::Acc; N],
        mins: &[[__m256; 2]; N],
        j: &JobRef,
        r: usize,
        i0: usize,
    ) {
        for i in 0..N {
            let [a0, a1] = D::halves(&acc[i]);
            let v = if FMT == Q4K || FMT == Q5K {
                [_mm256_add_ps(a0, mins[i][0]), _mm256_add_ps(a1, mins[i][1])]
            } else {
                [a0, a1]
            };
            *j.y.add((i0 + i) * j.rows + r) = Avx2::reduce_add(_mm256_add_ps(v[0], v[1]));
        }
    }

    /// y[i0..i0+N][r] for a K-quant row (`reference::matmul_int8`'s order), each super-block
    /// decoded as it streams past (decode: the weights are read once).
    #[inline(always)]
    unsafe fn rows_k<D: KDot, const FMT: u8, const N: usize>(j: &JobRef, r: usize, i0: usize) {
        let w = j.w.add(r * j.row_bytes);
        let bb = k_bytes::<FMT>();
        let mut acc = [D::zero(); N];
        let mut mins = [[_mm256_setzero_ps(); 2]; N];
        for s in 0..j.cols / 256 {
            let sb = w.add(s * bb);
            let ahead = sb.add(crate::cpu::int8::PREFETCH_AHEAD);
            let mut k = 0;
            while k < bb {
                _mm_prefetch::<_MM_HINT_T0>(ahead.add(k) as *const i8);
                k += 64;
            }
            let kb = decode_k::<FMT>(sb);
            D::dot::<FMT, N>(&kb, j, s, i0, &mut acc);
            mins_k::<FMT, N>(&kb, j, s, i0, &mut mins);
        }
        finish_k::<D, FMT, N>(&acc, &mins, j, r, i0);
    }

    /// Row r decoded once into `panel` (`k_panel_slots` f32 slots) for many activation rows.
    #[inline(always)]
    unsafe fn decode_row_k<const FMT: u8>(j: &JobRef, r: usize, panel: *mut KBlock) {
        let w = j.w.add(r * j.row_bytes);
        let bb = k_bytes::<FMT>();
        for s in 0..j.cols / 256 {
            panel.add(s).write_unaligned(decode_k::<FMT>(w.add(s * bb)));
        }
    }

    /// `rows_k` with the row already decoded in `panel` (batches: one decode per X_BLOCK rows).
    #[inline(always)]
    unsafe fn rows_k_panel<D: KDot, const FMT: u8, const N: usize>(
        j: &JobRef,
        panel: *const KBlock,
        r: usize,
        i0: usize,
    ) {
        let mut acc = [D::zero(); N];
        let mut mins = [[_mm256_setzero_ps(); 2]; N];
        for s in 0..j.cols / 256 {
            let kb = panel.add(s).read_unaligned();
            D::dot::<FMT, N>(&kb, j, s, i0, &mut acc);
            mins_k::<FMT, N>(&kb, j, s, i0, &mut mins);
        }
        finish_k::<D, FMT, N>(&acc, &mins, j, r, i0);
    }

    /// Rows i0..i0+m (1 ≤ m ≤ GROUP) of weight row r, streamed or from the panel.
    #[inline(always)]
    unsafe fn group_k<D: KDot, const FMT: u8>(
        j: &JobRef,
        panel: Option<*const KBlock>,
        r: usize,
        i0: usize,
        m: usize,
    ) {
        macro_rules! go {
            ($n:literal) => {
                match panel {
                    Some(p) => rows_k_panel::<D, FMT, $n>(j, p, r, i0),
                    None => rows_k::<D, FMT, $n>(j, r, i0),
                }
            };
        }
        match m {
            1 => go!(1),
            2 => go!(2),
            3 => go!(3),
            _ => go!(4),
        }
    }

    /// The K-quants' rows r0..r1 with the dot of D: a group of at most GROUP activation rows
    /// streams the weights (`rows_k`); more decode each weight row once per X_BLOCK rows into a
    /// panel on this thread.
    #[inline(always)]
    pub(in crate::cpu) unsafe fn task_k<D: KDot, const FMT: u8>(j: &JobRef, r0: usize, r1: usize) {
        let panel = super::super::job::scratch(&K_PANEL, k_panel_slots(j.cols)) as *mut KBlock;
        let mut ib = 0;
        while ib < j.n {
            let ie = (ib + X_BLOCK).min(j.n);
            let streamed = ie - ib <= GROUP;
            for r in r0..r1 {
                if !streamed {
                    decode_row_k::<FMT>(j, r, panel);
                }
                let mut i0 = ib;
                while i0 < ie {
                    let m = (ie - i0).min(GROUP);
                    group_k::<D, FMT>(j, (!streamed).then_some(panel as *const _), r, i0, m);
                    i0 += m;
                }
            }
            ib = ie;
        }
    }

    thread_local! {
        /// A K-quant weight row decoded for a batch (`task_k`), on the calling thread.
        static K_PANEL: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }
}
