//! The decoder-only transformer every supported family is (`Decoder`): its configuration and
//! weights, loaded from GGUF and kept in their block formats (one copy: read into 2 MB pages or
//! mapped; never dequantized as a whole, never copied again). What each `general.architecture`
//! means (RoPE layout, activation, norms, embedding scale, window rule, soft-caps, experts) is one
//! entry of `family`'s table. `forward` runs a packed batch (each sequence optionally through its
//! own adapter version; `pack` lays it out); `train` is the training forward and backward; `moe`
//! the experts; `buffers` and `activations` hold the activations; `gpu` the same on CUDA.

mod activations;
mod buffers;
mod family;
mod forward;
#[cfg(feature = "cuda")]
mod gpu;
mod moe;
mod pack;
mod train;

pub use buffers::{AdapterScratch, ForwardBuffers};
pub use forward::{adapter_groups, AdapterGroup, Projection};
#[cfg(feature = "cuda")]
pub use gpu::{GpuDecoder, GpuShape, RowOut, RowsBack};
pub use pack::{BatchSeq, Logits};
pub use train::{
    blocks_of, inline_prefixes, part_seqs, prefixes_to_inline, score_parts, TrainSeq, TrainState,
    ACTIVATION_BUDGET, HEAD_CHUNK, TRAIN_BLOCK,
};

use super::gguf::{Gguf, GgufError, TensorInfo, WeightMemory};
use flywheel_kernels::cpu::ops::rope_table;
use flywheel_kernels::{QuantType, RopeLayout};
use std::path::Path;

pub use family::{family, Family, FAMILIES};

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("unsupported model: {0}")]
    Unsupported(String),
    #[error("tensor '{name}': {msg}")]
    Shape { name: String, msg: String },
    #[error("batch: {0}")]
    Batch(String),
    #[error("GPU: {0}")]
    Gpu(String),
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct DecoderConfig {
    pub num_layers: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rope_dim: usize,
    pub rope_base: f32,
    /// Which dims RoPE pairs: adjacent for `llama` GGUFs, NeoX for the families whose converter
    /// keeps Hugging Face's q/k order.
    #[serde(serialize_with = "rope_layout_name")]
    pub rope_layout: RopeLayout,
    pub eps: f32,
    pub context_length: usize,
    /// Each head's q and k are RMS-normed before RoPE (Qwen3: `attn_q_norm`, `attn_k_norm`).
    pub qk_norm: bool,
    pub vocab_size: usize,
    /// A mixture of experts in place of the dense MLP (Qwen3-MoE); `ffn` is then 0.
    pub moe: Option<MoeConfig>,
    /// RMSNorms of the attention's and the MLP's outputs before their residual adds (Gemma 3).
    pub post_norms: bool,
    /// The MLP's gate activation: SiLU (SwiGLU) or the tanh GELU (Gemma's GeGLU).
    pub activation: Activation,
    /// Scores are q·k times this (1/√head_dim, or Gemma's query_pre_attn_scalar^-½).
    pub attn_scale: f32,
    /// The embedding rows are multiplied by this (Gemma: √hidden).
    pub embed_scale: Option<f32>,
    /// Gemma's local layers: a sliding window of this many keys, and their RoPE base (Gemma 3's
    /// own, Gemma 2's `rope_base`); every `global_every`-th layer attends globally with
    /// `rope_base` (and `rope_scale`).
    pub sliding_window: Option<usize>,
    pub global_every: usize,
    pub rope_local_base: f32,
    /// Linear RoPE scaling of the global layers (positions divided by it; 1: none).
    pub rope_scale: f32,
    /// Gemma 2's soft-capping of the scaled attention scores, c·tanh(s / c).
    pub attn_softcap: Option<f32>,
    /// Gemma 2's soft-capping of the final logits, c·tanh(z / c).
    pub final_softcap: Option<f32>,
}

/// The MLP's gate activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    Silu,
    GeluTanh,
}

/// A mixture-of-experts MLP: a router picks `used` of `experts` SwiGLU experts per token.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct MoeConfig {
    pub experts: usize,
    pub used: usize,
    /// Each expert's intermediate width.
    pub expert_ffn: usize,
    /// The chosen experts' softmax weights are renormalised to sum to one (Qwen3-MoE's
    /// `norm_topk_prob`; llama.cpp always does for `qwen3moe`).
    pub norm_topk: bool,
}

impl DecoderConfig {
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// The sliding window of layer `l` (None: a global layer, or no windows in this family).
    pub fn window(&self, l: usize) -> Option<usize> {
        self.sliding_window
            .filter(|_| !(l + 1).is_multiple_of(self.global_every))
    }

    /// What layer `l`'s attention does beyond causal softmax: its window and the soft-cap.
    pub fn attn_opts(&self, l: usize) -> flywheel_kernels::reference::AttnOpts {
        flywheel_kernels::reference::AttnOpts {
            window: self.window(l),
            softcap: self.attn_softcap,
        }
    }

    /// Soft-caps rows of logits in place (Gemma 2's final soft-capping; nothing without it).
    pub fn cap_logits(&self, logits: &mut [f32]) {
        if let Some(c) = self.final_softcap {
            for z in logits {
                *z = flywheel_kernels::reference::softcap(*z, c);
            }
        }
    }
}

impl crate::adapter::AdapterBase for DecoderConfig {
    fn adapter_shape(&self) -> crate::adapter::BaseShape {
        crate::adapter::BaseShape {
            num_layers: self.num_layers,
            hidden: self.hidden,
            q_dim: self.q_dim(),
            kv_dim: self.kv_dim(),
            ffn: self.ffn,
            head_dim: self.head_dim,
            vocab: self.vocab_size,
            qk_rows_permuted: self.rope_layout == RopeLayout::Adjacent,
        }
    }
}

/// A weight matrix: `rows` rows of `cols` values, stored in the mapped file.
#[derive(Clone, Debug)]
pub struct Weight {
    pub ty: QuantType,
    pub rows: usize,
    pub cols: usize,
    start: usize,
    len: usize,
}

pub struct Layer {
    pub attn_norm: Vec<f32>,
    pub wq: Weight,
    pub wk: Weight,
    pub wv: Weight,
    /// Added after the q, k and v products (Qwen2); None where the family has none.
    pub bq: Option<Vec<f32>>,
    pub bk: Option<Vec<f32>>,
    pub bv: Option<Vec<f32>>,
    /// RMSNorm weights (head_dim) of each head's q and k, before RoPE (Qwen3, Gemma 3).
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub wo: Weight,
    /// RMSNorm of the attention's output before the residual add (Gemma 3).
    pub post_attn_norm: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    pub mlp: Mlp,
    /// RMSNorm of the MLP's output before the residual add (Gemma 3).
    pub post_ffn_norm: Option<Vec<f32>>,
}

/// A layer's MLP: dense SwiGLU, or a routed mixture of SwiGLU experts.
pub enum Mlp {
    Dense {
        w_gate: Weight,
        w_up: Weight,
        w_down: Weight,
    },
    Moe(Experts),
}

/// One layer's experts: the router (experts × hidden) and each expert's projections, slices of
/// the stacked `ffn_*_exps` tensors (read in place, quantized, one expert at a time).
pub struct Experts {
    pub router: Weight,
    pub gate: Vec<Weight>,
    pub up: Vec<Weight>,
    pub down: Vec<Weight>,
}

/// The `general.architecture` values this build reads.
pub const SUPPORTED_ARCHITECTURES: &[&str] =
    &["llama", "qwen2", "qwen3", "qwen3moe", "gemma3", "gemma2"];

pub struct Decoder {
    pub config: DecoderConfig,
    pub gguf: Gguf,
    /// Llama 3's RoPE frequency factors (`rope_freqs.weight`, rope_dim / 2): each pair's angle
    /// is divided by its factor. None: plain RoPE.
    pub rope_freqs: Option<Vec<f32>>,
    pub token_embd: Weight,
    pub layers: Vec<Layer>,
    pub output_norm: Vec<f32>,
    pub output: Weight,
    /// What the KV caches of this model's forwards store (serving and training alike, so train
    /// = serve holds): f32 unless set before the model is shared.
    pub kv_dtype: crate::model::kv_cache::KvDtype,
}

impl Decoder {
    pub fn open(path: impl AsRef<Path>) -> Result<Decoder, ModelError> {
        Decoder::from_gguf(Gguf::open(path)?)
    }

    pub fn open_in(path: impl AsRef<Path>, memory: WeightMemory) -> Result<Decoder, ModelError> {
        Decoder::from_gguf(Gguf::open_in(path, memory)?)
    }

    pub fn from_gguf(g: Gguf) -> Result<Decoder, ModelError> {
        let arch = g.get_str("general.architecture")?.to_string();
        let fam = family(&arch)?;
        let k = |s: &str| format!("{arch}.{s}");
        let hidden = g.get_usize(&k("embedding_length"))?;
        let num_heads = g.get_usize(&k("attention.head_count"))?;
        let num_kv_heads = match g.get(&k("attention.head_count_kv")) {
            Some(_) => g.get_usize(&k("attention.head_count_kv"))?,
            None => num_heads,
        };
        if num_heads == 0
            || num_kv_heads == 0
            || (g.get(&k("attention.key_length")).is_none() && hidden % num_heads != 0)
            || num_heads % num_kv_heads != 0
        {
            return Err(ModelError::Unsupported(format!(
                "{num_heads} heads, {num_kv_heads} KV heads, hidden {hidden}: heads must divide hidden and KV heads must divide heads"
            )));
        }
        // Its own key where the family has one (Qwen3's head dim is not hidden / heads).
        let head_dim = match g.get(&k("attention.key_length")) {
            Some(_) => g.get_usize(&k("attention.key_length"))?,
            None => hidden / num_heads,
        };
        let rope_dim = match g.get(&k("rope.dimension_count")) {
            Some(_) => g.get_usize(&k("rope.dimension_count"))?,
            None => head_dim,
        };
        if rope_dim > head_dim || rope_dim % 2 != 0 {
            return Err(ModelError::Unsupported(format!(
                "rope dimension {rope_dim} with head dim {head_dim}"
            )));
        }
        let embd = g
            .tensor("token_embd.weight")
            .ok_or_else(|| missing("token_embd.weight"))?
            .clone();
        let vocab_size = *embd.dims.get(1).unwrap_or(&0) as usize;
        let moe = match g.get(&k("expert_count")) {
            None => None,
            Some(_) => {
                let experts = g.get_usize(&k("expert_count"))?;
                let used = g.get_usize(&k("expert_used_count"))?;
                if experts == 0 || used == 0 || used > experts {
                    return Err(ModelError::Unsupported(format!(
                        "{used} experts used of {experts}"
                    )));
                }
                Some(MoeConfig {
                    experts,
                    used,
                    expert_ffn: g.get_usize(&k("expert_feed_forward_length"))?,
                    norm_topk: match g.get(&k("expert_weights_norm")) {
                        Some(v) => v.as_i64().unwrap_or(1) != 0,
                        None => true,
                    },
                })
            }
        };
        let opt_f32 = |key: &str| -> Result<Option<f32>, ModelError> {
            match g.get(&k(key)) {
                Some(_) => Ok(Some(g.get_f32(&k(key))?)),
                None => Ok(None),
            }
        };
        // The file's cap where it has one (0: none), else the family's (Gemma 2: always on).
        let softcap = |key: &str, default: Option<f32>| -> Result<Option<f32>, ModelError> {
            match opt_f32(key)? {
                Some(v) if v.is_finite() && v > 0.0 => Ok(Some(v)),
                Some(0.0) => Ok(None),
                Some(v) => Err(ModelError::Unsupported(format!("{arch}.{key} = {v}"))),
                None => Ok(default),
            }
        };
        let attn_softcap = softcap("attn_logit_softcapping", fam.softcaps.map(|c| c.0))?;
        let final_softcap = softcap("final_logit_softcapping", fam.softcaps.map(|c| c.1))?;
        let num_layers = g.get_usize(&k("block_count"))?;
        // Gemma 3 scales q by query_pre_attn_scalar^-½, which its GGUF does not carry: llama.cpp's
        // rule (head_dim, but hidden / heads for the 62-layer 27B) unless the file says.
        let attn_scale = match opt_f32("attention.scale")? {
            Some(s) => s,
            None if fam.wide_q_scale_layers == Some(num_layers) => {
                1.0 / ((hidden / num_heads) as f32).sqrt()
            }
            None => 1.0 / (head_dim as f32).sqrt(),
        };
        let sliding_window = match (fam.sliding_window, g.get(&k("attention.sliding_window"))) {
            (true, Some(_)) => {
                Some(g.get_usize(&k("attention.sliding_window"))?).filter(|&w| w > 0)
            }
            (true, None) => fam.default_window,
            (false, _) => None,
        };
        let rope_scale = match g.get(&k("rope.scaling.type")).and_then(|v| v.as_str()) {
            None | Some("none") => 1.0,
            Some("linear") => opt_f32("rope.scaling.factor")?.unwrap_or(1.0),
            Some(other) => {
                return Err(ModelError::Unsupported(format!(
                    "{arch}.rope.scaling.type = '{other}' (linear, or Llama 3's rope_freqs)"
                )))
            }
        };
        let config = DecoderConfig {
            activation: fam.activation,
            attn_scale,
            post_norms: fam.post_norms,
            embed_scale: fam.embed_scale.then(|| (hidden as f32).sqrt()),
            sliding_window,
            global_every: match g.get(&k("attention.sliding_window_pattern")) {
                Some(v) => v
                    .as_i64()
                    .filter(|&p| p > 0)
                    .map_or(fam.global_every, |p| p as usize),
                None => fam.global_every,
            },
            rope_local_base: 0.0, // set below from the family and the global base
            rope_scale,
            attn_softcap,
            final_softcap,
            num_layers,
            hidden,
            ffn: match moe {
                Some(_) => 0,
                None => g.get_usize(&k("feed_forward_length"))?,
            },
            moe,
            num_heads,
            num_kv_heads,
            head_dim,
            rope_dim,
            rope_layout: fam.rope_layout,
            rope_base: match g.get(&k("rope.freq_base")) {
                Some(_) => g.get_f32(&k("rope.freq_base"))?,
                None => 10000.0,
            },
            eps: g.get_f32(&k("attention.layer_norm_rms_epsilon"))?,
            context_length: g.get_usize(&k("context_length"))?,
            qk_norm: g.tensor("blk.0.attn_q_norm.weight").is_some(),
            vocab_size,
        };
        let mut config = config;
        config.rope_local_base = fam.local_rope_base.unwrap_or(config.rope_base);
        let c = &config;
        let token_embd = weight(&g, "token_embd.weight", c.vocab_size, c.hidden)?;
        let mut layers = Vec::with_capacity(c.num_layers);
        for l in 0..c.num_layers {
            let n = |s: &str| format!("blk.{l}.{s}.weight");
            let bias = |s: &str, len: usize| -> Result<Option<Vec<f32>>, ModelError> {
                let name = format!("blk.{l}.{s}.bias");
                match g.tensor(&name) {
                    Some(_) => vector(&g, &name, len).map(Some),
                    None => Ok(None),
                }
            };
            // Every layer has them, or none (a missing one is an error naming it).
            let head_norm = |s: &str| -> Result<Option<Vec<f32>>, ModelError> {
                match c.qk_norm {
                    true => vector(&g, &n(s), c.head_dim).map(Some),
                    false => Ok(None),
                }
            };
            let post_norm = |s: &str| -> Result<Option<Vec<f32>>, ModelError> {
                match c.post_norms {
                    true => vector(&g, &n(s), c.hidden).map(Some),
                    false => Ok(None),
                }
            };
            layers.push(Layer {
                q_norm: head_norm("attn_q_norm")?,
                k_norm: head_norm("attn_k_norm")?,
                bq: bias("attn_q", c.q_dim())?,
                bk: bias("attn_k", c.kv_dim())?,
                bv: bias("attn_v", c.kv_dim())?,
                attn_norm: vector(&g, &n("attn_norm"), c.hidden)?,
                wq: weight(&g, &n("attn_q"), c.q_dim(), c.hidden)?,
                wk: weight(&g, &n("attn_k"), c.kv_dim(), c.hidden)?,
                wv: weight(&g, &n("attn_v"), c.kv_dim(), c.hidden)?,
                wo: weight(&g, &n("attn_output"), c.hidden, c.q_dim())?,
                post_attn_norm: post_norm("post_attention_norm")?,
                post_ffn_norm: post_norm("post_ffw_norm")?,
                ffn_norm: vector(&g, &n("ffn_norm"), c.hidden)?,
                mlp: match &c.moe {
                    None => Mlp::Dense {
                        w_gate: weight(&g, &n("ffn_gate"), c.ffn, c.hidden)?,
                        w_up: weight(&g, &n("ffn_up"), c.ffn, c.hidden)?,
                        w_down: weight(&g, &n("ffn_down"), c.hidden, c.ffn)?,
                    },
                    Some(m) => {
                        let (e, f) = (m.experts, m.expert_ffn);
                        Mlp::Moe(Experts {
                            router: weight(&g, &n("ffn_gate_inp"), e, c.hidden)?,
                            gate: experts(&g, &n("ffn_gate_exps"), e, f, c.hidden)?,
                            up: experts(&g, &n("ffn_up_exps"), e, f, c.hidden)?,
                            down: experts(&g, &n("ffn_down_exps"), e, c.hidden, f)?,
                        })
                    }
                },
            });
        }
        let rope_freqs = match g.tensor("rope_freqs.weight") {
            Some(_) => Some(vector(&g, "rope_freqs.weight", c.rope_dim / 2)?),
            None => None,
        };
        let output_norm = vector(&g, "output_norm.weight", c.hidden)?;
        let output = match g.tensor("output.weight") {
            Some(_) => weight(&g, "output.weight", c.vocab_size, c.hidden)?,
            None => token_embd.clone(),
        };
        Ok(Decoder {
            config,
            gguf: g,
            rope_freqs,
            token_embd,
            layers,
            output_norm,
            output,
            kv_dtype: Default::default(),
        })
    }

    /// RoPE tables of `positions`: the global layers' (with Llama 3's factors or linear scaling),
    /// and the sliding-window layers' (their own base; empty without such layers).
    pub fn rope_tables(&self, positions: &[u32]) -> (Vec<f32>, Vec<f32>) {
        let c = &self.config;
        let linear: Vec<f32>;
        let factors = match &self.rope_freqs {
            Some(f) => Some(f.as_slice()),
            None if c.rope_scale != 1.0 => {
                linear = vec![c.rope_scale; c.rope_dim / 2];
                Some(linear.as_slice())
            }
            None => None,
        };
        let global = rope_table(positions, c.rope_dim, c.rope_base, factors);
        let local = match c.sliding_window {
            Some(_) => rope_table(positions, c.rope_dim, c.rope_local_base, None),
            None => Vec::new(),
        };
        (global, local)
    }

    /// The bytes of a weight.
    pub fn bytes(&self, w: &Weight) -> &[u8] {
        &self.gguf.bytes()[w.start..w.start + w.len]
    }

    /// Total bytes of weights read per decoded token (every matrix once, the LM head included).
    pub fn weight_bytes_per_token(&self) -> usize {
        let per_layer: usize = self
            .layers
            .iter()
            .map(|l| {
                let attn: usize = [&l.wq, &l.wk, &l.wv, &l.wo].iter().map(|w| w.len).sum();
                attn + match &l.mlp {
                    Mlp::Dense {
                        w_gate,
                        w_up,
                        w_down,
                    } => w_gate.len + w_up.len + w_down.len,
                    // The router and the experts one token uses.
                    Mlp::Moe(x) => {
                        let used = self.config.moe.map_or(0, |m| m.used);
                        x.router.len + used * (x.gate[0].len + x.up[0].len + x.down[0].len)
                    }
                }
            })
            .sum();
        per_layer + self.output.len
    }
}

fn rope_layout_name<S: serde::Serializer>(l: &RopeLayout, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(match l {
        RopeLayout::Adjacent => "adjacent",
        RopeLayout::Neox => "neox",
    })
}

fn missing(name: &str) -> ModelError {
    ModelError::Shape {
        name: name.into(),
        msg: "missing".into(),
    }
}

fn weight(g: &Gguf, name: &str, rows: usize, cols: usize) -> Result<Weight, ModelError> {
    let t: &TensorInfo = g.tensor(name).ok_or_else(|| missing(name))?;
    if t.dims.len() != 2 || t.dims[0] as usize != cols || t.dims[1] as usize != rows {
        return Err(ModelError::Shape {
            name: name.into(),
            msg: format!("dims {:?}, expected [{cols}, {rows}]", t.dims),
        });
    }
    let start = (g.data_offset + t.offset) as usize;
    Ok(Weight {
        ty: t.ty,
        rows,
        cols,
        start,
        len: t.size,
    })
}

/// The `n` experts stacked in one tensor (dims [cols, rows, n]), each a weight of its own: a
/// slice of the file (llama.cpp's layout: expert e's rows follow expert e − 1's).
fn experts(
    g: &Gguf,
    name: &str,
    n: usize,
    rows: usize,
    cols: usize,
) -> Result<Vec<Weight>, ModelError> {
    let t: &TensorInfo = g.tensor(name).ok_or_else(|| missing(name))?;
    if t.dims != [cols as u64, rows as u64, n as u64] {
        return Err(ModelError::Shape {
            name: name.into(),
            msg: format!("dims {:?}, expected [{cols}, {rows}, {n}]", t.dims),
        });
    }
    let each = t.size / n;
    let row_bytes = t.ty.row_bytes(cols).unwrap_or(0);
    if row_bytes * rows != each {
        return Err(ModelError::Shape {
            name: name.into(),
            msg: format!("{} bytes do not hold {n} experts of {rows} rows", t.size),
        });
    }
    let start = (g.data_offset + t.offset) as usize;
    Ok((0..n)
        .map(|e| Weight {
            ty: t.ty,
            rows,
            cols,
            start: start + e * each,
            len: each,
        })
        .collect())
}

fn vector(g: &Gguf, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
    let t = g.tensor(name).ok_or_else(|| missing(name))?;
    if t.num_elements() as usize != len {
        return Err(ModelError::Shape {
            name: name.into(),
            msg: format!("dims {:?}, expected [{len}]", t.dims),
        });
    }
    let mut out = vec![0.0f32; len];
    flywheel_kernels::reference::dequantize_row(t.ty, g.tensor_data(t), &mut out);
    Ok(out)
}
