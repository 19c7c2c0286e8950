//! Backward kernels of the frozen base, each with its twin in `reference` (llm.c style: the
//! forward's inputs and dy in, dx out; parameters are frozen, so there are no weight gradients).
//!
//! - `linear_backward`: dx (n, cols) = dy (n, rows) · W for a quantized W (rows, cols), from
//!   dequantized tiles (a few rows × one column chunk at a time: bounded memory, never a whole
//!   dequantized copy). Tasks own disjoint column chunks; each dx value is one FMA chain over the
//!   weight rows in order, so results do not depend on the thread count.
//! - `rmsnorm_backward`, `rope_backward`, `swiglu_backward`: row-local, in f32.
//! - Attention's backward is in `attention_backward`.

// Safety of every `unsafe fn` here: the CPU has the features of `S`; sizes are checked by the
// public entry points.
#![allow(clippy::missing_safety_doc)]

use super::dequant::{dequant_row, Format};
use super::formats::per_format;
use super::isa::{Isa, Precision};
use super::job::scratch;
use super::pool::Tasks;
use super::simd::{Avx2, Avx512, Simd};
use crate::quant::QuantType;
use crate::reference;
use std::cell::RefCell;

/// Values of a dequantized weight tile (rows × one column chunk): 32 KiB, L1-sized. Long tiles
/// keep each accumulator in registers over many weight rows (`matmul_bench 2048 backward`, 1
/// thread, AVX2, one run each on a noisy host: 16-row tiles of 128 columns 44 GFLOP/s, 256 rows of
/// 32 columns 71; `flywheel bench --train` 8 × 256 LoRA: 120 → 136 tokens/s).
const TILE_VALUES: usize = 8192;
/// Activation rows swept per tile before the next block (their dx chunk stays in cache).
const I_BLOCK: usize = 64;

thread_local! {
    static TILE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// dy rounded to BF16 (`Precision::Bf16`), on the calling thread.
    static DYB: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// dx (n, cols) = dy (n, rows) · W, W `rows` rows of `cols` values in format `ty`.
#[allow(clippy::too_many_arguments)]
pub fn linear_backward(
    isa: Isa,
    precision: Precision,
    pool: Tasks,
    ty: QuantType,
    w: &[u8],
    rows: usize,
    cols: usize,
    dy: &[f32],
    dx: &mut [f32],
) {
    let rb = ty
        .row_bytes(cols)
        .expect("cols must be a whole number of blocks");
    assert!(w.len() >= rb * rows, "weight bytes too short");
    assert!(
        dy.len().is_multiple_of(rows),
        "dy is not a whole number of rows"
    );
    let n = dy.len() / rows;
    assert_eq!(dx.len(), n * cols, "dx has the wrong size");
    let bf16 = precision == Precision::Bf16 && super::matmul::bf16_applies(cols);
    if isa == Isa::Reference {
        if bf16 {
            reference::linear_backward_bf16(ty, w, rows, cols, dy, dx);
        } else {
            reference::linear_backward(ty, w, rows, cols, dy, dx);
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if bf16 {
        linear_backward_bf16(pool, ty, w, rows, cols, dy, dx);
        return;
    }
    // Column chunks: whole blocks, at least 32 values; tiles of as many rows as fit TILE_VALUES.
    let bs = ty.block_size().max(16);
    let chunk = bs * 32usize.div_ceil(bs);
    let tile_rows = (TILE_VALUES / chunk).clamp(16, 256);
    let num_chunks = cols.div_ceil(chunk);
    let job = Job {
        ty,
        w: w.as_ptr(),
        row_bytes: rb,
        rows,
        cols,
        dy: dy.as_ptr(),
        n,
        dx: dx.as_mut_ptr(),
        chunk,
        tile_rows,
    };
    let task = |t: usize| {
        let c0 = t * chunk;
        let c1 = (c0 + chunk).min(cols);
        // SAFETY: ISA detected at start-up; tasks write disjoint column ranges of dx.
        unsafe {
            match isa {
                Isa::Avx512 => lb_avx512(&job, c0, c1),
                Isa::Avx2 => lb_avx2(&job, c0, c1),
                Isa::Reference => unreachable!(),
            }
        }
    };
    pool.run(num_chunks, &task);
}

/// The BF16 input gradient: dy rounded once (on this thread), then column chunks as tasks.
#[cfg(target_arch = "x86_64")]
fn linear_backward_bf16(
    pool: Tasks,
    ty: QuantType,
    w: &[u8],
    rows: usize,
    cols: usize,
    dy: &[f32],
    dx: &mut [f32],
) {
    use super::bf16::{backward_task, round_pairs, BackwardJob};
    let n = dy.len() / rows;
    let even = rows.next_multiple_of(2);
    let dyb = scratch(&DYB, (n * even).div_ceil(2) + 16) as *mut u16;
    // SAFETY: BF16 support was checked by the caller (`Precision::supported`); sizes as allocated.
    unsafe { round_pairs(dy.as_ptr(), dyb, n, rows) };
    // Chunks of 32 columns (256 for K-quants); tiles of an even number of rows.
    let chunk = ty.block_size().max(32);
    let tile_rows = (TILE_VALUES / chunk).clamp(16, 256) & !1;
    let job = BackwardJob {
        ty,
        w: w.as_ptr(),
        row_bytes: ty.row_bytes(cols).expect("whole blocks"),
        rows,
        cols,
        dyb,
        n,
        dx: dx.as_mut_ptr(),
        tile_rows,
    };
    let task = |t: usize| {
        let c0 = t * chunk;
        // SAFETY: as above; tasks write disjoint column ranges of dx.
        unsafe { backward_task(&job, c0, (c0 + chunk).min(cols)) }
    };
    pool.run(cols.div_ceil(chunk), &task);
}

struct Job {
    ty: QuantType,
    w: *const u8,
    row_bytes: usize,
    rows: usize,
    cols: usize,
    dy: *const f32,
    n: usize,
    dx: *mut f32,
    chunk: usize,
    tile_rows: usize,
}
// SAFETY: tasks only write their own column range of `dx`.
unsafe impl Sync for Job {}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn lb_avx512(j: &Job, c0: usize, c1: usize) {
    lb_any::<Avx512>(j, c0, c1)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn lb_avx2(j: &Job, c0: usize, c1: usize) {
    lb_any::<Avx2>(j, c0, c1)
}

#[inline(always)]
unsafe fn lb_any<S: Simd>(j: &Job, c0: usize, c1: usize) {
    per_format!(j.ty, F => lb::<S, F>(j, c0, c1))
}

/// Columns c0..c1 of dx: zero them, then for each tile of `tile_rows` weight rows (dequantized into
/// a thread-local panel), dx[i][c] += Σ_r dy[i][r]·W[r][c] in row order.
#[inline(always)]
unsafe fn lb<S: Simd, F: Format>(j: &Job, c0: usize, c1: usize) {
    let width = c1 - c0;
    let panel = scratch(&TILE, j.tile_rows * j.chunk + 16);
    let off = (c0 / F::BS) * F::BB;
    for i in 0..j.n {
        std::ptr::write_bytes(j.dx.add(i * j.cols + c0), 0, width);
    }
    // Activation rows in blocks that keep their dx columns in L1/L2; the weight tiles are
    // dequantized again for each block (1/I_BLOCK of the multiply-adds).
    let mut ib = 0;
    while ib < j.n {
        let ie = (ib + I_BLOCK).min(j.n);
        let mut r0 = 0;
        while r0 < j.rows {
            let tr = (j.rows - r0).min(j.tile_rows);
            for r in 0..tr {
                dequant_row::<S, F>(
                    j.w.add((r0 + r) * j.row_bytes + off),
                    panel.add(r * width),
                    width,
                );
            }
            // Four activation rows at a time: each panel vector loaded feeds four FMAs.
            let mut i = ib;
            while i < ie {
                match (ie - i).min(4) {
                    1 => lb_rows::<S, 1>(j, panel, width, c0, r0, tr, i),
                    2 => lb_rows::<S, 2>(j, panel, width, c0, r0, tr, i),
                    3 => lb_rows::<S, 3>(j, panel, width, c0, r0, tr, i),
                    _ => lb_rows::<S, 4>(j, panel, width, c0, r0, tr, i),
                }
                i += 4;
            }
            r0 += tr;
        }
        ib = ie;
    }
}

/// dx rows i0..i0+N, columns c0..c0+width += dy[., r0..r0+tr] · panel (tr rows of `width`).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn lb_rows<S: Simd, const N: usize>(
    j: &Job,
    panel: *const f32,
    width: usize,
    c0: usize,
    r0: usize,
    tr: usize,
    i0: usize,
) {
    let l = S::LANES;
    let dys: [*const f32; N] = std::array::from_fn(|i| j.dy.add((i0 + i) * j.rows + r0));
    let outs: [*mut f32; N] = std::array::from_fn(|i| j.dx.add((i0 + i) * j.cols + c0));
    let mut c = 0;
    while c + 2 * l <= width {
        let mut acc: [[S::V; 2]; N] =
            std::array::from_fn(|i| [S::load(outs[i].add(c)), S::load(outs[i].add(c + l))]);
        for r in 0..tr {
            let p = panel.add(r * width + c);
            let (p0, p1) = (S::load(p), S::load(p.add(l)));
            for (a, dy) in acc.iter_mut().zip(&dys) {
                let g = S::splat(*dy.add(r));
                a[0] = S::fma(g, p0, a[0]);
                a[1] = S::fma(g, p1, a[1]);
            }
        }
        for (a, o) in acc.iter().zip(&outs) {
            S::store(o.add(c), a[0]);
            S::store(o.add(c + l), a[1]);
        }
        c += 2 * l;
    }
    while c + l <= width {
        let mut acc: [S::V; N] = std::array::from_fn(|i| S::load(outs[i].add(c)));
        for r in 0..tr {
            let p0 = S::load(panel.add(r * width + c));
            for (a, dy) in acc.iter_mut().zip(&dys) {
                *a = S::fma(S::splat(*dy.add(r)), p0, *a);
            }
        }
        for (a, o) in acc.iter().zip(&outs) {
            S::store(o.add(c), *a);
        }
        c += l;
    }
    while c < width {
        for (dy, o) in dys.iter().zip(&outs) {
            let mut a = *o.add(c);
            for r in 0..tr {
                a = (*dy.add(r)).mul_add(*panel.add(r * width + c), a);
            }
            *o.add(c) = a;
        }
        c += 1;
    }
}

/// RMSNorm backward for rows of `weight.len()` values: y = g ⊙ x / r, r = √(mean(x²) + eps);
/// with u = g ⊙ dy, dx = u/r − x·(u·x)/(n·r³). (g frozen: no dg.)
pub fn rmsnorm_backward(x: &[f32], weight: &[f32], eps: f32, dy: &[f32], dx: &mut [f32]) {
    let d = weight.len();
    assert!(x.len() == dy.len() && x.len() == dx.len() && x.len().is_multiple_of(d));
    for ((xr, gr), or) in x.chunks(d).zip(dy.chunks(d)).zip(dx.chunks_mut(d)) {
        let ms = xr.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        let ux: f32 = (0..d).map(|c| weight[c] * gr[c] * xr[c]).sum();
        let k = ux * inv * inv * inv / d as f32;
        for c in 0..d {
            or[c] = weight[c] * gr[c] * inv - xr[c] * k;
        }
    }
}

/// RoPE backward in place: each pair of dy turns by −θ (the table of `ops::rope_table`).
pub fn rope_backward(
    dy: &mut [f32],
    table: &[f32],
    n_heads: usize,
    head_dim: usize,
    rope_dim: usize,
    layout: crate::reference::RopeLayout,
) {
    let half = rope_dim / 2;
    let row = n_heads * head_dim;
    for (t, r) in dy.chunks_mut(row).enumerate() {
        let tab = &table[t * rope_dim..(t + 1) * rope_dim];
        for h in r.chunks_mut(head_dim) {
            for i in 0..half {
                let (c, s) = (tab[2 * i], tab[2 * i + 1]);
                let (p, q) = layout.pair(i, rope_dim);
                let (a, b) = (h[p], h[q]);
                h[p] = a * c + b * s;
                h[q] = -a * s + b * c;
            }
        }
    }
}

/// SwiGLU backward: a = silu(g) ⊙ u; du = da ⊙ silu(g); dg = da ⊙ u ⊙ σ(g)(1 + g(1 − σ(g))).
/// GeGLU's backward (tanh GELU), f32: dgate = da·up·gelu'(gate), dup = da·gelu(gate).
pub fn geglu_backward(gate: &[f32], up: &[f32], da: &[f32], dgate: &mut [f32], dup: &mut [f32]) {
    use super::ops::GELU_C;
    assert!(gate.len() == up.len() && up.len() == da.len());
    assert!(da.len() == dgate.len() && da.len() == dup.len());
    for i in 0..gate.len() {
        let g = gate[i];
        let t = (GELU_C * (g + 0.044715 * g * g * g)).tanh();
        let d = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * GELU_C * (1.0 + 3.0 * 0.044715 * g * g);
        dup[i] = da[i] * 0.5 * g * (1.0 + t);
        dgate[i] = da[i] * up[i] * d;
    }
}

pub fn swiglu_backward(gate: &[f32], up: &[f32], da: &[f32], dgate: &mut [f32], dup: &mut [f32]) {
    assert!(gate.len() == up.len() && up.len() == da.len());
    assert!(da.len() == dgate.len() && da.len() == dup.len());
    for i in 0..gate.len() {
        let g = gate[i];
        let s = 1.0 / (1.0 + (-g).exp());
        dup[i] = da[i] * g * s;
        dgate[i] = da[i] * up[i] * s * (1.0 + g * (1.0 - s));
    }
}
