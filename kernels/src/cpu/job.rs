//! What the product kernels share, below the `matmul` front that dispatches to them: a product
//! as the kernels see it (`JobRef`), how many activation rows one pass sweeps, thread-local
//! scratch, storing a tile's sums. Kept out of `matmul` so that the kernels it calls (`bf16`,
//! `int8`, `int8_avx2`) do not depend back on it.

#![allow(clippy::missing_safety_doc)]

use super::simd::Simd;
use crate::quant::QuantType;
use std::cell::RefCell;

/// Activation rows swept per weight panel before moving on (they stay in L2).
pub(crate) const X_BLOCK: usize = 64;

/// One product as the kernels see it: pointers and sizes (`Matmul::check` checked them), the
/// activations in the precision's form, and how the rows are split into tasks.
pub(crate) struct JobRef {
    pub ty: QuantType,
    pub w: *const u8,
    pub row_bytes: usize,
    pub rows: usize,
    pub cols: usize,
    pub x: *const f32,
    /// The activations rounded to BF16 (`Precision::Bf16`), or null: the exact f32 path.
    pub xb: *const u16,
    /// The activations quantized to int8 (`Precision::Int8`, `int8::quantize_rows`: codes,
    /// per-lane scales and corrections, per-block sums), or null.
    pub xq: *const i8,
    pub xd: *const f32,
    pub xc: *const i32,
    pub xs: *const f32,
    pub n: usize,
    pub y: *mut f32,
    /// Batches of DOT_MIN_ROWS rows or more: dequantized panel, dot-form tiles.
    pub dot_panel: bool,
    pub rows_per_task: usize,
}
unsafe impl Sync for JobRef {}

/// A thread-local scratch buffer of at least `len` floats. The pointer stays valid until the next
/// call on this thread for the same buffer (kernels never nest).
pub(crate) fn scratch(
    key: &'static std::thread::LocalKey<RefCell<Vec<f32>>>,
    len: usize,
) -> *mut f32 {
    key.with(|b| {
        let mut b = b.borrow_mut();
        if b.len() < len {
            b.resize(len, 0.0);
        }
        b.as_mut_ptr()
    })
}

/// A tile's sums into y: weight rows r0+w0.. (wr of them) x activation rows i0..ie (at most XR);
/// the padding rows' sums are dropped. Shared by the f32 and BF16 tiles.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) unsafe fn store_tile<S: Simd, const WR: usize, const XR: usize>(
    j: &JobRef,
    acc: &[[S::V; XR]; WR],
    r0: usize,
    w0: usize,
    wr: usize,
    i0: usize,
    ie: usize,
) {
    let xr = (ie - i0).min(XR);
    for (a, acca) in acc.iter().enumerate().take(wr) {
        for (i, v) in acca.iter().enumerate().take(xr) {
            *j.y.add((i0 + i) * j.rows + r0 + w0 + a) = S::reduce_add(*v);
        }
    }
}
