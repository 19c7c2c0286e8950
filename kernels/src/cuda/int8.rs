//! The int8 products on the GPU (`Precision::Int8`, `cuda/int8.cuh`): activations quantized per
//! block of 32 once (`quantize_q8`, into a `Q8Acts`), then any number of products with them
//! (`matmul_int8`, e.g. q, k and v of one input). Each product equals the CPU's int8 product
//! (`reference::matmul_int8`) bit for bit, whatever the batch: `tests/cuda_twin.rs` checks the
//! kernels' arithmetic through its host twin on every machine, `tests/cuda/int8.rs` the kernels
//! themselves on a GPU.

use super::launch::{grid1, len_at_least};
use super::{check, type_name, DeviceMatrix, Gpu, Result};
use crate::quant::QuantType;
use crate::reference::{int8_applies, Q8_BLOCK};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig};

/// Rows of an int8 product's block (`FW_I8_ROWS`), 4 threads each.
pub(super) const I8_ROWS: usize = 32;
/// Tokens a thread of the batch kernel takes (`FW_I8_TOKENS`).
const I8_TOKENS: usize = 8;

/// The formats with int8 kernels (`fw_matmul_i8_<format>`): those `reference::int8_applies`
/// takes.
pub(super) const INT8_FORMATS: [QuantType; 9] = [
    QuantType::Q4_0,
    QuantType::Q4_1,
    QuantType::Q8_0,
    QuantType::Q4K,
    QuantType::Q6K,
    QuantType::Q3K,
    QuantType::Q5K,
    QuantType::IQ4NL,
    QuantType::IQ4XS,
];

/// Blocks a quantized token holds: its blocks rounded up to pairs (`fw_q8_blocks`).
pub(super) fn q8_blocks(cols: usize) -> usize {
    (cols / Q8_BLOCK).div_ceil(2) * 2
}

/// Activations quantized for int8 products: per token, each block's 32 codes, its scale and its
/// codes' sum, for up to `max_tokens` tokens of up to `max_cols` values. It records what it holds
/// (tokens and width) for the products that read it.
pub struct Q8Acts {
    pub(super) codes: CudaSlice<i8>,
    pub(super) scales: CudaSlice<f32>,
    pub(super) sums: CudaSlice<i32>,
    max_tokens: usize,
    max_cols: usize,
    pub(super) n: usize,
    pub(super) cols: usize,
}

impl Q8Acts {
    /// (tokens, width) of what it holds now.
    pub fn holds(&self) -> (usize, usize) {
        (self.n, self.cols)
    }
}

impl Gpu {
    /// Room for `max_tokens` tokens of up to `max_cols` values quantized.
    pub fn q8_acts(&self, max_tokens: usize, max_cols: usize) -> Result<Q8Acts> {
        let blocks = max_tokens.max(1) * q8_blocks(max_cols.max(Q8_BLOCK));
        Ok(Q8Acts {
            codes: self.zeros(blocks * Q8_BLOCK)?,
            scales: self.zeros(blocks)?,
            sums: self.zeros(blocks)?,
            max_tokens,
            max_cols,
            n: 0,
            cols: 0,
        })
    }

    /// x (n, cols) quantized into `q` (`reference::quantize_block_q8` per block, to the bit).
    pub fn quantize_q8(
        &self,
        x: &impl DevicePtr<f32>,
        n: usize,
        cols: usize,
        q: &mut Q8Acts,
    ) -> Result<()> {
        check(cols.is_multiple_of(Q8_BLOCK) && cols > 0, || {
            format!("int8 activations of {cols} values (a multiple of 32)")
        })?;
        check(n <= q.max_tokens && cols <= q.max_cols, || {
            format!(
                "quantizing {n} tokens of {cols} into room for {} of {}",
                q.max_tokens, q.max_cols
            )
        })?;
        len_at_least(x, n * cols, "quantize_q8 x")?;
        (q.n, q.cols) = (n, cols);
        if n == 0 {
            return Ok(());
        }
        let f = self.function("fw_quantize_q8")?;
        let (xp, cp) = (self.ptr(x), self.ptr_mut(&mut q.codes));
        let (dp, sp) = (self.ptr_mut(&mut q.scales), self.ptr_mut(&mut q.sums));
        let (ni, ci) = (n as i32, cols as i32);
        let cfg = grid1(n * q8_blocks(cols), 128);
        self.launch(f, cfg, &[&xp, &ni, &ci, &cp, &dp, &sp])
    }

    /// y (n, rows) = x · Wᵀ in int8 (`reference::matmul_int8`'s bits), x as `q` holds it (n
    /// tokens of w.cols values). `int8_applies(w.ty, w.cols)` must hold.
    pub fn matmul_int8(
        &self,
        w: &DeviceMatrix,
        q: &Q8Acts,
        y: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        self.matmul_int8_range(w, q, 0..q.n, y)
    }

    /// `matmul_int8` of q's tokens `tokens` only: y (tokens.len(), rows).
    pub fn matmul_int8_range(
        &self,
        w: &DeviceMatrix,
        q: &Q8Acts,
        tokens: std::ops::Range<usize>,
        y: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        check_int8(w.ty, w.cols, q)?;
        check(tokens.start <= tokens.end && tokens.end <= q.n, || {
            format!("int8 tokens {tokens:?} of {}", q.n)
        })?;
        let n = tokens.len();
        len_at_least(y, n * w.rows, "matmul_int8 y")?;
        if n == 0 || w.rows == 0 {
            return Ok(());
        }
        let (kernel, nt) = if n == 1 {
            ("fw_matmul_i8", 1)
        } else {
            ("fw_matmul_i8b", I8_TOKENS)
        };
        let (gx, gy) = (w.rows.div_ceil(I8_ROWS), n.div_ceil(nt));
        check(
            w.rows <= i32::MAX as usize && gx <= i32::MAX as usize && gy <= 65535,
            || format!("an int8 product of {} rows and {n} tokens", w.rows),
        )?;
        let f = self.function(&format!("{kernel}_{}", type_name(w.ty)))?;
        let cfg = LaunchConfig {
            grid_dim: (gx as u32, gy as u32, 1),
            block_dim: (4 * I8_ROWS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (wp, yp) = (self.ptr(&w.data), self.ptr_mut(y));
        // The first token's codes (xb·32 bytes a token: 64-byte aligned), scales and sums.
        let first = (tokens.start * q8_blocks(q.cols)) as u64;
        let cp = self.ptr(&q.codes) + first * Q8_BLOCK as u64;
        let (dp, sp) = (
            self.ptr(&q.scales) + 4 * first,
            self.ptr(&q.sums) + 4 * first,
        );
        let (r, c, rb, ni) = (w.rows as i32, w.cols as i32, w.row_bytes as i64, n as i32);
        self.launch(f, cfg, &[&wp, &r, &c, &rb, &cp, &dp, &sp, &ni, &yp])
    }
}

/// Matrices of format `ty` and `cols` columns that `q` can multiply in int8: a format and width
/// with an int8 kernel, q's width.
pub(super) fn check_int8(ty: QuantType, cols: usize, q: &Q8Acts) -> Result<()> {
    check(int8_applies(ty, cols), || {
        format!("no int8 product for {} × {cols}", ty.name())
    })?;
    check(q.cols == cols, || {
        format!(
            "int8 activations of {} values for a matrix of {cols} columns",
            q.cols
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_int8_formats_are_those_the_cpu_runs_in_int8() {
        for ty in QuantType::ALL {
            let cols = ty.block_size().max(Q8_BLOCK) * 4;
            assert_eq!(INT8_FORMATS.contains(&ty), int8_applies(ty, cols), "{ty:?}");
        }
        assert_eq!(q8_blocks(96), 4);
        assert_eq!(q8_blocks(128), 4);
        assert_eq!(q8_blocks(32), 2);
    }
}
