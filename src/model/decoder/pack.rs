//! A batch of sequences as the forward takes it: packed into rows (tokens, positions, attention
//! spans through the block and window tables, the rows whose logits or hidden states are
//! wanted), each sequence checked first.

use super::{Decoder, ModelError};
use crate::adapter::{AdapterBase, AdapterWeights};
use flywheel_kernels::reference::AttnSeq;

/// Which logits a sequence of the batch wants back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    None,
    /// The last token's (the next-token distribution).
    Last,
    /// Every token's (prompt log-probs, training).
    All,
    /// No logits: every token's final hidden state after the output norm, in
    /// `ForwardBuffers::hidden` (embeddings).
    Hidden,
}

/// One sequence's part of a packed batch: `tokens` at positions `first_pos..`, its KV cache
/// already holding positions `0..first_pos`, stored through `block_table`.
#[derive(Clone, Copy, Debug)]
pub struct BatchSeq<'a> {
    pub tokens: &'a [u32],
    pub first_pos: usize,
    pub block_table: &'a [u32],
    /// The sliding-window layers' blocks where the cache keeps them in a window pool
    /// (`KvCache::windowed`, `BlockTable::window_ids`: the same positions, `SLID` before the
    /// window); empty otherwise.
    pub window_table: &'a [u32],
    pub logits: Logits,
    /// The adapter version the sequence runs through; None: the base model.
    pub adapter: Option<&'a AdapterWeights>,
}

/// A batch as rows: the tokens and their positions, each sequence's attention span, and the rows
/// whose logits and whose hidden states are wanted.
pub(super) struct Packed<'a> {
    pub tokens: Vec<u32>,
    pub positions: Vec<u32>,
    pub attn: Vec<AttnSeq<'a>>,
    /// The same spans through the window tables (`BatchSeq::window_table`; the block tables
    /// where a sequence has none).
    pub attn_window: Vec<AttnSeq<'a>>,
    pub logit_rows: Vec<usize>,
    pub hidden_rows: Vec<usize>,
}

impl Decoder {
    /// The batch packed into rows, each sequence checked (`check_seq`): what the CPU and the GPU
    /// forward both start from.
    pub(super) fn pack<'a>(
        &self,
        batch: &[BatchSeq<'a>],
        block_size: usize,
    ) -> Result<Packed<'a>, ModelError> {
        let mut p = Packed {
            tokens: Vec::new(),
            positions: Vec::new(),
            attn: Vec::with_capacity(batch.len()),
            attn_window: Vec::with_capacity(batch.len()),
            logit_rows: Vec::new(),
            hidden_rows: Vec::new(),
        };
        for s in batch {
            self.check_seq(s, block_size)?;
            let start = p.tokens.len();
            let rows = start..start + s.tokens.len();
            match s.logits {
                Logits::None => {}
                Logits::Last => p.logit_rows.push(rows.end - 1),
                Logits::All => p.logit_rows.extend(rows),
                Logits::Hidden => p.hidden_rows.extend(rows),
            }
            let span = AttnSeq {
                q_start: start,
                q_len: s.tokens.len(),
                first_pos: s.first_pos,
                block_table: s.block_table,
            };
            p.attn.push(span);
            let window_table = match s.window_table {
                [] => s.block_table,
                t => t,
            };
            p.attn_window.push(AttnSeq {
                block_table: window_table,
                ..span
            });
            p.tokens.extend_from_slice(s.tokens);
            p.positions
                .extend((s.first_pos..s.first_pos + s.tokens.len()).map(|p| p as u32));
        }
        Ok(p)
    }

    /// A sequence the forward can run over a cache of blocks of `block_size` positions.
    pub(super) fn check_seq(&self, s: &BatchSeq, block_size: usize) -> Result<(), ModelError> {
        let c = &self.config;
        if s.tokens.is_empty() {
            return Err(ModelError::Batch("a sequence has no tokens".into()));
        }
        let end = s.first_pos + s.tokens.len();
        if end > c.context_length {
            return Err(ModelError::Batch(format!(
                "{end} positions exceed the context length {}",
                c.context_length
            )));
        }
        if !s.window_table.is_empty() && s.window_table.len() != s.block_table.len() {
            return Err(ModelError::Batch(format!(
                "the window table has {} blocks, the block table {}",
                s.window_table.len(),
                s.block_table.len()
            )));
        }
        if s.block_table.len() * block_size < end {
            return Err(ModelError::Batch(format!(
                "block table covers {} positions, need {end}",
                s.block_table.len() * block_size
            )));
        }
        if let Some(&bad) = s.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(ModelError::Batch(format!(
                "token id {bad} is outside the vocabulary ({})",
                c.vocab_size
            )));
        }
        if let Some(a) = s.adapter {
            if a.layout.model != c.adapter_shape() {
                return Err(ModelError::Batch(
                    "the adapter was made for a model of other dimensions".into(),
                ));
            }
        }
        Ok(())
    }
}
