//! Adapter kernels: block-diagonal products of activation rows, x · diag(M_0, M_1, ...): OFT's
//! rotation (blocks R_k of b×b) and LoRA's second product (one block, Bᵀ). LoRA's first product,
//! A x, runs through `matmul` with f32 weights.
//!
//! Batch invariance: every output value is one FMA chain over its block's inputs in index order,
//! starting from 0, whichever tile or ISA computes it (a vector lane and the scalar tail perform the
//! same fused operations), so a row's rotation is the same to the bit in any batch.

// Safety of every `unsafe fn` here: the CPU has the features of `S`; slices were checked by
// `oft_rotate`.
#![allow(clippy::missing_safety_doc)]

use super::isa::Isa;
use super::pool::Tasks;
use super::simd::{Avx2, Avx512, Simd};
use super::small_gemm::gemm;
use crate::reference;

/// Rows computed together: each matrix vector loaded feeds this many FMAs.
const ROWS: usize = 4;
/// Output columns of one task when a single block is split (LoRA's B).
const COL_TILE: usize = 128;
/// Split across the pool only above this many multiply-adds (a guess, not tuned: small products
/// are not worth waking the workers for).
const PARALLEL_MIN_FMAS: usize = 1 << 16;

/// `out[t][k*b + j] = Σ_i x[t][k*b + i] · R_k[i][j]` for every row t of x (n, cols), with
/// `r` = (cols / b) blocks of b×b, row-major: R_k[i][j] at `r[(k*b + i)*b + j]`.
pub fn oft_rotate(isa: Isa, pool: Tasks, x: &[f32], r: &[f32], b: usize, out: &mut [f32]) {
    assert!(b > 0, "block size");
    let cols = r.len() / b;
    assert!(
        cols > 0 && r.len() == cols * b && cols.is_multiple_of(b),
        "rotation blocks"
    );
    block_matmul(isa, pool, x, r, cols / b, b, b, out)
}

/// Block-diagonal product of rows: x (n, nb·k) times diag(M_0 … M_{nb−1}), each M_q (k, m)
/// row-major at `mats[q*k*m..]`, into out (n, nb·m):
/// `out[t][q*m + j] = Σ_i x[t][q*k + i] · M_q[i][j]`, one FMA chain in i order per output.
/// OFT's rotation is nb = in/b blocks of b×b; LoRA's second product is one block, Bᵀ (r, out).
#[allow(clippy::too_many_arguments)]
pub fn block_matmul(
    isa: Isa,
    pool: Tasks,
    x: &[f32],
    mats: &[f32],
    nb: usize,
    k: usize,
    m: usize,
    out: &mut [f32],
) {
    assert!(nb > 0 && k > 0 && m > 0, "shape");
    assert_eq!(mats.len(), nb * k * m, "matrices");
    assert!(
        x.len().is_multiple_of(nb * k),
        "x is not a whole number of rows"
    );
    let n = x.len() / (nb * k);
    assert_eq!(out.len(), n * nb * m, "out");
    if n == 0 {
        return;
    }
    if isa == Isa::Reference {
        reference::block_matmul(x, mats, nb, k, m, out);
        return;
    }
    // Tasks: row chunks × (blocks, or column tiles of a single block).
    let col_tiles = if nb == 1 { m.div_ceil(COL_TILE) } else { 1 };
    let units = nb * col_tiles;
    let fmas = n * nb * k * m;
    let threads = pool.num_threads();
    let (row_tasks, unit_tasks) = if fmas < PARALLEL_MIN_FMAS || threads == 1 {
        (1, 1)
    } else {
        let want = 4 * threads;
        let u = units.min(want);
        (want.div_ceil(u).min(n.div_ceil(ROWS)), u)
    };
    let rows_per = n.div_ceil(row_tasks).next_multiple_of(ROWS).min(n);
    let row_tasks = n.div_ceil(rows_per);
    let units_per = units.div_ceil(unit_tasks);
    let unit_tasks = units.div_ceil(units_per);
    let job = Job {
        x: x.as_ptr(),
        mats: mats.as_ptr(),
        out: out.as_mut_ptr(),
        nb,
        k,
        m,
    };
    let task = |t: usize| {
        let (rt, ut) = (t / unit_tasks, t % unit_tasks);
        let (r0, r1) = (rt * rows_per, ((rt + 1) * rows_per).min(n));
        let (u0, u1) = (ut * units_per, ((ut + 1) * units_per).min(units));
        // Units: blocks (nb > 1) or column tiles of the one block.
        let (q0, q1, j0, j1) = if nb > 1 {
            (u0, u1, 0, m)
        } else {
            (0, 1, u0 * COL_TILE, (u1 * COL_TILE).min(m))
        };
        // SAFETY: ISA detected at start-up; tasks write disjoint (row, column) ranges of `out`.
        unsafe {
            match isa {
                Isa::Avx512 => bm_avx512(&job, r0, r1, q0, q1, j0, j1),
                Isa::Avx2 => bm_avx2(&job, r0, r1, q0, q1, j0, j1),
                Isa::Reference => unreachable!(),
            }
        }
    };
    pool.run(row_tasks * unit_tasks, &task);
}

struct Job {
    x: *const f32,
    mats: *const f32,
    out: *mut f32,
    nb: usize,
    k: usize,
    m: usize,
}
// SAFETY: the pointers are only used for the disjoint ranges each task is given.
unsafe impl Sync for Job {}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn bm_avx512(j: &Job, r0: usize, r1: usize, q0: usize, q1: usize, j0: usize, j1: usize) {
    bm::<Avx512>(j, r0, r1, q0, q1, j0, j1)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bm_avx2(j: &Job, r0: usize, r1: usize, q0: usize, q1: usize, j0: usize, j1: usize) {
    bm::<Avx2>(j, r0, r1, q0, q1, j0, j1)
}

#[inline(always)]
unsafe fn bm<S: Simd>(j: &Job, r0: usize, r1: usize, q0: usize, q1: usize, j0: usize, j1: usize) {
    let mut t = r0;
    while t < r1 {
        match (r1 - t).min(ROWS) {
            1 => bm_rows::<S, 1>(j, t, q0, q1, j0, j1),
            2 => bm_rows::<S, 2>(j, t, q0, q1, j0, j1),
            3 => bm_rows::<S, 3>(j, t, q0, q1, j0, j1),
            _ => bm_rows::<S, ROWS>(j, t, q0, q1, j0, j1),
        }
        t += ROWS;
    }
}

/// Rows t0..t0+N, blocks q0..q1, columns j0..j1 of each: two vectors of columns at a time (2·N
/// independent FMA chains), then one vector, then a scalar tail with the same fused operations.
#[inline(always)]
unsafe fn bm_rows<S: Simd, const N: usize>(
    jb: &Job,
    t0: usize,
    q0: usize,
    q1: usize,
    j0: usize,
    j1: usize,
) {
    let (k, m, l) = (jb.k, jb.m, S::LANES);
    let (xw, ow) = (jb.nb * k, jb.nb * m);
    for q in q0..q1 {
        let mq = jb.mats.add(q * k * m);
        let xs: [*const f32; N] = std::array::from_fn(|i| jb.x.add((t0 + i) * xw + q * k));
        let os: [*mut f32; N] = std::array::from_fn(|i| jb.out.add((t0 + i) * ow + q * m));
        let mut j = j0;
        while j + 2 * l <= j1 {
            let mut acc = [[S::zero(); 2]; N];
            for i in 0..k {
                let (ra, rb) = (S::load(mq.add(i * m + j)), S::load(mq.add(i * m + j + l)));
                for (a, xr) in acc.iter_mut().zip(&xs) {
                    let xv = S::splat(*xr.add(i));
                    a[0] = S::fma(xv, ra, a[0]);
                    a[1] = S::fma(xv, rb, a[1]);
                }
            }
            for (a, or) in acc.iter().zip(&os) {
                S::store(or.add(j), a[0]);
                S::store(or.add(j + l), a[1]);
            }
            j += 2 * l;
        }
        while j + l <= j1 {
            let mut acc = [S::zero(); N];
            for i in 0..k {
                let ra = S::load(mq.add(i * m + j));
                for (a, xr) in acc.iter_mut().zip(&xs) {
                    *a = S::fma(S::splat(*xr.add(i)), ra, *a);
                }
            }
            for (a, or) in acc.iter().zip(&os) {
                S::store(or.add(j), *a);
            }
            j += l;
        }
        while j < j1 {
            for (xr, or) in xs.iter().zip(&os) {
                let mut acc = 0.0f32;
                for i in 0..k {
                    acc = (*xr.add(i)).mul_add(*mq.add(i * m + j), acc);
                }
                *or.add(j) = acc;
            }
            j += 1;
        }
    }
}

/// Accumulate outer products block by block: `g[q][i][j] += Σ_t x[t][q*k + i] · dy[t][q*m + j]`
/// for x (n, nb·k) and dy (n, nb·m) — the gradient of a block-diagonal product with respect to its
/// blocks (OFT: G_k = Σ_t x_kᵀ·dx̃_k; LoRA: dBᵀ = Σ_t hᵀ·dy). Tasks own disjoint blocks (or column
/// tiles of one block); each value is one FMA chain over t in order.
#[allow(clippy::too_many_arguments)]
pub fn block_outer(
    isa: Isa,
    pool: Tasks,
    x: &[f32],
    dy: &[f32],
    nb: usize,
    k: usize,
    m: usize,
    g: &mut [f32],
) {
    assert!(nb > 0 && k > 0 && m > 0, "shape");
    assert_eq!(g.len(), nb * k * m, "g");
    assert!(x.len().is_multiple_of(nb * k));
    let n = x.len() / (nb * k);
    assert_eq!(dy.len(), n * nb * m, "dy");
    if isa == Isa::Reference {
        reference::block_outer(x, dy, nb, k, m, g);
        return;
    }
    let col_tiles = if nb == 1 { m.div_ceil(COL_TILE) } else { 1 };
    let units = nb * col_tiles;
    let tasks = if n * nb * k * m < PARALLEL_MIN_FMAS || pool.num_threads() == 1 {
        1
    } else {
        units.min(4 * pool.num_threads())
    };
    let per = units.div_ceil(tasks);
    let tasks = units.div_ceil(per);
    // The block product's job, read as: x, `mats` = dy (n, nb·m), `out` = g.
    let job = Job {
        x: x.as_ptr(),
        mats: dy.as_ptr(),
        out: g.as_mut_ptr(),
        nb,
        k,
        m,
    };
    let task = |t: usize| {
        let (u0, u1) = (t * per, ((t + 1) * per).min(units));
        let span = if nb > 1 {
            (u0, u1, 0, m)
        } else {
            (0, 1, u0 * COL_TILE, (u1 * COL_TILE).min(m))
        };
        // SAFETY: ISA detected at start-up; tasks write disjoint (block, column) ranges of g.
        unsafe {
            match isa {
                Isa::Avx512 => outer_avx512(&job, n, span),
                Isa::Avx2 => outer_avx2(&job, n, span),
                Isa::Reference => unreachable!(),
            }
        }
    };
    pool.run(tasks, &task);
}

/// (first block, end block, first column, end column) of one task.
type Span = (usize, usize, usize, usize);

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn outer_avx512(j: &Job, n: usize, span: Span) {
    outer::<Avx512>(j, n, span)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn outer_avx2(j: &Job, n: usize, span: Span) {
    outer::<Avx2>(j, n, span)
}

/// Row i of block q, columns j0..j1: one vector accumulator per LANES columns, over t in order.
#[inline(always)]
unsafe fn outer<S: Simd>(jb: &Job, n: usize, (q0, q1, j0, j1): Span) {
    let (x, dy, g, nb, k, m) = (jb.x, jb.mats, jb.out, jb.nb, jb.k, jb.m);
    for q in q0..q1 {
        // g[q] (k × m) += Σ_t x[t, q·k + i] · dy[t, q·m + j], columns j0..j1.
        gemm::<S>(
            k,
            j1 - j0,
            n,
            (x.add(q * k), 1, nb * k),
            (dy.add(q * m + j0), nb * m),
            (g.add(q * k * m + j0), m),
            true,
        );
    }
}
