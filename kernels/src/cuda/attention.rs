//! Paged attention over the cache, in one of two kernels (`FLYWHEEL_CUDA_ATTENTION`):
//! - `chunks` (the default; "flash-decoding", `cuda/attention.cuh`): a query's positions cut
//!   into at most `ATT_SPLITS` chunks by its own count of positions, each chunk's partial
//!   computed by one warp, the partials merged in order. Small batches split (a warp a chunk,
//!   the last to finish merges: many more warps where a decode step has only n_heads blocks),
//!   large ones fold (a block of 4 warps a query, taking its chunks in turn, the partials in
//!   shared memory); both give the same bits (the kernels test checks it), so a query's result
//!   does not depend on its batch or on the launch;
//! - `groups`: the chunks kernel whose small batches split by GQA group (`ChunkLaunch::Groups`:
//!   a warp takes a chunk of up to 4 query heads of one KV head, each key and value loaded once
//!   for them; each head's arithmetic unchanged, so the same bits). Not yet timed;
//! - `rows` (the first, proven on an H200 before): one block of 4 warps a (token, head), each
//!   warp taking every fourth tile of 32 positions, the warps merged at the end
//!   (`fw_attention_<kv>`).
//!
//! On an H200 (2026-11-28, the 1B shape's decode through graphs, tokens/s, rows → chunks): after
//! 8-token prompts 534 → 608 at batch 1, 1710 → 1794 at 8, 2267 → 2301 at 64; after 2048, 121 →
//! 494 at batch 1 and 726 → 1511 at 8; after 8000, 36 → 360 at batch 1
//! (`scripts/gpu_proof.sh context`).

use super::launch::{len_at_least, Arg, ATT_MAX_HEAD_DIM, ATT_WARPS};
use super::paged::Tokens;
use super::{check, Gpu, GpuKv, Result};
use crate::reference::AttnOpts;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig};

pub const ATTENTION_VAR: &str = "FLYWHEEL_CUDA_ATTENTION";

/// The most chunks a query's positions are cut into (`FW_ATT_SPLITS`).
pub const ATT_SPLITS: usize = 32;
/// Positions of a chunk come in tiles of this many (`FW_ATT_TILE`).
const ATT_TILE: usize = 32;
/// Warps a block of the chunks kernel (`FW_ATT_CW`): a fold's warps take a query's chunks in
/// turn, a split's blocks hold this many chunks' warps.
const ATT_CHUNK_WARPS: usize = 4;
/// The most (token, head) pairs a split launch takes (its scratch's size); `Auto` splits batches
/// up to it: at 32 heads, 16 tokens (4096 blocks of 4 warps, most of them empty at short
/// contexts: a block with no chunk returns at once).
pub const SPLIT_PAIRS: usize = 512;

/// Which attention kernel a `Gpu` launches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionKernel {
    Rows,
    #[default]
    Chunks,
    Groups,
}

impl AttentionKernel {
    pub const ALL: [AttentionKernel; 3] = [
        AttentionKernel::Rows,
        AttentionKernel::Chunks,
        AttentionKernel::Groups,
    ];

    pub fn name(self) -> &'static str {
        match self {
            AttentionKernel::Rows => "rows",
            AttentionKernel::Chunks => "chunks",
            AttentionKernel::Groups => "groups",
        }
    }

    /// The kernel `FLYWHEEL_CUDA_ATTENTION` names, the default where unset.
    pub fn from_env() -> Result<AttentionKernel> {
        AttentionKernel::from_value(std::env::var(ATTENTION_VAR).ok().as_deref())
    }

    fn from_value(v: Option<&str>) -> Result<AttentionKernel> {
        Ok(super::products::choose(ATTENTION_VAR, v, &Self::ALL, Self::name)?.unwrap_or_default())
    }
}

/// How the chunks kernel is launched: the same bits each way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChunkLaunch {
    /// Split up to `SPLIT_PAIRS` (token, head) pairs, fold beyond.
    Auto,
    /// A block a (token, head), its chunks one after another.
    Fold,
    /// A warp a chunk (grid.z = `ATT_SPLITS` / 4), the last of a query's merging.
    Split,
    /// Split by GQA group: a warp a chunk of up to `att_group_heads` query heads sharing a KV
    /// head (`fw_attention_groups`), the last of a group's merging each of its heads.
    Groups,
    /// `Groups` up to `SPLIT_PAIRS` (token, head) pairs, fold beyond.
    AutoGroups,
}

/// Query heads a warp of the groups launch takes at once, for heads of up to `dim` values (64,
/// 128, 256): `FW_ATT_GROUPS`'s GP (registers: GP · dim / 32 sums a lane).
pub fn att_group_heads(dim: usize) -> usize {
    if dim <= 128 {
        4
    } else {
        2
    }
}

/// The split launch's partials (`SPLIT_PAIRS` × `ATT_SPLITS` × (head_dim + 2) floats) and its
/// counters (zero between launches: the last block of a query resets its own). One a `Gpu`: its
/// launches run in order on one stream.
pub(super) struct AttnScratch {
    part: CudaSlice<f32>,
    counters: CudaSlice<u32>,
}

impl AttnScratch {
    pub(super) fn new(stream: &std::sync::Arc<CudaStream>) -> Result<AttnScratch> {
        Ok(AttnScratch {
            part: stream.alloc_zeros(SPLIT_PAIRS * ATT_SPLITS * (ATT_MAX_HEAD_DIM + 2))?,
            counters: stream.alloc_zeros(SPLIT_PAIRS)?,
        })
    }
}

/// (chunk length, chunks) for a query that sees `n_pos` positions (`fw_att_chunks`).
pub fn att_chunks(n_pos: usize) -> (usize, usize) {
    let len = ATT_TILE * n_pos.div_ceil(ATT_TILE * ATT_SPLITS).max(1);
    (len, n_pos.div_ceil(len))
}

/// The arguments both kernels check.
#[allow(clippy::too_many_arguments)]
fn check_args<E: GpuKv>(
    g: &Gpu,
    q: &impl DevicePtr<f32>,
    out: &impl DevicePtrMut<f32>,
    tokens: &Tokens,
    kc: &impl DevicePtr<E>,
    vc: &impl DevicePtr<E>,
    (n_heads, n_kv_heads, head_dim): (usize, usize, usize),
    softcap: Option<f32>,
) -> Result<()> {
    check(softcap.is_none_or(|c| c.is_finite() && c > 0.0), || {
        format!("soft-cap {softcap:?} (a positive number)")
    })?;
    check(
        n_kv_heads > 0 && n_heads.is_multiple_of(n_kv_heads) && n_heads <= 65535,
        || format!("{n_heads} query heads over {n_kv_heads} KV heads"),
    )?;
    check((1..=ATT_MAX_HEAD_DIM).contains(&head_dim), || {
        format!("head_dim {head_dim} (the kernel takes 1..={ATT_MAX_HEAD_DIM})")
    })?;
    let n = tokens.n;
    len_at_least(q, n * n_heads * head_dim, "attention q")?;
    len_at_least(out, n * n_heads * head_dim, "attention out")?;
    g.cache_fits(tokens, n_kv_heads * head_dim, kc, vc)
}

impl Gpu {
    /// Causal GQA attention of the batch's queries q (tokens.n, n_heads·head_dim) over the cache,
    /// through a sliding window and with soft-capped scores as `opts` says
    /// (`reference::AttnOpts`; an `Option<usize>` is a window alone), by the kernel this `Gpu`
    /// launches (`attention_kernel`).
    #[allow(clippy::too_many_arguments)]
    pub fn attention<E: GpuKv>(
        &self,
        q: &impl DevicePtr<f32>,
        out: &mut impl DevicePtrMut<f32>,
        tokens: &Tokens,
        kc: &impl DevicePtr<E>,
        vc: &impl DevicePtr<E>,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        scale: f32,
        opts: impl Into<AttnOpts>,
    ) -> Result<()> {
        let heads = (n_heads, n_kv_heads, head_dim);
        match self.attention_kernel {
            AttentionKernel::Rows => {
                self.attention_rows(q, out, tokens, kc, vc, heads, scale, opts.into())
            }
            AttentionKernel::Chunks => {
                let how = ChunkLaunch::Auto;
                self.attention_chunks(q, out, tokens, kc, vc, heads, scale, opts, how)
            }
            AttentionKernel::Groups => {
                let how = ChunkLaunch::AutoGroups;
                self.attention_chunks(q, out, tokens, kc, vc, heads, scale, opts, how)
            }
        }
    }

    /// The attention kernel `attention` launches (`FLYWHEEL_CUDA_ATTENTION`).
    pub fn attention_kernel(&self) -> AttentionKernel {
        self.attention_kernel
    }

    /// Launch later attention by `kernel`.
    pub fn set_attention_kernel(&mut self, kernel: AttentionKernel) {
        self.attention_kernel = kernel;
    }

    #[allow(clippy::too_many_arguments)]
    fn attention_rows<E: GpuKv>(
        &self,
        q: &impl DevicePtr<f32>,
        out: &mut impl DevicePtrMut<f32>,
        tokens: &Tokens,
        kc: &impl DevicePtr<E>,
        vc: &impl DevicePtr<E>,
        (n_heads, n_kv_heads, head_dim): (usize, usize, usize),
        scale: f32,
        AttnOpts { window, softcap }: AttnOpts,
    ) -> Result<()> {
        let heads = (n_heads, n_kv_heads, head_dim);
        check_args(self, q, out, tokens, kc, vc, heads, softcap)?;
        let n = tokens.n;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(&format!("fw_attention_{}", E::NAME))?;
        let cfg = LaunchConfig {
            grid_dim: (n as u32, n_heads as u32, 1),
            block_dim: (ATT_WARPS * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        let opts = AttnOpts { window, softcap };
        self.launch_attention(f, cfg, (q, out, tokens, kc, vc), heads, scale, opts, &[])
    }

    /// Launch an attention kernel with the arguments both take (then `extra`).
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn launch_attention<E: GpuKv>(
        &self,
        f: &CudaFunction,
        cfg: LaunchConfig,
        (q, out, tokens, kc, vc): (
            &impl DevicePtr<f32>,
            &mut impl DevicePtrMut<f32>,
            &Tokens,
            &impl DevicePtr<E>,
            &impl DevicePtr<E>,
        ),
        (n_heads, n_kv_heads, head_dim): (usize, usize, usize),
        scale: f32,
        AttnOpts { window, softcap }: AttnOpts,
        extra: &[&dyn Arg],
    ) -> Result<()> {
        let (qp, op, kp, vp) = (self.ptr(q), self.ptr_mut(out), self.ptr(kc), self.ptr(vc));
        let (nh, nkv, hd, bs) = (
            n_heads as i32,
            n_kv_heads as i32,
            head_dim as i32,
            tokens.block_size as i32,
        );
        let win = window.map_or(0, |w| w.min(i32::MAX as usize) as i32);
        let cap = softcap.unwrap_or(0.0);
        let toks = self.tokens_arg(tokens);
        let mut args: Vec<&dyn Arg> = vec![
            &qp, &op, &toks, &kp, &vp, &nh, &nkv, &hd, &bs, &scale, &win, &cap,
        ];
        args.extend_from_slice(extra);
        self.launch(f, cfg, &args)
    }

    /// Attention by the chunks kernel, launched as `how` says (the same bits every way).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_chunks<E: GpuKv>(
        &self,
        q: &impl DevicePtr<f32>,
        out: &mut impl DevicePtrMut<f32>,
        tokens: &Tokens,
        kc: &impl DevicePtr<E>,
        vc: &impl DevicePtr<E>,
        (n_heads, n_kv_heads, head_dim): (usize, usize, usize),
        scale: f32,
        opts: impl Into<AttnOpts>,
        how: ChunkLaunch,
    ) -> Result<()> {
        let AttnOpts { window, softcap } = opts.into();
        let heads = (n_heads, n_kv_heads, head_dim);
        check_args(self, q, out, tokens, kc, vc, heads, softcap)?;
        let n = tokens.n;
        if n == 0 {
            return Ok(());
        }
        let pairs = n * n_heads;
        // The launch itself: Fold, Split or Groups.
        let fits = pairs <= SPLIT_PAIRS;
        let launch = match how {
            ChunkLaunch::Auto if fits => ChunkLaunch::Split,
            ChunkLaunch::AutoGroups if fits => ChunkLaunch::Groups,
            ChunkLaunch::Auto | ChunkLaunch::AutoGroups | ChunkLaunch::Fold => ChunkLaunch::Fold,
            ChunkLaunch::Split | ChunkLaunch::Groups => {
                check(fits, || {
                    format!("a split attention launch of {pairs} (token, head) pairs (at most {SPLIT_PAIRS})")
                })?;
                how
            }
        };
        check(n <= i32::MAX as usize, || format!("{n} tokens"))?;
        // Compiled for heads of up to 64, 128 and 256 values (registers for what the head has).
        let dim = [64, 128, 256].into_iter().find(|&d| head_dim <= d).unwrap();
        let kernel = if launch == ChunkLaunch::Groups {
            "groups"
        } else {
            "chunks"
        };
        let f = self.function(&format!("fw_attention_{kernel}_{}_{dim}", E::NAME))?;
        // A fold keeps a query's partials in shared memory (at most 33 KB).
        let fold_bytes = ATT_SPLITS * (head_dim + 2) * 4;
        let splits = (ATT_SPLITS / ATT_CHUNK_WARPS) as u32;
        let group = (n_heads / n_kv_heads).div_ceil(att_group_heads(dim));
        let cfg = LaunchConfig {
            grid_dim: match launch {
                ChunkLaunch::Fold => (n as u32, n_heads as u32, 1),
                ChunkLaunch::Groups => (n as u32, (n_kv_heads * group) as u32, splits),
                _ => (n as u32, n_heads as u32, splits),
            },
            block_dim: (ATT_CHUNK_WARPS as u32 * 32, 1, 1),
            shared_mem_bytes: if launch == ChunkLaunch::Fold {
                fold_bytes as u32
            } else {
                0
            },
        };
        // The scratch is the device's to write: its handle is shared, its contents are not
        // Rust's (launches on the one stream run in order).
        let (pp, cp) = (
            self.ptr(&self.att_scratch.part),
            self.ptr(&self.att_scratch.counters),
        );
        let sp = (launch == ChunkLaunch::Split) as i32;
        let opts = AttnOpts { window, softcap };
        let extra: [&dyn Arg; 3] = [&pp, &cp, &sp];
        // The groups kernel takes no `split` (it is one).
        let extra = &extra[..if launch == ChunkLaunch::Groups { 2 } else { 3 }];
        self.launch_attention(f, cfg, (q, out, tokens, kc, vc), heads, scale, opts, extra)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_every_position_once_in_at_most_the_splits() {
        for n_pos in 1..=5000 {
            let (len, count) = att_chunks(n_pos);
            assert!(
                len % ATT_TILE == 0 && (1..=ATT_SPLITS).contains(&count),
                "{n_pos}"
            );
            assert!((count - 1) * len < n_pos && count * len >= n_pos, "{n_pos}");
            // The fewest tiles a chunk that leave at most ATT_SPLITS chunks.
            if len > ATT_TILE {
                assert!(n_pos.div_ceil(len - ATT_TILE) > ATT_SPLITS, "{n_pos}");
            }
        }
        assert_eq!(att_chunks(70), (32, 3));
        assert_eq!(att_chunks(2048), (64, 32));
        assert_eq!(att_chunks(8192), (256, 32));
        assert_eq!(att_chunks(32768), (1024, 32));
    }

    #[test]
    fn the_kernel_is_named_and_an_unknown_one_names_the_choices() {
        assert_eq!(
            AttentionKernel::from_value(None).unwrap(),
            AttentionKernel::Chunks
        );
        assert_eq!(
            AttentionKernel::from_value(Some(" rows")).unwrap(),
            AttentionKernel::Rows
        );
        let e = AttentionKernel::from_value(Some("flash")).unwrap_err().0;
        assert!(
            e.contains("FLYWHEEL_CUDA_ATTENTION=flash") && e.contains("rows, chunks, groups"),
            "{e}"
        );
    }
}
