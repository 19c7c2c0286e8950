//! Paged KV storage: per layer, `num_blocks` blocks of `block_size` token slots of K and V (f32).
//! Which block belongs to which sequence is the caller's business (a block table per sequence);
//! `BlockAllocator` is the simple free list used until the engine's block manager owns this.

use flywheel_kernels::reference::PagedKv;

pub struct KvCache {
    k: Vec<f32>,
    v: Vec<f32>,
    pub num_layers: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    pub kv_dim: usize,
}

impl KvCache {
    pub fn new(num_layers: usize, kv_dim: usize, block_size: usize, num_blocks: usize) -> KvCache {
        let n = num_layers * num_blocks * block_size * kv_dim;
        let (mut k, mut v) = (vec![0.0; n], vec![0.0; n]);
        // Touch every page now: zeroed allocations are mapped lazily, so the first-touch page
        // faults happen at start-up instead of in the middle of serving.
        k.fill(0.0);
        v.fill(0.0);
        KvCache {
            k,
            v,
            num_layers,
            num_blocks,
            block_size,
            kv_dim,
        }
    }

    fn layer_len(&self) -> usize {
        self.num_blocks * self.block_size * self.kv_dim
    }

    pub fn layer(&self, l: usize) -> PagedKv<'_> {
        let n = self.layer_len();
        PagedKv {
            k: &self.k[l * n..(l + 1) * n],
            v: &self.v[l * n..(l + 1) * n],
            block_size: self.block_size,
            kv_dim: self.kv_dim,
        }
    }

    /// Store the K and V rows of position `pos` of the sequence with `block_table` in layer `l`.
    pub fn write(&mut self, l: usize, block_table: &[u32], pos: usize, k: &[f32], v: &[f32]) {
        let n = self.layer_len();
        let block = block_table[pos / self.block_size] as usize;
        assert!(block < self.num_blocks, "block id {block} out of range");
        let (bs, slot) = (self.block_size, pos % self.block_size);
        let off = l * n + (block * bs + slot) * self.kv_dim;
        self.v[off..off + self.kv_dim].copy_from_slice(v);
        // K is transposed within its block (see `PagedKv`).
        let kb = &mut self.k[l * n + block * bs * self.kv_dim..][..bs * self.kv_dim];
        for (c, x) in k.iter().enumerate() {
            kb[c * bs + slot] = *x;
        }
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
