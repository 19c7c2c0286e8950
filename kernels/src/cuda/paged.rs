//! The paged KV cache on the GPU: the batch's per-token metadata (`Tokens`), the cache writer
//! and paged attention, each checked on the host before launch (every block-table entry against
//! the cache's size).

use super::launch::{grid1, len_at_least, ROW_THREADS};
use super::{check, Gpu, GpuError, GpuKv, Result};
use crate::reference::AttnSeq;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice};

/// The per-token metadata of a packed batch on the GPU (`FwTokens`): each token's position and
/// where its sequence's block table starts, every table entry checked against the cache's size.
/// Its buffers keep their addresses when rewritten (`Gpu::set_tokens`), so that a captured graph
/// reads each step's values.
pub struct Tokens {
    pub n: usize,
    pub block_size: usize,
    pub n_blocks: usize,
    block_tables: CudaSlice<u32>,
    table_at: CudaSlice<i32>,
    pos: CudaSlice<i32>,
}

impl Tokens {
    /// The most tokens and block table entries it holds.
    pub fn capacity(&self) -> (usize, usize) {
        (self.pos.len(), self.block_tables.len())
    }
}

/// `FwTokens` as the kernels take it: three device pointers.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct FwTokens {
    block_tables: u64,
    table_at: u64,
    pos: u64,
}
// SAFETY: plain data with the C layout of `FwTokens` in cuda/kernels.cu.
unsafe impl DeviceRepr for FwTokens {}

impl Gpu {
    /// Metadata buffers for up to `max_tokens` tokens and `max_table` block table entries.
    pub fn tokens_with_capacity(&self, max_tokens: usize, max_table: usize) -> Result<Tokens> {
        Ok(Tokens {
            n: 0,
            block_size: 1,
            n_blocks: 0,
            block_tables: self.zeros(max_table.max(1))?,
            table_at: self.zeros(max_tokens.max(1))?,
            pos: self.zeros(max_tokens.max(1))?,
        })
    }

    /// The metadata of `seqs` (rows q_start..q_start+q_len, packed from 0) over a cache of
    /// `n_blocks` blocks of `block_size` positions.
    pub fn tokens(&self, seqs: &[AttnSeq], block_size: usize, n_blocks: usize) -> Result<Tokens> {
        let n = seqs.iter().map(|s| s.q_start + s.q_len).max().unwrap_or(0);
        let table: usize = seqs.iter().map(|s| s.block_table.len()).sum();
        let mut t = self.tokens_with_capacity(n, table)?;
        self.set_tokens(&mut t, seqs, block_size, n_blocks)?;
        Ok(t)
    }

    /// Rewrite `t` in place (its buffers keep their addresses) for `seqs`.
    pub fn set_tokens(
        &self,
        t: &mut Tokens,
        seqs: &[AttnSeq],
        block_size: usize,
        n_blocks: usize,
    ) -> Result<()> {
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
            let at = i32::try_from(tables.len()).map_err(|_| GpuError("block tables".into()))?;
            tables.extend_from_slice(s.block_table);
            for i in 0..s.q_len {
                let row = s.q_start + i;
                check(table_at[row] < 0, || {
                    format!("token {row} in two sequences")
                })?;
                table_at[row] = at;
                pos[row] = (s.first_pos + i) as i32;
            }
        }
        check(table_at.iter().all(|&a| a >= 0), || {
            "the sequences leave a row of the batch out".into()
        })?;
        let (cap_tokens, cap_table) = t.capacity();
        check(n <= cap_tokens && tables.len() <= cap_table, || {
            format!(
                "{n} tokens and {} table entries; the buffers hold {cap_tokens} and {cap_table}",
                tables.len()
            )
        })?;
        self.write(&tables, &mut t.block_tables)?;
        self.write(&table_at, &mut t.table_at)?;
        self.write(&pos, &mut t.pos)?;
        t.n = n;
        t.block_size = block_size;
        t.n_blocks = n_blocks;
        Ok(())
    }

    pub(super) fn tokens_arg(&self, t: &Tokens) -> FwTokens {
        FwTokens {
            block_tables: self.ptr(&t.block_tables),
            table_at: self.ptr(&t.table_at),
            pos: self.ptr(&t.pos),
        }
    }

    pub(super) fn cache_fits<E>(
        &self,
        t: &Tokens,
        kv_dim: usize,
        kc: &impl DeviceSlice<E>,
        vc: &impl DeviceSlice<E>,
    ) -> Result<()> {
        let need = t.n_blocks * t.block_size * kv_dim;
        len_at_least(kc, need, "K cache")?;
        len_at_least(vc, need, "V cache")
    }

    /// Write the batch's K and V rows (tokens.n, kv_dim) into the cache at their positions.
    pub fn kv_write<E: GpuKv>(
        &self,
        k: &impl DevicePtr<f32>,
        v: &impl DevicePtr<f32>,
        tokens: &Tokens,
        kv_dim: usize,
        kc: &mut impl DevicePtrMut<E>,
        vc: &mut impl DevicePtrMut<E>,
    ) -> Result<()> {
        let n = tokens.n;
        len_at_least(k, n * kv_dim, "kv_write k")?;
        len_at_least(v, n * kv_dim, "kv_write v")?;
        self.cache_fits(tokens, kv_dim, kc, vc)?;
        if n * kv_dim == 0 {
            return Ok(());
        }
        let f = self.function(&format!("fw_kv_write_{}", E::NAME))?;
        let (kp, vp, kcp, vcp) = (self.ptr(k), self.ptr(v), self.ptr_mut(kc), self.ptr_mut(vc));
        let (ni, kd, bs) = (n as i32, kv_dim as i32, tokens.block_size as i32);
        let toks = self.tokens_arg(tokens);
        // Every block table entry was checked against n_blocks (`set_tokens`, `cache_fits`).
        self.launch(
            f,
            grid1(n * kv_dim, ROW_THREADS),
            &[&kp, &vp, &ni, &kd, &bs, &toks, &kcp, &vcp],
        )
    }
}
