//! Tokens drawn on the GPU (`Gpu::draw`, `cuda/draw.cuh`): the step's rows whose next token the
//! engine's sampler would draw from the whole distribution (greedy, or at a temperature with no
//! truncation, penalty or grammar) come back as the token, its log-prob and the alternatives
//! asked for — a few words instead of a row of logits (33 MB a step at batch 64 with a 128k
//! vocabulary) and the host's pass over it. The other rows' logits come back as before.

use super::GpuDecoder;
use crate::model::decoder::{Decoder, ModelError};
use flywheel_kernels::cuda::{DrawSpec, Drawn};

impl GpuDecoder {
    /// Whether this decoder draws tokens (`forward_drawing`): not with FLYWHEEL_CUDA_SAMPLING=0,
    /// nor for a model whose logits are soft-capped (Gemma 2: the cap is applied on the host).
    pub fn draws(&self) -> bool {
        self.draw.is_some()
    }

    /// Logit rows `first .. first + m` of the step, rows 0..m of the logits on the device: those
    /// `draws` names (by the step's logit row) drawn here, their results appended to `drawn` in
    /// order; the others' logits read into `out` (m rows) and capped, as `forward_into` does.
    pub(super) fn rows_out(
        &mut self,
        model: &Decoder,
        first: usize,
        m: usize,
        draws: &[Option<DrawSpec>],
        out: &mut [f32],
        drawn: &mut Vec<Drawn>,
    ) -> Result<(), ModelError> {
        let vocab = model.config.vocab_size;
        let spec = |j: usize| draws.get(first + j).copied().flatten();
        let specs: Vec<DrawSpec> = (0..m)
            .filter_map(|j| spec(j).map(|s| DrawSpec { row: j as u32, ..s }))
            .collect();
        if !specs.is_empty() {
            let bufs = self
                .draw
                .as_mut()
                .ok_or_else(|| ModelError::Gpu("this decoder draws no tokens".into()))?;
            let logits = &mut self.acts.logits;
            self.gpu
                .draw(logits, m, vocab, &specs, bufs, &mut self.drawn)?;
            drawn.append(&mut self.drawn);
        }
        // The other rows' logits, a run of rows at a time.
        let mut j = 0;
        while j < m {
            if spec(j).is_some() {
                j += 1;
                continue;
            }
            let end = (j..m).find(|&e| spec(e).is_some()).unwrap_or(m);
            let o = &mut out[j * vocab..end * vocab];
            self.gpu
                .read_into(&self.acts.logits.slice(j * vocab..end * vocab), o)?;
            model.config.cap_logits(o);
            j = end;
        }
        Ok(())
    }
}
