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
    /// one's blocks of the same tokens are found, the old ones never) — or, with `keep`, kept
    /// (the sequence's K/V are then mixed). The number of tokens whose K/V were dropped.
    pub fn switch_version(&mut self, id: SeqId, v: Arc<AdapterVersion>, keep: bool) -> usize {
        if keep {
            if let Some(s) = self.get_mut(id) {
                s.mixed_kv |= s.num_computed > 0;
                s.adapter = Some(v);
            }
            return 0;
        }
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
        s.mixed_kv = false;
        s.adapter = Some(v);
        dropped
    }

    fn preempt(&mut self, index: usize, plan: &mut Plan) {
        let mut s = self.running.remove(index);
        s.table.clear();
        s.num_computed = 0;
        s.mixed_kv = false;
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
                if !s.mixed_kv {
                    let (tokens, n, v) = (&s.tokens, s.num_computed, s.cache_key());
                    s.table.register_full_blocks(tokens, n, v);
                }
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
mod tests;
