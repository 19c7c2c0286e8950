//! Paged-KV bookkeeping: which block ids are in use, by how many sequences, and which full blocks
//! hold a known prefix (prefix caching). Pure data, no KV storage; single-threaded (the engine's).
//!
//! A full block is keyed by a hash chained over every token before it and by the adapter version
//! that computed it, so a hit means "the same tokens at the same positions under the same policy".
//! Freed blocks keep their key until reused: they are evicted least-recently-freed first, and blocks
//! without a key before any cached one.
//!
//! A model with sliding-window layers may keep their K/V in a second pool (`WindowPool`): a
//! sequence's table then holds, per block of positions, a block of each pool; the window pool's
//! blocks wholly before every future query's window are given back as the sequence advances
//! (`SLID` in their place), so a long context costs those layers only its window. They keep their
//! prefix key when given back: a prefix hit takes the global blocks of the prefix and the window
//! blocks of its last window, and only where both are still cached.

use std::cell::RefCell;
use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::Hasher;
use std::rc::Rc;

pub type BlockId = u32;

mod free_list;
use free_list::FreeList;

/// A window-pool table entry whose block was given back (before every query's window).
pub const SLID: BlockId = BlockId::MAX;

#[derive(Clone, Default)]
struct Meta {
    ref_count: u32,
    /// Set when the block is full, computed and registered in the prefix cache.
    hash: Option<u64>,
}

/// One pool of blocks: reference counts, the free list, the prefix cache.
struct Pool {
    meta: Vec<Meta>,
    /// Blocks with no reference: front is reused first.
    free: FreeList,
    cached: HashMap<u64, BlockId>,
}

impl Pool {
    fn new(num_blocks: usize) -> Pool {
        Pool {
            meta: vec![Meta::default(); num_blocks],
            free: FreeList::new(num_blocks),
            cached: HashMap::new(),
        }
    }

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
        if m.ref_count == 0 && self.free.contains(id) {
            self.free.remove(id);
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

    /// Key block `id` by `h` unless it has a key or another block holds `h`.
    fn register(&mut self, id: BlockId, h: u64) {
        if self.meta[id as usize].hash.is_none() && !self.cached.contains_key(&h) {
            self.meta[id as usize].hash = Some(h);
            self.cached.insert(h, id);
        }
    }
}

/// The sliding-window layers' own pool: `window` keys per query.
struct WindowPool {
    window: usize,
    pool: Pool,
}

struct Inner {
    block_size: usize,
    full: Pool,
    win: Option<WindowPool>,
    enable_prefix_caching: bool,
    num_prefix_queried_tokens: u64,
    num_prefix_hit_tokens: u64,
}

impl Inner {
    /// The first block a query at position `pos` or later reads in a window layer.
    fn first_window_block(&self, pos: usize) -> usize {
        let w = self.win.as_ref().map_or(usize::MAX, |w| w.window);
        (pos + 1).saturating_sub(w) / self.block_size
    }

    /// The window blocks keyed `hashes[first_window_block(n·bs)..n]`, if all are cached.
    fn cached_window(&self, hashes: &[u64], n: usize) -> Option<Vec<BlockId>> {
        let w = &self.win.as_ref()?.pool;
        let lo = self.first_window_block(n * self.block_size);
        hashes[lo..n]
            .iter()
            .map(|h| w.cached.get(h).copied())
            .collect()
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
    /// The window pool's blocks and those in use (0 without one).
    pub num_window_blocks: usize,
    pub num_window_used: usize,
}

impl BlockManager {
    pub fn new(num_blocks: usize, block_size: usize, enable_prefix_caching: bool) -> BlockManager {
        BlockManager(Rc::new(RefCell::new(Inner {
            block_size,
            full: Pool::new(num_blocks),
            win: None,
            enable_prefix_caching,
            num_prefix_queried_tokens: 0,
            num_prefix_hit_tokens: 0,
        })))
    }

    /// With a pool of `num_blocks` for the sliding-window layers, whose queries read `window`
    /// keys (call before any table is made).
    pub fn with_window_pool(self, window: usize, num_blocks: usize) -> BlockManager {
        assert!(window > 0, "a window holds at least one key");
        self.0.borrow_mut().win = Some(WindowPool {
            window,
            pool: Pool::new(num_blocks),
        });
        self
    }

    pub fn block_size(&self) -> usize {
        self.0.borrow().block_size
    }

    /// Free blocks of the global pool.
    pub fn num_free(&self) -> usize {
        self.0.borrow().full.free.len()
    }

    pub fn stats(&self) -> BlockStats {
        let i = self.0.borrow();
        let (num_window_blocks, num_window_used) = i.win.as_ref().map_or((0, 0), |w| {
            (w.pool.meta.len(), w.pool.meta.len() - w.pool.free.len())
        });
        BlockStats {
            num_blocks: i.full.meta.len(),
            num_used: i.full.meta.len() - i.full.free.len(),
            num_cached: i.full.cached.len(),
            num_prefix_queried_tokens: i.num_prefix_queried_tokens,
            num_prefix_hit_tokens: i.num_prefix_hit_tokens,
            num_window_blocks,
            num_window_used,
        }
    }

    pub fn new_table(&self) -> BlockTable {
        BlockTable {
            ids: Vec::new(),
            hashes: Vec::new(),
            win: Vec::new(),
            mgr: self.clone(),
        }
    }
}

/// One sequence's blocks, in position order. Dropping it (or `clear`) releases them.
pub struct BlockTable {
    ids: Vec<BlockId>,
    /// Hash chain of the leading full blocks already registered or matched.
    hashes: Vec<u64>,
    /// The window pool's blocks for the same positions (`SLID` where given back); empty without
    /// a window pool.
    win: Vec<BlockId>,
    mgr: BlockManager,
}

impl BlockTable {
    pub fn ids(&self) -> &[BlockId] {
        &self.ids
    }

    /// The sliding-window layers' blocks (empty without a window pool: they use `ids`).
    pub fn window_ids(&self) -> &[BlockId] {
        &self.win
    }

    pub fn num_blocks(&self) -> usize {
        self.ids.len()
    }

    /// The positions this table could cover with its blocks and every free one of each pool.
    pub fn capacity(&self) -> usize {
        let inner = self.mgr.0.borrow();
        let full = self.ids.len() + inner.full.free.len();
        let win = inner
            .win
            .as_ref()
            .map_or(usize::MAX, |w| self.win.len() + w.pool.free.len());
        full.min(win) * inner.block_size
    }

    /// Take the cached blocks holding the longest full-block prefix of `tokens` (with a window
    /// pool: whose last window's window blocks are cached too); return how many tokens they
    /// cover. At least one token is always left to compute (its logits are needed). Call on an
    /// empty table only.
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
            let Some(&id) = inner.full.cached.get(&h) else {
                break;
            };
            inner.full.acquire(id);
            self.ids.push(id);
            self.hashes.push(h);
            parent = h;
        }
        if inner.win.is_some() {
            // The longest matched prefix whose last window is cached in the window pool.
            let mut n = self.ids.len();
            let blocks = loop {
                if let Some(b) = inner.cached_window(&self.hashes, n) {
                    break b;
                }
                n -= 1;
            };
            for id in self.ids.drain(n..).rev() {
                inner.full.release(id);
            }
            self.hashes.truncate(n);
            let pool = &mut inner.win.as_mut().expect("a window pool").pool;
            self.win = vec![SLID; n - blocks.len()];
            for id in blocks {
                pool.acquire(id);
                self.win.push(id);
            }
        }
        let hit = self.ids.len() * bs;
        inner.num_prefix_queried_tokens += tokens.len() as u64;
        inner.num_prefix_hit_tokens += hit as u64;
        hit
    }

    /// Grow the table to cover `num_tokens` positions: all or nothing (in each pool); false when
    /// out of blocks.
    pub fn ensure(&mut self, num_tokens: usize) -> bool {
        let mut inner = self.mgr.0.borrow_mut();
        let need = num_tokens
            .div_ceil(inner.block_size)
            .saturating_sub(self.ids.len());
        let win_free = inner.win.as_ref().map_or(usize::MAX, |w| w.pool.free.len());
        if need > inner.full.free.len() || need > win_free {
            return false;
        }
        for _ in 0..need {
            let id = inner.full.alloc().expect("counted free blocks");
            self.ids.push(id);
            if let Some(w) = inner.win.as_mut() {
                self.win.push(w.pool.alloc().expect("counted free blocks"));
            }
        }
        true
    }

    /// The first `num_computed` tokens have their K/V: register the full blocks among them in
    /// the prefix cache, and give back the window blocks no later query reads.
    pub fn register_full_blocks(&mut self, tokens: &[u32], num_computed: usize, version: u64) {
        let mut guard = self.mgr.0.borrow_mut();
        let inner = &mut *guard;
        let bs = inner.block_size;
        if inner.enable_prefix_caching {
            let num_full = (num_computed.min(tokens.len()) / bs).min(self.ids.len());
            while self.hashes.len() < num_full {
                let b = self.hashes.len();
                let parent = self.hashes.last().copied().unwrap_or(0);
                let h = block_hash(parent, &tokens[b * bs..(b + 1) * bs], version);
                self.hashes.push(h);
                inner.full.register(self.ids[b], h);
                if let (Some(w), Some(&id)) = (inner.win.as_mut(), self.win.get(b)) {
                    if id != SLID {
                        w.pool.register(id, h);
                    }
                }
            }
        }
        let lo = inner.first_window_block(num_computed).min(self.win.len());
        if let Some(w) = inner.win.as_mut() {
            // Given-back blocks are always a prefix: walk back from `lo` to the last one only.
            for id in self.win[..lo]
                .iter_mut()
                .rev()
                .take_while(|id| **id != SLID)
            {
                w.pool.release(*id);
                *id = SLID;
            }
        }
    }

    /// A new table sharing this one's first `num_blocks` blocks (for the other choices of a
    /// request, which share its prompt) — with a window pool, fewer where the window blocks
    /// the new table's first query reads were given back already: see its `num_blocks`.
    pub fn share_prefix(&self, num_blocks: usize) -> BlockTable {
        let mut inner = self.mgr.0.borrow_mut();
        let mut n = num_blocks;
        let mut win = Vec::new();
        if inner.win.is_some() {
            while n > 0 {
                let lo = inner.first_window_block(n * inner.block_size);
                if self.win[lo..n].iter().all(|&id| id != SLID) {
                    break;
                }
                n -= 1;
            }
            let lo = inner.first_window_block(n * inner.block_size);
            let pool = &mut inner.win.as_mut().expect("a window pool").pool;
            win = vec![SLID; lo];
            for &id in &self.win[lo..n] {
                pool.acquire(id);
                win.push(id);
            }
        }
        let ids = self.ids[..n].to_vec();
        for &id in &ids {
            inner.full.acquire(id);
        }
        BlockTable {
            ids,
            hashes: self.hashes[..n.min(self.hashes.len())].to_vec(),
            win,
            mgr: self.mgr.clone(),
        }
    }

    /// Release every block (preemption), the last first: a chain's tail is then evicted before
    /// its head, which other prompts are likelier to share.
    pub fn clear(&mut self) {
        let mut guard = self.mgr.0.borrow_mut();
        let inner = &mut *guard;
        for id in self.ids.drain(..).rev() {
            inner.full.release(id);
        }
        if let Some(w) = inner.win.as_mut() {
            for id in self.win.drain(..).rev().filter(|&id| id != SLID) {
                w.pool.release(id);
            }
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

    #[test]
    fn window_blocks_before_every_window_are_given_back_and_still_hit() {
        // Blocks of 4, a window of 6 keys: a query at position p reads p-5..=p.
        let m = BlockManager::new(16, 4, true).with_window_pool(6, 5);
        let toks: Vec<u32> = (0..20).collect();
        let mut a = m.new_table();
        assert_eq!(a.capacity(), 20, "the window pool bounds it");
        assert!(a.ensure(12));
        assert_eq!((a.num_blocks(), a.window_ids().len()), (3, 3));
        a.register_full_blocks(&toks, 12, 0);
        // The next query (12) reads 7..=12: block 0 is given back, 1 and 2 kept.
        assert_eq!(a.window_ids()[0], SLID);
        assert!(a.window_ids()[1..].iter().all(|&b| b != SLID));
        assert_eq!(m.stats().num_window_used, 2);
        assert_eq!(m.stats().num_used, 3);
        assert_eq!(a.capacity(), (3 + 3) * 4, "3 window blocks free");
        assert!(a.ensure(20));
        a.register_full_blocks(&toks, 20, 0);
        assert_eq!(&a.window_ids()[..3], &[SLID; 3]);
        assert_eq!(m.stats().num_window_used, 2);
        // Another choice sharing 5 blocks: its first query (20) needs blocks 3 and 4, held.
        let b = a.share_prefix(5);
        assert_eq!(b.num_blocks(), 5);
        assert_eq!(b.window_ids()[3..], a.window_ids()[3..5]);
        drop(b);
        // Sharing 3 blocks would need block 1 (query 12 reads 7..): given back, so 2 are shared
        // (query 8 reads 3..: blocks 0 and 1, given back too) ... down to none.
        assert_eq!(a.share_prefix(3).num_blocks(), 0);
        drop(a);
        assert_eq!(m.stats().num_window_used, 0);
        // The same tokens again: the global blocks of the prefix and the window blocks of its
        // last window are cached (prefix of 16 tokens: the query at 16 reads blocks 2 and 3).
        let mut c = m.new_table();
        assert_eq!(c.match_prefix(&toks, 0), 16);
        assert_eq!(&c.window_ids()[..2], &[SLID; 2]);
        assert!(c.window_ids()[2..].iter().all(|&b| b != SLID));
        drop(c);
        // A window pool that has evicted them: the hit shrinks to what it still holds.
        let mut d = m.new_table();
        assert!(
            d.ensure(20),
            "all 5 window blocks, evicting the cached ones"
        );
        let mut e = m.new_table();
        assert_eq!(e.match_prefix(&toks, 0), 0);
        assert_eq!(m.stats().num_used, 5, "nothing of the global hit is held");
        drop((d, e));
        assert_eq!((m.stats().num_used, m.stats().num_window_used), (0, 0));
    }
}
