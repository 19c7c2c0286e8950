//! What the training forward keeps for the backward: each layer's input (the checkpoints) and,
//! within a memory budget, the products of the last layers; a layer whose products were not kept
//! is recomputed from its input by the forward's own block (`Llama::recompute_layer`, so with the
//! same bits).

/// One layer's activations kept by the training forward for its backward, T rows each: q and k
/// after RoPE, v, the attention output, the residual stream after attention (`hx`), and the MLP's
/// gate and up products. (The RMSNorm outputs and SwiGLU are recomputed: they are cheap.)
#[derive(Default)]
pub(super) struct LayerActs {
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub att: Vec<f32>,
    pub hx: Vec<f32>,
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    /// q and k before their per-head norms (families with q/k norms; empty otherwise).
    pub q_lin: Vec<f32>,
    pub k_lin: Vec<f32>,
    /// The attention's and the MLP's outputs before their post-norms (Gemma 3; else empty).
    pub o_out: Vec<f32>,
    pub down_out: Vec<f32>,
    /// The mixture of experts' routing and products (MoE families, in place of gate and up).
    pub moe: Option<super::moe::MoeActs>,
}

/// What `forward_store` keeps: every layer's input, and the activations of layers
/// `keep_from..` (the others are recomputed from their input by the backward).
#[derive(Default)]
pub(super) struct ActStore {
    /// layers × T × hidden.
    pub checkpoints: Vec<f32>,
    pub keep_from: usize,
    pub acts: Vec<Option<LayerActs>>,
}

/// Bytes of one layer's `LayerActs` for `t` tokens.
pub(super) fn layer_act_bytes(c: &super::DecoderConfig, t: usize) -> usize {
    let qk_lin = if c.qk_norm { c.q_dim() + c.kv_dim() } else { 0 };
    let moe = c
        .moe
        .map_or(0, |m| super::moe::MoeActs::bytes(&m, c.hidden, t));
    let post = if c.post_norms { 2 * c.hidden } else { 0 };
    t * (2 * c.q_dim() + 2 * c.kv_dim() + c.hidden + 2 * c.ffn + qk_lin + post) * 4 + moe
}
