//! What the scheduler knows of a sequence: its tokens (prompt, then generated), how many of them
//! have K/V in the cache, and the blocks holding them. Output state lives with the engine.

use super::block_manager::BlockTable;
use super::handle::{ClientId, Follow};
use crate::adapter::registry::AdapterVersion;
use std::sync::Arc;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

pub struct Sequence {
    pub id: SeqId,
    /// Prompt tokens followed by generated tokens.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Tokens whose K/V are in the cache: always a prefix of `tokens`.
    pub num_computed: usize,
    pub table: BlockTable,
    /// The adapter version the sequence is pinned to, from admission to its end (None: the base).
    pub adapter: Option<Arc<AdapterVersion>>,
    /// How often it was preempted (its K/V dropped, to be recomputed).
    pub num_preemptions: u32,
    /// Its prompt is scored (prompt log-probs): every prompt position is computed, none is
    /// taken from the prefix cache.
    pub score_prompt: bool,
    /// Its prompt is embedded: every position's final hidden state, none from the prefix cache.
    pub embed: bool,
    /// Whose it is (`ClientId`) and which request of theirs (its choices and prompts share it):
    /// the scheduler shares slots and blocks fairly between clients, then between requests.
    pub client: ClientId,
    pub request: u64,
    /// The slot whose newer versions it moves to (partial rollouts); None: pinned.
    pub follow: Option<Follow>,
    /// Its cached K/V hold more than one version's (a switch kept them): its blocks are never
    /// offered to the prefix cache, and its tokens are not exact. A recompute clears it.
    pub mixed_kv: bool,
}

impl Sequence {
    pub fn new(
        id: SeqId,
        tokens: Vec<u32>,
        table: BlockTable,
        adapter: Option<Arc<AdapterVersion>>,
    ) -> Sequence {
        Sequence {
            id,
            prompt_len: tokens.len(),
            tokens,
            num_computed: 0,
            table,
            adapter,
            num_preemptions: 0,
            score_prompt: false,
            embed: false,
            client: ClientId::default(),
            request: id.0,
            follow: None,
            mixed_kv: false,
        }
    }

    /// Tokens still to run through the model (1 for a sequence that is decoding).
    pub fn num_remaining(&self) -> usize {
        self.tokens.len() - self.num_computed
    }

    /// The prefix cache's key for its blocks: the pinned version's process-unique id (0: base).
    pub fn cache_key(&self) -> u64 {
        self.adapter.as_ref().map_or(0, |a| a.uid)
    }

    pub fn num_generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
}
