//! Quantized-weight x f32-activation products, y = x · Wᵀ, for one row or a batch of rows.
//!
//! Activations stay f32 (llama.cpp quantizes them to 8 bits; we do not, so our products are closer
//! to exact math).
//!
//! Batch invariance: every path computes an output y[i][r] in one canonical order — products of
//! weight and activation accumulated LANES values at a time, in column order, into one vector,
//! then `reduce_add` — from identically dequantized weights. A row's result is therefore the same
//! to the bit whatever else is in the batch and whichever path ran (the seed contract of the
//! server, and exact agreement between serving and a trainer's recomputation). Only rows whose
//! length is not a whole number of blocks fall back to a different order.
//!
//! Paths, all generic over ISA and block format:
//! - `fused_rows` (decode, batch 1): each weight block is decoded in registers and dotted with up
//!   to 8 activation rows (4 with AVX2); memory-bound on the weights, as decode must be.
//! - `paired_rows` (small batches, formats with `decode32`): two weight rows at a time, so each
//!   activation load feeds two FMAs.
//! - `dot_panel` (>= DOT_MIN_ROWS rows: batched decode and prefill): a few weight rows are
//!   dequantized once into a row-major f32 panel, then WR x XR tiles (6 weight rows x 4 activation
//!   rows with AVX-512, 24 accumulators; 3 x 3 with AVX2) compute dot products over blocks of
//!   activation rows that stay in L2. Tile shape measured with `examples/matmul_bench.rs` (6x4
//!   beat 3x8, 4x6, 8x3, 5x4, 2x12 at batch 16 on Zen 4, 2026-11-22).
//!
//! Formats without an in-register decoder (K-quants, element formats) dequantize a block on the
//! stack.

// Safety of every `unsafe fn` here: the CPU has the features of `S`, and pointers are valid for
// the lengths and rows the `JobRef` states.
#![allow(clippy::missing_safety_doc)]

use super::dequant::{dequant_row, Format};
use super::formats::per_format;
use super::isa::{Isa, Precision};
use super::job::{scratch, store_tile, JobRef, X_BLOCK};
use super::pool::Tasks;
use super::simd::{Avx2, Avx512, Simd};
use crate::quant::QuantType;
use crate::reference;
use std::cell::RefCell;

/// One product `y (n, rows) = x (n, cols) · Wᵀ` with W `rows` rows of `cols` values in format `ty`.
pub struct Matmul<'a> {
    pub ty: QuantType,
    pub w: &'a [u8],
    pub rows: usize,
    pub cols: usize,
    pub x: &'a [f32],
    pub y: &'a mut [f32],
}

impl Matmul<'_> {
    fn check(&self) {
        let rb = self
            .ty
            .row_bytes(self.cols)
            .expect("cols must be a whole number of blocks");
        assert!(self.w.len() >= rb * self.rows, "weight bytes too short");
        assert_eq!(
            self.x.len() % self.cols,
            0,
            "x is not a whole number of rows"
        );
        let n = self.x.len() / self.cols;
        assert_eq!(self.y.len(), n * self.rows, "y has the wrong size");
    }
}

/// Batches of at least this many rows take the `dot_panel` path.
pub const DOT_MIN_ROWS: usize = 8;
const MAX_JOBS: usize = 8;

thread_local! {
    static PANEL: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// The rounded activations of a BF16 chunk (as u16 pairs), on the calling thread.
    static XB: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// The quantized activations of an int8 chunk, on the calling thread.
    static XQ: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// f32 slots of `n` rows of quantized activations (`int8::quantize_rows`).
fn q8_slots(n: usize, cols: usize) -> usize {
    #[cfg(target_arch = "x86_64")]
    return n * super::int8::q8_row_slots(cols).iter().sum::<usize>();
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("int8 products are x86_64 only ({n} x {cols})")
}

/// Whether a product of rows of `cols` values takes the BF16 path under `Precision::Bf16` (the
/// others stay exact f32: a choice by shape only, never by batch).
pub fn bf16_applies(cols: usize) -> bool {
    cols.is_multiple_of(32)
}

/// Run several independent products as one parallel region (e.g. q, k and v of a layer).
/// `precision` is `Exact` or one the CPU supports (`Precision::supported`).
pub fn matmul_many(isa: Isa, precision: Precision, pool: Tasks, jobs: &mut [Matmul]) {
    for j in jobs.iter() {
        j.check();
    }
    let bf16 = precision == Precision::Bf16;
    let int8 = precision == Precision::Int8;
    if isa == Isa::Reference {
        for j in jobs.iter_mut() {
            if int8 && reference::int8_applies(j.ty, j.cols) {
                reference::matmul_int8(j.ty, j.w, j.rows, j.cols, j.x, j.y);
            } else if bf16 && bf16_applies(j.cols) {
                reference::matmul_bf16(j.ty, j.w, j.rows, j.cols, j.x, j.y);
            } else {
                reference::matmul(j.ty, j.w, j.rows, j.cols, j.x, j.y);
            }
        }
        return;
    }
    assert!(
        precision.supported(isa),
        "{} products need {}",
        precision.name(),
        precision.needs()
    );
    for chunk in jobs.chunks_mut(MAX_JOBS) {
        run_chunk(isa, precision, pool, chunk);
    }
}

fn run_chunk(isa: Isa, precision: Precision, pool: Tasks, jobs: &mut [Matmul]) {
    let bf16 = precision == Precision::Bf16;
    // Int8: the VNNI kernels where the CPU has them (the K-quants' take AVX2's activation layout),
    // else AVX2's (the same bits).
    let vnni_cpu = isa == Isa::Avx512 && super::Features::get().avx512_vnni;
    let vnni = |ty: QuantType| vnni_cpu && super::int8::VNNI_FORMATS.contains(&ty);
    let int8 = |j: &Matmul| precision == Precision::Int8 && reference::int8_applies(j.ty, j.cols);
    // Int8: every job's activations quantized once, into one buffer on this thread.
    let q8_total: usize = jobs
        .iter()
        .filter(|j| int8(j))
        .map(|j| q8_slots(j.x.len() / j.cols, j.cols))
        .sum();
    let xq_all = if q8_total > 0 {
        scratch(&XQ, q8_total + 16)
    } else {
        std::ptr::null_mut()
    };
    let mut xq_used = 0;
    // BF16: every job's activations rounded once, into one buffer on this thread.
    let rounded: usize = jobs
        .iter()
        .filter(|j| bf16 && bf16_applies(j.cols))
        .map(|j| j.x.len())
        .sum();
    let xb_all = if rounded > 0 {
        scratch(&XB, rounded.div_ceil(2) + 16) as *mut u16
    } else {
        std::ptr::null_mut()
    };
    let mut xb_used = 0;
    let wr = if isa.lanes() >= 16 { 6 } else { 3 };
    let mut refs: [Option<JobRef>; MAX_JOBS] = Default::default();
    let mut first_task = [0usize; MAX_JOBS + 1];
    for (k, j) in jobs.iter_mut().enumerate() {
        let n = j.x.len() / j.cols;
        let row_bytes = j.ty.row_bytes(j.cols).unwrap_or(0);
        let xb = if bf16 && bf16_applies(j.cols) {
            // SAFETY: the buffer holds `rounded` values; BF16 support was checked.
            #[cfg(target_arch = "x86_64")]
            unsafe {
                let dst = xb_all.add(xb_used);
                super::bf16::round_rows(j.x.as_ptr(), dst, j.x.len());
                xb_used += j.x.len();
                dst as *const u16
            }
            #[cfg(not(target_arch = "x86_64"))]
            unreachable!("BF16 products are x86_64 only")
        } else {
            std::ptr::null()
        };
        let mut xq = (
            std::ptr::null(),
            std::ptr::null(),
            std::ptr::null(),
            std::ptr::null(),
        );
        if int8(j) {
            // Jobs on the same activations and format (q, k and v; gate and up) share one
            // quantization.
            let shared = refs[..k].iter().flatten().find(|r| {
                !r.xq.is_null() && r.x == j.x.as_ptr() && (r.n, r.cols, r.ty) == (n, j.cols, j.ty)
            });
            if let Some(r) = shared {
                xq = (r.xq, r.xd, r.xc, r.xs);
            } else {
                // SAFETY: the buffer holds q8_total slots; the kernels of `isa` run here.
                #[cfg(target_arch = "x86_64")]
                unsafe {
                    let base = xq_all.add(xq_used);
                    xq_used += q8_slots(n, j.cols);
                    xq = if vnni(j.ty) {
                        super::int8::quantize_rows(j.x.as_ptr(), n, j.cols, j.ty, base)
                    } else {
                        super::int8_avx2::quantize_rows(j.x.as_ptr(), n, j.cols, j.ty, base)
                    };
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            unreachable!("int8 products are x86_64 only")
        }
        let (xq, xd, xc, xs) = xq;
        let dot_panel = xq.is_null() && n >= DOT_MIN_ROWS && j.cols.is_multiple_of(32);
        let rows_per_task = if dot_panel {
            // Small products (LoRA's A: r rows) in tiles of one panel height, so that both
            // threads get work; a row's result does not depend on the split.
            if j.rows < 16 * wr * pool.num_threads() {
                wr
            } else {
                4 * wr
            }
        } else {
            (32768 / (row_bytes * n.min(8)).max(1)).clamp(4, 256)
        };
        refs[k] = Some(JobRef {
            ty: j.ty,
            w: j.w.as_ptr(),
            row_bytes,
            rows: j.rows,
            cols: j.cols,
            x: j.x.as_ptr(),
            xb,
            xq,
            xd,
            xc,
            xs,
            n,
            y: j.y.as_mut_ptr(),
            dot_panel,
            rows_per_task,
        });
        first_task[k + 1] = first_task[k] + j.rows.div_ceil(rows_per_task);
    }
    let num_jobs = jobs.len();
    let total = first_task[num_jobs];
    let task = |t: usize| {
        let k = (0..num_jobs).find(|&k| t < first_task[k + 1]).unwrap_or(0);
        let Some(j) = refs[k].as_ref() else { return };
        let r0 = (t - first_task[k]) * j.rows_per_task;
        let r1 = (r0 + j.rows_per_task).min(j.rows);
        // SAFETY: the ISA was detected at start-up; tasks write disjoint row ranges of y.
        unsafe {
            match isa {
                #[cfg(target_arch = "x86_64")]
                _ if !j.xq.is_null() && vnni(j.ty) => super::int8::task(j, r0, r1),
                #[cfg(target_arch = "x86_64")]
                _ if !j.xq.is_null() && super::int8_kquant::FORMATS.contains(&j.ty) => {
                    if vnni_cpu {
                        super::int8_kquant_vnni::task(j, r0, r1)
                    } else {
                        super::int8_kquant::task(j, r0, r1)
                    }
                }
                #[cfg(target_arch = "x86_64")]
                _ if !j.xq.is_null() => super::int8_avx2::task(j, r0, r1),
                #[cfg(target_arch = "x86_64")]
                _ if !j.xb.is_null() => super::bf16::task(j, r0, r1),
                Isa::Avx512 => task_avx512(j, r0, r1),
                Isa::Avx2 => task_avx2(j, r0, r1),
                Isa::Reference => unreachable!(),
            }
        }
    };
    pool.run(total, &task);
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn task_avx512(j: &JobRef, r0: usize, r1: usize) {
    task_generic::<Avx512>(j, r0, r1)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn task_avx2(j: &JobRef, r0: usize, r1: usize) {
    task_generic::<Avx2>(j, r0, r1)
}

#[inline(always)]
unsafe fn task_generic<S: Simd>(j: &JobRef, r0: usize, r1: usize) {
    per_format!(j.ty, F => task_fmt::<S, F>(j, r0, r1))
}

// No closures below this line on hot paths: a closure does not inherit the caller's target
// features, so the intrinsics inside it would not inline.
#[inline(always)]
unsafe fn task_fmt<S: Simd, F: Format>(j: &JobRef, r0: usize, r1: usize) {
    if j.dot_panel {
        let panel = scratch(&PANEL, j.cols * (r1 - r0) + 16);
        if S::LANES >= 16 {
            dot_panel::<S, F, 6, 4>(j, r0, r1, panel);
        } else {
            dot_panel::<S, F, 3, 3>(j, r0, r1, panel);
        }
    } else {
        dot_rows::<S, F>(j, r0, r1);
    }
}

#[inline(always)]
unsafe fn dot_rows<S: Simd, F: Format>(j: &JobRef, r0: usize, r1: usize) {
    if !j.cols.is_multiple_of(F::BS) {
        // Odd row lengths (element formats only): plain dots, outside the canonical order.
        let buf = scratch(&PANEL, j.cols + 16);
        for r in r0..r1 {
            let src = j.w.add(r * j.row_bytes);
            let w = if F::TY == QuantType::F32 {
                src as *const f32
            } else {
                dequant_row::<S, F>(src, buf, j.cols);
                buf as *const f32
            };
            for i in 0..j.n {
                *j.y.add(i * j.rows + r) = dot::<S>(w, j.x.add(i * j.cols), j.cols);
            }
        }
        return;
    }
    if F::PAIRED && j.n > 1 {
        // Two weight rows at a time against up to 4 activation rows: each activation load feeds
        // two FMAs (batched decode is bound by loads otherwise).
        let mut i0 = 0;
        while i0 < j.n {
            match (j.n - i0).min(4) {
                1 => paired_rows::<S, F, 1>(j, r0, r1, i0),
                2 => paired_rows::<S, F, 2>(j, r0, r1, i0),
                3 => paired_rows::<S, F, 3>(j, r0, r1, i0),
                _ => paired_rows::<S, F, 4>(j, r0, r1, i0),
            }
            i0 += 4;
        }
        return;
    }
    // Fused: each weight block is decoded in registers and used for up to 8 activation rows
    // (4 with AVX2).
    // (Two matches: the AVX2 instances never name the groups of 5..8, so they are not compiled.)
    let group = if S::LANES >= 16 { 8 } else { 4 };
    let mut i0 = 0;
    while i0 < j.n {
        if S::LANES >= 16 {
            match (j.n - i0).min(group) {
                1 => fused_rows::<S, F, 1>(j, r0, r1, i0),
                2 => fused_rows::<S, F, 2>(j, r0, r1, i0),
                3 => fused_rows::<S, F, 3>(j, r0, r1, i0),
                4 => fused_rows::<S, F, 4>(j, r0, r1, i0),
                5 => fused_rows::<S, F, 5>(j, r0, r1, i0),
                6 => fused_rows::<S, F, 6>(j, r0, r1, i0),
                7 => fused_rows::<S, F, 7>(j, r0, r1, i0),
                _ => fused_rows::<S, F, 8>(j, r0, r1, i0),
            }
        } else {
            match (j.n - i0).min(group) {
                1 => fused_rows::<S, F, 1>(j, r0, r1, i0),
                2 => fused_rows::<S, F, 2>(j, r0, r1, i0),
                3 => fused_rows::<S, F, 3>(j, r0, r1, i0),
                _ => fused_rows::<S, F, 4>(j, r0, r1, i0),
            }
        }
        i0 += group;
    }
}

#[inline(always)]
unsafe fn paired_rows<S: Simd, F: Format, const N: usize>(
    j: &JobRef,
    r0: usize,
    r1: usize,
    i0: usize,
) {
    let nb = j.cols / 32;
    let vecs = 32 / S::LANES;
    let mut r = r0;
    while r + 2 <= r1 {
        let (wa, wb) = (j.w.add(r * j.row_bytes), j.w.add((r + 1) * j.row_bytes));
        let mut acc = [[[S::zero(); 2]; N]; 2];
        let mut da = [S::zero(); 4];
        let mut db = [S::zero(); 4];
        for b in 0..nb {
            let (sa, sb) = (wa.add(b * F::BB), wb.add(b * F::BB));
            S::prefetch(sa.add(512));
            S::prefetch(sb.add(512));
            F::decode32::<S>(sa, &mut da);
            F::decode32::<S>(sb, &mut db);
            let [acc_a, acc_b] = &mut acc;
            // The canonical order: value order into one accumulator (see the module doc).
            for k in 0..vecs {
                for (i, (aa, ab)) in acc_a.iter_mut().zip(acc_b.iter_mut()).enumerate() {
                    let xv = S::load(j.x.add((i0 + i) * j.cols + b * 32 + k * S::LANES));
                    aa[0] = S::fma(da[k], xv, aa[0]);
                    ab[0] = S::fma(db[k], xv, ab[0]);
                }
            }
        }
        for (w, accw) in acc.iter().enumerate() {
            for (i, a) in accw.iter().enumerate() {
                *j.y.add((i0 + i) * j.rows + r + w) = S::reduce_add(S::add(a[0], a[1]));
            }
        }
        r += 2;
    }
    if r < r1 {
        fused_rows::<S, F, N>(j, r, r1, i0);
    }
}

#[inline(always)]
unsafe fn fused_rows<S: Simd, F: Format, const N: usize>(
    j: &JobRef,
    r0: usize,
    r1: usize,
    i0: usize,
) {
    let nb = j.cols / F::BS;
    for r in r0..r1 {
        let w = j.w.add(r * j.row_bytes);
        let mut acc = [[S::zero(); 2]; N];
        for b in 0..nb {
            let src = w.add(b * F::BB);
            S::prefetch(src.add(512));
            let mut xs = [std::ptr::null::<f32>(); N];
            for (i, p) in xs.iter_mut().enumerate() {
                *p = j.x.add((i0 + i) * j.cols + b * F::BS);
            }
            F::dot_block::<S, N>(src, &xs, &mut acc);
        }
        for (i, a) in acc.iter().enumerate() {
            *j.y.add((i0 + i) * j.rows + r) = S::reduce_add(S::add(a[0], a[1]));
        }
    }
}

/// Dequantize rows `r0..r1` of W once into `panel` (row-major f32), then sweep tiles of `WR`
/// weight rows x `XR` activation rows, one vector accumulator per pair: per LANES columns, WR + XR
/// loads feed WR * XR FMAs, and no weight is decoded more than once per product. Activation rows
/// are taken X_BLOCK at a time so that they stay in L2 while the panel is swept.
#[inline(always)]
unsafe fn dot_panel<S: Simd, F: Format, const WR: usize, const XR: usize>(
    j: &JobRef,
    r0: usize,
    r1: usize,
    panel: *mut f32,
) {
    let k = j.cols;
    for r in r0..r1 {
        dequant_row::<S, F>(j.w.add(r * j.row_bytes), panel.add((r - r0) * k), k);
    }
    let mut ib = 0;
    while ib < j.n {
        let ie = (ib + X_BLOCK).min(j.n);
        let mut w0 = 0;
        while w0 < r1 - r0 {
            let wr = (r1 - r0 - w0).min(WR);
            let mut i0 = ib;
            while i0 < ie {
                dot_tile::<S, WR, XR>(j, panel, r0, w0, wr, i0, ie);
                i0 += XR;
            }
            w0 += WR;
        }
        ib = ie;
    }
}

#[inline(always)]
unsafe fn dot_tile<S: Simd, const WR: usize, const XR: usize>(
    j: &JobRef,
    panel: *const f32,
    r0: usize,
    w0: usize,
    wr: usize,
    i0: usize,
    ie: usize,
) {
    let k = j.cols;
    let l = S::LANES;
    // Missing rows repeat the last valid one; their results are not stored.
    let w: [*const f32; WR] = std::array::from_fn(|a| panel.add((w0 + a.min(wr - 1)) * k));
    let x: [*const f32; XR] = std::array::from_fn(|i| j.x.add((i0 + i).min(ie - 1) * k));
    let mut acc = [[S::zero(); XR]; WR];
    let mut c = 0;
    while c + l <= k {
        let wv: [S::V; WR] = std::array::from_fn(|a| S::load(w[a].add(c)));
        for i in 0..XR {
            let xv = S::load(x[i].add(c));
            for a in 0..WR {
                acc[a][i] = S::fma(wv[a], xv, acc[a][i]);
            }
        }
        c += l;
    }
    store_tile::<S, WR, XR>(j, &acc, r0, w0, wr, i0, ie);
}

/// Dot product of two f32 vectors of length `n`.
#[inline(always)]
pub unsafe fn dot<S: Simd>(a: *const f32, b: *const f32, n: usize) -> f32 {
    let l = S::LANES;
    let (mut a0, mut a1, mut a2, mut a3) = (S::zero(), S::zero(), S::zero(), S::zero());
    let mut i = 0;
    while i + 4 * l <= n {
        a0 = S::fma(S::load(a.add(i)), S::load(b.add(i)), a0);
        a1 = S::fma(S::load(a.add(i + l)), S::load(b.add(i + l)), a1);
        a2 = S::fma(S::load(a.add(i + 2 * l)), S::load(b.add(i + 2 * l)), a2);
        a3 = S::fma(S::load(a.add(i + 3 * l)), S::load(b.add(i + 3 * l)), a3);
        i += 4 * l;
    }
    while i + l <= n {
        a0 = S::fma(S::load(a.add(i)), S::load(b.add(i)), a0);
        i += l;
    }
    let mut s = S::reduce_add(S::add(S::add(a0, a1), S::add(a2, a3)));
    while i < n {
        s += *a.add(i) * *b.add(i);
        i += 1;
    }
    s
}
