//! What the scheduler knows of a sequence: its tokens (prompt, then generated), how many of them
//! have K/V in the cache, and the blocks holding them. Output state lives with the engine.

use super::block_manager::BlockTable;

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
    /// The adapter version the sequence is pinned to (0: the base model).
    pub adapter_version: u64,
    /// How often it was preempted (its K/V dropped, to be recomputed).
    pub num_preemptions: u32,
}

impl Sequence {
    pub fn new(id: SeqId, tokens: Vec<u32>, table: BlockTable, adapter_version: u64) -> Sequence {
        Sequence {
            id,
            prompt_len: tokens.len(),
            tokens,
            num_computed: 0,
            table,
            adapter_version,
            num_preemptions: 0,
        }
    }

    /// Tokens still to run through the model (1 for a sequence that is decoding).
    pub fn num_remaining(&self) -> usize {
        self.tokens.len() - self.num_computed
    }

    pub fn num_generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
}
