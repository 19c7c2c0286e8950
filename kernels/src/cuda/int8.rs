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

/// Rows of an int8 product's block in the quads layout (`FW_I8_ROWS`), 4 threads each.
pub(super) const I8_ROWS: usize = 32;
/// Rows of a block in the lanes layout (`FW_I8L_ROWS`), 16 threads each.
const I8_LANE_ROWS: usize = 8;

pub const INT8_VAR: &str = "FLYWHEEL_CUDA_INT8";

/// How the int8 products of dense matrices are launched (`FLYWHEEL_CUDA_INT8`): the same bits
/// every way (the CPU's), so the choice is one of speed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Int8Layout {
    /// Lanes up to `I8_TOKENS` tokens (decode), quads beyond (prefill, large batches): on an
    /// H200, the 1B shape's decode at batch 1 ran at 308 tok/s in lanes and 172–202 in quads,
    /// batch 8 at 684 and 562–588, batch 64 at 1374 and 2230–2368, a 512-token prefill at 1659
    /// and 3793–4097 (docs/gpu.md).
    #[default]
    Auto,
    /// A thread a lane of the CPU's 16, 16 threads a row, each row's bytes staged in shared
    /// memory 64 blocks at a time (`fw_matmul_i8l`): more rows in flight where a product has few
    /// tokens, but each lane decodes its block's scale again.
    Lanes,
    /// Four threads a row, four lanes each, the row read from global memory 16 bytes a step
    /// (`fw_matmul_i8`).
    Quads,
}

impl Int8Layout {
    pub const ALL: [Int8Layout; 3] = [Int8Layout::Auto, Int8Layout::Lanes, Int8Layout::Quads];

    pub fn name(self) -> &'static str {
        match self {
            Int8Layout::Auto => "auto",
            Int8Layout::Lanes => "lanes",
            Int8Layout::Quads => "quads",
        }
    }

    /// The layout `FLYWHEEL_CUDA_INT8` names, the default where unset.
    pub fn from_env() -> Result<Int8Layout> {
        super::products::choose_env(INT8_VAR, &Self::ALL, Self::name)
    }

    /// The kernels' prefix for a product of n tokens, the tokens a thread takes and the rows a
    /// block.
    fn kernel(self, n: usize) -> (&'static str, usize, usize) {
        let lanes = match self {
            Int8Layout::Auto => n <= I8_TOKENS,
            Int8Layout::Lanes => true,
            Int8Layout::Quads => false,
        };
        match (lanes, n) {
            (true, 1) => ("fw_matmul_i8l", 1, I8_LANE_ROWS),
            (true, _) => ("fw_matmul_i8lb", I8_TOKENS, I8_LANE_ROWS),
            (false, 1) => ("fw_matmul_i8", 1, I8_ROWS),
            (false, _) => ("fw_matmul_i8b", I8_TOKENS, I8_ROWS),
        }
    }
}

/// The dense int8 kernels' prefixes (`fw_<prefix>_<format>`), every layout's.
pub(super) const INT8_KERNELS: [&str; 5] = [
    "fw_matmul_i8",
    "fw_matmul_i8b",
    "fw_matmul_i8l",
    "fw_matmul_i8lb",
    "fw_matmul_experts_i8",
];
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
        let (kernel, nt, block_rows) = self.int8_layout.kernel(n);
        let (gx, gy) = (w.rows.div_ceil(block_rows), n.div_ceil(nt));
        check(
            w.rows <= i32::MAX as usize && gx <= i32::MAX as usize && gy <= 65535,
            || format!("an int8 product of {} rows and {n} tokens", w.rows),
        )?;
        let f = self.function(&format!("{kernel}_{}", type_name(w.ty)))?;
        let cfg = LaunchConfig {
            grid_dim: (gx as u32, gy as u32, 1),
            block_dim: (128, 1, 1), // 4 threads × 32 rows, or 16 × 8
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
    fn auto_takes_lanes_for_a_few_tokens_and_quads_beyond() {
        let kernel = |l: Int8Layout, n| l.kernel(n).0;
        assert_eq!(kernel(Int8Layout::Auto, 1), "fw_matmul_i8l");
        assert_eq!(kernel(Int8Layout::Auto, I8_TOKENS), "fw_matmul_i8lb");
        assert_eq!(kernel(Int8Layout::Auto, I8_TOKENS + 1), "fw_matmul_i8b");
        assert_eq!(kernel(Int8Layout::Lanes, 512), "fw_matmul_i8lb");
        assert_eq!(kernel(Int8Layout::Quads, 1), "fw_matmul_i8");
        for l in Int8Layout::ALL {
            for n in [1, 2, 8, 9, 64] {
                let (name, nt, rows) = l.kernel(n);
                assert!(INT8_KERNELS.contains(&name));
                assert_eq!(nt == 1, n == 1, "{name}");
                // The launch's 128 threads: 4 a row in quads, 16 in lanes.
                let per_row = if name.starts_with("fw_matmul_i8l") {
                    16
                } else {
                    4
                };
                assert_eq!(rows * per_row, 128, "{name}");
            }
        }
    }

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
