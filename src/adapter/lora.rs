//! LoRA as PEFT defines it: y = W x + s·B(A x), A (r, in), B (out, r), s = α/r (α/√r with rsLoRA).
//! The quantized W is used as stored (never merged). h = A x runs through the batch-invariant f32
//! `matmul` (dot form over `in`); B h through the row-times-matrix kernel with Bᵀ (built once per
//! version), r FMAs per output and no horizontal sums. Both keep a row's result independent of its
//! batch.

use flywheel_kernels::{Cpu, Matmul, QuantType};

/// Reinterpret f32 values as the little-endian bytes `matmul` reads for an F32 weight.
pub fn f32_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding or invalid bit patterns; u8 has alignment 1; the length is exact.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

/// The LoRA delta of `n` rows: `d (n, out) = s · (x (n, in) · Aᵀ) · Bᵀ`, with `bt` = Bᵀ (r, out)
/// and `h` (n, r) scratch.
#[allow(clippy::too_many_arguments)]
pub fn delta(
    cpu: &Cpu,
    a: &[f32],
    bt: &[f32],
    r: usize,
    scale: f32,
    x: &[f32],
    h: &mut Vec<f32>,
    d: &mut Vec<f32>,
) {
    let in_dim = a.len() / r;
    let out_dim = bt.len() / r;
    let n = x.len() / in_dim;
    h.resize(n * r, 0.0);
    d.resize(n * out_dim, 0.0);
    cpu.matmul_many(&mut [Matmul {
        ty: QuantType::F32,
        w: f32_bytes(a),
        rows: r,
        cols: in_dim,
        x,
        y: h,
    }]);
    cpu.block_matmul(h, bt, 1, r, out_dim, d);
    for v in d.iter_mut() {
        *v *= scale;
    }
}
