//! BF16 products (`Precision::Bf16`, AVX512_BF16's `vdpbf16ps`): y = x · Wᵀ with activations and
//! dequantized weights rounded to BF16 (round to nearest even), products of pairs summed in f32.
//! Twice the multiply-adds per instruction of the f32 path; the same canonical-order contract.
//!
//! One arithmetic for a value y[i][r], whatever the batch and whichever path runs: per 32
//! columns, one `vdpbf16ps` into one accumulator (lane j takes columns 2j+1 then 2j, each an f32
//! add), columns in order, then the AVX-512 `reduce_add`. The weights are rounded from the same
//! f32 values the exact path dequantizes (`Format::dequant` / `decode32`, identical to the bit),
//! the activations once per product. `reference::matmul_bf16` is the scalar twin, to the bit.
//!
//! Paths: `rows` (fewer than DOT_MIN_ROWS activation rows: each weight block decoded, rounded in
//! registers and dotted with every row — decode stays one pass over the quantized weights; the
//! super-blocks through `Format::codes16`, their codes widened and scaled in registers) and
//! `panel` (batches: a task's weight rows dequantized once into a BF16 panel, then 6 x 4 tiles of
//! 24 accumulators, as the f32 `dot_panel`).
//!
//! The training backward's input gradient dx = dy·W (`backward_task`) takes the same operands:
//! pairs of weight rows interleaved column by column, dy rounded once, one `vdpbf16ps` per 16
//! columns (`reference::linear_backward_bf16` is its twin, to the bit).
//!
//! Written by hand: no crate offers quantized-weight x BF16 products with a fixed summation order.

// Safety of every `unsafe fn` here: the CPU has AVX-512F/BW/VL/DQ and AVX512_BF16, and pointers
// are valid for the lengths and rows the `JobRef` states.
#![allow(clippy::missing_safety_doc)]

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{backward_task, round_pairs, round_rows, task, BackwardJob};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::dequant::{code_values, dequant_row, Format};
    use super::super::formats::per_format;
    use super::super::job::{scratch, store_tile, JobRef, X_BLOCK};
    use super::super::simd::{Avx512, Simd};
    use crate::quant::QuantType;
    use std::arch::x86_64::*;
    use std::cell::RefCell;

    thread_local! {
        static ROW: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
        static PANEL: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
        static TILE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    }

    /// dx (n, cols) = dy (n, rows) · W on BF16 operands (`Precision::Bf16`'s input gradient):
    /// `dyb` holds dy rounded, each row padded to an even length (`round_pairs`), so that the
    /// u32 at (i, 2p) is the pair (dy[i][2p], dy[i][2p+1]).
    pub struct BackwardJob {
        pub ty: QuantType,
        pub w: *const u8,
        pub row_bytes: usize,
        pub rows: usize,
        pub cols: usize,
        pub dyb: *const u16,
        pub n: usize,
        pub dx: *mut f32,
        pub tile_rows: usize,
    }
    // SAFETY: tasks only write their own column range of `dx`.
    unsafe impl Sync for BackwardJob {}

    /// Rows of `rows` f32 values rounded to BF16, each padded with a zero to an even length.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,avx512bf16")]
    pub unsafe fn round_pairs(src: *const f32, dst: *mut u16, n: usize, rows: usize) {
        let even = rows.next_multiple_of(2);
        for i in 0..n {
            let (s, d) = (src.add(i * rows), dst.add(i * even));
            let mut c = 0;
            while c + 16 <= rows {
                let v = _mm512_cvtneps_pbh(_mm512_loadu_ps(s.add(c)));
                _mm256_storeu_si256(
                    d.add(c) as *mut __m256i,
                    std::mem::transmute::<__m256bh, __m256i>(v),
                );
                c += 16;
            }
            while c < rows {
                let v = _mm512_cvtneps_pbh(_mm512_set1_ps(*s.add(c)));
                *d.add(c) =
                    _mm256_extract_epi16::<0>(std::mem::transmute::<__m256bh, __m256i>(v)) as u16;
                c += 1;
            }
            if even > rows {
                *d.add(rows) = 0;
            }
        }
    }

    /// Columns c0..c1 (a multiple of 16 wide) of the BF16 input gradient: per pair of weight rows
    /// (2p, 2p+1), a tile of dwords holding both rows' rounded values column by column, and one
    /// `vdpbf16ps` per 16 columns with the broadcast pair of dy: lane c adds W[2p+1][c]·dy[2p+1]
    /// then W[2p][c]·dy[2p] (`reference::linear_backward_bf16`), pairs in row order.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,avx512bf16")]
    pub unsafe fn backward_task(j: &BackwardJob, c0: usize, c1: usize) {
        per_format!(j.ty, F => backward_fmt::<F>(j, c0, c1))
    }

    #[inline(always)]
    unsafe fn backward_fmt<F: Format>(j: &BackwardJob, c0: usize, c1: usize) {
        let width = c1 - c0;
        let pairs_per_tile = j.tile_rows / 2;
        // Two dequantized rows, then the tile: pairs_per_tile x width dwords.
        let rows2 = scratch(&ROW, 2 * width + 16);
        let tile = scratch(&TILE, pairs_per_tile * width + 16) as *mut u32;
        let off = (c0 / F::BS) * F::BB;
        let even = j.rows.next_multiple_of(2);
        for i in 0..j.n {
            std::ptr::write_bytes(j.dx.add(i * j.cols + c0), 0, width);
        }
        let num_pairs = even / 2;
        let mut p0 = 0;
        while p0 < num_pairs {
            let tp = (num_pairs - p0).min(pairs_per_tile);
            for p in 0..tp {
                let r = 2 * (p0 + p);
                dequant_row::<Avx512, F>(j.w.add(r * j.row_bytes + off), rows2, width);
                if r + 1 < j.rows {
                    dequant_row::<Avx512, F>(
                        j.w.add((r + 1) * j.row_bytes + off),
                        rows2.add(width),
                        width,
                    );
                } else {
                    std::ptr::write_bytes(rows2.add(width), 0, width);
                }
                let mut c = 0;
                while c < width {
                    let lo = _mm512_cvtneps_pbh(_mm512_loadu_ps(rows2.add(c)));
                    let hi = _mm512_cvtneps_pbh(_mm512_loadu_ps(rows2.add(width + c)));
                    let lo = _mm512_cvtepu16_epi32(std::mem::transmute::<__m256bh, __m256i>(lo));
                    let hi = _mm512_cvtepu16_epi32(std::mem::transmute::<__m256bh, __m256i>(hi));
                    let both = _mm512_or_si512(lo, _mm512_slli_epi32::<16>(hi));
                    _mm512_storeu_si512(tile.add(p * width + c) as *mut _, both);
                    c += 16;
                }
            }
            let mut i = 0;
            while i < j.n {
                // Up to 8 rows of dy: 16 accumulators, 2 tile loads and 8 broadcasts per 16
                // `vdpbf16ps`.
                match j.n - i {
                    1 => backward_rows::<1>(j, tile, width, c0, p0, tp, i),
                    2 => backward_rows::<2>(j, tile, width, c0, p0, tp, i),
                    3 => backward_rows::<3>(j, tile, width, c0, p0, tp, i),
                    4 => backward_rows::<4>(j, tile, width, c0, p0, tp, i),
                    5 => backward_rows::<5>(j, tile, width, c0, p0, tp, i),
                    6 => backward_rows::<6>(j, tile, width, c0, p0, tp, i),
                    7 => backward_rows::<7>(j, tile, width, c0, p0, tp, i),
                    _ => backward_rows::<8>(j, tile, width, c0, p0, tp, i),
                }
                i += 8;
            }
            p0 += tp;
        }
    }

    /// dx rows i0..i0+N, columns c0..c0+width += the tile's pairs p0..p0+tp.
    #[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
    #[inline(always)]
    unsafe fn backward_rows<const N: usize>(
        j: &BackwardJob,
        tile: *const u32,
        width: usize,
        c0: usize,
        p0: usize,
        tp: usize,
        i0: usize,
    ) {
        let even = j.rows.next_multiple_of(2);
        let dys: [*const u32; N] =
            std::array::from_fn(|i| j.dyb.add((i0 + i) * even + 2 * p0) as *const u32);
        let outs: [*mut f32; N] = std::array::from_fn(|i| j.dx.add((i0 + i) * j.cols + c0));
        let mut c = 0;
        while c + 32 <= width {
            let mut acc = [[_mm512_setzero_ps(); 2]; N];
            for i in 0..N {
                acc[i][0] = _mm512_loadu_ps(outs[i].add(c));
                acc[i][1] = _mm512_loadu_ps(outs[i].add(c + 16));
            }
            for p in 0..tp {
                let t = tile.add(p * width + c);
                let w0 =
                    std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(t as *const _));
                let w1 = std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                    t.add(16) as *const _
                ));
                for i in 0..N {
                    let g = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(
                        dys[i].add(p).read_unaligned() as i32,
                    ));
                    acc[i][0] = _mm512_dpbf16_ps(acc[i][0], w0, g);
                    acc[i][1] = _mm512_dpbf16_ps(acc[i][1], w1, g);
                }
            }
            for i in 0..N {
                _mm512_storeu_ps(outs[i].add(c), acc[i][0]);
                _mm512_storeu_ps(outs[i].add(c + 16), acc[i][1]);
            }
            c += 32;
        }
        while c < width {
            let mut acc = [_mm512_setzero_ps(); N];
            for i in 0..N {
                acc[i] = _mm512_loadu_ps(outs[i].add(c));
            }
            for p in 0..tp {
                let w0 = std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                    tile.add(p * width + c) as *const _,
                ));
                for i in 0..N {
                    let g = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(
                        dys[i].add(p).read_unaligned() as i32,
                    ));
                    acc[i] = _mm512_dpbf16_ps(acc[i], w0, g);
                }
            }
            for i in 0..N {
                _mm512_storeu_ps(outs[i].add(c), acc[i]);
            }
            c += 16;
        }
    }

    /// Round `n` values (a multiple of 32) to BF16, in order.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,avx512bf16")]
    pub unsafe fn round_rows(src: *const f32, dst: *mut u16, n: usize) {
        let mut c = 0;
        while c < n {
            store(dst.add(c), pair(src.add(c)));
            c += 32;
        }
    }

    /// 32 f32 values at `p` as one vector of 32 BF16, value order.
    #[inline(always)]
    unsafe fn pair(p: *const f32) -> __m512bh {
        // The second operand fills the low half.
        _mm512_cvtne2ps_pbh(_mm512_loadu_ps(p.add(16)), _mm512_loadu_ps(p))
    }

    #[inline(always)]
    unsafe fn store(p: *mut u16, v: __m512bh) {
        _mm512_storeu_si512(p as *mut _, std::mem::transmute::<__m512bh, __m512i>(v))
    }

    #[inline(always)]
    unsafe fn load(p: *const u16) -> __m512bh {
        std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(p as *const _))
    }

    /// Rows `r0..r1` of the product whose activations `j.xb` are already rounded.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,avx512bf16")]
    pub unsafe fn task(j: &JobRef, r0: usize, r1: usize) {
        per_format!(j.ty, F => task_fmt::<F>(j, r0, r1))
    }

    #[inline(always)]
    unsafe fn task_fmt<F: Format>(j: &JobRef, r0: usize, r1: usize) {
        if j.dot_panel {
            panel::<F>(j, r0, r1);
        } else {
            let mut i0 = 0;
            while i0 < j.n {
                match (j.n - i0).min(4) {
                    1 => rows::<F, 1>(j, r0, r1, i0),
                    2 => rows::<F, 2>(j, r0, r1, i0),
                    3 => rows::<F, 3>(j, r0, r1, i0),
                    _ => rows::<F, 4>(j, r0, r1, i0),
                }
                i0 += 4;
            }
        }
    }

    /// Each weight block decoded (in registers where the format can), rounded, and dotted with
    /// activation rows i0..i0+N; R weight rows at a time, R·N independent accumulator chains
    /// (one chain per output keeps the canonical order).
    #[inline(always)]
    unsafe fn rows<F: Format, const N: usize>(j: &JobRef, r0: usize, r1: usize, i0: usize) {
        let mut r = r0;
        // Four rows at a time for super-blocks; formats of 32-value blocks stream better two
        // rows at a time (head-sized Q4_1 at batch 1 on a Zen 4, 2 threads: 29 GFLOP/s with four,
        // 46 with two, the f32 path's 48; `matmul_bench`).
        if N <= 2 && !F::HAS_DECODE32 {
            while r + 4 <= r1 {
                rows_r::<F, N, 4>(j, r, i0);
                r += 4;
            }
        }
        while r + 2 <= r1 {
            rows_r::<F, N, 2>(j, r, i0);
            r += 2;
        }
        if r < r1 {
            rows_r::<F, N, 1>(j, r, i0);
        }
    }

    // Index loops over the constant R and N: an earlier build with iterator chains over arrays
    // kept its accumulators on the stack (seen in `perf annotate`).
    #[allow(clippy::needless_range_loop)]
    #[inline(always)]
    unsafe fn rows_r<F: Format, const N: usize, const R: usize>(j: &JobRef, r: usize, i0: usize) {
        let k = j.cols;
        // Units of 32 values or one block, whichever is longer (element formats: 16-value blocks).
        let unit = F::BS.max(32);
        let blocks = unit / F::BS;
        let x: [*const u16; N] = std::array::from_fn(|i| j.xb.add((i0 + i) * k));
        let w: [*const u8; R] = std::array::from_fn(|a| j.w.add((r + a) * j.row_bytes));
        // Written before read, block by block (formats without `decode32` only).
        let mut buf = std::mem::MaybeUninit::<[[f32; 256]; R]>::uninit();
        let buf = buf.as_mut_ptr() as *mut f32;
        let mut acc = [[_mm512_setzero_ps(); N]; R];
        // Written before read, block by block (formats with `codes16` only).
        let mut codes = [[0i8; 256]; R];
        let (mut scale, mut min) = ([[0.0f32; 16]; R], [[0.0f32; 16]; R]);
        for u in 0..k / unit {
            let off = u * blocks * F::BB;
            // The R rows are one contiguous run: fetch the same place of the next run.
            for wa in &w {
                let next = wa.add(off + R * j.row_bytes);
                let mut l = 0;
                while l < blocks * F::BB {
                    Avx512::prefetch(next.add(l));
                    l += 64;
                }
            }
            if F::HAS_DECODE32 {
                for a in 0..R {
                    let mut d = [Avx512::zero(); 4];
                    F::decode32::<Avx512>(w[a].add(off), &mut d);
                    let wv = _mm512_cvtne2ps_pbh(d[1], d[0]);
                    for i in 0..N {
                        acc[a][i] = _mm512_dpbf16_ps(acc[a][i], wv, load(x[i].add(u * 32)));
                    }
                }
            } else if F::HAS_CODES16 {
                // Super-blocks: codes as bytes, each 32 values widened and scaled in registers
                // (the f32 values `dequant` gives, to the bit), rounded and dotted.
                for a in 0..R {
                    F::codes16::<Avx512>(w[a].add(off), &mut codes[a], &mut scale[a], &mut min[a]);
                }
                for c in 0..8 {
                    for a in 0..R {
                        let c8 = codes[a].as_ptr().add(32 * c) as *const u8;
                        let (s, m) = (&scale[a][2 * c..], &min[a][2 * c..]);
                        let (s0, m0) = (Avx512::splat(s[0]), Avx512::splat(m[0]));
                        let (s1, m1) = (Avx512::splat(s[1]), Avx512::splat(m[1]));
                        let lo = code_values::<Avx512>(c8, s0, m0, F::CODES_MIN);
                        let hi = code_values::<Avx512>(c8.add(16), s1, m1, F::CODES_MIN);
                        let wv = _mm512_cvtne2ps_pbh(hi, lo);
                        for i in 0..N {
                            let xv = load(x[i].add(u * unit + 32 * c));
                            acc[a][i] = _mm512_dpbf16_ps(acc[a][i], wv, xv);
                        }
                    }
                }
            } else {
                for a in 0..R {
                    for b in 0..blocks {
                        F::dequant::<Avx512>(
                            w[a].add(off + b * F::BB),
                            buf.add(a * 256 + b * F::BS),
                        );
                    }
                }
                let mut c = 0;
                while c < unit {
                    for a in 0..R {
                        let wv = pair(buf.add(a * 256 + c));
                        for i in 0..N {
                            let xv = load(x[i].add(u * unit + c));
                            acc[a][i] = _mm512_dpbf16_ps(acc[a][i], wv, xv);
                        }
                    }
                    c += 32;
                }
            }
        }
        for (a, acca) in acc.iter().enumerate() {
            for (i, v) in acca.iter().enumerate() {
                *j.y.add((i0 + i) * j.rows + r + a) = Avx512::reduce_add(*v);
            }
        }
    }

    /// Rows r0..r1 dequantized and rounded once into a BF16 panel, then 6 x 4 tiles over blocks
    /// of X_BLOCK activation rows (they stay in L2 while the panel is swept).
    #[inline(always)]
    unsafe fn panel<F: Format>(j: &JobRef, r0: usize, r1: usize) {
        const WR: usize = 6;
        const XR: usize = 4;
        let k = j.cols;
        let row = scratch(&ROW, k + 16);
        let panel = scratch(&PANEL, (k * (r1 - r0)).div_ceil(2) + 16) as *mut u16;
        for r in r0..r1 {
            dequant_row::<Avx512, F>(j.w.add(r * j.row_bytes), row, k);
            round_rows(row, panel.add((r - r0) * k), k);
        }
        let mut ib = 0;
        while ib < j.n {
            let ie = (ib + X_BLOCK).min(j.n);
            let mut w0 = 0;
            while w0 < r1 - r0 {
                let wr = (r1 - r0 - w0).min(WR);
                let mut i0 = ib;
                while i0 < ie {
                    tile::<WR, XR>(j, panel, r0, w0, wr, i0, ie);
                    i0 += XR;
                }
                w0 += WR;
            }
            ib = ie;
        }
    }

    #[inline(always)]
    unsafe fn tile<const WR: usize, const XR: usize>(
        j: &JobRef,
        panel: *const u16,
        r0: usize,
        w0: usize,
        wr: usize,
        i0: usize,
        ie: usize,
    ) {
        let k = j.cols;
        // Missing rows repeat the last valid one; their results are not stored.
        let w: [*const u16; WR] = std::array::from_fn(|a| panel.add((w0 + a.min(wr - 1)) * k));
        let x: [*const u16; XR] = std::array::from_fn(|i| j.xb.add((i0 + i).min(ie - 1) * k));
        let mut acc = [[_mm512_setzero_ps(); XR]; WR];
        let mut c = 0;
        while c < k {
            let wv: [__m512bh; WR] = std::array::from_fn(|a| load(w[a].add(c)));
            for i in 0..XR {
                let xv = load(x[i].add(c));
                for a in 0..WR {
                    acc[a][i] = _mm512_dpbf16_ps(acc[a][i], wv[a], xv);
                }
            }
            c += 32;
        }
        store_tile::<Avx512, WR, XR>(j, &acc, r0, w0, wr, i0, ie);
    }
}
