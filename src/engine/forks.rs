//! The sibling choices of an `n` > 1 request: forked off its first choice when that choice's
//! first row of logits arrives, sharing its prompt's full blocks.

use super::output::RequestState;
use super::output::SeqOutput;
use super::sequence::{SeqId, Sequence};
use super::{Engine, EngineEvent};
use std::rc::Rc;
use std::time::Instant;

impl Engine {
    /// Choices 1..=`forks` of the request `id` (its first choice) serves: each draws its first
    /// token from `fork_from` (the prompt's last row of logits, with the device's log-sum-exp of
    /// them where it gave one), then runs as a sequence of its own.
    pub(super) fn fork_choices(
        &mut self,
        id: SeqId,
        req: &Rc<RequestState>,
        num_cached: usize,
        forks: usize,
        fork_from: &[f32],
        lse: Option<f32>,
    ) {
        let ctx = self.model.config.context_length;
        let bs = self.sched.blocks().block_size();
        for choice in 1..=forks {
            let mut row = fork_from.to_vec();
            let mut child = SeqOutput::new(req.clone(), choice);
            child.scheduled_at = Some(Instant::now());
            child.num_cached_tokens = num_cached;
            // A forked choice draws its first token: nothing generated yet.
            let s = match child.sample(&self.cpu, &mut row, lse, &[]) {
                Ok(s) => s,
                Err(e) => {
                    let _ = req.tx.send(EngineEvent::GrammarFailed(e));
                    continue;
                }
            };
            let child_id = self.new_seq_id();
            let parent = self.sched.get(id).expect("running");
            let mut tokens = parent.tokens[..parent.prompt_len].to_vec();
            tokens.push(s.token);
            // Share the parent's full prompt blocks; the rest of the prompt is recomputed.
            // (With a window pool, fewer where the window's blocks were given back.)
            let table = parent.table.share_prefix(parent.prompt_len / bs);
            let full = table.num_blocks();
            let mut seq = Sequence::new(child_id, tokens, table, parent.adapter.clone());
            (seq.client, seq.request) = (parent.client, parent.request);
            seq.follow = parent.follow.clone();
            seq.mixed_kv = parent.mixed_kv;
            let version = (seq.adapter.as_ref().map_or(0, |a| a.version), !seq.mixed_kv);
            seq.prompt_len = parent.prompt_len;
            seq.num_computed = full * bs;
            let at_end = seq.tokens.len() >= ctx;
            if !child.emit(&self.tokenizer, &s, 1, version, at_end, &self.metrics) {
                self.sched.add_first(seq);
                self.outputs.insert(child_id, child);
            }
        }
    }
}
