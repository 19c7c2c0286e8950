//! The trainer's backward on the GPU (`cuda/backward.cuh`), its first kernels: the input gradient
//! of a frozen product (in a fixed order of sums: a token's gradient the same bits alone or in
//! any batch), and those of RMSNorm, SwiGLU, GeGLU and RoPE. Not yet used by the trainer, whose
//! backward (with attention's and the adapters' own gradients) still runs on the CPU.

use super::launch::{grid1, len_at_least, ROW_THREADS};
use super::{check, type_code, DeviceMatrix, Gpu, Result};
use crate::reference::{AttnOpts, RopeLayout};
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

    /// RMSNorm's input gradient (its weight frozen) for `rows` rows of `weight.len()` values.
    pub fn rmsnorm_backward(
        &self,
        x: &impl DevicePtr<f32>,
        weight: &impl DevicePtr<f32>,
        eps: f32,
        dy: &impl DevicePtr<f32>,
        rows: usize,
        dx: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let d = weight.len();
        check(d > 0 && d <= i32::MAX as usize, || {
            format!("rmsnorm_backward: width {d}")
        })?;
        len_at_least(x, rows * d, "rmsnorm_backward x")?;
        len_at_least(dy, rows * d, "rmsnorm_backward dy")?;
        len_at_least(dx, rows * d, "rmsnorm_backward dx")?;
        if rows == 0 {
            return Ok(());
        }
        let f = self.function("fw_rmsnorm_backward")?;
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (xp, wp, gp, dp) = (
            self.ptr(x),
            self.ptr(weight),
            self.ptr(dy),
            self.ptr_mut(dx),
        );
        let di = d as i32;
        self.launch(f, cfg, &[&xp, &wp, &eps, &gp, &di, &dp])
    }

    /// The gated MLP's backward (`gelu`: GeGLU, else SwiGLU) over n values: dgate and dup from
    /// the activation's gradient `da`.
    #[allow(clippy::too_many_arguments)]
    pub fn glu_backward(
        &self,
        gelu: bool,
        gate: &impl DevicePtr<f32>,
        up: &impl DevicePtr<f32>,
        da: &impl DevicePtr<f32>,
        n: usize,
        dgate: &mut impl DevicePtrMut<f32>,
        dup: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        for (len, what) in [
            (gate.len(), "gate"),
            (up.len(), "up"),
            (da.len(), "da"),
            (dgate.len(), "dgate"),
            (dup.len(), "dup"),
        ] {
            check(len >= n, || {
                format!("glu_backward: {what} holds {len} of {n}")
            })?;
        }
        if n == 0 {
            return Ok(());
        }
        let name = if gelu {
            "fw_geglu_backward"
        } else {
            "fw_swiglu_backward"
        };
        let f = self.function(name)?;
        let (gp, up, ap) = (self.ptr(gate), self.ptr(up), self.ptr(da));
        let (dgp, dup, nn) = (self.ptr_mut(dgate), self.ptr_mut(dup), n as i64);
        self.launch(f, grid1(n, ROW_THREADS), &[&gp, &up, &ap, &nn, &dgp, &dup])
    }

    /// RoPE's backward in place (`rope`'s arguments): each pair turned back.
    #[allow(clippy::too_many_arguments)]
    pub fn rope_backward(
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
        self.rope_kernel("fw_rope_backward", x, table, shape, layout)
    }

    /// Attention's backward for one sequence of `t` queries after `off` earlier positions
    /// (`reference::attention_backward_windowed`'s contract: q, dout, dq (t, heads·hd); k, v, dk,
    /// dv (off + t, kv_heads·hd), contiguous; dk and dv written, not added to).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_backward(
        &self,
        (q, k, v, dout): (
            &impl DevicePtr<f32>,
            &impl DevicePtr<f32>,
            &impl DevicePtr<f32>,
            &impl DevicePtr<f32>,
        ),
        t: usize,
        off: usize,
        (heads, kv_heads, hd): (usize, usize, usize),
        scale: f32,
        opts: AttnOpts,
        (dq, dk, dv): (
            &mut impl DevicePtrMut<f32>,
            &mut impl DevicePtrMut<f32>,
            &mut impl DevicePtrMut<f32>,
        ),
    ) -> Result<()> {
        check(
            hd.is_multiple_of(32) && hd <= 256 && kv_heads > 0 && heads.is_multiple_of(kv_heads),
            || format!("attention_backward: {heads} heads, {kv_heads} KV heads of {hd}"),
        )?;
        check(opts.window != Some(0), || {
            "attention_backward: a window of 0".into()
        })?;
        let (qd, kvd, keys) = (heads * hd, kv_heads * hd, off + t);
        len_at_least(q, t * qd, "attention_backward q")?;
        len_at_least(dout, t * qd, "attention_backward dout")?;
        len_at_least(dq, t * qd, "attention_backward dq")?;
        for (len, what) in [
            (k.len(), "k"),
            (v.len(), "v"),
            (dk.len(), "dk"),
            (dv.len(), "dv"),
        ] {
            check(len >= keys * kvd, || {
                format!("attention_backward: {what} holds {len} of {}", keys * kvd)
            })?;
        }
        if t == 0 {
            return Ok(());
        }
        let mut stats = self.zeros::<f32>(t * heads * 2)?;
        let warp = |x: usize, y: usize| LaunchConfig {
            grid_dim: (x as u32, y as u32, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (ti, oi, hi, ki, di) = (
            t as i32,
            off as i32,
            heads as i32,
            kv_heads as i32,
            hd as i32,
        );
        // A window of at least every key is none (and keeps the kernels' index sums in range).
        check(keys <= i32::MAX as usize / 2, || {
            format!("attention_backward: {keys} positions")
        })?;
        let window = opts.window.map_or(0, |w| w.min(keys) as i32);
        let cap = opts.softcap.unwrap_or(0.0);
        let (qp, kp, vp, gp) = (self.ptr(q), self.ptr(k), self.ptr(v), self.ptr(dout));
        let f = self.function("fw_attention_backward_q")?;
        let (dqp, sp) = (self.ptr_mut(dq), self.ptr_mut(&mut stats));
        self.launch(
            f,
            warp(t, heads),
            &[
                &qp, &kp, &vp, &gp, &ti, &oi, &hi, &ki, &di, &scale, &window, &cap, &dqp, &sp,
            ],
        )?;
        let f = self.function("fw_attention_backward_kv")?;
        let (dkp, dvp) = (self.ptr_mut(dk), self.ptr_mut(dv));
        let sp = self.ptr(&stats);
        self.launch(
            f,
            warp(keys, kv_heads),
            &[
                &qp, &kp, &vp, &gp, &sp, &ti, &oi, &hi, &ki, &di, &scale, &window, &cap, &dkp, &dvp,
            ],
        )?;
        // `stats` lives until the launches that read it are done.
        self.synchronize()
    }
}
