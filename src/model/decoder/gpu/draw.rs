//! Tokens drawn on the GPU (`Gpu::draw`, `cuda/draw.cuh`): the step's rows whose next token the
//! engine's sampler would draw from the whole distribution (greedy, or at a temperature with no
//! truncation, penalty or grammar) come back as the token, its log-prob and the alternatives
//! asked for — a few words instead of a row of logits (33 MB a step at batch 64 with a 128k
//! vocabulary) and the host's pass over it. The other rows' logits come back as before.

use super::GpuDecoder;
use crate::model::decoder::{Decoder, ModelError};
use flywheel_kernels::cuda::{DrawSpec, Drawn, NormSpec};

/// What a row of the step's logits comes back as (`GpuDecoder::forward_drawing`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RowOut {
    /// Its logits.
    Logits,
    /// Its logits, and the log-sum-exp of logits / T (None: T = 1, greedy's) that the draw's
    /// log-softmax subtracts (`Gpu::normalize`), in `RowsBack::lse`: for the host to sample a row
    /// the draw does not cover (penalties, a grammar, choices forked off it) with the log-probs
    /// the GPU would have drawn with, and a trainer scoring on it computes (`fw_score`).
    Normalized(Option<f32>),
    /// Its token drawn here (the spec's `row` is ignored), in `RowsBack::drawn`.
    Drawn(DrawSpec),
}

/// What came back besides the logits, each in the order of its rows.
#[derive(Debug, Default)]
pub struct RowsBack {
    pub drawn: Vec<Drawn>,
    pub lse: Vec<f32>,
}

impl RowsBack {
    pub fn clear(&mut self) {
        self.drawn.clear();
        self.lse.clear();
    }
}

impl GpuDecoder {
    /// Whether this decoder draws tokens (`forward_drawing`) and normalizes rows: not with
    /// FLYWHEEL_CUDA_SAMPLING=0, nor for a model whose logits are soft-capped (Gemma 2: the cap
    /// is applied on the host).
    pub fn draws(&self) -> bool {
        self.draw.is_some()
    }

    /// Logit rows `first .. first + m` of the step, rows 0..m of the logits on the device: those
    /// `rows` has drawn here, their results appended to `back` in order; the others' logits read
    /// into `out` (m rows) and capped, as `forward_into` does, then the log-sum-exps of those
    /// `rows` has normalized (`RowOut::Normalized`) appended to `back`.
    pub(super) fn rows_out(
        &mut self,
        model: &Decoder,
        first: usize,
        m: usize,
        rows: &[RowOut],
        out: &mut [f32],
        back: &mut RowsBack,
    ) -> Result<(), ModelError> {
        let vocab = model.config.vocab_size;
        let plan = |j: usize| rows.get(first + j).copied().unwrap_or(RowOut::Logits);
        let drawn_here = |j: usize| matches!(plan(j), RowOut::Drawn(_));
        let specs: Vec<DrawSpec> = (0..m)
            .filter_map(|j| match plan(j) {
                RowOut::Drawn(s) => Some(DrawSpec { row: j as u32, ..s }),
                _ => None,
            })
            .collect();
        let norms: Vec<NormSpec> = (0..m)
            .filter_map(|j| match plan(j) {
                RowOut::Normalized(temperature) => Some(NormSpec {
                    row: j as u32,
                    temperature,
                }),
                _ => None,
            })
            .collect();
        let need = || ModelError::Gpu("this decoder draws no tokens".into());
        if !specs.is_empty() {
            let bufs = self.draw.as_mut().ok_or_else(need)?;
            let logits = &mut self.acts.logits;
            self.gpu
                .draw(logits, m, vocab, &specs, bufs, &mut self.drawn)?;
            back.drawn.append(&mut self.drawn);
        }
        // The other rows' logits, a run of rows at a time.
        let mut j = 0;
        while j < m {
            if drawn_here(j) {
                j += 1;
                continue;
            }
            let end = (j..m).find(|&e| drawn_here(e)).unwrap_or(m);
            let o = &mut out[j * vocab..end * vocab];
            self.gpu
                .read_into(&self.acts.logits.slice(j * vocab..end * vocab), o)?;
            model.config.cap_logits(o);
            j = end;
        }
        // After their logits were read: `normalize` leaves a row as its log-probs.
        if !norms.is_empty() {
            let bufs = self.draw.as_mut().ok_or_else(need)?;
            let logits = &mut self.acts.logits;
            self.gpu
                .normalize(logits, m, vocab, &norms, bufs, &mut self.lse)?;
            back.lse.extend_from_slice(&self.lse);
        }
        Ok(())
    }
}
