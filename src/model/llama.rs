//! The Llama-family forward pass over a packed batch of sequences, each with its own positions
//! and its own block table in the paged KV cache. Weights stay in their GGUF block format.
//!
//! Per layer (T = tokens in the batch):
//!   n = RMSNorm(x) * attn_norm                       (T, hidden)
//!   q, k, v = n Wqᵀ, n Wkᵀ, n Wvᵀ                     (T, q_dim), (T, kv_dim), (T, kv_dim)
//!   q, k = RoPE(q), RoPE(k)   (adjacent pairs)
//!   x += Attn(q, K, V) Woᵀ    (causal, GQA, over the cache)
//!   m = RMSNorm(x) * ffn_norm
//!   x += (silu(m Wgateᵀ) ⊙ m Wupᵀ) Wdownᵀ
//! logits = RMSNorm(x) * output_norm · Woutᵀ (Wout = token_embd when tied)

use super::gguf::{Gguf, GgufError, TensorInfo};
use super::kv_cache::KvCache;
use flywheel_kernels::cpu::ops::rope_table;
use flywheel_kernels::reference::AttnSeq;
use flywheel_kernels::{Cpu, Matmul, QuantType};
use std::path::Path;

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
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct LlamaConfig {
    pub num_layers: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rope_dim: usize,
    pub rope_base: f32,
    pub eps: f32,
    pub context_length: usize,
    pub vocab_size: usize,
}

impl LlamaConfig {
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
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
    pub wo: Weight,
    pub ffn_norm: Vec<f32>,
    pub w_gate: Weight,
    pub w_up: Weight,
    pub w_down: Weight,
}

pub struct Llama {
    pub config: LlamaConfig,
    pub gguf: Gguf,
    pub token_embd: Weight,
    pub layers: Vec<Layer>,
    pub output_norm: Vec<f32>,
    pub output: Weight,
}

/// Which logits a sequence of the batch wants back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    None,
    /// The last token's (the next-token distribution).
    Last,
    /// Every token's (prompt log-probs, training).
    All,
}

/// One sequence's part of a packed batch: `tokens` at positions `first_pos..`, its KV cache
/// already holding positions `0..first_pos`, stored through `block_table`.
#[derive(Clone, Copy, Debug)]
pub struct BatchSeq<'a> {
    pub tokens: &'a [u32],
    pub first_pos: usize,
    pub block_table: &'a [u32],
    pub logits: Logits,
}

impl Llama {
    pub fn open(path: impl AsRef<Path>) -> Result<Llama, ModelError> {
        Llama::from_gguf(Gguf::open(path)?)
    }

    pub fn from_gguf(g: Gguf) -> Result<Llama, ModelError> {
        let arch = g.get_str("general.architecture")?.to_string();
        if arch != "llama" {
            return Err(ModelError::Unsupported(format!(
                "general.architecture = '{arch}' (only 'llama')"
            )));
        }
        let k = |s: &str| format!("{arch}.{s}");
        let hidden = g.get_usize(&k("embedding_length"))?;
        let num_heads = g.get_usize(&k("attention.head_count"))?;
        let num_kv_heads = match g.get(&k("attention.head_count_kv")) {
            Some(_) => g.get_usize(&k("attention.head_count_kv"))?,
            None => num_heads,
        };
        if num_heads == 0
            || num_kv_heads == 0
            || hidden % num_heads != 0
            || num_heads % num_kv_heads != 0
        {
            return Err(ModelError::Unsupported(format!(
                "{num_heads} heads, {num_kv_heads} KV heads, hidden {hidden}: heads must divide hidden and KV heads must divide heads"
            )));
        }
        let head_dim = hidden / num_heads;
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
        let config = LlamaConfig {
            num_layers: g.get_usize(&k("block_count"))?,
            hidden,
            ffn: g.get_usize(&k("feed_forward_length"))?,
            num_heads,
            num_kv_heads,
            head_dim,
            rope_dim,
            rope_base: match g.get(&k("rope.freq_base")) {
                Some(_) => g.get_f32(&k("rope.freq_base"))?,
                None => 10000.0,
            },
            eps: g.get_f32(&k("attention.layer_norm_rms_epsilon"))?,
            context_length: g.get_usize(&k("context_length"))?,
            vocab_size,
        };
        let c = &config;
        let token_embd = weight(&g, "token_embd.weight", c.vocab_size, c.hidden)?;
        let mut layers = Vec::with_capacity(c.num_layers);
        for l in 0..c.num_layers {
            let n = |s: &str| format!("blk.{l}.{s}.weight");
            layers.push(Layer {
                attn_norm: vector(&g, &n("attn_norm"), c.hidden)?,
                wq: weight(&g, &n("attn_q"), c.q_dim(), c.hidden)?,
                wk: weight(&g, &n("attn_k"), c.kv_dim(), c.hidden)?,
                wv: weight(&g, &n("attn_v"), c.kv_dim(), c.hidden)?,
                wo: weight(&g, &n("attn_output"), c.hidden, c.q_dim())?,
                ffn_norm: vector(&g, &n("ffn_norm"), c.hidden)?,
                w_gate: weight(&g, &n("ffn_gate"), c.ffn, c.hidden)?,
                w_up: weight(&g, &n("ffn_up"), c.ffn, c.hidden)?,
                w_down: weight(&g, &n("ffn_down"), c.hidden, c.ffn)?,
            });
        }
        let output_norm = vector(&g, "output_norm.weight", c.hidden)?;
        let output = match g.tensor("output.weight") {
            Some(_) => weight(&g, "output.weight", c.vocab_size, c.hidden)?,
            None => token_embd.clone(),
        };
        Ok(Llama {
            config,
            gguf: g,
            token_embd,
            layers,
            output_norm,
            output,
        })
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
                [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down]
                    .iter()
                    .map(|w| w.len)
                    .sum::<usize>()
            })
            .sum();
        per_layer + self.output.len
    }

    fn mm<'a>(&'a self, w: &Weight, x: &'a [f32], y: &'a mut [f32]) -> Matmul<'a> {
        Matmul {
            ty: w.ty,
            w: self.bytes(w),
            rows: w.rows,
            cols: w.cols,
            x,
            y,
        }
    }

    /// Run the batch; write K/V of its tokens into `cache`; return the wanted logits, sequence by
    /// sequence, as rows of `vocab_size` (Last: one row; All: one row per token).
    pub fn forward(
        &self,
        cpu: &Cpu,
        cache: &mut KvCache,
        batch: &[BatchSeq],
    ) -> Result<Vec<f32>, ModelError> {
        let mut bufs = ForwardBuffers::default();
        self.forward_into(cpu, cache, batch, &mut bufs)?;
        Ok(bufs.logits)
    }

    /// `forward` with the caller's buffers (reused from step to step: no allocation or page
    /// faults per step once they have grown); the logits are left in `bufs.logits`.
    pub fn forward_into(
        &self,
        cpu: &Cpu,
        cache: &mut KvCache,
        batch: &[BatchSeq],
        bufs: &mut ForwardBuffers,
    ) -> Result<(), ModelError> {
        let c = &self.config;
        let (hidden, qd, kvd) = (c.hidden, c.q_dim(), c.kv_dim());
        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        let mut logit_rows = Vec::new();
        let mut attn = Vec::with_capacity(batch.len());
        for s in batch {
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
            if s.block_table.len() * cache.block_size < end {
                return Err(ModelError::Batch(format!(
                    "block table covers {} positions, need {end}",
                    s.block_table.len() * cache.block_size
                )));
            }
            if let Some(&bad) = s.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
                return Err(ModelError::Batch(format!(
                    "token id {bad} is outside the vocabulary ({})",
                    c.vocab_size
                )));
            }
            let start = tokens.len();
            match s.logits {
                Logits::None => {}
                Logits::Last => logit_rows.push(start + s.tokens.len() - 1),
                Logits::All => logit_rows.extend(start..start + s.tokens.len()),
            }
            attn.push(AttnSeq {
                q_start: start,
                q_len: s.tokens.len(),
                first_pos: s.first_pos,
                block_table: s.block_table,
            });
            tokens.extend_from_slice(s.tokens);
            positions.extend((s.first_pos..end).map(|p| p as u32));
        }
        let t = tokens.len();
        let rope = rope_table(&positions, c.rope_dim, c.rope_base);
        let m = logit_rows.len();
        bufs.size(t, m, c);
        let ForwardBuffers {
            x,
            n,
            q,
            k,
            v,
            att,
            proj,
            gate,
            up,
            act,
            xs,
            normed,
            logits,
        } = bufs;

        let erb = self.token_embd.ty.row_bytes(hidden).unwrap_or(0);
        let embd = self.bytes(&self.token_embd);
        for (i, &tok) in tokens.iter().enumerate() {
            let tok = tok as usize;
            cpu.dequantize_row(
                self.token_embd.ty,
                &embd[tok * erb..(tok + 1) * erb],
                &mut x[i * hidden..(i + 1) * hidden],
            );
        }
        let scale = 1.0 / (c.head_dim as f32).sqrt();

        for (l, layer) in self.layers.iter().enumerate() {
            cpu.rmsnorm(x, &layer.attn_norm, c.eps, n);
            cpu.matmul_many(&mut [
                self.mm(&layer.wq, n, q),
                self.mm(&layer.wk, n, k),
                self.mm(&layer.wv, n, v),
            ]);
            cpu.rope(q, &rope, c.num_heads, c.head_dim, c.rope_dim);
            cpu.rope(k, &rope, c.num_kv_heads, c.head_dim, c.rope_dim);
            for (s, a) in batch.iter().zip(&attn) {
                for i in 0..a.q_len {
                    let r = a.q_start + i;
                    cache.write(
                        l,
                        s.block_table,
                        s.first_pos + i,
                        &k[r * kvd..(r + 1) * kvd],
                        &v[r * kvd..(r + 1) * kvd],
                    );
                }
            }
            cpu.attention(
                q,
                att,
                &attn,
                cache.layer(l),
                c.num_heads,
                c.num_kv_heads,
                c.head_dim,
                scale,
            );
            cpu.matmul(layer.wo.ty, self.bytes(&layer.wo), hidden, qd, att, proj);
            add_in_place(x, proj);
            cpu.rmsnorm(x, &layer.ffn_norm, c.eps, n);
            cpu.matmul_many(&mut [self.mm(&layer.w_gate, n, gate), self.mm(&layer.w_up, n, up)]);
            cpu.swiglu(gate, up, act);
            cpu.matmul(
                layer.w_down.ty,
                self.bytes(&layer.w_down),
                hidden,
                c.ffn,
                act,
                proj,
            );
            add_in_place(x, proj);
        }

        for (j, &r) in logit_rows.iter().enumerate() {
            xs[j * hidden..(j + 1) * hidden].copy_from_slice(&x[r * hidden..(r + 1) * hidden]);
        }
        cpu.rmsnorm(xs, &self.output_norm, c.eps, normed);
        if m > 0 {
            cpu.matmul(
                self.output.ty,
                self.bytes(&self.output),
                c.vocab_size,
                hidden,
                normed,
                logits,
            );
        }
        Ok(())
    }
}

/// The activations of one forward pass, kept by the caller and reused.
#[derive(Default)]
pub struct ForwardBuffers {
    x: Vec<f32>,
    n: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    proj: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    act: Vec<f32>,
    xs: Vec<f32>,
    normed: Vec<f32>,
    /// (rows of logits asked for, vocab_size) after a pass.
    pub logits: Vec<f32>,
}

impl ForwardBuffers {
    /// Set every buffer's length for `t` tokens and `m` logit rows (growing only touches the
    /// new part).
    fn size(&mut self, t: usize, m: usize, c: &LlamaConfig) {
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

fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
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
