//! The training forward's log-probs on the GPU (`GpuDecoder::logprobs`): `Decoder::logprobs`'s
//! contract (log-softmax(logits / T) of every completion token of every sequence of a packed
//! batch, shared prefixes once) through the serving forward's own launches and the draw's
//! log-softmax (`Gpu::score`), so that on one GPU a completion's log-probs are those it was
//! served with, bit for bit, where the step's kernels are batch-invariant: the products (every
//! layout the same bits as the default, a decode step's and a prefill's), attention (its fold and
//! split launches the same bits), the norms and adapters (row by row in graphs, by groups
//! eagerly: the same bits). A mixture of experts routes a prefill on the host (`moe::route`) and
//! a decode step on the device: the GPU tests check its forward within f32 rounding, not bits.

use super::super::train::{
    inline_prefixes, inv_temperature, part_seqs, prefixes_to_inline, score_parts, scored_rows,
    train_batch, train_tables, Tables,
};
use super::adapters::head_lora;
use super::{GpuDecoder, HEAD_ROWS};
use crate::adapter::AdapterWeights;
use crate::model::decoder::forward::adapter_groups;
use crate::model::decoder::pack::Packed;
use crate::model::decoder::{Decoder, ModelError, TrainSeq};
use flywheel_kernels::cuda::ScoreSpec;

impl GpuDecoder {
    /// The most tokens one step runs, and the tokens of a KV block (`score_parts`' bounds).
    pub fn step_bounds(&self) -> (usize, usize) {
        (self.max_tokens, self.block_size)
    }

    /// `Decoder::logprobs` on the GPU: `logprobs_part` over the parts of at most a step's tokens
    /// and `blocks.len()` blocks (`score_parts`), each sequence's log-probs in its place; a shared
    /// prefix that is not whole blocks of this cache's is computed with each sequence continuing
    /// it (`inline_prefixes`).
    pub fn logprobs(
        &mut self,
        model: &Decoder,
        seqs: &[TrainSeq],
        blocks: &[u32],
        adapter: Option<&AdapterWeights>,
        temperature: f32,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let mut out = vec![Vec::new(); seqs.len()];
        let inlined = prefixes_to_inline(seqs, self.block_size);
        let seqs = &inline_prefixes(seqs, &inlined);
        for part in score_parts(seqs, self.block_size, self.max_tokens, blocks.len())? {
            let got =
                self.logprobs_part(model, &part_seqs(seqs, &part), blocks, adapter, temperature)?;
            for (i, lp) in part.into_iter().zip(got) {
                out[i] = lp;
            }
        }
        Ok(out)
    }

    /// `Decoder::logprobs` on the GPU, in one eager step: the sequences' tokens through every
    /// layer into the KV blocks `blocks` (of this decoder's cache, enough for the batch, held by
    /// the caller for the call and free after it), then the LM head over the scored rows,
    /// `HEAD_ROWS` at a time, each token's log-prob by the draw's arithmetic. The batch's tokens
    /// must fit one step (`step_bounds`).
    pub fn logprobs_part(
        &mut self,
        model: &Decoder,
        seqs: &[TrainSeq],
        blocks: &[u32],
        adapter: Option<&AdapterWeights>,
        temperature: f32,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let c = &model.config;
        if c.final_softcap.is_some() {
            // The GPU's logits arrive uncapped; the host applies the cap (`rows_out`).
            return Err(ModelError::Unsupported(
                "training log-probs on the GPU of a model whose logits are soft-capped (Gemma 2)"
                    .into(),
            ));
        }
        let Tables {
            tables,
            first_pos,
            blocks: needed,
        } = train_tables(seqs, self.block_size)?;
        if blocks.len() < needed || blocks.iter().any(|&b| b >= self.scratch_block) {
            return Err(ModelError::Batch(format!(
                "the batch needs {needed} KV blocks below {}; {} given",
                self.scratch_block,
                blocks.len()
            )));
        }
        let tables: Vec<Vec<u32>> = tables
            .iter()
            .map(|t| t.iter().map(|&b| blocks[b as usize]).collect())
            .collect();
        let batch = train_batch(seqs, &tables, &first_pos, adapter);
        let Packed {
            tokens,
            positions,
            attn,
            ..
        } = model.pack(&batch, self.block_size)?;
        let t = tokens.len();
        if t > self.max_tokens {
            return Err(ModelError::Batch(format!(
                "{t} tokens in one training forward; the GPU's buffers hold {} a step",
                self.max_tokens
            )));
        }
        self.step += 1;
        let groups = adapter_groups(&batch);
        self.upload_adapters(&groups)?;
        self.load_step(model, &tokens, &positions, &attn)?;
        self.body(model, t, &groups, None, false)?;

        let vocab = c.vocab_size;
        // None: at T = 1, as the sampler does not scale there (nor when greedy).
        let temperature = (inv_temperature(temperature) != 1.0).then_some(temperature);
        let mut out: Vec<Vec<f32>> = seqs
            .iter()
            .map(|s| Vec::with_capacity(s.tokens.len() - s.prompt_len))
            .collect();
        let mut bufs = match self.score.take() {
            Some(b) => b,
            None => self.gpu.draw_buffers(HEAD_ROWS)?,
        };
        let mut got = Vec::with_capacity(HEAD_ROWS);
        let scored = scored_rows(seqs);
        let mut run = || -> Result<(), ModelError> {
            for chunk in scored.chunks(HEAD_ROWS) {
                let rows: Vec<u32> = chunk.iter().map(|&(_, r, _)| r as u32).collect();
                self.final_norm(model, &rows)?;
                self.head(rows.len())?;
                let a = &mut self.acts;
                head_lora(
                    &self.gpu,
                    &self.adapters,
                    &groups,
                    &rows,
                    &a.normed,
                    &mut a.logits,
                    &mut a.lora_h,
                    &mut a.lora_d,
                )?;
                let specs: Vec<ScoreSpec> = chunk
                    .iter()
                    .enumerate()
                    .map(|(j, &(_, _, token))| ScoreSpec {
                        row: j as u32,
                        token,
                        temperature,
                    })
                    .collect();
                let m = rows.len();
                self.gpu
                    .score(&mut a.logits, m, vocab, &specs, &mut bufs, &mut got)?;
                for (&(i, _, _), &lp) in chunk.iter().zip(&got) {
                    out[i].push(lp);
                }
            }
            Ok(())
        };
        let done = run();
        self.score = Some(bufs);
        done.map(|()| out)
    }
}
