//! The GPU forward's activation buffers, sized once for the most tokens a step holds: their
//! addresses never change, so that decode graphs read each step's values from them.

use super::adapters::LORA_MAX_R;
use super::HEAD_ROWS;
use crate::model::decoder::DecoderConfig;
use flywheel_kernels::cuda::{CudaSlice, Gpu, GpuError, Q8Acts};

/// The activations, sized once for the most tokens a step holds (fixed addresses: graphs).
pub(super) struct Acts {
    pub(super) tokens: CudaSlice<u32>,
    pub(super) rope: CudaSlice<f32>,
    pub(super) rope_local: CudaSlice<f32>,
    /// The rows whose logits (or hidden states) are wanted, per head pass.
    pub(super) rows: CudaSlice<u32>,
    pub(super) x: CudaSlice<f32>,
    pub(super) n: CudaSlice<f32>,
    pub(super) q: CudaSlice<f32>,
    pub(super) k: CudaSlice<f32>,
    pub(super) v: CudaSlice<f32>,
    pub(super) att: CudaSlice<f32>,
    pub(super) proj: CudaSlice<f32>,
    pub(super) gate: CudaSlice<f32>,
    pub(super) up: CudaSlice<f32>,
    pub(super) act: CudaSlice<f32>,
    /// A projection's input with an OFT group's rows rotated.
    pub(super) rotated: CudaSlice<f32>,
    pub(super) lora_h: CudaSlice<f32>,
    pub(super) lora_d: CudaSlice<f32>,
    pub(super) moe: MoeBufs,
    pub(super) xs: CudaSlice<f32>,
    pub(super) normed: CudaSlice<f32>,
    pub(super) logits: CudaSlice<f32>,
    /// A projection's input quantized for int8 products (int8 decoders only).
    pub(super) q8: Option<Q8Acts>,
}

/// A mixture of experts' activations (one row per token and choice; empty for dense models).
pub(super) struct MoeBufs {
    pub(super) logits: CudaSlice<f32>,
    /// Each grouped row's token, each choice's grouped row, each choice's weight.
    pub(super) tok: CudaSlice<u32>,
    pub(super) row_of: CudaSlice<u32>,
    pub(super) weight: CudaSlice<f32>,
    pub(super) xs: CudaSlice<f32>,
    pub(super) gate: CudaSlice<f32>,
    pub(super) up: CudaSlice<f32>,
    pub(super) act: CudaSlice<f32>,
    pub(super) out: CudaSlice<f32>,
}

impl Acts {
    /// The bytes `new` allocates for `t` tokens (4 a value; the int8 inputs' codes counted as
    /// values too, an over-count), for sizing the KV cache from what the GPU has left.
    pub(super) fn bytes(c: &DecoderConfig, t: usize, int8: bool) -> usize {
        let (h, qd, kvd, f) = (c.hidden, c.q_dim(), c.kv_dim(), c.ffn);
        let widest = h.max(qd).max(f);
        let (ne, k, ef) = c
            .moe
            .map_or((0, 0, 0), |m| (m.experts, m.used, m.expert_ffn));
        let values = t * (2 + 2 * c.rope_dim + 3 * h + 2 * qd + 2 * kvd + 3 * f + widest)
            + t * LORA_MAX_R
            + (t * widest).max(c.vocab_size)
            + t * ne
            + t * k * (3 + 2 * h + 3 * ef)
            + HEAD_ROWS * (2 * h + c.vocab_size)
            + match int8 {
                true => t * k.max(1) * (widest.max(ef) + 1),
                false => 0,
            };
        values * 4
    }

    /// Buffers for up to `t` tokens of a model of shape `c` (with room to quantize inputs for
    /// int8 products where `int8`).
    pub(super) fn new(
        gpu: &Gpu,
        c: &DecoderConfig,
        t: usize,
        int8: bool,
    ) -> Result<Acts, GpuError> {
        let (h, qd, kvd, f) = (c.hidden, c.q_dim(), c.kv_dim(), c.ffn);
        let widest = h.max(qd).max(f);
        let lora_r = LORA_MAX_R; // LoRA ranks up to this run on the GPU (`project` checks)
        let z = |n: usize| gpu.zeros::<f32>(n);
        Ok(Acts {
            tokens: gpu.zeros(t)?,
            rope: z(t * c.rope_dim)?,
            rope_local: z(t * c.rope_dim)?,
            rows: gpu.zeros(t)?,
            x: z(t * h)?,
            n: z(t * h)?,
            q: z(t * qd)?,
            k: z(t * kvd)?,
            v: z(t * kvd)?,
            att: z(t * qd)?,
            proj: z(t * h)?,
            gate: z(t * f)?,
            up: z(t * f)?,
            act: z(t * f)?,
            rotated: z(t * widest)?,
            lora_h: z(t * lora_r)?,
            // A head pass's LoRA delta takes at least one row of the vocabulary.
            lora_d: z((t * widest).max(c.vocab_size))?,
            moe: {
                let (ne, k, ef) = c
                    .moe
                    .map_or((0, 0, 0), |m| (m.experts, m.used, m.expert_ffn));
                MoeBufs {
                    logits: z(t * ne)?,
                    tok: gpu.zeros(t * k)?,
                    row_of: gpu.zeros(t * k)?,
                    weight: z(t * k)?,
                    xs: z(t * k * h)?,
                    gate: z(t * k * ef)?,
                    up: z(t * k * ef)?,
                    act: z(t * k * ef)?,
                    out: z(t * k * h)?,
                }
            },
            xs: z(HEAD_ROWS * h)?,
            normed: z(HEAD_ROWS * h)?,
            logits: z(HEAD_ROWS * c.vocab_size)?,
            // A mixture of experts quantizes its (token, choice) rows: k a token.
            q8: int8
                .then(|| {
                    let (k, ef) = c.moe.map_or((1, 0), |m| (m.used.max(1), m.expert_ffn));
                    gpu.q8_acts(t * k, widest.max(ef))
                })
                .transpose()?,
        })
    }
}
