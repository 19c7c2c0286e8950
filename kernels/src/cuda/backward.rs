//! The trainer's backward on the GPU (`cuda/backward.cuh`), its first kernel: the input gradient
//! of a frozen product, in a fixed order of sums (a token's gradient the same bits alone or in
//! any batch). The rest of the backward (attention, norms, RoPE, the adapters' own gradients)
//! still runs on the CPU.

use super::launch::len_at_least;
use super::{check, type_code, DeviceMatrix, Gpu, Result};
use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig};

/// `FW_LB_THREADS`, `FW_LB_TOKENS`.
const THREADS: u32 = 256;
const TOKENS: usize = 8;

impl Gpu {
    /// dx (n, cols) = dy (n, rows) · W: the input gradient of the frozen product y = W·x
    /// (`Cpu::linear_backward`'s contract), each value a sum over W's rows in order.
    pub fn linear_backward(
        &self,
        w: &DeviceMatrix,
        dy: &impl DevicePtr<f32>,
        n: usize,
        dx: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let (rows, cols) = (w.rows, w.cols);
        check(cols.is_multiple_of(32), || {
            format!("linear_backward: {cols} columns")
        })?;
        check(rows <= i32::MAX as usize && n <= i32::MAX as usize, || {
            format!("linear_backward: {rows} rows, {n} tokens")
        })?;
        len_at_least(&w.data, rows * w.row_bytes, "linear_backward w")?;
        len_at_least(dy, n * rows, "linear_backward dy")?;
        len_at_least(dx, n * cols, "linear_backward dx")?;
        if n == 0 || cols == 0 {
            return Ok(());
        }
        let f = self.function("fw_linear_backward")?;
        let cfg = LaunchConfig {
            grid_dim: ((cols / 32) as u32, n.div_ceil(TOKENS) as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (wp, dyp, dxp) = (self.ptr(&w.data), self.ptr(dy), self.ptr_mut(dx));
        let (ty, r, rb) = (type_code(w.ty), rows as i32, w.row_bytes as i64);
        let (n, c) = (n as i32, cols as i32);
        self.launch(f, cfg, &[&wp, &ty, &r, &rb, &dyp, &n, &c, &dxp])
    }
}
