//! The families: what each `general.architecture` means beyond the keys every family shares.

use super::{Activation, ModelError, SUPPORTED_ARCHITECTURES};
use flywheel_kernels::RopeLayout;

/// What a family's GGUF means beyond the keys every family shares: one entry per
/// `general.architecture`, so that a new family is an entry here plus its tests. What a file
/// carries itself (Qwen2's q/k/v biases, Qwen3's q/k norms, experts, Llama 3's RoPE factors) is
/// read from the file whatever the family.
#[derive(Clone, Copy, Debug)]
pub struct Family {
    pub arch: &'static str,
    /// Which dims RoPE pairs: llama.cpp's converter permutes LLaMA's q/k rows for adjacent pairs
    /// and keeps the other families' NeoX order.
    pub rope_layout: RopeLayout,
    /// The MLP's gate activation.
    pub activation: Activation,
    /// RMSNorms of the attention's and the MLP's outputs before their residual adds.
    pub post_norms: bool,
    /// Embedding rows times √hidden.
    pub embed_scale: bool,
    /// Sliding-window layers (`attention.sliding_window`), every `global_every`-th layer global
    /// unless the file says (`attention.sliding_window_pattern`).
    pub sliding_window: bool,
    pub global_every: usize,
    /// The window where the file has no `attention.sliding_window` (llama.cpp's default for
    /// Gemma 2: 4096); None: no sliding layers then.
    pub default_window: Option<usize>,
    /// The layer count of the model whose q is scaled by (hidden / heads)^-½ rather than
    /// head_dim^-½ when the file has no `attention.scale` (llama.cpp's rule: Gemma 2 and 3 27B).
    pub wide_q_scale_layers: Option<usize>,
    /// The sliding-window layers' RoPE base (Gemma 3: 10⁴); None: `rope.freq_base`, as the
    /// global layers (Gemma 2).
    pub local_rope_base: Option<f32>,
    /// Soft-capping of the attention scores and of the final logits, c·tanh(x / c), where the file
    /// does not set `attn_logit_softcapping` / `final_logit_softcapping` (llama.cpp's defaults
    /// for Gemma 2: 50 and 30). A file's own keys apply in every family; 0 turns one off.
    pub softcaps: Option<(f32, f32)>,
}

const DEFAULT_FAMILY: Family = Family {
    arch: "llama",
    rope_layout: RopeLayout::Adjacent,
    activation: Activation::Silu,
    post_norms: false,
    embed_scale: false,
    sliding_window: false,
    global_every: 6,
    default_window: None,
    wide_q_scale_layers: None,
    local_rope_base: None,
    softcaps: None,
};

/// The families, in `SUPPORTED_ARCHITECTURES`' order.
pub const FAMILIES: &[Family] = &[
    DEFAULT_FAMILY,
    Family {
        arch: "qwen2",
        rope_layout: RopeLayout::Neox,
        ..DEFAULT_FAMILY
    },
    Family {
        arch: "qwen3",
        rope_layout: RopeLayout::Neox,
        ..DEFAULT_FAMILY
    },
    Family {
        arch: "qwen3moe",
        rope_layout: RopeLayout::Neox,
        ..DEFAULT_FAMILY
    },
    Family {
        arch: "gemma3",
        rope_layout: RopeLayout::Neox,
        activation: Activation::GeluTanh,
        post_norms: true,
        embed_scale: true,
        sliding_window: true,
        global_every: 6,
        default_window: None,
        wide_q_scale_layers: Some(62),
        local_rope_base: Some(10000.0),
        softcaps: None,
    },
    // Gemma 3's layout before q/k norms: every other layer global, one RoPE base, scores and
    // logits soft-capped.
    Family {
        arch: "gemma2",
        rope_layout: RopeLayout::Neox,
        activation: Activation::GeluTanh,
        post_norms: true,
        embed_scale: true,
        sliding_window: true,
        global_every: 2,
        default_window: Some(4096),
        wide_q_scale_layers: Some(46),
        local_rope_base: None,
        softcaps: Some((50.0, 30.0)),
    },
];

/// The family of `arch`, or an error naming the supported ones.
pub fn family(arch: &str) -> Result<Family, ModelError> {
    FAMILIES
        .iter()
        .find(|f| f.arch == arch)
        .copied()
        .ok_or_else(|| {
            ModelError::Unsupported(format!(
                "general.architecture = '{arch}': supported are {}",
                SUPPORTED_ARCHITECTURES.join(", ")
            ))
        })
}
