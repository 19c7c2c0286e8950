//! `Gpu`'s ops: each checks its arguments here (a kernel trusts its sizes; a bad size on the GPU is
//! a silent out-of-bounds access), sizes the launch, and queues the kernel on the stream. Inputs
//! and outputs are any device buffer or view of one (`DevicePtr`/`DevicePtrMut`), so that a
//! forward works on rows of its buffers in place.

use super::{check, type_name, DeviceMatrix, Gpu, Result};
use crate::quant::QuantType;
use crate::reference::RopeLayout;
use cudarc::driver::{
    CudaFunction, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice, LaunchConfig, PushKernelArg,
};

/// Threads of the row kernels and of the elementwise ones.
pub(super) const ROW_THREADS: u32 = 256;
/// Warps of the attention kernel (`FW_ATT_WARPS`).
pub(super) const ATT_WARPS: u32 = 4;
/// The largest head dimension the attention kernel takes (`FW_MAX_HEAD_DIM`).
pub const ATT_MAX_HEAD_DIM: usize = 256;

pub(super) fn grid1(n: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((n as u64).div_ceil(threads as u64).max(1) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn rows(n: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

pub(super) fn len_at_least<T>(s: &impl DeviceSlice<T>, n: usize, what: &str) -> Result<()> {
    check(s.len() >= n, || {
        format!("{what}: {} values, {n} needed", s.len())
    })
}

impl Gpu {
    pub(super) fn ptr<T>(&self, s: &impl DevicePtr<T>) -> u64 {
        // Event tracking is off (`Gpu::open`): the guard has nothing to record.
        s.device_ptr(self.stream()).0
    }

    pub(super) fn ptr_mut<T>(&self, s: &mut impl DevicePtrMut<T>) -> u64 {
        s.device_ptr_mut(self.stream()).0
    }

    pub(super) fn launch(
        &self,
        f: &CudaFunction,
        cfg: LaunchConfig,
        args: &[&dyn Arg],
    ) -> Result<()> {
        let mut b = self.stream().launch_builder(f);
        for a in args {
            a.push(&mut b);
        }
        // SAFETY: every caller checked the sizes its kernel reads and writes, and passes the
        // kernel's parameters in its order and types.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// y (n, rows) = x (n, cols) · Wᵀ from W's blocks as stored.
    pub fn matmul(
        &self,
        w: &DeviceMatrix,
        x: &impl DevicePtr<f32>,
        n: usize,
        y: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        self.matmul_raw(w.ty, &w.data, w.rows, w.cols, x, n, y)
    }

    /// `matmul` of a matrix given as its bytes (an adapter's f32 tensor inside its parameters).
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_raw(
        &self,
        ty: QuantType,
        w: &impl DevicePtr<u8>,
        rows: usize,
        cols: usize,
        x: &impl DevicePtr<f32>,
        n: usize,
        y: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        check(
            cols.is_multiple_of(32) && cols.is_multiple_of(ty.block_size()),
            || format!("a {} matrix of {cols} columns", ty.name()),
        )?;
        let row_bytes = ty.row_bytes(cols).unwrap();
        len_at_least(w, rows * row_bytes, "matmul w")?;
        len_at_least(x, n * cols, "matmul x")?;
        len_at_least(y, n * rows, "matmul y")?;
        if n == 0 || rows == 0 {
            return Ok(());
        }
        let plan = self.products().plan(rows, n)?;
        let f = self.function(&format!("{}_{}", plan.kernel, type_name(ty)))?;
        let cfg = LaunchConfig {
            grid_dim: (plan.grid.0, plan.grid.1, 1),
            block_dim: (plan.threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let (wp, xp, yp) = (self.ptr(w), self.ptr(x), self.ptr_mut(y));
        let (r, c, rb, n) = (rows as i32, cols as i32, row_bytes as i64, n as i32);
        self.launch(f, cfg, &[&wp, &r, &c, &rb, &xp, &n, &yp])
    }

    /// out (n, cols) = the table's rows tokens[0..n], dequantized (the CPU's values exactly).
    /// The ids are the caller's to check (`embed_checked` does).
    pub fn embed(
        &self,
        table: &DeviceMatrix,
        tokens: &impl DevicePtr<u32>,
        n: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        len_at_least(tokens, n, "embed tokens")?;
        len_at_least(out, n * table.cols, "embed out")?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(&format!("fw_embed_{}", type_name(table.ty)))?;
        let (tp, wp, op) = (self.ptr(tokens), self.ptr(&table.data), self.ptr_mut(out));
        let (rb, cols) = (table.row_bytes as i64, table.cols as i32);
        self.launch(f, rows(n, 128), &[&wp, &rb, &tp, &cols, &op])
    }

    /// `embed` from host token ids, each checked against the table's rows.
    pub fn embed_checked(
        &self,
        table: &DeviceMatrix,
        tokens: &[u32],
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        check(tokens.iter().all(|&t| (t as usize) < table.rows), || {
            format!("a token id past the table's {} rows", table.rows)
        })?;
        let dev = self.upload(if tokens.is_empty() { &[0] } else { tokens })?;
        self.embed(table, &dev, tokens.len(), out)
    }

    /// out = x / rms(x) · weight for `n` rows of weight.len() values.
    pub fn rmsnorm(
        &self,
        x: &impl DevicePtr<f32>,
        weight: &impl DevicePtr<f32>,
        eps: f32,
        n: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let d = weight.len();
        len_at_least(x, n * d, "rmsnorm x")?;
        len_at_least(out, n * d, "rmsnorm out")?;
        let (xp, op) = (self.ptr(x), self.ptr_mut(out));
        self.rmsnorm_ptrs(xp, weight, eps, n, op)
    }

    /// x += y, then out = RMSNorm(x)·weight (n rows of weight.len()): `add` then `rmsnorm` in one
    /// launch, the same bits.
    pub fn add_rmsnorm(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        y: &impl DevicePtr<f32>,
        weight: &impl DevicePtr<f32>,
        eps: f32,
        n: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let d = weight.len();
        len_at_least(x, n * d, "add_rmsnorm x")?;
        len_at_least(y, n * d, "add_rmsnorm y")?;
        len_at_least(out, n * d, "add_rmsnorm out")?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function("fw_add_rmsnorm")?;
        let (xp, yp, wp, op) = (
            self.ptr_mut(x),
            self.ptr(y),
            self.ptr(weight),
            self.ptr_mut(out),
        );
        let di = d as i32;
        self.launch(f, rows(n, ROW_THREADS), &[&xp, &yp, &wp, &eps, &di, &op])
    }

    /// `rmsnorm` in place (each head's q/k norm).
    pub fn rmsnorm_in_place(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        weight: &impl DevicePtr<f32>,
        eps: f32,
        n: usize,
    ) -> Result<()> {
        len_at_least(x, n * weight.len(), "rmsnorm x")?;
        let p = self.ptr_mut(x);
        // The kernel reads a row whole (its sum) before it writes any of it.
        self.rmsnorm_ptrs(p, weight, eps, n, p)
    }

    fn rmsnorm_ptrs(
        &self,
        x: u64,
        weight: &impl DevicePtr<f32>,
        eps: f32,
        n: usize,
        out: u64,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let f = self.function("fw_rmsnorm")?;
        let (wp, d) = (self.ptr(weight), weight.len() as i32);
        self.launch(f, rows(n, ROW_THREADS), &[&x, &wp, &eps, &d, &out])
    }

    /// RoPE in place on n rows of n_heads·head_dim by a table of `ops::rope_table`.
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        table: &impl DevicePtr<f32>,
        n: usize,
        n_heads: usize,
        head_dim: usize,
        rope_dim: usize,
        layout: RopeLayout,
    ) -> Result<()> {
        let shape = (n, n_heads, head_dim, rope_dim);
        self.rope_kernel("fw_rope", x, table, shape, layout)
    }

    /// `kernel` (`fw_rope`, or its backward) in place on n rows of n_heads heads of head_dim,
    /// RoPE over their first rope_dim values: one thread a (token, head, pair).
    pub(super) fn rope_kernel(
        &self,
        kernel: &str,
        x: &mut impl DevicePtrMut<f32>,
        table: &impl DevicePtr<f32>,
        (n, n_heads, head_dim, rope_dim): (usize, usize, usize, usize),
        layout: RopeLayout,
    ) -> Result<()> {
        check(rope_dim <= head_dim && rope_dim.is_multiple_of(2), || {
            format!("{kernel}: rope_dim {rope_dim} with head_dim {head_dim}")
        })?;
        len_at_least(x, n * n_heads * head_dim, "rope x")?;
        len_at_least(table, n * rope_dim, "rope table")?;
        let work = n * n_heads * (rope_dim / 2);
        if work == 0 {
            return Ok(());
        }
        let f = self.function(kernel)?;
        let (xp, tp) = (self.ptr_mut(x), self.ptr(table));
        let (ni, nh, hd, rd) = (n as i32, n_heads as i32, head_dim as i32, rope_dim as i32);
        let neox = (layout == RopeLayout::Neox) as i32;
        self.launch(
            f,
            grid1(work, ROW_THREADS),
            &[&xp, &tp, &ni, &nh, &hd, &rd, &neox],
        )
    }

    /// `rope` on queries (n rows of `heads`) and keys (n rows of `kv_heads`) in one launch, the
    /// same bits.
    #[allow(clippy::too_many_arguments)]
    pub fn rope_qk(
        &self,
        q: &mut impl DevicePtrMut<f32>,
        k: &mut impl DevicePtrMut<f32>,
        table: &impl DevicePtr<f32>,
        n: usize,
        (heads, kv_heads): (usize, usize),
        head_dim: usize,
        rope_dim: usize,
        layout: RopeLayout,
    ) -> Result<()> {
        check(rope_dim <= head_dim && rope_dim.is_multiple_of(2), || {
            format!("rope_dim {rope_dim} with head_dim {head_dim}")
        })?;
        len_at_least(q, n * heads * head_dim, "rope q")?;
        len_at_least(k, n * kv_heads * head_dim, "rope k")?;
        len_at_least(table, n * rope_dim, "rope table")?;
        let work = n * (heads + kv_heads) * (rope_dim / 2);
        if work == 0 {
            return Ok(());
        }
        let f = self.function("fw_rope_qk")?;
        let (qp, kp, tp) = (self.ptr_mut(q), self.ptr_mut(k), self.ptr(table));
        let (ni, hq, hk) = (n as i32, heads as i32, kv_heads as i32);
        let (hd, rd) = (head_dim as i32, rope_dim as i32);
        let neox = (layout == RopeLayout::Neox) as i32;
        self.launch(
            f,
            grid1(work, ROW_THREADS),
            &[&qp, &kp, &tp, &ni, &hq, &hk, &hd, &rd, &neox],
        )
    }

    fn gated(
        &self,
        name: &str,
        gate: &impl DevicePtr<f32>,
        up: &impl DevicePtr<f32>,
        n: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        len_at_least(gate, n, name)?;
        len_at_least(up, n, name)?;
        len_at_least(out, n, name)?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(name)?;
        let (gp, up, op, n64) = (self.ptr(gate), self.ptr(up), self.ptr_mut(out), n as i64);
        self.launch(f, grid1(n, ROW_THREADS), &[&gp, &up, &n64, &op])
    }

    /// out = silu(gate) · up over n values.
    pub fn swiglu(
        &self,
        gate: &impl DevicePtr<f32>,
        up: &impl DevicePtr<f32>,
        n: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        self.gated("fw_swiglu", gate, up, n, out)
    }

    /// out = gelu_tanh(gate) · up over n values.
    pub fn geglu(
        &self,
        gate: &impl DevicePtr<f32>,
        up: &impl DevicePtr<f32>,
        n: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        self.gated("fw_geglu", gate, up, n, out)
    }

    /// x += y over n values.
    pub fn add(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        y: &impl DevicePtr<f32>,
        n: usize,
    ) -> Result<()> {
        len_at_least(x, n, "add x")?;
        len_at_least(y, n, "add y")?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function("fw_residual_add")?;
        let (xp, yp, n64) = (self.ptr_mut(x), self.ptr(y), n as i64);
        self.launch(f, grid1(n, ROW_THREADS), &[&xp, &yp, &n64])
    }

    /// y += s · d over n values.
    pub fn axpy(
        &self,
        y: &mut impl DevicePtrMut<f32>,
        d: &impl DevicePtr<f32>,
        s: f32,
        n: usize,
    ) -> Result<()> {
        len_at_least(y, n, "axpy y")?;
        len_at_least(d, n, "axpy d")?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function("fw_axpy")?;
        let (yp, dp, n64) = (self.ptr_mut(y), self.ptr(d), n as i64);
        self.launch(f, grid1(n, ROW_THREADS), &[&yp, &dp, &s, &n64])
    }

    /// x *= s over n values.
    pub fn scale(&self, x: &mut impl DevicePtrMut<f32>, s: f32, n: usize) -> Result<()> {
        len_at_least(x, n, "scale x")?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function("fw_scale")?;
        let (xp, n64) = (self.ptr_mut(x), n as i64);
        self.launch(f, grid1(n, ROW_THREADS), &[&xp, &s, &n64])
    }

    /// Each of `rows` rows of y plus the bias b.
    pub fn add_bias(
        &self,
        y: &mut impl DevicePtrMut<f32>,
        b: &impl DevicePtr<f32>,
        rows: usize,
    ) -> Result<()> {
        let d = b.len();
        len_at_least(y, rows * d, "add_bias y")?;
        if rows * d == 0 {
            return Ok(());
        }
        let f = self.function("fw_add_bias")?;
        let (yp, bp, n64, di) = (self.ptr_mut(y), self.ptr(b), (rows * d) as i64, d as i32);
        self.launch(f, grid1(rows * d, ROW_THREADS), &[&yp, &bp, &n64, &di])
    }

    /// out (m, d) = rows idx[0..m] of x (rows of d); the indices are the caller's to check.
    pub fn gather_rows(
        &self,
        x: &impl DevicePtr<f32>,
        idx: &impl DevicePtr<u32>,
        m: usize,
        d: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        len_at_least(idx, m, "gather idx")?;
        len_at_least(out, m * d, "gather out")?;
        if m * d == 0 {
            return Ok(());
        }
        let f = self.function("fw_gather_rows")?;
        let (xp, ip, op) = (self.ptr(x), self.ptr(idx), self.ptr_mut(out));
        let (mi, di) = (m as i32, d as i32);
        self.launch(f, grid1(m * d, ROW_THREADS), &[&xp, &ip, &mi, &di, &op])
    }

    /// out[t][q·m + j] = Σ_i x[t][q·k + i] · mats[q][i][j] for n rows (`Cpu::block_matmul`).
    #[allow(clippy::too_many_arguments)]
    pub fn block_matmul(
        &self,
        x: &impl DevicePtr<f32>,
        mats: &impl DevicePtr<f32>,
        n: usize,
        nb: usize,
        k: usize,
        m: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        len_at_least(x, n * nb * k, "block_matmul x")?;
        len_at_least(mats, nb * k * m, "block_matmul mats")?;
        len_at_least(out, n * nb * m, "block_matmul out")?;
        if n * nb * m == 0 {
            return Ok(());
        }
        let f = self.function("fw_block_matmul")?;
        let (xp, mp, op) = (self.ptr(x), self.ptr(mats), self.ptr_mut(out));
        let (ni, nbi, ki, mi) = (n as i32, nb as i32, k as i32, m as i32);
        self.launch(
            f,
            grid1(n * nb * m, ROW_THREADS),
            &[&xp, &mp, &ni, &nbi, &ki, &mi, &op],
        )
    }

    /// y (t, h): each token's `k` expert outputs (rows of `out`, h wide, at `row_of`) weighted by
    /// `weight` and summed in the order of its choices (the MoE's output; `row_of` entries are
    /// the caller's to check).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_combine(
        &self,
        out: &impl DevicePtr<f32>,
        row_of: &impl DevicePtr<u32>,
        weight: &impl DevicePtr<f32>,
        t: usize,
        k: usize,
        h: usize,
        y: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        len_at_least(row_of, t * k, "moe_combine row_of")?;
        len_at_least(weight, t * k, "moe_combine weight")?;
        len_at_least(out, t * k * h, "moe_combine out")?;
        len_at_least(y, t * h, "moe_combine y")?;
        if t * h == 0 {
            return Ok(());
        }
        let f = self.function("fw_moe_combine")?;
        let (op, rp, wp, yp) = (
            self.ptr(out),
            self.ptr(row_of),
            self.ptr(weight),
            self.ptr_mut(y),
        );
        let (ti, ki, hi) = (t as i32, k as i32, h as i32);
        self.launch(
            f,
            grid1(t * h, ROW_THREADS),
            &[&op, &rp, &wp, &ti, &ki, &hi, &yp],
        )
    }

    /// Log-softmax in place of `n` rows of `vocab` logits divided by `temperature`.
    pub fn log_softmax(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        n: usize,
        vocab: usize,
        temperature: f32,
    ) -> Result<()> {
        check(temperature > 0.0, || format!("temperature {temperature}"))?;
        len_at_least(x, n * vocab, "log_softmax")?;
        if n * vocab == 0 {
            return Ok(());
        }
        let f = self.function("fw_log_softmax")?;
        let (xp, v, inv) = (self.ptr_mut(x), vocab as i32, 1.0 / temperature);
        self.launch(f, rows(n, ROW_THREADS), &[&xp, &v, &inv])
    }

    /// out[r] = the index of row r's largest value (the first of equals).
    pub fn argmax(
        &self,
        x: &impl DevicePtr<f32>,
        n: usize,
        vocab: usize,
        out: &mut impl DevicePtrMut<u32>,
    ) -> Result<()> {
        len_at_least(x, n * vocab, "argmax x")?;
        len_at_least(out, n, "argmax out")?;
        if n * vocab == 0 {
            return Ok(());
        }
        let f = self.function("fw_argmax")?;
        let (xp, v, op) = (self.ptr(x), vocab as i32, self.ptr_mut(out));
        self.launch(f, rows(n, ROW_THREADS), &[&xp, &v, &op])
    }
}

/// A kernel argument: anything the launch builder takes by reference.
pub(super) trait Arg {
    fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>);
}

impl<T: DeviceRepr> Arg for T {
    fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>) {
        b.arg(self);
    }
}
