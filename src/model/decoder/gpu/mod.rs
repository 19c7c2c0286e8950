//! The forward pass on a CUDA GPU (feature `cuda`). `GpuDecoder` holds the base's weights on the
//! GPU as stored (GGUF blocks, one copy there, never dequantized as a whole), the KV cache (the
//! block manager's blocks in the CPU's layout, plus one scratch block that graph padding writes
//! into), the activations, the adapter versions in use, and one CUDA graph per decode bucket.
//!
//! `forward_into` keeps `Llama::forward_into`'s contract: the same batch in, the wanted logits
//! (and hidden rows) in `ForwardBuffers` on the host, for the engine's sampler. The steps are the
//! CPU forward's (`forward/`) in its order; each kernel has its CPU twin (kernels/tests/cuda.rs).
//!
//! Decode steps (every sequence one token, wanting its next-token logits) replay a graph captured
//! once per batch bucket (`plan::graph_bucket`) and adapter signature (which modules some version
//! of the step rotates or adds LoRA to, `adapters::AdapterSig`), the batch padded with rows that
//! read and write only the scratch block. The graph reads each step's tokens, positions, RoPE
//! table, block tables and each row's adapter slot from buffers whose addresses never change, and
//! a slot's tensors from the adapter directory (`AdapterRows`); weights never change, so a publish
//! (a new version: a slot's entries written) never invalidates or re-captures a graph. Prefill and
//! other eager steps apply adapters group by group. A mixture of experts routes on the device in
//! every step (`fw_moe_route`: a token's experts and weights the same bits in any step; a model
//! with more than `MOE_MAX_USED` experts a token routes on the host in every step instead); in
//! decode steps (graph or eager: the same launches) each (token, choice) row is its expert's
//! product, other steps read the choices back and group them on the host (`moe::group`, the CPU
//! forward's own), each expert's rows then one product on the GPU.

use super::forward::{adapter_groups, AdapterGroup};
use super::moe::{group, ranges, route, Choice, MoeActs};
use super::pack::{BatchSeq, Logits, Packed};
use super::{Activation, Decoder, ForwardBuffers, Mlp, ModelError, MoeConfig, Weight};
use crate::adapter::{AdapterWeights, Method, Target, NUM_TARGETS};
use crate::model::kv_cache::KvDtype;
use flywheel_kernels::cuda::{
    AdapterEntry, AdapterRows, CudaGraph, CudaSlice, DeviceMatrix, DrawBuffers, Drawn, ExpertTable,
    Gpu, GpuError, GpuKv, Tokens, ATT_MAX_HEAD_DIM, MOE_MAX_USED,
};
use flywheel_kernels::plan::{graph_bucket, GRAPH_MAX_BATCH};
use flywheel_kernels::reference::AttnSeq;
use flywheel_kernels::QuantType;
use std::collections::HashMap;
use std::ops::Range;

impl From<GpuError> for ModelError {
    fn from(e: GpuError) -> ModelError {
        ModelError::Gpu(e.0)
    }
}

/// Rows of logits the LM head computes per pass (prompt scoring asks for every row's).
const HEAD_ROWS: usize = 256;

struct GpuLayer {
    attn_norm: CudaSlice<f32>,
    wq: DeviceMatrix,
    wk: DeviceMatrix,
    wv: DeviceMatrix,
    bq: Option<CudaSlice<f32>>,
    bk: Option<CudaSlice<f32>>,
    bv: Option<CudaSlice<f32>>,
    q_norm: Option<CudaSlice<f32>>,
    k_norm: Option<CudaSlice<f32>>,
    wo: DeviceMatrix,
    post_attn_norm: Option<CudaSlice<f32>>,
    ffn_norm: CudaSlice<f32>,
    mlp: GpuMlp,
    post_ffn_norm: Option<CudaSlice<f32>>,
}

enum GpuMlp {
    Dense {
        gate: DeviceMatrix,
        up: DeviceMatrix,
        down: DeviceMatrix,
    },
    /// The router and each expert's projections (slices of the stacked tensors, one matrix each).
    Moe {
        router: DeviceMatrix,
        gate: Vec<DeviceMatrix>,
        up: Vec<DeviceMatrix>,
        down: Vec<DeviceMatrix>,
        /// The gate's, up's and down's expert tables for routing on the device (decode steps),
        /// where a token uses no more experts than the device's router takes.
        tables: Option<[ExpertTable; 3]>,
    },
}

/// Each layer's K and V blocks.
enum Cache {
    F32(Vec<(CudaSlice<f32>, CudaSlice<f32>)>),
    F16(Vec<(CudaSlice<u16>, CudaSlice<u16>)>),
}

pub struct GpuDecoder {
    gpu: Gpu,
    layers: Vec<GpuLayer>,
    embd: DeviceMatrix,
    /// None: the LM head is the embedding (tied).
    output: Option<DeviceMatrix>,
    output_norm: CudaSlice<f32>,
    cache: Cache,
    block_size: usize,
    /// The block padding rows write into: the one past the block manager's.
    scratch_block: u32,
    max_tokens: usize,
    acts: Acts,
    meta: Tokens,
    /// Decode graphs by bucket and, for steps with adapters, their signature.
    graphs: HashMap<(usize, Option<AdapterSig>), CudaGraph>,
    use_graphs: bool,
    adapters: HashMap<u64, GpuAdapter>,
    /// The adapter directory decode graphs read, and its free slots.
    rowwise: AdapterRows,
    free_slots: Vec<usize>,
    step: u64,
    /// The host's side of MoE routing (the router's softmax, the choices, the grouping).
    routing: MoeActs,
    /// Room for the tokens drawn on the GPU (`draw.rs`); None: every row's logits come back.
    draw: Option<DrawBuffers>,
    drawn: Vec<Drawn>,
    /// The normalized rows' log-sum-exps of a pass (`draw.rs`).
    lse: Vec<f32>,
    /// Room for the training forward's scored rows (`score.rs`), made on its first call.
    score: Option<DrawBuffers>,
}

/// What `GpuDecoder::new` sizes its buffers for.
#[derive(Clone, Copy, Debug)]
pub struct GpuShape {
    pub num_kv_blocks: usize,
    pub block_size: usize,
    /// The most tokens one step runs (the scheduler's `max_num_batched_tokens`).
    pub max_tokens: usize,
    /// The most sequences one step runs.
    pub max_seqs: usize,
    /// The longest sequence (positions).
    pub max_model_len: usize,
    /// Decode through CUDA graphs (else every step launches eagerly).
    pub graphs: bool,
    /// The base's products in int8 (`Precision::Int8`: each product the CPU's int8 bits, in the
    /// formats and shapes the CPU runs in int8; the LM head stays f32 as there), else in f32.
    pub int8: bool,
    /// Draw the tokens of rows the engine's sampler would draw from the whole distribution on
    /// the GPU (`forward_drawing`; FLYWHEEL_CUDA_SAMPLING=0 turns it off).
    pub draws: bool,
}

impl GpuDecoder {
    /// The GPU and the products' arithmetic, for the start-up log.
    pub fn describe(&self) -> String {
        let int8 = if self.acts.q8.is_some() {
            ", int8 products"
        } else {
            ""
        };
        format!("{}{int8}", self.gpu.describe())
    }

    /// Decode graphs captured so far (one per batch bucket used).
    pub fn graphs_captured(&self) -> usize {
        self.graphs.len()
    }

    /// `Llama::forward_into` on the GPU: the logits (and hidden rows) in `bufs`, on the host.
    pub fn forward_into(
        &mut self,
        model: &Decoder,
        batch: &[BatchSeq],
        bufs: &mut ForwardBuffers,
    ) -> Result<(), ModelError> {
        self.forward_drawing(model, batch, &[], bufs, &mut RowsBack::default())
    }

    /// `forward_into`, each logit row of the step coming back as `rows` says (one entry per
    /// logit row, or none at all: every row's logits; `draws()` must hold for any other): the
    /// drawn rows' results and the normalized rows' log-sum-exps in `back`, in order, and the
    /// drawn rows of `bufs.logits` left as they were.
    pub fn forward_drawing(
        &mut self,
        model: &Decoder,
        batch: &[BatchSeq],
        rows: &[RowOut],
        bufs: &mut ForwardBuffers,
        back: &mut RowsBack,
    ) -> Result<(), ModelError> {
        back.clear();
        let c = &model.config;
        self.step += 1;
        let Packed {
            mut tokens,
            mut positions,
            mut attn,
            // The GPU's cache keeps every layer in one pool (no window pool).
            attn_window: _,
            logit_rows,
            hidden_rows,
        } = model.pack(batch, self.block_size)?;
        if !rows.is_empty() && rows.len() != logit_rows.len() {
            return Err(ModelError::Batch(format!(
                "{} row outputs for {} rows of logits",
                rows.len(),
                logit_rows.len()
            )));
        }
        let mut logit_rows: Vec<u32> = logit_rows.into_iter().map(|r| r as u32).collect();
        let hidden_rows: Vec<u32> = hidden_rows.into_iter().map(|r| r as u32).collect();
        let t = tokens.len();
        if t > self.max_tokens {
            return Err(ModelError::Batch(format!(
                "{t} tokens in one step; the GPU's buffers hold {}",
                self.max_tokens
            )));
        }
        let groups = adapter_groups(batch);
        let decode = batch
            .iter()
            .all(|s| s.tokens.len() == 1 && s.logits == Logits::Last);
        let mut bucket = graph_bucket(t).filter(|_| self.use_graphs && decode);
        self.upload_adapters(&groups)?;
        // A decode step with adapters replays its signature's graph, each row's version read from
        // the directory; a version without a slot launches eagerly.
        let mut sig = None;
        if let (Some(b), false) = (bucket, groups.is_empty()) {
            sig = self.adapter_rows(&groups, b)?;
            if sig.is_none() {
                bucket = None;
            }
        }
        // Padding rows up to the bucket: token 0 at position 0 of the scratch block.
        let n = bucket.unwrap_or(t);
        let scratch = [self.scratch_block];
        for row in t..n {
            tokens.push(0);
            positions.push(0);
            attn.push(AttnSeq {
                q_start: row,
                q_len: 1,
                first_pos: 0,
                block_table: &scratch,
            });
            logit_rows.push(row as u32);
        }
        self.load_step(model, &tokens, &positions, &attn)?;

        let vocab = c.vocab_size;
        if let Some(b) = bucket {
            // Every row wants its logits: the head runs over the whole bucket inside the graph.
            self.gpu.write(&logit_rows, &mut self.acts.rows)?;
            let key = (b, sig);
            if !self.graphs.contains_key(&key) {
                let graph = self.capture(model, b, key.1.as_ref())?;
                self.graphs.insert(key.clone(), graph);
            }
            self.graphs[&key].launch().map_err(GpuError::from)?;
            bufs.logits.resize(t * vocab, 0.0);
            // The final soft-cap (Gemma 2) on the host, where sampling reads the logits.
            return self.rows_out(model, 0, t, rows, &mut bufs.logits, back);
        }
        self.body(model, n, &groups, None, decode)?;
        // Hidden rows (embeddings), then logits, HEAD_ROWS rows per pass.
        bufs.hidden.resize(hidden_rows.len() * c.hidden, 0.0);
        for (i, chunk) in hidden_rows.chunks(HEAD_ROWS).enumerate() {
            self.final_norm(model, chunk)?;
            let at = i * HEAD_ROWS * c.hidden;
            let out = &mut bufs.hidden[at..at + chunk.len() * c.hidden];
            self.gpu
                .read_into(&self.acts.normed.slice(..out.len()), out)?;
        }
        bufs.logits.resize(logit_rows.len() * vocab, 0.0);
        for (i, chunk) in logit_rows.chunks(HEAD_ROWS).enumerate() {
            self.final_norm(model, chunk)?;
            self.head(chunk.len())?;
            let a = &mut self.acts;
            head_lora(
                &self.gpu,
                &self.adapters,
                &groups,
                chunk,
                &a.normed,
                &mut a.logits,
                &mut a.lora_h,
                &mut a.lora_d,
            )?;
            let at = i * HEAD_ROWS * vocab;
            let out = &mut bufs.logits[at..at + chunk.len() * vocab];
            self.rows_out(model, i * HEAD_ROWS, chunk.len(), rows, out, back)?;
        }
        Ok(())
    }

    /// A step's tokens, RoPE tables (from their positions) and attention rows on the device.
    fn load_step(
        &mut self,
        model: &Decoder,
        tokens: &[u32],
        positions: &[u32],
        attn: &[AttnSeq],
    ) -> Result<(), ModelError> {
        let (rope, rope_local) = model.rope_tables(positions);
        let g = &self.gpu;
        g.write(tokens, &mut self.acts.tokens)?;
        g.write(&rope, &mut self.acts.rope)?;
        if !rope_local.is_empty() {
            g.write(&rope_local, &mut self.acts.rope_local)?;
        }
        let n_blocks = self.scratch_block as usize + 1;
        g.set_tokens(&mut self.meta, attn, self.block_size, n_blocks)?;
        Ok(())
    }

    /// Capture the decode step of `n` rows (the layers and the head over every row), with the
    /// adapters of signature `sig` row by row from the directory.
    fn capture(
        &mut self,
        model: &Decoder,
        n: usize,
        sig: Option<&AdapterSig>,
    ) -> Result<CudaGraph, ModelError> {
        let stream = self.gpu.stream().clone();
        stream
            .begin_capture(cudarc_mode::THREAD_LOCAL)
            .map_err(GpuError::from)?;
        let run = self.body(model, n, &[], sig, true).and_then(|()| {
            self.norm_rows(model, n)?;
            self.head(n)?;
            if let Some(sig) = sig {
                let rw = Rowwise {
                    rows: &self.rowwise,
                    sig,
                };
                let a = &mut self.acts;
                rw.head(&self.gpu, n, &a.normed, &mut a.lora_h, &mut a.logits)?;
            }
            Ok(())
        });
        // The capture ends whatever happened, so that the stream is usable again.
        let graph = stream.end_capture(cudarc_mode::INSTANTIATE_DEFAULT);
        run?;
        graph
            .map_err(GpuError::from)?
            .ok_or_else(|| ModelError::Gpu("the capture made no graph".into()))
    }

    /// The embedding and every layer over rows 0..n of the step's buffers, through the groups'
    /// adapters (eager steps) or those of signature `sig` row by row (a decode graph).
    /// `decode`: every row is a sequence's one new token (a mixture of experts routes on the
    /// device then, so that a decode step is the same launches through a graph or eagerly).
    fn body(
        &mut self,
        model: &Decoder,
        n: usize,
        groups: &[AdapterGroup],
        sig: Option<&AdapterSig>,
        decode: bool,
    ) -> Result<(), ModelError> {
        let c = &model.config;
        let (h, kvd, f) = (c.hidden, c.kv_dim(), c.ffn);
        let GpuDecoder {
            gpu: g,
            layers,
            embd,
            cache,
            acts: a,
            meta,
            adapters,
            routing,
            rowwise,
            ..
        } = self;
        let rowwise = sig.map(|sig| Rowwise {
            rows: &*rowwise,
            sig,
        });
        g.embed(embd, &a.tokens, n, &mut a.x)?;
        if let Some(s) = c.embed_scale {
            g.scale(&mut a.x, s, n * h)?;
        }
        for (l, layer) in layers.iter().enumerate() {
            let mut proj = Projector {
                g,
                adapters,
                groups,
                l,
                rotated: &mut a.rotated,
                lora_h: &mut a.lora_h,
                lora_d: &mut a.lora_d,
                rowwise,
                q8: a.q8.as_mut(),
                q8_holds: None,
            };
            // Later layers' attention norm ran with the residual before them.
            if l == 0 {
                g.rmsnorm(&a.x, &layer.attn_norm, c.eps, n, &mut a.n)?;
            }
            proj.run(Target::Q, &layer.wq, &a.n, n, &mut a.q)?;
            proj.run(Target::K, &layer.wk, &a.n, n, &mut a.k)?;
            proj.run(Target::V, &layer.wv, &a.n, n, &mut a.v)?;
            for (y, b) in [
                (&mut a.q, &layer.bq),
                (&mut a.k, &layer.bk),
                (&mut a.v, &layer.bv),
            ] {
                if let Some(b) = b {
                    g.add_bias(y, b, n)?;
                }
            }
            if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
                g.rmsnorm_in_place(&mut a.q, qn, c.eps, n * c.num_heads)?;
                g.rmsnorm_in_place(&mut a.k, kn, c.eps, n * c.num_kv_heads)?;
            }
            let rope = match c.window(l) {
                Some(_) => &a.rope_local,
                None => &a.rope,
            };
            let (hd, rd, lay) = (c.head_dim, c.rope_dim, c.rope_layout);
            let heads = (c.num_heads, c.num_kv_heads);
            g.rope_qk(&mut a.q, &mut a.k, rope, n, heads, hd, rd, lay)?;
            let (heads, kv_heads, scale, window) =
                (c.num_heads, c.num_kv_heads, c.attn_scale, c.attn_opts(l));
            let shape = (heads, kv_heads, hd, scale, window);
            let (q, k, v) = (&a.q, &a.k, &a.v);
            match cache {
                Cache::F32(kv) => {
                    let (kc, vc) = &mut kv[l];
                    attend(g, q, k, v, &mut a.att, meta, kvd, kc, vc, shape)?
                }
                Cache::F16(kv) => {
                    let (kc, vc) = &mut kv[l];
                    attend(g, q, k, v, &mut a.att, meta, kvd, kc, vc, shape)?
                }
            }
            proj.run(Target::O, &layer.wo, &a.att, n, &mut a.proj)?;
            let norms = (c.eps, n, h);
            let ffn_norm = Some(&layer.ffn_norm);
            let post = &layer.post_attn_norm;
            residual_then_norm(g, &mut a.x, &a.proj, &mut a.n, post, ffn_norm, norms)?;
            match &layer.mlp {
                GpuMlp::Dense { gate, up, down } => {
                    proj.run(Target::Gate, gate, &a.n, n, &mut a.gate)?;
                    proj.run(Target::Up, up, &a.n, n, &mut a.up)?;
                    match c.activation {
                        Activation::Silu => g.swiglu(&a.gate, &a.up, n * f, &mut a.act)?,
                        Activation::GeluTanh => g.geglu(&a.gate, &a.up, n * f, &mut a.act)?,
                    }
                    proj.run(Target::Down, down, &a.act, n, &mut a.proj)?;
                }
                GpuMlp::Moe {
                    router,
                    gate,
                    up,
                    down,
                    tables,
                } => {
                    let mc = c.moe.expect("a MoE layer has a MoE config");
                    let experts = Experts {
                        router,
                        gate,
                        up,
                        down,
                        // Routed on the device in decode steps.
                        tables: tables.as_ref().filter(|_| decode),
                    };
                    let q8 = a.q8.as_mut();
                    experts.run(g, &mc, &a.n, n, h, &mut a.moe, routing, q8, &mut a.proj)?;
                }
            }
            // The residual, then the next layer's attention norm (none after the last).
            let next_norm = layers.get(l + 1).map(|nx| &nx.attn_norm);
            let post = &layer.post_ffn_norm;
            residual_then_norm(g, &mut a.x, &a.proj, &mut a.n, post, next_norm, norms)?;
        }
        Ok(())
    }
}

mod acts;
mod adapters;
mod build;
mod draw;
pub use draw::{RowOut, RowsBack};
mod ops;
mod score;
use acts::{Acts, MoeBufs};
use adapters::{head_lora, module_dims, AdapterSig, GpuAdapter, Projector, Rowwise, ADAPTER_SLOTS};
use ops::{attend, cudarc_mode, residual_then_norm, Experts};
