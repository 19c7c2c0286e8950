//! Adapter kernels: OFT's block-diagonal rotation of activation rows, x_rot = x · diag(R_0, R_1, ...).
//! (LoRA's two small products run through `matmul` with f32 weights: no kernel of its own.)
//!
//! Batch invariance: every output value is one FMA chain over its block's inputs in index order,
//! starting from 0, whichever tile or ISA computes it (a vector lane and the scalar tail perform the
//! same fused operations), so a row's rotation is the same to the bit in any batch.

// Safety of every `unsafe fn` here: the CPU has the features of `S`; slices were checked by
// `oft_rotate`.
#![allow(clippy::missing_safety_doc)]

use super::simd::{Avx2, Avx512, Simd};
use super::{Isa, ThreadPool};
use crate::reference;

/// Rows rotated together: each R vector loaded feeds this many FMAs.
const ROWS: usize = 4;
/// Split across the pool only above this many multiply-adds (below, the pool's wake-up costs more).
const PARALLEL_MIN_FMAS: usize = 1 << 18;

/// `out[t][k*b + j] = Σ_i x[t][k*b + i] · R_k[i][j]` for every row t of x (n, cols), with
/// `r` = (cols / b) blocks of b×b, row-major: R_k[i][j] at `r[(k*b + i)*b + j]`.
pub fn oft_rotate(isa: Isa, pool: &ThreadPool, x: &[f32], r: &[f32], b: usize, out: &mut [f32]) {
    assert!(b > 0 && !x.is_empty(), "block size and rows");
    assert_eq!(x.len(), out.len(), "x and out sizes");
    let cols = r.len() / b;
    assert!(
        cols > 0 && r.len() == cols * b && cols.is_multiple_of(b),
        "rotation blocks"
    );
    assert!(
        x.len().is_multiple_of(cols),
        "x is not a whole number of rows"
    );
    let n = x.len() / cols;
    if isa == Isa::Reference {
        reference::oft_rotate(x, r, b, out);
        return;
    }
    let fmas = n * cols * b;
    let tasks = if fmas >= PARALLEL_MIN_FMAS && pool.num_threads() > 1 {
        n.div_ceil(ROWS).min(4 * pool.num_threads())
    } else {
        1
    };
    let rows_per_task = n.div_ceil(tasks).next_multiple_of(ROWS).min(n);
    let (xp, rp, op) = (
        x.as_ptr() as usize,
        r.as_ptr() as usize,
        out.as_mut_ptr() as usize,
    );
    let task = |t: usize| {
        let r0 = t * rows_per_task;
        let r1 = (r0 + rows_per_task).min(n);
        if r0 >= r1 {
            return;
        }
        let (x, r, o) = (xp as *const f32, rp as *const f32, op as *mut f32);
        // SAFETY: ISA detected at start-up; tasks write disjoint row ranges of `out`.
        unsafe {
            match isa {
                Isa::Avx512 => rotate_avx512(x, r, o, cols, b, r0, r1),
                Isa::Avx2 => rotate_avx2(x, r, o, cols, b, r0, r1),
                Isa::Reference => unreachable!(),
            }
        }
    };
    pool.run(n.div_ceil(rows_per_task), &task);
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn rotate_avx512(
    x: *const f32,
    r: *const f32,
    o: *mut f32,
    cols: usize,
    b: usize,
    r0: usize,
    r1: usize,
) {
    rotate::<Avx512>(x, r, o, cols, b, r0, r1)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rotate_avx2(
    x: *const f32,
    r: *const f32,
    o: *mut f32,
    cols: usize,
    b: usize,
    r0: usize,
    r1: usize,
) {
    rotate::<Avx2>(x, r, o, cols, b, r0, r1)
}

#[inline(always)]
unsafe fn rotate<S: Simd>(
    x: *const f32,
    r: *const f32,
    o: *mut f32,
    cols: usize,
    b: usize,
    r0: usize,
    r1: usize,
) {
    let mut t = r0;
    while t < r1 {
        match (r1 - t).min(ROWS) {
            1 => rotate_rows::<S, 1>(x, r, o, cols, b, t),
            2 => rotate_rows::<S, 2>(x, r, o, cols, b, t),
            3 => rotate_rows::<S, 3>(x, r, o, cols, b, t),
            _ => rotate_rows::<S, ROWS>(x, r, o, cols, b, t),
        }
        t += ROWS;
    }
}

/// Rows t0..t0+N, every block; output columns two vectors at a time (2·N independent FMA chains),
/// then one vector, then a scalar tail with the same fused operations.
#[inline(always)]
unsafe fn rotate_rows<S: Simd, const N: usize>(
    x: *const f32,
    r: *const f32,
    o: *mut f32,
    cols: usize,
    b: usize,
    t0: usize,
) {
    let l = S::LANES;
    for k in 0..cols / b {
        let rk = r.add(k * b * b);
        let xs: [*const f32; N] = std::array::from_fn(|i| x.add((t0 + i) * cols + k * b));
        let os: [*mut f32; N] = std::array::from_fn(|i| o.add((t0 + i) * cols + k * b));
        let mut j = 0;
        while j + 2 * l <= b {
            let mut acc = [[S::zero(); 2]; N];
            for i in 0..b {
                let (ra, rb) = (S::load(rk.add(i * b + j)), S::load(rk.add(i * b + j + l)));
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
        while j + l <= b {
            let mut acc = [S::zero(); N];
            for i in 0..b {
                let ra = S::load(rk.add(i * b + j));
                for (a, xr) in acc.iter_mut().zip(&xs) {
                    *a = S::fma(S::splat(*xr.add(i)), ra, *a);
                }
            }
            for (a, or) in acc.iter().zip(&os) {
                S::store(or.add(j), *a);
            }
            j += l;
        }
        while j < b {
            for (xr, or) in xs.iter().zip(&os) {
                let mut acc = 0.0f32;
                for i in 0..b {
                    acc = (*xr.add(i)).mul_add(*rk.add(i * b + j), acc);
                }
                *or.add(j) = acc;
            }
            j += 1;
        }
    }
}
