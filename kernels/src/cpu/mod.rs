//! CPU compute: ISA detection (once, at start-up), the thread pool, and the `Cpu` seam that the
//! model calls for every op. A later CUDA backend sits beside `Cpu` behind the same method set.

pub mod adapter;
pub mod attention;
pub mod attention_backward;
pub mod backward;
mod bf16;
pub mod dequant;
pub mod dequant_k;
pub mod features;
mod formats;
pub mod gate;
mod int8;
mod int8_avx2;
mod int8_kquant;
mod int8_kquant_vnni;
mod isa;
mod job;
pub mod matmul;
pub mod ops;
pub mod pool;
pub mod simd;
mod small_gemm;

pub use crate::reference::RopeLayout;
pub use features::Features;
pub use isa::{Isa, Precision};
pub use matmul::Matmul;
pub use pool::{Tasks, ThreadPool};

use crate::quant::QuantType;
use crate::reference::{AttnSeq, PagedKv};

/// The compute seam: an ISA plus the thread pool. Everything the model computes goes through here.
/// A `Cpu` is foreground (serving) or background (training, from `Cpu::background`): its
/// kernels then yield to foreground steps (`gate`). Both share one pool.
pub struct Cpu {
    pub isa: Isa,
    pub pool: std::sync::Arc<ThreadPool>,
    precision: Precision,
    background: bool,
}

/// A precision whose products this CPU's kernels lack (`Cpu::with_precision`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrecisionUnsupported {
    pub precision: Precision,
    pub isa: Isa,
}

impl std::fmt::Display for PrecisionUnsupported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} products need {} (this CPU's kernels: {})",
            self.precision.name(),
            self.precision.needs(),
            self.isa.name()
        )
    }
}

impl std::error::Error for PrecisionUnsupported {}

impl Cpu {
    pub fn new(isa: Isa, pool: ThreadPool) -> Cpu {
        Cpu {
            isa,
            pool: std::sync::Arc::new(pool),
            precision: Precision::Exact,
            background: false,
        }
    }

    /// The same kernels with the base's products in `precision`; an error naming what the CPU
    /// lacks where it cannot.
    pub fn with_precision(mut self, precision: Precision) -> Result<Cpu, PrecisionUnsupported> {
        if !precision.supported(self.isa) {
            return Err(PrecisionUnsupported {
                precision,
                isa: self.isa,
            });
        }
        self.precision = precision;
        Ok(self)
    }

    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// The line the start-up log and `flywheel bench` print: the kernels and instruction sets in
    /// use, and those present but unused (`Features::report`).
    pub fn paths(&self) -> String {
        Features::get().report(&isa::paths_in_use(self.isa, self.precision))
    }

    /// The same ISA and pool, for background work (training beside serving).
    pub fn background(&self) -> Cpu {
        Cpu {
            isa: self.isa,
            pool: self.pool.clone(),
            precision: self.precision,
            background: true,
        }
    }

    pub fn is_background(&self) -> bool {
        self.background
    }

    /// The pool as this `Cpu` uses it.
    fn tasks(&self) -> Tasks<'_> {
        Tasks {
            pool: &self.pool,
            background: self.background,
        }
    }

    /// The best ISA, one thread per core.
    pub fn detect() -> Cpu {
        Cpu::new(Isa::detect(), ThreadPool::with_available_cores())
    }

    /// Several independent products in one parallel region.
    pub fn matmul_many(&self, jobs: &mut [Matmul]) {
        matmul::matmul_many(self.isa, self.precision, self.tasks(), jobs)
    }

    /// Products in exact f32 whatever the precision (an adapter's own matrices: adapter math
    /// stays f32).
    pub fn matmul_many_exact(&self, jobs: &mut [Matmul]) {
        matmul::matmul_many(self.isa, Precision::Exact, self.tasks(), jobs)
    }

    /// The LM head's product in `Precision::head`'s arithmetic.
    pub fn matmul_head(&self, job: Matmul) {
        matmul::matmul_many(self.isa, self.precision.head(), self.tasks(), &mut [job])
    }

    pub fn matmul(
        &self,
        ty: QuantType,
        w: &[u8],
        rows: usize,
        cols: usize,
        x: &[f32],
        y: &mut [f32],
    ) {
        self.matmul_many(&mut [Matmul {
            ty,
            w,
            rows,
            cols,
            x,
            y,
        }])
    }

    /// OFT: each row of x (n, cols) times the block-diagonal rotation `r` (cols/b blocks of b×b).
    pub fn oft_rotate(&self, x: &[f32], r: &[f32], b: usize, out: &mut [f32]) {
        adapter::oft_rotate(self.isa, self.tasks(), x, r, b, out)
    }

    /// Rows of x (n, nb·k) times the block-diagonal diag(M_0 … M_{nb−1}) of (k, m) blocks.
    #[allow(clippy::too_many_arguments)]
    pub fn block_matmul(
        &self,
        x: &[f32],
        mats: &[f32],
        nb: usize,
        k: usize,
        m: usize,
        out: &mut [f32],
    ) {
        adapter::block_matmul(self.isa, self.tasks(), x, mats, nb, k, m, out)
    }

    /// dx (n, cols) = dy (n, rows) · W: the input gradient of a frozen quantized linear.
    #[allow(clippy::too_many_arguments)]
    pub fn linear_backward(
        &self,
        ty: QuantType,
        w: &[u8],
        rows: usize,
        cols: usize,
        dy: &[f32],
        dx: &mut [f32],
    ) {
        backward::linear_backward(
            self.isa,
            self.precision.backward(self.isa),
            self.tasks(),
            ty,
            w,
            rows,
            cols,
            dy,
            dx,
        )
    }

    pub fn rmsnorm_backward(
        &self,
        x: &[f32],
        weight: &[f32],
        eps: f32,
        dy: &[f32],
        dx: &mut [f32],
    ) {
        match self.isa {
            Isa::Reference => crate::reference::rmsnorm_backward(x, weight, eps, dy, dx),
            _ => backward::rmsnorm_backward(x, weight, eps, dy, dx),
        }
    }

    pub fn rope_backward(
        &self,
        dy: &mut [f32],
        table: &[f32],
        n_heads: usize,
        head_dim: usize,
        rope_dim: usize,
        layout: RopeLayout,
    ) {
        match self.isa {
            Isa::Reference => {
                crate::reference::rope_backward(dy, table, n_heads, head_dim, rope_dim, layout)
            }
            _ => backward::rope_backward(dy, table, n_heads, head_dim, rope_dim, layout),
        }
    }

    pub fn swiglu_backward(
        &self,
        gate: &[f32],
        up: &[f32],
        da: &[f32],
        dgate: &mut [f32],
        dup: &mut [f32],
    ) {
        match self.isa {
            Isa::Reference => crate::reference::swiglu_backward(gate, up, da, dgate, dup),
            _ => backward::swiglu_backward(gate, up, da, dgate, dup),
        }
    }

    /// g (nb, k, m) += Σ_t x_q[t]ᵀ·dy_q[t]: gradients of block-diagonal products' blocks.
    #[allow(clippy::too_many_arguments)]
    pub fn block_outer(&self, x: &[f32], dy: &[f32], nb: usize, k: usize, m: usize, g: &mut [f32]) {
        adapter::block_outer(self.isa, self.tasks(), x, dy, nb, k, m, g)
    }

    /// Causal GQA attention backward, queries the last rows of K/V (see
    /// `attention_backward::attention_backward`).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_backward(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        dout: &[f32],
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        scale: f32,
        dq: &mut [f32],
        dk: &mut [f32],
        dv: &mut [f32],
    ) {
        self.attention_backward_windowed(
            q, k, v, dout, n_heads, n_kv_heads, head_dim, scale, None, dq, dk, dv,
        )
    }

    /// `attention_backward` through a sliding window and with soft-capping as `opts` says
    /// (`reference::AttnOpts`; an `Option<usize>` is a window alone).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_backward_windowed(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        dout: &[f32],
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        scale: f32,
        opts: impl Into<crate::reference::AttnOpts>,
        dq: &mut [f32],
        dk: &mut [f32],
        dv: &mut [f32],
    ) {
        let heads = (n_heads, n_kv_heads, head_dim);
        let opts = opts.into();
        match self.isa {
            Isa::Reference => crate::reference::attention_backward_windowed(
                q, k, v, dout, heads, scale, opts, dq, dk, dv,
            ),
            _ => attention_backward::attention_backward(
                self.isa,
                self.tasks(),
                (q, k, v, dout),
                heads,
                scale,
                opts,
                (dq, dk, dv),
            ),
        }
    }

    pub fn dequantize_row(&self, ty: QuantType, src: &[u8], dst: &mut [f32]) {
        formats::dequantize_row(self.isa, ty, src, dst)
    }

    pub fn rmsnorm(&self, x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
        ops::rmsnorm(self.isa, x, weight, eps, out)
    }

    /// `x` rounded to IEEE halves in place, their bits in `out` (`ops::round_to_f16`).
    pub fn round_to_f16(&self, x: &mut [f32], out: &mut [crate::reference::F16]) {
        ops::round_to_f16(self.isa, x, out)
    }

    pub fn rope(
        &self,
        x: &mut [f32],
        table: &[f32],
        n_heads: usize,
        head_dim: usize,
        rope_dim: usize,
        layout: RopeLayout,
    ) {
        ops::rope(x, table, n_heads, head_dim, rope_dim, layout)
    }

    /// out = gelu_tanh(gate) · up (Gemma's MLP), f32.
    pub fn geglu(&self, gate: &[f32], up: &[f32], out: &mut [f32]) {
        ops::geglu(self.isa, gate, up, out)
    }

    pub fn geglu_backward(
        &self,
        gate: &[f32],
        up: &[f32],
        da: &[f32],
        dgate: &mut [f32],
        dup: &mut [f32],
    ) {
        match self.isa {
            Isa::Reference => crate::reference::geglu_backward(gate, up, da, dgate, dup),
            _ => backward::geglu_backward(gate, up, da, dgate, dup),
        }
    }

    pub fn swiglu(&self, gate: &[f32], up: &[f32], out: &mut [f32]) {
        ops::swiglu(self.isa, gate, up, out)
    }

    pub fn log_softmax(&self, x: &mut [f32]) {
        ops::log_softmax(self.isa, x)
    }

    /// `dz = −scale·exp(lp)` for a row of log-probs; returns its entropy (`ops::softmax_backward_row`).
    pub fn softmax_backward_row(&self, lp: &[f32], scale: f32, dz: &mut [f32]) -> f64 {
        ops::softmax_backward_row(self.isa, lp, scale, dz)
    }

    #[allow(clippy::too_many_arguments)]
    pub fn attention<E: attention::KvLoad>(
        &self,
        q: &[f32],
        out: &mut [f32],
        seqs: &[AttnSeq],
        kv: PagedKv<E>,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        scale: f32,
    ) {
        self.attention_windowed(q, out, seqs, kv, n_heads, n_kv_heads, head_dim, scale, None)
    }

    /// `attention` through a sliding window and with soft-capping as `opts` says
    /// (`reference::AttnOpts`; an `Option<usize>` is a window alone).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_windowed<E: attention::KvLoad>(
        &self,
        q: &[f32],
        out: &mut [f32],
        seqs: &[AttnSeq],
        kv: PagedKv<E>,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        scale: f32,
        opts: impl Into<crate::reference::AttnOpts>,
    ) {
        attention::attention(
            self.isa,
            self.tasks(),
            q,
            out,
            seqs,
            kv,
            n_heads,
            n_kv_heads,
            head_dim,
            scale,
            opts.into(),
        )
    }
}
