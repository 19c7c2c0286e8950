//! Paged-KV bookkeeping: which block ids are in use, by how many sequences, and which full blocks
//! hold a known prefix (prefix caching). Pure data, no KV storage; single-threaded (the engine's).
//!
//! A full block is keyed by a hash chained over every token before it and by the adapter version
//! that computed it, so a hit means "the same tokens at the same positions under the same policy".
//! Freed blocks keep their key until reused: they are evicted least-recently-freed first, and blocks
//! without a key before any cached one.

use std::cell::RefCell;
use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, VecDeque};
use std::hash::Hasher;
use std::rc::Rc;

pub type BlockId = u32;

#[derive(Clone, Default)]
struct Meta {
    ref_count: u32,
    /// Set when the block is full, computed and registered in the prefix cache.
    hash: Option<u64>,
}

struct Inner {
    block_size: usize,
    meta: Vec<Meta>,
    /// Blocks with no reference: front is reused first.
    free: VecDeque<BlockId>,
    cached: HashMap<u64, BlockId>,
    enable_prefix_caching: bool,
    num_prefix_queried_tokens: u64,
    num_prefix_hit_tokens: u64,
}

impl Inner {
    fn alloc(&mut self) -> Option<BlockId> {
        let id = self.free.pop_front()?;
        let m = &mut self.meta[id as usize];
        if let Some(h) = m.hash.take() {
            if self.cached.get(&h) == Some(&id) {
                self.cached.remove(&h);
            }
        }
        m.ref_count = 1;
        Some(id)
    }

    fn acquire(&mut self, id: BlockId) {
        let m = &mut self.meta[id as usize];
        if m.ref_count == 0 {
            if let Some(i) = self.free.iter().position(|&b| b == id) {
                self.free.remove(i);
            }
        }
        m.ref_count += 1;
    }

    fn release(&mut self, id: BlockId) {
        let m = &mut self.meta[id as usize];
        debug_assert!(m.ref_count > 0, "block {id} released twice");
        m.ref_count -= 1;
        if m.ref_count == 0 {
            if m.hash.is_some() {
                self.free.push_back(id);
            } else {
                self.free.push_front(id);
            }
        }
    }
}

/// Cheap to clone: every clone and every `BlockTable` share the one pool.
#[derive(Clone)]
pub struct BlockManager(Rc<RefCell<Inner>>);

/// The hash of a full block, chained to the hash of the block before it.
pub fn block_hash(parent: u64, tokens: &[u32], adapter_version: u64) -> u64 {
    let mut h = DefaultHasher::new();
    h.write_u64(parent);
    h.write_u64(adapter_version);
    for t in tokens {
        h.write_u32(*t);
    }
    h.finish()
}

#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BlockStats {
    pub num_blocks: usize,
    pub num_used: usize,
    pub num_cached: usize,
    pub num_prefix_queried_tokens: u64,
    pub num_prefix_hit_tokens: u64,
}

impl BlockManager {
    pub fn new(num_blocks: usize, block_size: usize, enable_prefix_caching: bool) -> BlockManager {
        BlockManager(Rc::new(RefCell::new(Inner {
            block_size,
            meta: vec![Meta::default(); num_blocks],
            free: (0..num_blocks as BlockId).collect(),
            cached: HashMap::new(),
            enable_prefix_caching,
            num_prefix_queried_tokens: 0,
            num_prefix_hit_tokens: 0,
        })))
    }

    pub fn block_size(&self) -> usize {
        self.0.borrow().block_size
    }

    pub fn num_free(&self) -> usize {
        self.0.borrow().free.len()
    }

    pub fn stats(&self) -> BlockStats {
        let i = self.0.borrow();
        BlockStats {
            num_blocks: i.meta.len(),
            num_used: i.meta.len() - i.free.len(),
            num_cached: i.cached.len(),
            num_prefix_queried_tokens: i.num_prefix_queried_tokens,
            num_prefix_hit_tokens: i.num_prefix_hit_tokens,
        }
    }

    pub fn new_table(&self) -> BlockTable {
        BlockTable {
            ids: Vec::new(),
            hashes: Vec::new(),
            mgr: self.clone(),
        }
    }
}

/// One sequence's blocks, in position order. Dropping it (or `clear`) releases them.
pub struct BlockTable {
    ids: Vec<BlockId>,
    /// Hash chain of the leading full blocks already registered or matched.
    hashes: Vec<u64>,
    mgr: BlockManager,
}

impl BlockTable {
    pub fn ids(&self) -> &[BlockId] {
        &self.ids
    }

    pub fn num_blocks(&self) -> usize {
        self.ids.len()
    }

    /// Take the cached blocks holding the longest full-block prefix of `tokens`; return how many
    /// tokens they cover. At least one token is always left to compute (its logits are needed).
    /// Call on an empty table only.
    pub fn match_prefix(&mut self, tokens: &[u32], adapter_version: u64) -> usize {
        assert!(self.ids.is_empty(), "match_prefix on a non-empty table");
        let mut inner = self.mgr.0.borrow_mut();
        if !inner.enable_prefix_caching {
            return 0;
        }
        let bs = inner.block_size;
        let max_blocks = tokens.len().saturating_sub(1) / bs;
        let mut parent = 0;
        for chunk in tokens.chunks_exact(bs).take(max_blocks) {
            let h = block_hash(parent, chunk, adapter_version);
            let Some(&id) = inner.cached.get(&h) else {
                break;
            };
            inner.acquire(id);
            self.ids.push(id);
            self.hashes.push(h);
            parent = h;
        }
        let hit = self.ids.len() * bs;
        inner.num_prefix_queried_tokens += tokens.len() as u64;
        inner.num_prefix_hit_tokens += hit as u64;
        hit
    }

    /// Grow the table to cover `num_tokens` positions: all or nothing; false when out of blocks.
    pub fn ensure(&mut self, num_tokens: usize) -> bool {
        let mut inner = self.mgr.0.borrow_mut();
        let need = num_tokens
            .div_ceil(inner.block_size)
            .saturating_sub(self.ids.len());
        if need > inner.free.len() {
            return false;
        }
        for _ in 0..need {
            let id = inner.alloc().expect("counted free blocks");
            self.ids.push(id);
        }
        true
    }

    /// Register the full blocks among the first `num_computed` tokens in the prefix cache.
    pub fn register_full_blocks(&mut self, tokens: &[u32], num_computed: usize, version: u64) {
        let mut inner = self.mgr.0.borrow_mut();
        if !inner.enable_prefix_caching {
            return;
        }
        let bs = inner.block_size;
        let num_full = (num_computed.min(tokens.len()) / bs).min(self.ids.len());
        while self.hashes.len() < num_full {
            let b = self.hashes.len();
            let parent = self.hashes.last().copied().unwrap_or(0);
            let h = block_hash(parent, &tokens[b * bs..(b + 1) * bs], version);
            self.hashes.push(h);
            let id = self.ids[b];
            if inner.meta[id as usize].hash.is_none() && !inner.cached.contains_key(&h) {
                inner.meta[id as usize].hash = Some(h);
                inner.cached.insert(h, id);
            }
        }
    }

    /// A new table sharing this one's first `num_blocks` blocks (for the other choices of a
    /// request, which share its prompt).
    pub fn share_prefix(&self, num_blocks: usize) -> BlockTable {
        let mut inner = self.mgr.0.borrow_mut();
        let ids = self.ids[..num_blocks].to_vec();
        for &id in &ids {
            inner.acquire(id);
        }
        BlockTable {
            ids,
            hashes: self.hashes[..num_blocks.min(self.hashes.len())].to_vec(),
            mgr: self.mgr.clone(),
        }
    }

    /// Release every block (preemption), the last first: a chain's tail is then evicted before
    /// its head, which other prompts are likelier to share.
    pub fn clear(&mut self) {
        let mut inner = self.mgr.0.borrow_mut();
        for id in self.ids.drain(..).rev() {
            inner.release(id);
        }
        self.hashes.clear();
    }
}

impl Drop for BlockTable {
    fn drop(&mut self) {
        self.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_allocate_all_or_nothing_and_free_on_drop() {
        let m = BlockManager::new(4, 16, true);
        let mut a = m.new_table();
        assert!(a.ensure(33));
        assert_eq!(a.num_blocks(), 3);
        let mut b = m.new_table();
        assert!(!b.ensure(20), "needs 2, 1 free");
        assert_eq!(b.num_blocks(), 0);
        assert_eq!(m.num_free(), 1);
        drop(a);
        assert_eq!(m.num_free(), 4);
        assert!(b.ensure(64));
        assert_eq!(m.stats().num_used, 4);
    }

    #[test]
    fn prefix_hits_need_same_tokens_positions_and_version() {
        let m = BlockManager::new(8, 4, true);
        let toks: Vec<u32> = (0..10).collect();
        let mut a = m.new_table();
        assert_eq!(a.match_prefix(&toks, 0), 0);
        assert!(a.ensure(10));
        a.register_full_blocks(&toks, 10, 0);
        let a_ids = a.ids().to_vec();
        drop(a);
        // Freed, but still cached: a new sequence with the same first 8 tokens reuses 2 blocks.
        let mut b = m.new_table();
        assert_eq!(b.match_prefix(&toks, 0), 8);
        assert_eq!(b.ids(), &a_ids[..2]);
        // Another version, or a change in the first block, hits nothing.
        assert_eq!(m.new_table().match_prefix(&toks, 1), 0);
        let mut other = toks.clone();
        other[1] = 99;
        assert_eq!(m.new_table().match_prefix(&other, 0), 0);
        // A change in the second block keeps the first.
        other = toks.clone();
        other[5] = 99;
        assert_eq!(m.new_table().match_prefix(&other, 0), 4);
        // A whole-prompt hit leaves the last token to compute.
        assert_eq!(m.new_table().match_prefix(&toks[..8], 0), 4);
        let s = m.stats();
        assert!(s.num_prefix_hit_tokens == 16 && s.num_prefix_queried_tokens == 58);
        drop(b);
    }

    #[test]
    fn uncached_blocks_are_reused_before_cached_ones() {
        let m = BlockManager::new(3, 2, true);
        let mut a = m.new_table();
        assert!(a.ensure(4));
        a.register_full_blocks(&[1, 2, 3, 4], 4, 0);
        drop(a);
        let mut b = m.new_table();
        assert!(b.ensure(2)); // takes the never-used block
        assert_eq!(m.stats().num_cached, 2);
        assert_eq!(m.new_table().match_prefix(&[1, 2, 3, 4, 5], 0), 4);
        assert!(b.ensure(6)); // now must evict both cached blocks
        assert_eq!(m.stats().num_cached, 0);
        assert_eq!(m.new_table().match_prefix(&[1, 2, 3, 4, 5], 0), 0);
    }

    #[test]
    fn shared_blocks_live_until_the_last_holder_drops() {
        let m = BlockManager::new(4, 2, false);
        let mut a = m.new_table();
        assert!(a.ensure(5));
        let b = a.share_prefix(2);
        assert_eq!(b.ids(), &a.ids()[..2]);
        drop(a);
        assert_eq!(m.num_free(), 2);
        drop(b);
        assert_eq!(m.num_free(), 4);
    }
}
