//! `Gpu`'s ops: each checks its arguments here (a kernel trusts its sizes; a bad size on the GPU is
//! a silent out-of-bounds access), sizes the launch, and queues the kernel on the stream.

use super::{check, type_name, DeviceMatrix, Gpu, GpuKv, Result};
use crate::reference::{AttnSeq, RopeLayout};
use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg};

/// Tokens per matmul block row-pass (`FW_MM_TOKENS`), warps per matmul block.
const MM_TOKENS: usize = 8;
const MM_WARPS: usize = 4;
/// Threads of the row kernels and of the elementwise ones.
const ROW_THREADS: u32 = 256;
/// Warps of the attention kernel (`FW_ATT_WARPS`).
const ATT_WARPS: u32 = 4;
/// The largest head dimension the attention kernel takes (`FW_MAX_HEAD_DIM`).
pub const ATT_MAX_HEAD_DIM: usize = 256;

fn grid1(n: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((n as u64).div_ceil(threads as u64).max(1) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn len_at_least<T>(s: &CudaSlice<T>, n: usize, what: &str) -> Result<()> {
    check(s.len() >= n, || {
        format!("{what}: {} values, {n} needed", s.len())
    })
}

/// The per-token metadata of a packed batch on the GPU (`FwTokens`): each token's position and
/// where its sequence's block table starts, every table entry checked against the cache's size.
pub struct Tokens {
    pub n: usize,
    pub block_size: usize,
    pub n_blocks: usize,
    block_tables: CudaSlice<u32>,
    table_at: CudaSlice<i32>,
    pos: CudaSlice<i32>,
}

/// `FwTokens` as the kernels take it: three device pointers.
#[repr(C)]
#[derive(Clone, Copy)]
struct FwTokens {
    block_tables: u64,
    table_at: u64,
    pos: u64,
}
// SAFETY: plain data with the C layout of `FwTokens` in cuda/kernels.cu.
unsafe impl DeviceRepr for FwTokens {}

impl Gpu {
    /// The metadata of `seqs` (rows q_start..q_start+q_len, packed from 0) over a cache of
    /// `n_blocks` blocks of `block_size` positions.
    pub fn tokens(&self, seqs: &[AttnSeq], block_size: usize, n_blocks: usize) -> Result<Tokens> {
        check(block_size > 0, || "a block size of 0".into())?;
        let n = seqs.iter().map(|s| s.q_start + s.q_len).max().unwrap_or(0);
        let (mut tables, mut table_at, mut pos) = (Vec::new(), vec![-1i32; n], vec![0i32; n]);
        for s in seqs {
            let end = s.first_pos + s.q_len;
            check(end <= s.block_table.len() * block_size, || {
                format!(
                    "positions up to {end} with {} blocks of {block_size}",
                    s.block_table.len()
                )
            })?;
            check(
                s.block_table.iter().all(|&b| (b as usize) < n_blocks),
                || format!("a block table names a block past the cache's {n_blocks}"),
            )?;
            let at = i32::try_from(tables.len()).map_err(|_| super::GpuError("tables".into()))?;
            tables.extend_from_slice(s.block_table);
            for i in 0..s.q_len {
                let t = s.q_start + i;
                check(table_at[t] < 0, || format!("token {t} in two sequences"))?;
                table_at[t] = at;
                pos[t] = (s.first_pos + i) as i32;
            }
        }
        check(table_at.iter().all(|&a| a >= 0), || {
            "the sequences leave a row of the batch out".into()
        })?;
        Ok(Tokens {
            n,
            block_size,
            n_blocks,
            block_tables: self.upload(if tables.is_empty() { &[0] } else { &tables })?,
            table_at: self.upload(if n == 0 { &[0] } else { &table_at })?,
            pos: self.upload(if n == 0 { &[0] } else { &pos })?,
        })
    }

    fn tokens_arg(&self, t: &Tokens) -> FwTokens {
        let s = self.stream();
        FwTokens {
            block_tables: t.block_tables.device_ptr(s).0,
            table_at: t.table_at.device_ptr(s).0,
            pos: t.pos.device_ptr(s).0,
        }
    }

    /// y (n, rows) = x (n, cols) · Wᵀ from W's blocks as stored.
    pub fn matmul(
        &self,
        w: &DeviceMatrix,
        x: &CudaSlice<f32>,
        n: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        len_at_least(x, n * w.cols, "matmul x")?;
        len_at_least(y, n * w.rows, "matmul y")?;
        if n == 0 || w.rows == 0 {
            return Ok(());
        }
        let f = self.function(&format!("fw_matmul_{}", type_name(w.ty)))?;
        let cfg = LaunchConfig {
            grid_dim: (
                w.rows.div_ceil(MM_WARPS) as u32,
                n.div_ceil(MM_TOKENS) as u32,
                1,
            ),
            block_dim: ((MM_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (rows, cols, row_bytes, n) =
            (w.rows as i32, w.cols as i32, w.row_bytes as i64, n as i32);
        let mut b = self.stream().launch_builder(&f);
        b.arg(&w.data)
            .arg(&rows)
            .arg(&cols)
            .arg(&row_bytes)
            .arg(x)
            .arg(&n)
            .arg(y);
        // SAFETY: sizes checked above; the kernel's signature is fw_matmul_body's.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// out (tokens.len(), cols) = the table's rows `tokens`, dequantized (the CPU's values exactly).
    pub fn embed(
        &self,
        table: &DeviceMatrix,
        tokens: &CudaSlice<u32>,
        n: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        len_at_least(tokens, n, "embed tokens")?;
        len_at_least(out, n * table.cols, "embed out")?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(&format!("fw_embed_{}", type_name(table.ty)))?;
        let cfg = LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let (row_bytes, cols) = (table.row_bytes as i64, table.cols as i32);
        let mut b = self.stream().launch_builder(&f);
        b.arg(&table.data)
            .arg(&row_bytes)
            .arg(tokens)
            .arg(&cols)
            .arg(out);
        // SAFETY: sizes checked; token ids are the caller's (`embed_checked` checks them).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// `embed` from host token ids, each checked against the table's rows.
    pub fn embed_checked(
        &self,
        table: &DeviceMatrix,
        tokens: &[u32],
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        check(tokens.iter().all(|&t| (t as usize) < table.rows), || {
            format!("a token id past the table's {} rows", table.rows)
        })?;
        let dev = self.upload(if tokens.is_empty() { &[0] } else { tokens })?;
        self.embed(table, &dev, tokens.len(), out)
    }

    /// out = x / rms(x) · weight for `rows` rows of weight.len() values.
    pub fn rmsnorm(
        &self,
        x: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        eps: f32,
        rows: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let d = weight.len();
        len_at_least(x, rows * d, "rmsnorm x")?;
        len_at_least(out, rows * d, "rmsnorm out")?;
        if rows == 0 {
            return Ok(());
        }
        let f = self.function("fw_rmsnorm")?;
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let d = d as i32;
        let mut b = self.stream().launch_builder(&f);
        b.arg(x).arg(weight).arg(&eps).arg(&d).arg(out);
        // SAFETY: sizes checked above.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// RoPE in place on n rows of n_heads·head_dim by a table of `ops::rope_table`.
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        x: &mut CudaSlice<f32>,
        table: &CudaSlice<f32>,
        n: usize,
        n_heads: usize,
        head_dim: usize,
        rope_dim: usize,
        layout: RopeLayout,
    ) -> Result<()> {
        check(rope_dim <= head_dim && rope_dim % 2 == 0, || {
            format!("rope_dim {rope_dim} with head_dim {head_dim}")
        })?;
        len_at_least(x, n * n_heads * head_dim, "rope x")?;
        len_at_least(table, n * rope_dim, "rope table")?;
        let work = n * n_heads * (rope_dim / 2);
        if work == 0 {
            return Ok(());
        }
        let f = self.function("fw_rope")?;
        let (ni, nh, hd, rd) = (n as i32, n_heads as i32, head_dim as i32, rope_dim as i32);
        let neox = (layout == RopeLayout::Neox) as i32;
        let mut b = self.stream().launch_builder(&f);
        b.arg(x)
            .arg(table)
            .arg(&ni)
            .arg(&nh)
            .arg(&hd)
            .arg(&rd)
            .arg(&neox);
        // SAFETY: sizes checked above.
        unsafe { b.launch(grid1(work, ROW_THREADS)) }?;
        Ok(())
    }

    fn elementwise(
        &self,
        name: &str,
        a: &CudaSlice<f32>,
        b2: &CudaSlice<f32>,
        n: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        len_at_least(a, n, name)?;
        len_at_least(b2, n, name)?;
        len_at_least(out, n, name)?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(name)?;
        let n64 = n as i64;
        let mut b = self.stream().launch_builder(&f);
        b.arg(a).arg(b2).arg(&n64).arg(out);
        // SAFETY: sizes checked above.
        unsafe { b.launch(grid1(n, ROW_THREADS)) }?;
        Ok(())
    }

    /// out = silu(gate) · up over n values.
    pub fn swiglu(
        &self,
        gate: &CudaSlice<f32>,
        up: &CudaSlice<f32>,
        n: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        self.elementwise("fw_swiglu", gate, up, n, out)
    }

    /// out = gelu_tanh(gate) · up over n values.
    pub fn geglu(
        &self,
        gate: &CudaSlice<f32>,
        up: &CudaSlice<f32>,
        n: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        self.elementwise("fw_geglu", gate, up, n, out)
    }

    /// x += y over n values.
    pub fn add(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>, n: usize) -> Result<()> {
        len_at_least(x, n, "add x")?;
        len_at_least(y, n, "add y")?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function("fw_residual_add")?;
        let n64 = n as i64;
        let mut b = self.stream().launch_builder(&f);
        b.arg(x).arg(y).arg(&n64);
        // SAFETY: sizes checked above.
        unsafe { b.launch(grid1(n, ROW_THREADS)) }?;
        Ok(())
    }

    fn cache_fits<E>(
        &self,
        t: &Tokens,
        kv_dim: usize,
        kc: &CudaSlice<E>,
        vc: &CudaSlice<E>,
    ) -> Result<()> {
        let need = t.n_blocks * t.block_size * kv_dim;
        len_at_least(kc, need, "K cache")?;
        len_at_least(vc, need, "V cache")
    }

    /// Write the batch's K and V rows (tokens.n, kv_dim) into the cache at their positions.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_write<E: GpuKv>(
        &self,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        tokens: &Tokens,
        kv_dim: usize,
        kc: &mut CudaSlice<E>,
        vc: &mut CudaSlice<E>,
    ) -> Result<()> {
        let n = tokens.n;
        len_at_least(k, n * kv_dim, "kv_write k")?;
        len_at_least(v, n * kv_dim, "kv_write v")?;
        self.cache_fits(tokens, kv_dim, kc, vc)?;
        if n * kv_dim == 0 {
            return Ok(());
        }
        let f = self.function(&format!("fw_kv_write_{}", E::NAME))?;
        let (ni, kd, bs) = (n as i32, kv_dim as i32, tokens.block_size as i32);
        let toks = self.tokens_arg(tokens);
        let mut b = self.stream().launch_builder(&f);
        b.arg(k)
            .arg(v)
            .arg(&ni)
            .arg(&kd)
            .arg(&bs)
            .arg(&toks)
            .arg(kc)
            .arg(vc);
        // SAFETY: sizes and every block table entry checked (`tokens`, `cache_fits`).
        unsafe { b.launch(grid1(n * kv_dim, ROW_THREADS)) }?;
        Ok(())
    }

    /// Causal GQA attention of the batch's queries q (tokens.n, n_heads·head_dim) over the cache,
    /// through a sliding window of `window` keys where given.
    #[allow(clippy::too_many_arguments)]
    pub fn attention<E: GpuKv>(
        &self,
        q: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        tokens: &Tokens,
        kc: &CudaSlice<E>,
        vc: &CudaSlice<E>,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        scale: f32,
        window: Option<usize>,
    ) -> Result<()> {
        check(
            n_kv_heads > 0 && n_heads % n_kv_heads == 0 && n_heads <= 65535,
            || format!("{n_heads} query heads over {n_kv_heads} KV heads"),
        )?;
        check((1..=ATT_MAX_HEAD_DIM).contains(&head_dim), || {
            format!("head_dim {head_dim} (the kernel takes 1..={ATT_MAX_HEAD_DIM})")
        })?;
        let n = tokens.n;
        len_at_least(q, n * n_heads * head_dim, "attention q")?;
        len_at_least(out, n * n_heads * head_dim, "attention out")?;
        self.cache_fits(tokens, n_kv_heads * head_dim, kc, vc)?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(&format!("fw_attention_{}", E::NAME))?;
        let cfg = LaunchConfig {
            grid_dim: (n as u32, n_heads as u32, 1),
            block_dim: (ATT_WARPS * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (nh, nkv, hd, bs) = (
            n_heads as i32,
            n_kv_heads as i32,
            head_dim as i32,
            tokens.block_size as i32,
        );
        let win = window.map_or(0, |w| w.min(i32::MAX as usize) as i32);
        let toks = self.tokens_arg(tokens);
        let mut b = self.stream().launch_builder(&f);
        b.arg(q).arg(out).arg(&toks).arg(kc).arg(vc);
        b.arg(&nh).arg(&nkv).arg(&hd).arg(&bs).arg(&scale).arg(&win);
        // SAFETY: sizes, heads and every block table entry checked above.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// Log-softmax in place of `rows` rows of `vocab` logits divided by `temperature`.
    pub fn log_softmax(
        &self,
        x: &mut CudaSlice<f32>,
        rows: usize,
        vocab: usize,
        temperature: f32,
    ) -> Result<()> {
        check(temperature > 0.0, || format!("temperature {temperature}"))?;
        len_at_least(x, rows * vocab, "log_softmax")?;
        if rows * vocab == 0 {
            return Ok(());
        }
        let f = self.function("fw_log_softmax")?;
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (v, inv) = (vocab as i32, 1.0 / temperature);
        let mut b = self.stream().launch_builder(&f);
        b.arg(x).arg(&v).arg(&inv);
        // SAFETY: sizes checked above.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// out[r] = the index of row r's largest value (the first of equals).
    pub fn argmax(
        &self,
        x: &CudaSlice<f32>,
        rows: usize,
        vocab: usize,
        out: &mut CudaSlice<u32>,
    ) -> Result<()> {
        len_at_least(x, rows * vocab, "argmax x")?;
        len_at_least(out, rows, "argmax out")?;
        if rows * vocab == 0 {
            return Ok(());
        }
        let f = self.function("fw_argmax")?;
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let v = vocab as i32;
        let mut b = self.stream().launch_builder(&f);
        b.arg(x).arg(&v).arg(out);
        // SAFETY: sizes checked above.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}
