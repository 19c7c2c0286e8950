//! The scheduler: sequences and budgets in, a plan for one forward pass out. Pure: no model, no
//! clock, no channels; unit-tested alone.
//!
//! Each step: running sequences that decode get one token each first (preempting the most recently
//! admitted sequences, by recompute, when a new block cannot be had), then running prefills continue
//! in chunks, then waiting sequences are admitted, fairly between clients (the client running the
//! fewest first, first come first served among equals; a client running none may preempt the
//! newest sequence of one running many), while the token budget, the sequence limit and the free
//! blocks allow. A long prompt is thus cut into chunks and never
//! stalls the decodes of others for more than one budget's worth of tokens.

use super::block_manager::BlockManager;
use super::handle::ClientId;
use super::sequence::{SeqId, Sequence};
use crate::adapter::registry::AdapterVersion;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

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

    /// Every sequence, running and waiting.
    pub fn sequences_mut(&mut self) -> impl Iterator<Item = &mut Sequence> {
        self.running.iter_mut().chain(self.waiting.iter_mut())
    }

    /// Move sequence `id` to adapter version `v` (a partial rollout's switch, at a step
    /// boundary): its K/V, computed under the old version, are dropped and recomputed under the
    /// new one, as a preemption recomputes (the prefix cache keys blocks by version: the new
    /// one's blocks of the same tokens are found, the old ones never). The number of tokens
    /// whose K/V were dropped.
    pub fn switch_version(&mut self, id: SeqId, v: Arc<AdapterVersion>) -> usize {
        let s = match self.running.iter().position(|s| s.id == id) {
            Some(i) => {
                let s = self.running.remove(i);
                self.waiting.push_front(s);
                &mut self.waiting[0]
            }
            None => match self.waiting.iter_mut().find(|s| s.id == id) {
                Some(s) => s,
                None => return 0,
            },
        };
        let dropped = s.num_computed;
        s.table.clear();
        s.num_computed = 0;
        s.adapter = Some(v);
        dropped
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

        // 1. Decodes, oldest first; when blocks run out, preempt the newest sequence of the client
        // running the most.
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
            // The newest sequence of the client running the most (so that a client's one
            // sequence is not preempted for another's many).
            let victim = self.fair_victim();
            self.preempt(victim, &mut plan);
            if victim < i {
                i -= 1;
            }
            // If the victim was this very sequence, the next one is at `i` now.
        }

        // 2. Prefills already under way continue.
        for s in &mut self.running {
            let remaining = s.num_remaining();
            if remaining <= 1 || budget == 0 {
                continue;
            }
            let len = remaining
                .min(budget)
                .min(capacity(s).saturating_sub(s.num_computed));
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

        // 3. Admit waiting sequences: of the client running the fewest first (in line order
        // among equals), so that one client's many sequences never hold every slot and block
        // while another's wait; a client running none takes a slot or blocks from the newest
        // sequence of a client running two or more beyond it (preempted by recompute).
        while budget > 0 {
            let Some(k) = self.next_waiting() else {
                break;
            };
            if self.running.len() >= self.cfg.max_num_seqs {
                if self.make_room(k, &mut plan) {
                    continue;
                }
                break;
            }
            let mut s = self.waiting.remove(k).expect("in line");
            if s.num_computed == 0 && s.table.num_blocks() == 0 && !s.score_prompt && !s.embed {
                s.num_computed = s.table.match_prefix(&s.tokens, s.cache_key());
            }
            let remaining = s.num_remaining();
            let len = remaining
                .min(budget)
                .min(capacity(&s).saturating_sub(s.num_computed));
            if len == 0 || !s.table.ensure(s.num_computed + len) {
                // Not now: give back what a prefix match took, keep its place in line.
                s.table.clear();
                s.num_computed = 0;
                self.waiting.insert(k, s);
                if self.make_room(k, &mut plan) {
                    continue;
                }
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

    /// How much each running sequence's client and request hold: (sequences of its client,
    /// sequences of its request).
    fn loads(&self) -> Loads {
        let mut l = Loads::default();
        for s in &self.running {
            *l.clients.entry(s.client).or_default() += 1;
            *l.requests.entry(s.request).or_default() += 1;
        }
        l
    }

    /// The waiting sequence to admit next: of the least loaded client (then request), first in
    /// line among equals.
    fn next_waiting(&self) -> Option<usize> {
        let loads = self.loads();
        let mut best: Option<((usize, usize), usize)> = None;
        for (i, s) in self.waiting.iter().enumerate() {
            let l = loads.of(s);
            if best.is_none_or(|(b, _)| l < b) {
                best = Some((l, i));
                if l == (0, 0) {
                    break;
                }
            }
        }
        best.map(|(_, i)| i)
    }

    /// The newest running sequence of the most loaded client (then request).
    fn fair_victim(&self) -> usize {
        let loads = self.loads();
        let most = self.running.iter().map(|s| loads.of(s)).max();
        self.running
            .iter()
            .rposition(|s| Some(loads.of(s)) == most)
            .unwrap_or(self.running.len() - 1)
    }

    /// Make room for waiting sequence `k` by preempting `fair_victim`, if its client runs at
    /// least two more sequences than `k`'s (or, of the same client, its request two more than
    /// `k`'s); false when none does.
    fn make_room(&mut self, k: usize, plan: &mut Plan) -> bool {
        if self.running.is_empty() {
            return false;
        }
        let loads = self.loads();
        let w = &self.waiting[k];
        let mine = loads.of(w);
        let victim = self.fair_victim();
        let v = &self.running[victim];
        let theirs = loads.of(v);
        let heavier = if v.client == w.client {
            theirs.1 >= mine.1 + 2
        } else {
            theirs.0 >= mine.0 + 2
        };
        if !heavier {
            return false;
        }
        self.preempt(victim, plan);
        true
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

/// Running sequences per client and per request.
#[derive(Default)]
struct Loads {
    clients: HashMap<ClientId, usize>,
    requests: HashMap<u64, usize>,
}

impl Loads {
    fn of(&self, s: &Sequence) -> (usize, usize) {
        (
            self.clients.get(&s.client).copied().unwrap_or(0),
            self.requests.get(&s.request).copied().unwrap_or(0),
        )
    }
}

/// Positions `s` could cover with its blocks plus every free one (of each pool).
fn capacity(s: &Sequence) -> usize {
    s.table.capacity()
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

    fn add_for(s: &mut Scheduler, id: u64, client: u64, prompt: Vec<u32>) {
        let t = s.blocks().new_table();
        let mut q = Sequence::new(SeqId(id), prompt, t, None);
        q.client = ClientId(client);
        s.add(q);
    }

    fn running_of(s: &Scheduler, client: u64) -> usize {
        s.running
            .iter()
            .filter(|q| q.client == ClientId(client))
            .count()
    }

    /// One client's sequences fill every slot; another client's sequence arriving later is
    /// admitted at the next step, in place of the first client's newest (preempted, first in line
    /// again), and the first client's waiting sequences do not jump ahead of it.
    #[test]
    fn a_client_running_none_takes_a_slot_from_a_client_running_many() {
        let mut s = sched(64, 4, 64);
        for id in 1..=6 {
            add_for(&mut s, id, 1, vec![1, 2, 3]);
        }
        step(&mut s);
        assert_eq!(running_of(&s, 1), 4);
        add_for(&mut s, 10, 2, vec![4, 5, 6]);
        let p = step(&mut s);
        assert_eq!(p.admitted, vec![SeqId(10)]);
        assert_eq!(p.preempted, vec![SeqId(4)]);
        assert_eq!((running_of(&s, 1), running_of(&s, 2)), (3, 1));
        // Client 1 still runs two more: a second sequence of client 2 takes another slot.
        add_for(&mut s, 11, 2, vec![7, 8, 9]);
        let p = step(&mut s);
        assert_eq!((p.admitted, p.preempted), (vec![SeqId(11)], vec![SeqId(3)]));
        // Balanced now (2 and 2): a third of client 2 waits its turn.
        add_for(&mut s, 12, 2, vec![7, 8, 9]);
        let p = step(&mut s);
        assert!(p.preempted.is_empty() && p.admitted.is_empty(), "{p:?}");
        // A client alone is never preempted for fairness.
        let mut s = sched(64, 2, 64);
        for id in 1..=3 {
            add_for(&mut s, id, 1, vec![1, 2, 3]);
        }
        for _ in 0..3 {
            assert!(step(&mut s).preempted.is_empty());
        }
    }

    /// Blocks, not slots, are what one client holds: the other client's prompt is admitted by
    /// preempting the heavy client's newest, and when a decode needs a block the heavy client's
    /// newest goes, never the light client's one sequence.
    #[test]
    fn blocks_are_shared_fairly_between_clients() {
        // 8 blocks of 4 tokens; client 1's three sequences of 8 tokens take 6.
        let mut s = sched(8, 8, 64);
        for id in 1..=3 {
            add_for(&mut s, id, 1, (0..8).collect());
        }
        step(&mut s);
        assert_eq!(s.blocks().num_free(), 2);
        add_for(&mut s, 10, 2, (100..111).collect());
        let p = step(&mut s);
        assert!(p.admitted.contains(&SeqId(10)), "{p:?}");
        assert!(p.preempted.contains(&SeqId(3)), "{p:?}");
        // Decode until blocks run out: client 2's one sequence goes only once client 1 runs no
        // more than it does.
        let mut seen = false;
        for _ in 0..12 {
            let before = (running_of(&s, 1), running_of(&s, 2));
            let p = step(&mut s);
            seen |= !p.preempted.is_empty();
            if p.preempted.contains(&SeqId(10)) {
                assert!(before.0 <= before.1, "{before:?} {p:?}");
            }
        }
        assert!(seen, "blocks never ran out");
    }
}
