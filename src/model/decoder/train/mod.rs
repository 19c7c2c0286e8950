//! The training forward and backward over a packed batch of whole sequences through one adapter.
//!
//! Forward: the serving forward itself (`forward_store`: same kernels, same quantized weights, same
//! adapter code, batch-invariant), keeping each layer's input (the checkpoints) and, within a
//! memory budget, the products of the last layers (q, k, v, attention output, residual, gate, up);
//! the LM head and log-softmax(logits / T) run in chunks of completion tokens with the sampler's
//! own arithmetic, so a completion's log-probs equal the ones recorded when it was served, to the
//! bit. While a chunk's log-probs are at hand, the head's backward runs too: d log π(token)/d(normed
//! hidden) = (onehot − softmax)/T · W_out, one row per scored token (the loss only scales it).
//!
//! Backward (`backward.rs`): layer by layer, last first, into the adapter's parameters only
//! (OFT through the rotation to θ, LoRA into A and B; frozen linears' dx = dy·W from dequantized
//! tiles). Memory: the checkpoints (L × T × hidden), the kept activations (at most the
//! budget), one layer's gradients, and one chunk of logits (never T × vocab).

use super::activations::{layer_act_bytes, ActStore};
use super::buffers::{ForwardBuffers, LoraScratch};
use super::forward::{adapter_groups, add_in_place, LayerIo};
use super::{Activation, BatchSeq, Decoder, Logits, Mlp, ModelError, Weight};
use crate::adapter::{lora, oft, AdapterWeights, Method, Target};
use crate::model::kv_cache::KvCache;
use crate::policy::scale_and_normalize;
use flywheel_kernels::reference::AttnSeq;
use flywheel_kernels::{Cpu, Matmul};

/// Completion tokens scored per LM-head chunk. Each chunk's head product and its backward read
/// (and decode) the whole output matrix once, so small chunks cost: at 16, decoding the tied
/// 49,152 x 576 head took 40% of the BF16 backward's time; at 128 a step of 8 x 256 is 1.15-1.25x
/// faster and keeps 2 x 25 MB of logits. A serving step still waits for one ~2 ms slice only
/// (the pool runs background kernels in slices).
pub const HEAD_CHUNK: usize = 128;

/// Tokens per KV block of the training cache; a shared prefix is a whole number of blocks.
pub const TRAIN_BLOCK: usize = 16;

/// One training sequence: prompt then completion tokens; the completion's tokens are scored.
///
/// With `prefix: Some(j)`, the sequence continues sequence j of the same batch (an earlier one,
/// with no prefix of its own, nothing scored, and a whole number of `TRAIN_BLOCK`s): its tokens
/// sit at positions `len(j)..` and attend to j's keys and values, which are computed once for all
/// the sequences sharing them, and receive the sum of their gradients (a GRPO group's prompt).
#[derive(Clone, Copy, Debug)]
pub struct TrainSeq<'a> {
    pub tokens: &'a [u32],
    pub prompt_len: usize,
    pub prefix: Option<usize>,
}

impl TrainSeq<'_> {
    /// A sequence of its own (no shared prefix).
    pub fn whole(tokens: &[u32], prompt_len: usize) -> TrainSeq<'_> {
        TrainSeq {
            tokens,
            prompt_len,
            prefix: None,
        }
    }
}

/// A training batch's block tables in one pool of `blocks` KV blocks (ids `0..blocks`), and each
/// sequence's first position.
pub(super) struct Tables {
    pub tables: Vec<Vec<u32>>,
    pub first_pos: Vec<usize>,
    pub blocks: usize,
}

/// A training batch as the forward takes it: each sequence at its first position through its
/// block table, no logits, every one through `adapter`.
pub(super) fn train_batch<'a>(
    seqs: &[TrainSeq<'a>],
    tables: &'a [Vec<u32>],
    first_pos: &[usize],
    adapter: Option<&'a AdapterWeights>,
) -> Vec<BatchSeq<'a>> {
    seqs.iter()
        .zip(tables)
        .zip(first_pos)
        .map(|((s, t), &p)| BatchSeq {
            tokens: s.tokens,
            first_pos: p,
            block_table: t,
            window_table: &[],
            logits: Logits::None,
            adapter,
        })
        .collect()
}

/// Block tables (one pool of blocks of `bs` tokens) and first positions of a training batch,
/// checked.
pub(super) fn train_tables(seqs: &[TrainSeq], bs: usize) -> Result<Tables, ModelError> {
    let mut tables: Vec<Vec<u32>> = Vec::with_capacity(seqs.len());
    let mut first_pos = Vec::with_capacity(seqs.len());
    let mut next = 0u32;
    for (i, s) in seqs.iter().enumerate() {
        if s.prompt_len == 0 || s.prompt_len > s.tokens.len() {
            return Err(ModelError::Batch(
                "a training sequence needs a prompt of at least one token".into(),
            ));
        }
        let mut table = Vec::new();
        let mut pos = 0;
        if let Some(j) = s.prefix {
            let ok = j < i && seqs[j].prefix.is_none() && seqs[j].tokens.len().is_multiple_of(bs);
            if !ok || seqs[j].prompt_len != seqs[j].tokens.len() {
                return Err(ModelError::Batch(format!(
                    "sequence {i}: its prefix must be an earlier unscored sequence of whole \
                     {bs}-token blocks"
                )));
            }
            table.extend_from_slice(&tables[j]);
            pos = seqs[j].tokens.len();
        }
        let nb = s.tokens.len().div_ceil(bs) as u32;
        table.extend(next..next + nb);
        next += nb;
        tables.push(table);
        first_pos.push(pos);
    }
    Ok(Tables {
        tables,
        first_pos,
        blocks: next as usize,
    })
}

/// What the forward keeps for the backward.
pub struct TrainState {
    cache: KvCache,
    tables: Vec<Vec<u32>>,
    /// Position of each sequence's first token (its prefix's length, else 0).
    first_pos: Vec<usize>,
    store: ActStore,
    /// T × hidden: the final hidden state.
    final_x: Vec<f32>,
    /// T × hidden: d log π(token)/d(normed final hidden state) at each scored row (the LM head's
    /// backward, done in the forward while the chunk's log-probs are at hand), zero elsewhere.
    head_grad: Vec<f32>,
    /// The log-probs' temperature, for the LM head's LoRA backward.
    temperature: f32,
    num_tokens: usize,
    /// Mean entropy (nats) of the policy's next-token distribution over the scored tokens.
    pub mean_entropy: f64,
    /// Layers whose activations were kept (the rest are recomputed by the backward).
    pub layers_kept: usize,
}

/// The default memory budget of the kept activations (`train_forward`): 8 × 256 tokens keep all
/// 30 layers of SmolLM2-135M.
pub const ACTIVATION_BUDGET: usize = 1300 << 20;

impl Decoder {
    /// Bytes one layer's kept activations take for `tokens` tokens (the unit of the activation
    /// budget of `train_forward`).
    pub fn layer_activation_bytes(&self, tokens: usize) -> usize {
        layer_act_bytes(&self.config, tokens)
    }

    /// The forward of a training batch: its cache, and the final hidden state in `bufs.x`.
    fn train_pass(
        &self,
        cpu: &Cpu,
        seqs: &[TrainSeq],
        adapter: Option<&AdapterWeights>,
        bufs: &mut ForwardBuffers,
        store: Option<&mut ActStore>,
    ) -> Result<(KvCache, Tables), ModelError> {
        let c = &self.config;
        let tb = train_tables(seqs, TRAIN_BLOCK)?;
        let (tables, first_pos) = (&tb.tables, &tb.first_pos);
        let mut cache = KvCache::with_dtype(
            c.num_layers,
            c.kv_dim(),
            TRAIN_BLOCK,
            tb.blocks,
            self.kv_dtype,
        );
        let batch = train_batch(seqs, tables, first_pos, adapter);
        match store {
            Some(st) => self.forward_store(cpu, &mut cache, &batch, bufs, st)?,
            None => self.forward_into(cpu, &mut cache, &batch, bufs)?,
        }
        drop(batch);
        Ok((cache, tb))
    }

    /// Log-probs (from logits / `temperature`) of every completion token of every sequence, the
    /// same as `train_forward`'s, without keeping anything for a backward (the reference policy,
    /// evaluations).
    pub fn logprobs(
        &self,
        cpu: &Cpu,
        seqs: &[TrainSeq],
        adapter: Option<&AdapterWeights>,
        temperature: f32,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let mut bufs = ForwardBuffers::default();
        self.train_pass(cpu, seqs, adapter, &mut bufs, None)?;
        let vocab = self.config.vocab_size;
        let mut logps: Vec<Vec<f32>> = seqs
            .iter()
            .map(|s| Vec::with_capacity(s.tokens.len() - s.prompt_len))
            .collect();
        self.head_chunks(
            cpu,
            seqs,
            &bufs.x,
            adapter,
            temperature,
            |chunk, rows, _, _| {
                for (k, &(i, _, tok)) in chunk.iter().enumerate() {
                    logps[i].push(rows[k * vocab + tok as usize]);
                }
            },
        );
        Ok(logps)
    }

    /// Log-probs (from logits / `temperature`) of every completion token of every sequence, and
    /// the state the backward needs: the activations of as many layers as `activation_budget`
    /// bytes hold (the others are recomputed by the backward; the gradients are the same to the
    /// bit either way).
    pub fn train_forward(
        &self,
        cpu: &Cpu,
        seqs: &[TrainSeq],
        adapter: &AdapterWeights,
        temperature: f32,
        activation_budget: usize,
    ) -> Result<(Vec<Vec<f32>>, TrainState), ModelError> {
        let c = &self.config;
        let h = c.hidden;
        let num_tokens: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        let per_layer = self.layer_activation_bytes(num_tokens).max(1);
        let kept = (activation_budget / per_layer).min(c.num_layers);
        let mut store = ActStore {
            keep_from: c.num_layers - kept,
            ..ActStore::default()
        };
        let mut bufs = ForwardBuffers::default();
        let (
            cache,
            Tables {
                tables, first_pos, ..
            },
        ) = self.train_pass(cpu, seqs, Some(adapter), &mut bufs, Some(&mut store))?;
        let final_x = std::mem::take(&mut bufs.x);
        drop(bufs);
        let mut logps: Vec<Vec<f32>> = seqs
            .iter()
            .map(|s| Vec::with_capacity(s.tokens.len() - s.prompt_len))
            .collect();
        // d log π(tok)/dz = (onehot − softmax)/T for z = the logits; through the frozen head now.
        let inv_t = inv_temperature(temperature);
        let mut head_grad = vec![0.0f32; num_tokens * h];
        let (mut entropy, mut scored) = (0.0f64, 0usize);
        let (mut dz, mut dn) = (Vec::new(), Vec::new());
        let head = Some(adapter);
        self.head_chunks(
            cpu,
            seqs,
            &final_x,
            head,
            temperature,
            |chunk, rows, slopes, _| {
                dz.resize(rows.len(), 0.0);
                for (k, &(i, _, tok)) in chunk.iter().enumerate() {
                    let row = &rows[k * c.vocab_size..(k + 1) * c.vocab_size];
                    logps[i].push(row[tok as usize]);
                    let d = &mut dz[k * c.vocab_size..(k + 1) * c.vocab_size];
                    entropy += logit_grad(cpu, row, tok, inv_t, slopes, k, d);
                    scored += 1;
                }
                dn.resize(chunk.len() * h, 0.0);
                cpu.linear_backward(
                    self.output.ty,
                    self.bytes(&self.output),
                    c.vocab_size,
                    h,
                    &dz,
                    &mut dn,
                );
                for (k, &(_, r, _)) in chunk.iter().enumerate() {
                    head_grad[r * h..(r + 1) * h].copy_from_slice(&dn[k * h..(k + 1) * h]);
                }
            },
        );
        let state = TrainState {
            cache,
            tables,
            first_pos,
            store,
            final_x,
            head_grad,
            temperature,
            num_tokens,
            mean_entropy: entropy / scored.max(1) as f64,
            layers_kept: kept,
        };
        Ok((logps, state))
    }

    /// The scored rows (sequence, row in the batch, target token), HEAD_CHUNK at a time: their
    /// log-softmax(logits / T) rows (from the final hidden state `final_x`, through the
    /// adapter's LoRA on the LM head if it has one) are handed to `f`, with the final soft-cap's
    /// slope at each logit (Gemma 2; empty without a cap) and the normed hidden rows.
    pub(super) fn head_chunks(
        &self,
        cpu: &Cpu,
        seqs: &[TrainSeq],
        final_x: &[f32],
        adapter: Option<&AdapterWeights>,
        temperature: f32,
        mut f: impl FnMut(&[(usize, usize, u32)], &[f32], &[f32], &[f32]),
    ) {
        let c = &self.config;
        let h = c.hidden;
        let mut xs = Vec::new();
        let mut normed = Vec::new();
        let mut logits = Vec::new();
        let mut slopes = Vec::new();
        let mut scratch = LoraScratch::default();
        for chunk in scored_rows(seqs).chunks(HEAD_CHUNK) {
            xs.clear();
            for &(_, r, _) in chunk {
                xs.extend_from_slice(&final_x[r * h..(r + 1) * h]);
            }
            normed.resize(xs.len(), 0.0);
            cpu.rmsnorm(&xs, &self.output_norm, c.eps, &mut normed);
            logits.resize(chunk.len() * c.vocab_size, 0.0);
            cpu.matmul_head(Matmul {
                ty: self.output.ty,
                w: self.bytes(&self.output),
                rows: c.vocab_size,
                cols: h,
                x: &normed,
                y: &mut logits,
            });
            if let Some(a) = adapter {
                let rows: Vec<usize> = (0..chunk.len()).collect();
                self.head_lora(cpu, a, &rows, &normed, &mut logits, &mut scratch);
            }
            c.cap_logits(&mut logits);
            if let Some(cap) = c.final_softcap {
                slopes.clear();
                slopes.extend(logits.iter().map(|z| 1.0 - (z / cap) * (z / cap)));
            }
            for row in logits.chunks_mut(c.vocab_size) {
                scale_and_normalize(cpu, row, temperature);
            }
            f(chunk, &logits, &slopes, &normed);
        }
    }
}

/// 1/T of log-probs at temperature T (1 for greedy, whose log-probs are at T = 1).
pub(super) fn inv_temperature(temperature: f32) -> f32 {
    if !crate::policy::is_greedy(temperature) {
        1.0 / temperature
    } else {
        1.0
    }
}

/// d log π(tok)/dz into `d` for one scored row `k` of a chunk (its log-softmax `row`): (onehot −
/// softmax)/T, through the final soft-cap's slopes if any (dz_raw = dz · (1 − tanh²)); returns the
/// row's entropy. The forward and the LM head's LoRA backward both take it from here.
pub(super) fn logit_grad(
    cpu: &Cpu,
    row: &[f32],
    tok: u32,
    inv_t: f32,
    slopes: &[f32],
    k: usize,
    d: &mut [f32],
) -> f64 {
    let vocab = row.len();
    let entropy = cpu.softmax_backward_row(row, inv_t, d);
    d[tok as usize] += inv_t;
    if !slopes.is_empty() {
        let g = &slopes[k * vocab..(k + 1) * vocab];
        d.iter_mut().zip(g).for_each(|(x, g)| *x *= g);
    }
    entropy
}

/// The scored rows of a packed batch: (sequence, row whose logits predict the token, token), in
/// order (each completion token is predicted by the row before it).
pub(super) fn scored_rows(seqs: &[TrainSeq]) -> Vec<(usize, usize, u32)> {
    let mut scored = Vec::new();
    let mut start = 0;
    for (i, s) in seqs.iter().enumerate() {
        for a in s.prompt_len..s.tokens.len() {
            scored.push((i, start + a - 1, s.tokens[a]));
        }
        start += s.tokens.len();
    }
    scored
}

mod backward;
mod parts;
pub use parts::{blocks_of, inline_prefixes, part_seqs, prefixes_to_inline, score_parts};
