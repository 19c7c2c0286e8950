//! Paged KV storage: per layer, `num_blocks` blocks of `block_size` token slots of K and V (f32,
//! or IEEE halves); with a window pool (`with_window_pool`), the sliding-window layers hold
//! `window_blocks` blocks each instead, addressed by the sequences' window tables.
//! Which block belongs to which sequence is the caller's business (a block table per sequence);
//! `BlockAllocator` is the simple free list used until the engine's block manager owns this.

use flywheel_kernels::reference::{KvElem, PagedKv, F16};

/// What K and V are stored as.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvDtype {
    #[default]
    F32,
    /// IEEE halves (half the memory; llama.cpp's default). The forward rounds K and V to halves
    /// before storing and attending (`Llama::layer`), serving and training alike, so train =
    /// serve holds to the bit and the backward sees the values the forward used.
    F16,
}

impl KvDtype {
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 => 2,
        }
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<KvDtype, String> {
        match s {
            "f32" | "float32" => Ok(KvDtype::F32),
            "f16" | "float16" | "half" => Ok(KvDtype::F16),
            other => Err(format!(
                "'{other}': the KV cache is stored as \"f16\" or \"f32\""
            )),
        }
    }
}

enum Store {
    F32 { k: Vec<f32>, v: Vec<f32> },
    F16 { k: Vec<F16>, v: Vec<F16> },
}

pub struct KvCache {
    store: Store,
    pub num_layers: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    pub kv_dim: usize,
    /// Per layer: its blocks and where its K (and V) start in the store.
    layer_blocks: Vec<usize>,
    layer_start: Vec<usize>,
    /// Which layers keep their K/V in the window pool.
    windowed: Vec<bool>,
}

/// One layer's K/V as the attention reads them, in the cache's element type.
pub enum LayerKv<'a> {
    F32(PagedKv<'a, f32>),
    F16(PagedKv<'a, F16>),
}

/// Allocate `n` elements and touch every page now: zeroed allocations are mapped lazily, so the
/// first-touch page faults happen at start-up instead of in the middle of serving.
fn touched<E: Copy>(n: usize, zero: E) -> Vec<E> {
    let mut v = vec![zero; n];
    v.fill(zero);
    v
}

impl KvCache {
    /// An f32 cache.
    pub fn new(num_layers: usize, kv_dim: usize, block_size: usize, num_blocks: usize) -> KvCache {
        KvCache::with_dtype(num_layers, kv_dim, block_size, num_blocks, KvDtype::F32)
    }

    pub fn with_dtype(
        num_layers: usize,
        kv_dim: usize,
        block_size: usize,
        num_blocks: usize,
        dtype: KvDtype,
    ) -> KvCache {
        let windowed = vec![false; num_layers];
        KvCache::with_window_pool(kv_dim, block_size, num_blocks, dtype, windowed, 0)
    }

    /// A cache whose `windowed` layers hold `window_blocks` blocks each (the block manager's
    /// window pool: `BlockTable::window_ids` address them), the others `num_blocks`.
    pub fn with_window_pool(
        kv_dim: usize,
        block_size: usize,
        num_blocks: usize,
        dtype: KvDtype,
        windowed: Vec<bool>,
        window_blocks: usize,
    ) -> KvCache {
        let num_layers = windowed.len();
        let layer_blocks: Vec<usize> = windowed
            .iter()
            .map(|&w| if w { window_blocks } else { num_blocks })
            .collect();
        let layer_start: Vec<usize> = layer_blocks
            .iter()
            .scan(0, |at, &b| {
                let start = *at;
                *at += b * block_size * kv_dim;
                Some(start)
            })
            .collect();
        let n = layer_blocks.iter().sum::<usize>() * block_size * kv_dim;
        let store = match dtype {
            KvDtype::F32 => Store::F32 {
                k: touched(n, 0.0),
                v: touched(n, 0.0),
            },
            KvDtype::F16 => Store::F16 {
                k: touched(n, F16(0)),
                v: touched(n, F16(0)),
            },
        };
        KvCache {
            store,
            num_layers,
            num_blocks,
            block_size,
            kv_dim,
            layer_blocks,
            layer_start,
            windowed,
        }
    }

    /// Layer `l` keeps its K/V in the window pool (its sequences' window tables address it).
    pub fn windowed(&self, l: usize) -> bool {
        self.windowed[l]
    }

    /// The bytes of K and V held.
    pub fn bytes(&self) -> usize {
        let elems = self.layer_blocks.iter().sum::<usize>() * self.block_size * self.kv_dim;
        2 * elems * self.dtype().bytes()
    }

    pub fn dtype(&self) -> KvDtype {
        match self.store {
            Store::F32 { .. } => KvDtype::F32,
            Store::F16 { .. } => KvDtype::F16,
        }
    }

    /// Layer `l`'s span of the store.
    fn span(&self, l: usize) -> std::ops::Range<usize> {
        let start = self.layer_start[l];
        start..start + self.layer_blocks[l] * self.block_size * self.kv_dim
    }

    pub fn layer(&self, l: usize) -> LayerKv<'_> {
        let r = self.span(l);
        let (block_size, kv_dim) = (self.block_size, self.kv_dim);
        match &self.store {
            Store::F32 { k, v } => LayerKv::F32(PagedKv {
                k: &k[r.clone()],
                v: &v[r],
                block_size,
                kv_dim,
            }),
            Store::F16 { k, v } => LayerKv::F16(PagedKv {
                k: &k[r.clone()],
                v: &v[r],
                block_size,
                kv_dim,
            }),
        }
    }

    /// Where position `pos` of the sequence with `block_table` lives in layer `l`: its V row's
    /// offset, its K block's start, and its slot in the block.
    fn place(&self, l: usize, block_table: &[u32], pos: usize) -> (usize, usize, usize) {
        let start = self.layer_start[l];
        let block = block_table[pos / self.block_size] as usize;
        assert!(
            block < self.layer_blocks[l],
            "block id {block} out of range"
        );
        let (bs, slot, kvd) = (self.block_size, pos % self.block_size, self.kv_dim);
        (
            start + (block * bs + slot) * kvd,
            start + block * bs * kvd,
            slot,
        )
    }

    /// Store the K and V rows of position `pos` of the sequence with `block_table` in layer `l`
    /// (an f16 cache takes values already rounded to halves: stored exactly).
    pub fn write(&mut self, l: usize, block_table: &[u32], pos: usize, k: &[f32], v: &[f32]) {
        let (off, kstart, slot) = self.place(l, block_table, pos);
        let bs = self.block_size;
        match &mut self.store {
            Store::F32 { k: ks, v: vs } => put(ks, vs, off, kstart, bs, slot, k, v, |x| x),
            Store::F16 { k: ks, v: vs } => put(ks, vs, off, kstart, bs, slot, k, v, |x| {
                let h = F16(flywheel_kernels::quant::f32_to_f16(x));
                debug_assert_eq!(
                    h.to_f32(),
                    x,
                    "f16 KV values are rounded before they are stored"
                );
                h
            }),
        }
    }

    /// `write` with rows already in halves (`Cpu::round_to_f16`'s bits): stored as they are in
    /// an f16 cache, widened in an f32 one.
    pub fn write_f16(&mut self, l: usize, block_table: &[u32], pos: usize, k: &[F16], v: &[F16]) {
        let (off, kstart, slot) = self.place(l, block_table, pos);
        let bs = self.block_size;
        match &mut self.store {
            Store::F16 { k: ks, v: vs } => put(ks, vs, off, kstart, bs, slot, k, v, |x| x),
            Store::F32 { k: ks, v: vs } => {
                put(ks, vs, off, kstart, bs, slot, k, v, |x: F16| x.to_f32())
            }
        }
    }
}

/// One position's V row at `off`, and its K values transposed within the block at `kstart`
/// (see `PagedKv`).
#[allow(clippy::too_many_arguments)]
fn put<T: Copy, E: Copy>(
    ks: &mut [E],
    vs: &mut [E],
    off: usize,
    kstart: usize,
    bs: usize,
    slot: usize,
    k: &[T],
    v: &[T],
    conv: impl Fn(T) -> E,
) {
    for (d, &x) in vs[off..off + v.len()].iter_mut().zip(v) {
        *d = conv(x);
    }
    let kb = &mut ks[kstart..kstart + bs * k.len()];
    for (c, &x) in k.iter().enumerate() {
        kb[c * bs + slot] = conv(x);
    }
}

/// A free list of block ids.
pub struct BlockAllocator {
    free: Vec<u32>,
}

impl BlockAllocator {
    pub fn new(num_blocks: usize) -> BlockAllocator {
        BlockAllocator {
            free: (0..num_blocks as u32).rev().collect(),
        }
    }
    pub fn alloc(&mut self) -> Option<u32> {
        self.free.pop()
    }
    /// Grow `table` so that it covers `num_tokens` tokens; false when out of blocks.
    pub fn ensure(&mut self, table: &mut Vec<u32>, num_tokens: usize, block_size: usize) -> bool {
        while table.len() * block_size < num_tokens {
            match self.alloc() {
                Some(b) => table.push(b),
                None => return false,
            }
        }
        true
    }
}
