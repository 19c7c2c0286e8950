//! The activations of one forward pass, owned by the caller and reused from step to step.

use super::DecoderConfig;

/// The activations of one forward pass, kept by the caller and reused.
#[derive(Default)]
pub struct ForwardBuffers {
    pub(super) x: Vec<f32>,
    pub(super) n: Vec<f32>,
    pub(super) q: Vec<f32>,
    pub(super) k: Vec<f32>,
    pub(super) v: Vec<f32>,
    pub(super) att: Vec<f32>,
    pub(super) proj: Vec<f32>,
    pub(super) gate: Vec<f32>,
    pub(super) up: Vec<f32>,
    pub(super) act: Vec<f32>,
    pub(super) xs: Vec<f32>,
    pub(super) normed: Vec<f32>,
    /// (rows of logits asked for, vocab_size) after a pass.
    pub logits: Vec<f32>,
    /// (rows of hidden states asked for, hidden): the final norm's output (`Logits::Hidden`).
    pub hidden: Vec<f32>,
    /// An f16 KV cache: the rows of K and V as the halves it stores (rounded once, written as
    /// they are).
    pub(super) k16: Vec<flywheel_kernels::reference::F16>,
    pub(super) v16: Vec<flywheel_kernels::reference::F16>,
    pub(super) adapter: AdapterScratch,
    /// The mixture of experts' routing and products (MoE families).
    pub(super) moe: super::moe::MoeActs,
}

/// Scratch for adapter work: rotated inputs (one per projection sharing an input) and LoRA's
/// gathered rows and intermediate products.
#[derive(Default)]
pub struct AdapterScratch {
    pub rotated: [Vec<f32>; 3],
    pub lora: LoraScratch,
    /// The logit rows of one adapter group (LoRA on the LM head).
    pub head_rows: Vec<usize>,
}

#[derive(Default)]
pub struct LoraScratch {
    pub x: Vec<f32>,
    pub h: Vec<f32>,
    pub d: Vec<f32>,
}

impl ForwardBuffers {
    /// Set every buffer's length for `t` tokens and `m` logit rows (growing only touches the
    /// new part).
    pub(super) fn size(&mut self, t: usize, m: usize, c: &DecoderConfig) {
        let (h, qd, kvd, f) = (c.hidden, c.q_dim(), c.kv_dim(), c.ffn);
        for (b, len) in [
            (&mut self.x, t * h),
            (&mut self.n, t * h),
            (&mut self.q, t * qd),
            (&mut self.k, t * kvd),
            (&mut self.v, t * kvd),
            (&mut self.att, t * qd),
            (&mut self.proj, t * h),
            (&mut self.gate, t * f),
            (&mut self.up, t * f),
            (&mut self.act, t * f),
            (&mut self.xs, m * h),
            (&mut self.normed, m * h),
            (&mut self.logits, m * c.vocab_size),
        ] {
            b.resize(len, 0.0);
        }
    }
}
