//! The scheduler: sequences and budgets in, a plan for one forward pass out. Pure: no model, no
//! clock, no channels; unit-tested alone.
//!
//! Each step: running sequences that decode get one token each first (preempting the most recently
//! admitted sequences, by recompute, when a new block cannot be had), then running prefills continue
//! in chunks, then waiting sequences are admitted first-come first-served while the token budget,
//! the sequence limit and the free blocks allow. A long prompt is thus cut into chunks and never
//! stalls the decodes of others for more than one budget's worth of tokens.

use super::block_manager::BlockManager;
use super::sequence::{SeqId, Sequence};
use std::collections::VecDeque;

#[derive(Clone, Copy, Debug)]
pub struct SchedulerConfig {
    /// Sequences running at once (decoding or prefilling).
    pub max_num_seqs: usize,
    /// Tokens in one forward pass.
    pub max_num_batched_tokens: usize,
}

/// `len` tokens of `seq` from position `start`; `wants_logits` when the chunk reaches the end of the
/// sequence's tokens, so that the next token is to be sampled from its last row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub seq: SeqId,
    pub start: usize,
    pub len: usize,
    pub wants_logits: bool,
}

#[derive(Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub chunks: Vec<Chunk>,
    /// Sequences whose K/V were dropped this step (they wait again, first in line).
    pub preempted: Vec<SeqId>,
    /// Sequences scheduled for the first time (their queue time ends now).
    pub admitted: Vec<SeqId>,
}

impl Plan {
    pub fn num_tokens(&self) -> usize {
        self.chunks.iter().map(|c| c.len).sum()
    }
}

pub struct Scheduler {
    cfg: SchedulerConfig,
    blocks: BlockManager,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig, blocks: BlockManager) -> Scheduler {
        assert!(cfg.max_num_seqs > 0 && cfg.max_num_batched_tokens > 0);
        Scheduler {
            cfg,
            blocks,
            waiting: VecDeque::new(),
            running: Vec::new(),
        }
    }

    pub fn blocks(&self) -> &BlockManager {
        &self.blocks
    }

    /// Queue a new sequence at the back.
    pub fn add(&mut self, seq: Sequence) {
        self.waiting.push_back(seq);
    }

    /// Queue a sequence ahead of every waiting one (a choice forked from a running request).
    pub fn add_first(&mut self, seq: Sequence) {
        self.waiting.push_front(seq);
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    pub fn get(&self, id: SeqId) -> Option<&Sequence> {
        self.running
            .iter()
            .chain(self.waiting.iter())
            .find(|s| s.id == id)
    }

    pub fn get_mut(&mut self, id: SeqId) -> Option<&mut Sequence> {
        self.running
            .iter_mut()
            .chain(self.waiting.iter_mut())
            .find(|s| s.id == id)
    }

    /// Take a sequence out (finished or aborted); dropping it frees its blocks.
    pub fn remove(&mut self, id: SeqId) -> Option<Sequence> {
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            return Some(self.running.remove(i));
        }
        let i = self.waiting.iter().position(|s| s.id == id)?;
        self.waiting.remove(i)
    }

    fn preempt(&mut self, index: usize, plan: &mut Plan) {
        let mut s = self.running.remove(index);
        s.table.clear();
        s.num_computed = 0;
        s.num_preemptions += 1;
        plan.preempted.push(s.id);
        plan.chunks.retain(|c| c.seq != s.id);
        self.waiting.push_front(s);
    }

    pub fn schedule(&mut self) -> Plan {
        let mut plan = Plan::default();
        let mut budget = self.cfg.max_num_batched_tokens;

        // 1. Decodes, oldest first; preempt from the newest end when blocks run out.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            if self.running[i].num_remaining() != 1 {
                i += 1;
                continue;
            }
            let need = self.running[i].num_computed + 1;
            if self.running[i].table.ensure(need) {
                let s = &self.running[i];
                plan.chunks.push(Chunk {
                    seq: s.id,
                    start: s.num_computed,
                    len: 1,
                    wants_logits: true,
                });
                budget -= 1;
                i += 1;
                continue;
            }
            let victim = self.running.len() - 1;
            self.preempt(victim, &mut plan);
            // If the victim was this very sequence, the loop ends (i == len).
        }

        // 2. Prefills already under way continue.
        for s in &mut self.running {
            let remaining = s.num_remaining();
            if remaining <= 1 || budget == 0 {
                continue;
            }
            let len = remaining
                .min(budget)
                .min(capacity(&self.blocks, s).saturating_sub(s.num_computed));
            if len == 0 || !s.table.ensure(s.num_computed + len) {
                continue;
            }
            plan.chunks.push(Chunk {
                seq: s.id,
                start: s.num_computed,
                len,
                wants_logits: len == remaining,
            });
            budget -= len;
        }

        // 3. Admit waiting sequences in order.
        while budget > 0 && self.running.len() < self.cfg.max_num_seqs {
            let Some(mut s) = self.waiting.pop_front() else {
                break;
            };
            if s.num_computed == 0 && s.table.num_blocks() == 0 && !s.score_prompt {
                s.num_computed = s.table.match_prefix(&s.tokens, s.cache_key());
            }
            let remaining = s.num_remaining();
            let len = remaining
                .min(budget)
                .min(capacity(&self.blocks, &s).saturating_sub(s.num_computed));
            if len == 0 || !s.table.ensure(s.num_computed + len) {
                // Not now: give back what a prefix match took, keep its place in line.
                s.table.clear();
                s.num_computed = 0;
                self.waiting.push_front(s);
                break;
            }
            plan.chunks.push(Chunk {
                seq: s.id,
                start: s.num_computed,
                len,
                wants_logits: len == remaining,
            });
            plan.admitted.push(s.id);
            budget -= len;
            self.running.push(s);
        }
        plan
    }

    /// The forward pass of `plan` ran: its K/V are in the cache.
    pub fn commit(&mut self, plan: &Plan) {
        for c in &plan.chunks {
            if let Some(s) = self.running.iter_mut().find(|s| s.id == c.seq) {
                debug_assert_eq!(s.num_computed, c.start);
                s.num_computed = c.start + c.len;
                let (tokens, n, v) = (&s.tokens, s.num_computed, s.cache_key());
                s.table.register_full_blocks(tokens, n, v);
            }
        }
    }
}

/// Positions `s` could cover with its blocks plus every free one.
fn capacity(blocks: &BlockManager, s: &Sequence) -> usize {
    (s.table.num_blocks() + blocks.num_free()) * blocks.block_size()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sched(num_blocks: usize, max_seqs: usize, budget: usize) -> Scheduler {
        Scheduler::new(
            SchedulerConfig {
                max_num_seqs: max_seqs,
                max_num_batched_tokens: budget,
            },
            BlockManager::new(num_blocks, 4, true),
        )
    }

    fn add(s: &mut Scheduler, id: u64, prompt: Vec<u32>) {
        let t = s.blocks().new_table();
        s.add(Sequence::new(SeqId(id), prompt, t, None));
    }

    /// Run a plan as the engine would: commit, then append a sampled token where logits came back.
    fn step(s: &mut Scheduler) -> Plan {
        let p = s.schedule();
        s.commit(&p);
        for c in &p.chunks {
            if c.wants_logits {
                s.get_mut(c.seq).unwrap().tokens.push(7);
            }
        }
        p
    }

    fn chunk(seq: u64, start: usize, len: usize, wants_logits: bool) -> Chunk {
        Chunk {
            seq: SeqId(seq),
            start,
            len,
            wants_logits,
        }
    }

    #[test]
    fn long_prompts_are_chunked_and_decodes_go_first() {
        let mut s = sched(64, 8, 8);
        add(&mut s, 1, vec![1; 3]);
        let p = step(&mut s);
        assert_eq!(p.chunks, vec![chunk(1, 0, 3, true)]);
        assert_eq!(p.admitted, vec![SeqId(1)]);
        add(&mut s, 2, vec![2; 20]);
        // Seq 1 decodes (1 token), seq 2 takes the remaining 7 of the budget.
        let p = step(&mut s);
        assert_eq!(p.chunks, vec![chunk(1, 3, 1, true), chunk(2, 0, 7, false)]);
        let p = step(&mut s);
        assert_eq!(p.chunks, vec![chunk(1, 4, 1, true), chunk(2, 7, 7, false)]);
        let p = step(&mut s);
        assert_eq!(p.chunks, vec![chunk(1, 5, 1, true), chunk(2, 14, 6, true)]);
        let p = step(&mut s);
        assert_eq!(p.chunks, vec![chunk(1, 6, 1, true), chunk(2, 20, 1, true)]);
        assert!(p.admitted.is_empty());
    }

    #[test]
    fn sequence_limit_and_fcfs_admission() {
        let mut s = sched(64, 2, 100);
        for id in 1..=3 {
            add(&mut s, id, vec![id as u32; 5]);
        }
        let p = step(&mut s);
        assert_eq!(p.admitted, vec![SeqId(1), SeqId(2)]);
        assert_eq!((s.num_running(), s.num_waiting()), (2, 1));
        drop(s.remove(SeqId(1)));
        let p = step(&mut s);
        assert_eq!(p.admitted, vec![SeqId(3)]);
        assert_eq!(p.chunks[0], chunk(2, 5, 1, true));
    }

    #[test]
    fn out_of_blocks_preempts_the_newest_and_recomputes_it_later() {
        // 4 blocks of 4 tokens: two sequences of 7 prompt tokens fit (2 blocks each) until the
        // first needs a third block.
        let mut s = sched(4, 4, 100);
        add(&mut s, 1, vec![1; 7]);
        add(&mut s, 2, vec![2; 7]);
        step(&mut s); // both prefilled, 8 tokens each now
        step(&mut s); // both decode position 7, 9 tokens each now
        assert_eq!(s.blocks().num_free(), 0);
        let p = step(&mut s);
        // Seq 1 needs a third block for position 8: seq 2 is preempted.
        assert_eq!(p.preempted, vec![SeqId(2)]);
        assert_eq!(p.chunks, vec![chunk(1, 8, 1, true)]);
        assert_eq!(s.get(SeqId(2)).unwrap().num_computed, 0);
        assert_eq!(s.get(SeqId(2)).unwrap().num_preemptions, 1);
        assert_eq!(
            s.get(SeqId(2)).unwrap().tokens.len(),
            9,
            "generated tokens kept"
        );
        // When seq 1 ends, seq 2 comes back and recomputes its 9 tokens, sampling the 10th.
        drop(s.remove(SeqId(1)));
        assert_eq!(s.blocks().num_free(), 4);
        let p = step(&mut s);
        assert_eq!(p.chunks.len(), 1);
        let c = p.chunks[0];
        assert_eq!(
            (c.seq, c.start + c.len, c.wants_logits),
            (SeqId(2), 9, true)
        );
        // Its first block survived in the prefix cache (tail blocks are evicted first).
        assert_eq!(c.start, 4);
    }

    #[test]
    fn a_lone_sequence_that_cannot_grow_preempts_itself() {
        let mut s = sched(2, 4, 100);
        add(&mut s, 1, vec![1; 8]);
        step(&mut s);
        let p = step(&mut s);
        assert_eq!(p.preempted, vec![SeqId(1)]);
        assert!(p.chunks.is_empty());
    }

    #[test]
    fn prefix_cache_skips_shared_prompt_blocks() {
        let mut s = sched(16, 4, 100);
        add(&mut s, 1, (0..10).collect());
        step(&mut s);
        add(&mut s, 2, (0..12).collect());
        let p = step(&mut s);
        assert_eq!(p.chunks[1], chunk(2, 8, 4, true));
        assert_eq!(s.blocks().stats().num_prefix_hit_tokens, 8);
    }

    #[test]
    fn admission_waits_for_blocks_without_holding_any() {
        let mut s = sched(3, 4, 100);
        add(&mut s, 1, vec![1; 12]);
        step(&mut s);
        add(&mut s, 2, vec![2; 5]);
        let p = step(&mut s);
        // Seq 1 needs a 4th block for position 12: none; it preempts itself, and cannot come back
        // yet. Seq 2 waits behind it (first come, first served), and the cached blocks seq 1
        // matched on the way are not held while it waits.
        assert_eq!(p.preempted, vec![SeqId(1)]);
        assert!(p.admitted.is_empty() && p.chunks.is_empty());
        assert_eq!(s.blocks().num_free(), 3);
        assert_eq!(s.num_waiting(), 2);
    }
}
