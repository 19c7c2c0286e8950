//! A small register-blocked f32 matrix product for the backward's odd shapes (attention's
//! per-head products, the adapters' outer-product gradients): strided operands, no packing.

// Safety: callers pass pointers valid for the shapes given, on a CPU with the features of `S`.
#![allow(clippy::missing_safety_doc)]

use super::simd::Simd;

/// C (m × n) (+)= A B with A[i, p] at `a + i·lda + p·ada`, B (kdim × n) rows `ldb` apart and C
/// rows `ldc` apart (`acc`: add to C, else overwrite). Register tiles of 4 rows × 2 vectors, the
/// columns past the last whole vector one at a time; every C value is one FMA chain over p in
/// order (so the result does not depend on how callers split m or n).
#[inline(always)]
pub(crate) unsafe fn gemm<S: Simd>(
    m: usize,
    n: usize,
    kdim: usize,
    (a, lda, ada): (*const f32, usize, usize),
    (b, ldb): (*const f32, usize),
    (c, ldc): (*mut f32, usize),
    acc: bool,
) {
    let l = S::LANES;
    let mut j = 0;
    while j + l <= n {
        let nv = if n - j >= 2 * l { 2 } else { 1 };
        let mut i = 0;
        while i < m {
            let mr = (m - i).min(4);
            let args = (
                a.add(i * lda),
                lda,
                ada,
                b.add(j),
                ldb,
                kdim,
                c.add(i * ldc + j),
                ldc,
                acc,
            );
            match (mr, nv) {
                (4, 2) => tile::<S, 4, 2>(args),
                (3, 2) => tile::<S, 3, 2>(args),
                (2, 2) => tile::<S, 2, 2>(args),
                (1, 2) => tile::<S, 1, 2>(args),
                (4, _) => tile::<S, 4, 1>(args),
                (3, _) => tile::<S, 3, 1>(args),
                (2, _) => tile::<S, 2, 1>(args),
                _ => tile::<S, 1, 1>(args),
            }
            i += mr;
        }
        j += nv * l;
    }
    for j in j..n {
        for i in 0..m {
            let cij = c.add(i * ldc + j);
            let mut s = if acc { *cij } else { 0.0 };
            for p in 0..kdim {
                s = (*a.add(i * lda + p * ada)).mul_add(*b.add(p * ldb + j), s);
            }
            *cij = s;
        }
    }
}

type TileArgs = (
    *const f32,
    usize,
    usize,
    *const f32,
    usize,
    usize,
    *mut f32,
    usize,
    bool,
);

#[inline(always)]
unsafe fn tile<S: Simd, const MR: usize, const NV: usize>(
    (a, lda, ada, b, ldb, kdim, c, ldc, acc): TileArgs,
) {
    let l = S::LANES;
    let mut r = [[S::zero(); NV]; MR];
    if acc {
        for (i, ri) in r.iter_mut().enumerate() {
            for (v, x) in ri.iter_mut().enumerate() {
                *x = S::load(c.add(i * ldc + v * l));
            }
        }
    }
    for p in 0..kdim {
        let bp = b.add(p * ldb);
        let mut bv = [S::zero(); NV];
        for (v, x) in bv.iter_mut().enumerate() {
            *x = S::load(bp.add(v * l));
        }
        for (i, ri) in r.iter_mut().enumerate() {
            let av = S::splat(*a.add(i * lda + p * ada));
            for (x, bx) in ri.iter_mut().zip(&bv) {
                *x = S::fma(av, *bx, *x);
            }
        }
    }
    for (i, ri) in r.iter().enumerate() {
        for (v, x) in ri.iter().enumerate() {
            S::store(c.add(i * ldc + v * l), *x);
        }
    }
}
