//! The training forward and backward over a packed batch of whole sequences through one adapter.
//!
//! Forward: the serving forward itself (`forward_store`: same kernels, same quantized weights, same
//! adapter code, batch-invariant), keeping each layer's input (the checkpoints) and, within a
//! memory budget, the products of the last layers (q, k, v, attention output, residual, gate, up);
//! the LM head and log-softmax(logits / T) run in chunks of completion tokens with the sampler's
//! own arithmetic, so a completion's log-probs equal the ones recorded when it was served, to the
//! bit. While a chunk's log-probs are at hand, the head's backward runs too: d log π(token)/d(normed
//! hidden) = (onehot − softmax)/T · W_out, one row per scored token (the loss only scales it).
//!
//! Backward (layer by layer, last first): the layer's kept activations, or the layer recomputed
//! from its checkpoint (the same kernels: the same bits), then gradients flow through the MLP
//! (frozen linears' dx = dy·W from dequantized tiles, SwiGLU), RMSNorm, attention (P recomputed),
//! RoPE and the residuals; into the adapter's parameters only (OFT through the rotation to θ, LoRA
//! into A and B). Memory: the checkpoints (L × T × hidden), the kept activations (at most the
//! budget), one layer's gradients, and one chunk of logits (never T × vocab).

use super::activations::{layer_act_bytes, ActStore};
use super::buffers::ForwardBuffers;
use super::forward::{adapter_groups, add_in_place, LayerIo};
use super::{Activation, BatchSeq, Llama, Logits, Mlp, ModelError, Weight};
use crate::adapter::{lora, oft, AdapterWeights, Method, Target};
use crate::model::kv_cache::KvCache;
use crate::policy::scale_and_normalize;
use flywheel_kernels::reference::AttnSeq;
use flywheel_kernels::Cpu;

/// Completion tokens scored per LM-head chunk (small: one chunk is one kernel call, and a
/// serving step may wait for the trainer's kernel in flight).
const HEAD_CHUNK: usize = 16;

/// Tokens per KV block of the training cache; a shared prefix is a whole number of blocks.
pub const TRAIN_BLOCK: usize = 16;

/// One training sequence: prompt then completion tokens; the completion's tokens are scored.
///
/// With `prefix: Some(j)`, the sequence continues sequence j of the same batch (an earlier one,
/// with no prefix of its own, nothing scored, and a whole number of `TRAIN_BLOCK`s): its tokens
/// sit at positions `len(j)..` and attend to j's keys and values, which are computed once for all
/// the sequences sharing them, and receive the sum of their gradients (a GRPO group's prompt).
#[derive(Clone, Copy, Debug)]
pub struct TrainSeq<'a> {
    pub tokens: &'a [u32],
    pub prompt_len: usize,
    pub prefix: Option<usize>,
}

impl TrainSeq<'_> {
    /// A sequence of its own (no shared prefix).
    pub fn whole(tokens: &[u32], prompt_len: usize) -> TrainSeq<'_> {
        TrainSeq {
            tokens,
            prompt_len,
            prefix: None,
        }
    }
}

/// A training batch's block tables in one pool of `blocks` KV blocks, and each sequence's first
/// position.
struct Tables {
    tables: Vec<Vec<u32>>,
    first_pos: Vec<usize>,
    blocks: usize,
}

/// What the forward keeps for the backward.
pub struct TrainState {
    cache: KvCache,
    tables: Vec<Vec<u32>>,
    /// Position of each sequence's first token (its prefix's length, else 0).
    first_pos: Vec<usize>,
    store: ActStore,
    /// T × hidden: the final hidden state.
    final_x: Vec<f32>,
    /// T × hidden: d log π(token)/d(normed final hidden state) at each scored row (the LM head's
    /// backward, done in the forward while the chunk's log-probs are at hand), zero elsewhere.
    head_grad: Vec<f32>,
    num_tokens: usize,
    /// Mean entropy (nats) of the policy's next-token distribution over the scored tokens.
    pub mean_entropy: f64,
    /// Layers whose activations were kept (the rest are recomputed by the backward).
    pub layers_kept: usize,
}

/// The default memory budget of the kept activations (`train_forward`): 8 × 256 tokens keep all
/// 30 layers of SmolLM2-135M.
pub const ACTIVATION_BUDGET: usize = 1300 << 20;

impl Llama {
    /// Bytes one layer's kept activations take for `tokens` tokens (the unit of the activation
    /// budget of `train_forward`).
    pub fn layer_activation_bytes(&self, tokens: usize) -> usize {
        layer_act_bytes(&self.config, tokens)
    }

    /// Block tables (one KV block pool) and first positions of a training batch, checked.
    fn train_tables(&self, seqs: &[TrainSeq]) -> Result<Tables, ModelError> {
        let bs = TRAIN_BLOCK;
        let mut tables: Vec<Vec<u32>> = Vec::with_capacity(seqs.len());
        let mut first_pos = Vec::with_capacity(seqs.len());
        let mut next = 0u32;
        for (i, s) in seqs.iter().enumerate() {
            if s.prompt_len == 0 || s.prompt_len > s.tokens.len() {
                return Err(ModelError::Batch(
                    "a training sequence needs a prompt of at least one token".into(),
                ));
            }
            let mut table = Vec::new();
            let mut pos = 0;
            if let Some(j) = s.prefix {
                let ok =
                    j < i && seqs[j].prefix.is_none() && seqs[j].tokens.len().is_multiple_of(bs);
                if !ok || seqs[j].prompt_len != seqs[j].tokens.len() {
                    return Err(ModelError::Batch(format!(
                        "sequence {i}: its prefix must be an earlier unscored sequence of whole \
                         {bs}-token blocks"
                    )));
                }
                table.extend_from_slice(&tables[j]);
                pos = seqs[j].tokens.len();
            }
            let nb = s.tokens.len().div_ceil(bs) as u32;
            table.extend(next..next + nb);
            next += nb;
            tables.push(table);
            first_pos.push(pos);
        }
        Ok(Tables {
            tables,
            first_pos,
            blocks: next as usize,
        })
    }

    /// The forward of a training batch: its cache, and the final hidden state in `bufs.x`.
    fn train_pass(
        &self,
        cpu: &Cpu,
        seqs: &[TrainSeq],
        adapter: Option<&AdapterWeights>,
        bufs: &mut ForwardBuffers,
        store: Option<&mut ActStore>,
    ) -> Result<(KvCache, Tables), ModelError> {
        let c = &self.config;
        let tb = self.train_tables(seqs)?;
        let (tables, first_pos) = (&tb.tables, &tb.first_pos);
        let mut cache = KvCache::new(c.num_layers, c.kv_dim(), TRAIN_BLOCK, tb.blocks);
        let batch: Vec<BatchSeq> = seqs
            .iter()
            .zip(tables)
            .zip(first_pos)
            .map(|((s, t), &p)| BatchSeq {
                tokens: s.tokens,
                first_pos: p,
                block_table: t,
                logits: Logits::None,
                adapter,
            })
            .collect();
        match store {
            Some(st) => self.forward_store(cpu, &mut cache, &batch, bufs, st)?,
            None => self.forward_into(cpu, &mut cache, &batch, bufs)?,
        }
        drop(batch);
        Ok((cache, tb))
    }

    /// Log-probs (from logits / `temperature`) of every completion token of every sequence, the
    /// same as `train_forward`'s, without keeping anything for a backward (the reference policy,
    /// evaluations).
    pub fn logprobs(
        &self,
        cpu: &Cpu,
        seqs: &[TrainSeq],
        adapter: Option<&AdapterWeights>,
        temperature: f32,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let mut bufs = ForwardBuffers::default();
        self.train_pass(cpu, seqs, adapter, &mut bufs, None)?;
        let vocab = self.config.vocab_size;
        let mut logps: Vec<Vec<f32>> = seqs
            .iter()
            .map(|s| Vec::with_capacity(s.tokens.len() - s.prompt_len))
            .collect();
        self.head_chunks(cpu, seqs, &bufs.x, temperature, |chunk, rows| {
            for (k, &(i, _, tok)) in chunk.iter().enumerate() {
                logps[i].push(rows[k * vocab + tok as usize]);
            }
        });
        Ok(logps)
    }

    /// Log-probs (from logits / `temperature`) of every completion token of every sequence, and
    /// the state the backward needs: the activations of as many layers as `activation_budget`
    /// bytes hold (the others are recomputed by the backward; the gradients are the same to the
    /// bit either way).
    pub fn train_forward(
        &self,
        cpu: &Cpu,
        seqs: &[TrainSeq],
        adapter: &AdapterWeights,
        temperature: f32,
        activation_budget: usize,
    ) -> Result<(Vec<Vec<f32>>, TrainState), ModelError> {
        let c = &self.config;
        let h = c.hidden;
        let num_tokens: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        let per_layer = self.layer_activation_bytes(num_tokens).max(1);
        let kept = (activation_budget / per_layer).min(c.num_layers);
        let mut store = ActStore {
            keep_from: c.num_layers - kept,
            ..ActStore::default()
        };
        let mut bufs = ForwardBuffers::default();
        let (
            cache,
            Tables {
                tables, first_pos, ..
            },
        ) = self.train_pass(cpu, seqs, Some(adapter), &mut bufs, Some(&mut store))?;
        let final_x = std::mem::take(&mut bufs.x);
        drop(bufs);
        let mut logps: Vec<Vec<f32>> = seqs
            .iter()
            .map(|s| Vec::with_capacity(s.tokens.len() - s.prompt_len))
            .collect();
        // d log π(tok)/dz = (onehot − softmax)/T for z = the logits; through the frozen head now.
        let inv_t = if !crate::policy::is_greedy(temperature) {
            1.0 / temperature
        } else {
            1.0
        };
        let mut head_grad = vec![0.0f32; num_tokens * h];
        let (mut entropy, mut scored) = (0.0f64, 0usize);
        let (mut dz, mut dn) = (Vec::new(), Vec::new());
        self.head_chunks(cpu, seqs, &final_x, temperature, |chunk, rows| {
            dz.resize(rows.len(), 0.0);
            for (k, &(i, _, tok)) in chunk.iter().enumerate() {
                let row = &rows[k * c.vocab_size..(k + 1) * c.vocab_size];
                logps[i].push(row[tok as usize]);
                let d = &mut dz[k * c.vocab_size..(k + 1) * c.vocab_size];
                entropy += cpu.softmax_backward_row(row, inv_t, d);
                d[tok as usize] += inv_t;
                scored += 1;
            }
            dn.resize(chunk.len() * h, 0.0);
            cpu.linear_backward(
                self.output.ty,
                self.bytes(&self.output),
                c.vocab_size,
                h,
                &dz,
                &mut dn,
            );
            for (k, &(_, r, _)) in chunk.iter().enumerate() {
                head_grad[r * h..(r + 1) * h].copy_from_slice(&dn[k * h..(k + 1) * h]);
            }
        });
        let state = TrainState {
            cache,
            tables,
            first_pos,
            store,
            final_x,
            head_grad,
            num_tokens,
            mean_entropy: entropy / scored.max(1) as f64,
            layers_kept: kept,
        };
        Ok((logps, state))
    }

    /// The scored rows (sequence, row in the batch, target token), HEAD_CHUNK at a time: their
    /// log-softmax(logits / T) rows (from the final hidden state `final_x`) are handed to `f`.
    fn head_chunks(
        &self,
        cpu: &Cpu,
        seqs: &[TrainSeq],
        final_x: &[f32],
        temperature: f32,
        mut f: impl FnMut(&[(usize, usize, u32)], &[f32]),
    ) {
        let c = &self.config;
        let h = c.hidden;
        let mut xs = Vec::new();
        let mut normed = Vec::new();
        let mut logits = Vec::new();
        for chunk in scored_rows(seqs).chunks(HEAD_CHUNK) {
            xs.clear();
            for &(_, r, _) in chunk {
                xs.extend_from_slice(&final_x[r * h..(r + 1) * h]);
            }
            normed.resize(xs.len(), 0.0);
            cpu.rmsnorm(&xs, &self.output_norm, c.eps, &mut normed);
            logits.resize(chunk.len() * c.vocab_size, 0.0);
            cpu.matmul(
                self.output.ty,
                self.bytes(&self.output),
                c.vocab_size,
                h,
                &normed,
                &mut logits,
            );
            for row in logits.chunks_mut(c.vocab_size) {
                scale_and_normalize(cpu, row, temperature);
            }
            f(chunk, &logits);
        }
    }

    /// Add dL/dθ of every adapter parameter to `grads` (the adapter's flat layout), given dL/dlog π
    /// of every completion token (`grad_logp`, as `train_forward` returned the log-probs). The
    /// state is consumed: each layer's kept activations are freed once its backward is done.
    pub fn train_backward(
        &self,
        cpu: &Cpu,
        seqs: &[TrainSeq],
        adapter: &AdapterWeights,
        mut st: TrainState,
        grad_logp: &[Vec<f32>],
        grads: &mut [f32],
    ) -> Result<(), ModelError> {
        let c = &self.config;
        let (h, t) = (c.hidden, st.num_tokens);
        assert_eq!(grads.len(), adapter.layout.num_params);
        // dL/dx of the final hidden state: the head's gradient times dL/dlog π, through the final
        // RMSNorm.
        let mut dnormed_all = std::mem::take(&mut st.head_grad);
        let mut done: Vec<usize> = vec![0; seqs.len()];
        for (i, r, _) in scored_rows(seqs) {
            let g = grad_logp[i][done[i]];
            done[i] += 1;
            dnormed_all[r * h..(r + 1) * h]
                .iter_mut()
                .for_each(|v| *v *= g);
        }
        let mut dx = vec![0.0f32; t * h];
        cpu.rmsnorm_backward(&st.final_x, &self.output_norm, c.eps, &dnormed_all, &mut dx);
        drop(dnormed_all);

        let batch: Vec<BatchSeq> = seqs
            .iter()
            .zip(&st.tables)
            .zip(&st.first_pos)
            .map(|((s, tb), &p)| BatchSeq {
                tokens: s.tokens,
                first_pos: p,
                block_table: tb,
                logits: Logits::None,
                adapter: Some(adapter),
            })
            .collect();
        let groups = adapter_groups(&batch);
        let mut positions = Vec::with_capacity(t);
        let mut attn = Vec::with_capacity(seqs.len());
        let mut start = 0;
        for ((s, tb), &p) in seqs.iter().zip(&st.tables).zip(&st.first_pos) {
            attn.push(AttnSeq {
                q_start: start,
                q_len: s.tokens.len(),
                first_pos: p,
                block_table: tb,
            });
            positions.extend((p..p + s.tokens.len()).map(|p| p as u32));
            start += s.tokens.len();
        }
        let (rope, rope_local) = self.rope_tables(&positions);
        let mut bufs = ForwardBuffers::default();
        let io = LayerIo {
            attn: &attn,
            rope: &rope,
            rope_local: &rope_local,
            groups: &groups,
        };
        let (qd, kvd, f) = (c.q_dim(), c.kv_dim(), c.ffn);
        let z = |n: usize| vec![0.0f32; n];
        for (l, layer) in self.layers.iter().enumerate().rev() {
            let x0 = &st.store.checkpoints[l * t * h..(l + 1) * t * h];
            let a = match st.store.acts[l].take() {
                Some(a) => a,
                None => self.recompute_layer(cpu, l, x0, &st.cache, &io, &mut bufs),
            };
            let mut n = z(t * h);
            cpu.rmsnorm(x0, &layer.attn_norm, c.eps, &mut n);

            // Backward: dx holds dL/d(layer output).
            let dm = match &layer.mlp {
                Mlp::Dense {
                    w_gate,
                    w_up,
                    w_down,
                } => {
                    let (mut m, mut act) = (z(t * h), z(t * f));
                    cpu.rmsnorm(&a.hx, &layer.ffn_norm, c.eps, &mut m);
                    match c.activation {
                        Activation::Silu => cpu.swiglu(&a.gate, &a.up, &mut act),
                        Activation::GeluTanh => cpu.geglu(&a.gate, &a.up, &mut act),
                    }
                    // Through the MLP's post-norm (Gemma 3), from the output it normed.
                    let dy = match &layer.post_ffn_norm {
                        Some(w) => {
                            let mut d = z(t * h);
                            cpu.rmsnorm_backward(&a.down_out, w, c.eps, &dx, &mut d);
                            d
                        }
                        None => dx.clone(),
                    };
                    let dact = self.linear_backward_adapted(
                        cpu,
                        adapter,
                        l,
                        Target::Down,
                        w_down,
                        &act,
                        &dy,
                        grads,
                    );
                    drop((act, dy));
                    let (mut dgate, mut dup) = (z(t * f), z(t * f));
                    match c.activation {
                        Activation::Silu => {
                            cpu.swiglu_backward(&a.gate, &a.up, &dact, &mut dgate, &mut dup)
                        }
                        Activation::GeluTanh => {
                            cpu.geglu_backward(&a.gate, &a.up, &dact, &mut dgate, &mut dup)
                        }
                    }
                    drop(dact);
                    let mut dm = self.linear_backward_adapted(
                        cpu,
                        adapter,
                        l,
                        Target::Gate,
                        w_gate,
                        &m,
                        &dgate,
                        grads,
                    );
                    let dm_up = self.linear_backward_adapted(
                        cpu,
                        adapter,
                        l,
                        Target::Up,
                        w_up,
                        &m,
                        &dup,
                        grads,
                    );
                    add_in_place(&mut dm, &dm_up);
                    dm
                }
                // Frozen experts: the gradient only passes through them to the norm's output.
                Mlp::Moe(experts) => {
                    let acts = a
                        .moe
                        .as_ref()
                        .expect("the MoE forward kept its activations");
                    self.moe_backward(cpu, experts, acts, &dx)
                }
            };
            let mut dh = z(t * h);
            cpu.rmsnorm_backward(&a.hx, &layer.ffn_norm, c.eps, &dm, &mut dh);
            add_in_place(&mut dh, &dx);
            // Through the attention's post-norm (Gemma 3).
            let mut d_o = Vec::new();
            if let Some(w) = &layer.post_attn_norm {
                d_o = z(t * h);
                cpu.rmsnorm_backward(&a.o_out, w, c.eps, &dh, &mut d_o);
            }
            let datt = self.linear_backward_adapted(
                cpu,
                adapter,
                l,
                Target::O,
                &layer.wo,
                &a.att,
                if d_o.is_empty() { &dh } else { &d_o },
                grads,
            );
            drop(d_o);
            let (mut dq, mut dk, mut dv) = (z(t * qd), z(t * kvd), z(t * kvd));
            for (i, s) in seqs.iter().enumerate() {
                attention_backward_seq(
                    cpu,
                    &self.config,
                    c.window(l),
                    &attn,
                    i,
                    s.prefix,
                    (&a.q, &a.k, &a.v, &datt),
                    (&mut dq, &mut dk, &mut dv),
                );
            }
            let (q_lin, k_lin) = (a.q_lin, a.k_lin);
            drop((a.q, a.k, a.v, a.att));
            let layout = c.rope_layout;
            let rope = io.rope_of(c, l);
            cpu.rope_backward(&mut dq, rope, c.num_heads, c.head_dim, c.rope_dim, layout);
            cpu.rope_backward(
                &mut dk,
                rope,
                c.num_kv_heads,
                c.head_dim,
                c.rope_dim,
                layout,
            );
            if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
                // Through the per-head norms, from the products they normed.
                let (mut dql, mut dkl) = (z(t * qd), z(t * kvd));
                cpu.rmsnorm_backward(&q_lin, qn, c.eps, &dq, &mut dql);
                cpu.rmsnorm_backward(&k_lin, kn, c.eps, &dk, &mut dkl);
                (dq, dk) = (dql, dkl);
            }
            let mut dn =
                self.linear_backward_adapted(cpu, adapter, l, Target::Q, &layer.wq, &n, &dq, grads);
            for (target, w, d) in [(Target::K, &layer.wk, &dk), (Target::V, &layer.wv, &dv)] {
                let part = self.linear_backward_adapted(cpu, adapter, l, target, w, &n, d, grads);
                add_in_place(&mut dn, &part);
            }
            let mut dx0 = z(t * h);
            cpu.rmsnorm_backward(x0, &layer.attn_norm, c.eps, &dn, &mut dx0);
            add_in_place(&mut dx0, &dh);
            dx = dx0;
        }
        Ok(())
    }

    /// dL/d(input) of one adapted projection of layer `l` with input `x` (T, in) and output
    /// gradient `dy` (T, out); adds the adapter's parameter gradients to `grads`.
    #[allow(clippy::too_many_arguments)]
    fn linear_backward_adapted(
        &self,
        cpu: &Cpu,
        adapter: &AdapterWeights,
        l: usize,
        target: Target,
        w: &Weight,
        x: &[f32],
        dy: &[f32],
        grads: &mut [f32],
    ) -> Vec<f32> {
        let mut dxr = vec![0.0f32; x.len()];
        cpu.linear_backward(w.ty, self.bytes(w), w.rows, w.cols, dy, &mut dxr);
        let Some(m) = adapter.layout.module(l, target) else {
            return dxr;
        };
        match &adapter.layout.config.method {
            Method::Oft(o) => {
                let mut dx = vec![0.0f32; x.len()];
                let th = m.tensors[0].range.clone();
                oft::module_backward(
                    cpu,
                    o,
                    &adapter.params[th.clone()],
                    adapter.derived(m),
                    x,
                    &dxr,
                    &mut dx,
                    &mut grads[th],
                );
                dx
            }
            Method::Lora(cfg) => {
                let (ra, rb) = (m.tensors[0].range.clone(), m.tensors[1].range.clone());
                debug_assert_eq!(ra.end, rb.start);
                let (ga, gb) = grads[ra.start..rb.end].split_at_mut(ra.len());
                lora::module_backward(
                    cpu,
                    &adapter.params[ra],
                    &adapter.params[rb],
                    cfg.r,
                    cfg.scale(),
                    x,
                    dy,
                    &mut dxr,
                    ga,
                    gb,
                );
                dxr
            }
        }
    }
}

/// Attention backward of sequence `i` of the packed rows (its queries; its keys and values and
/// those of its prefix, if any), adding into the packed dq, dk, dv.
#[allow(clippy::too_many_arguments)]
fn attention_backward_seq(
    cpu: &Cpu,
    c: &super::LlamaConfig,
    window: Option<usize>,
    attn: &[AttnSeq],
    i: usize,
    prefix: Option<usize>,
    (q, k, v, datt): (&[f32], &[f32], &[f32], &[f32]),
    (dq, dk, dv): (&mut [f32], &mut [f32], &mut [f32]),
) {
    let (qd, kvd) = (c.q_dim(), c.kv_dim());
    let rows = |a: &AttnSeq| a.q_start..a.q_start + a.q_len;
    let own = rows(&attn[i]);
    let mut parts = vec![own.clone()];
    if let Some(j) = prefix {
        parts.insert(0, rows(&attn[j]));
    }
    let gather = |x: &[f32]| -> Vec<f32> {
        parts
            .iter()
            .flat_map(|r| x[r.start * kvd..r.end * kvd].iter().copied())
            .collect()
    };
    let (kk, vv) = (gather(k), gather(v));
    let (mut dkk, mut dvv) = (vec![0.0f32; kk.len()], vec![0.0f32; vv.len()]);
    let qr = own.start * qd..own.end * qd;
    cpu.attention_backward_windowed(
        &q[qr.clone()],
        &kk,
        &vv,
        &datt[qr.clone()],
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        c.attn_scale,
        window,
        &mut dq[qr],
        &mut dkk,
        &mut dvv,
    );
    let mut at = 0;
    for r in parts {
        let n = (r.end - r.start) * kvd;
        add_in_place(&mut dk[r.start * kvd..r.end * kvd], &dkk[at..at + n]);
        add_in_place(&mut dv[r.start * kvd..r.end * kvd], &dvv[at..at + n]);
        at += n;
    }
}

/// The scored rows of a packed batch: (sequence, row whose logits predict the token, token), in
/// order (each completion token is predicted by the row before it).
fn scored_rows(seqs: &[TrainSeq]) -> Vec<(usize, usize, u32)> {
    let mut scored = Vec::new();
    let mut start = 0;
    for (i, s) in seqs.iter().enumerate() {
        for a in s.prompt_len..s.tokens.len() {
            scored.push((i, start + a - 1, s.tokens[a]));
        }
        start += s.tokens.len();
    }
    scored
}
