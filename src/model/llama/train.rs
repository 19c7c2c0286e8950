//! The training forward and backward over a packed batch of whole sequences through one adapter.
//!
//! Forward: the serving forward itself (`forward_store`: same kernels, same quantized weights, same
//! adapter code, batch-invariant), keeping only each layer's input (the checkpoints); the LM head
//! and log-softmax(logits / T) run in chunks of completion tokens with the sampler's own
//! arithmetic, so a completion's log-probs equal the ones recorded when it was served, to the bit.
//!
//! Backward (layer by layer, last first): the layer is recomputed from its checkpoint, then
//! gradients flow through the MLP (frozen linears' dx = dy·W from dequantized tiles, SwiGLU),
//! RMSNorm, attention (P recomputed), RoPE and the residuals; into the adapter's parameters only
//! (OFT through the rotation to θ, LoRA into A and B). Memory: the checkpoints ((L + 1) × T ×
//! hidden), one layer's activations, and one chunk of logits (never T × vocab).

use super::buffers::{AdapterScratch, ForwardBuffers};
use super::forward::{adapter_groups, add_in_place, Projection};
use super::{BatchSeq, Llama, Logits, ModelError, Weight};
use crate::adapter::{lora, oft, AdapterWeights, Method, Target};
use crate::engine::sampler::scale_and_normalize;
use crate::model::kv_cache::KvCache;
use flywheel_kernels::cpu::ops::rope_table;
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

/// What the forward keeps for the backward.
pub struct TrainState {
    cache: KvCache,
    tables: Vec<Vec<u32>>,
    /// Position of each sequence's first token (its prefix's length, else 0).
    first_pos: Vec<usize>,
    /// (layers + 1) × T × hidden: each layer's input, then the final hidden state.
    store: Vec<f32>,
    num_tokens: usize,
    /// Mean entropy (nats) of the policy's next-token distribution over the scored tokens.
    pub mean_entropy: f64,
}

impl Llama {
    /// Log-probs (from logits / `temperature`) of every completion token of every sequence, and
    /// the state the backward needs.
    pub fn train_forward(
        &self,
        cpu: &Cpu,
        seqs: &[TrainSeq],
        adapter: Option<&AdapterWeights>,
        temperature: f32,
    ) -> Result<(Vec<Vec<f32>>, TrainState), ModelError> {
        let c = &self.config;
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
        let mut cache = KvCache::new(c.num_layers, c.kv_dim(), bs, next as usize);
        let batch: Vec<BatchSeq> = seqs
            .iter()
            .zip(&tables)
            .zip(&first_pos)
            .map(|((s, t), &p)| BatchSeq {
                tokens: s.tokens,
                first_pos: p,
                block_table: t,
                logits: Logits::None,
                adapter,
            })
            .collect();
        let mut bufs = ForwardBuffers::default();
        let mut store = Vec::new();
        self.forward_store(cpu, &mut cache, &batch, &mut bufs, &mut store)?;
        let num_tokens: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        let mut state = TrainState {
            cache,
            tables,
            first_pos,
            store,
            num_tokens,
            mean_entropy: 0.0,
        };
        let mut logps: Vec<Vec<f32>> = seqs
            .iter()
            .map(|s| Vec::with_capacity(s.tokens.len() - s.prompt_len))
            .collect();
        let (mut entropy, mut scored) = (0.0f64, 0usize);
        self.head_chunks(cpu, seqs, &state, temperature, |chunk, rows| {
            for (k, &(i, _, _)) in chunk.iter().enumerate() {
                let row = &rows[k * c.vocab_size..(k + 1) * c.vocab_size];
                let tok = seqs[i].tokens[seqs[i].prompt_len + logps[i].len()] as usize;
                logps[i].push(row[tok]);
                entropy -= row
                    .iter()
                    .map(|&lp| (lp as f64).exp() * lp as f64)
                    .filter(|v| v.is_finite())
                    .sum::<f64>();
                scored += 1;
            }
        });
        state.mean_entropy = entropy / scored.max(1) as f64;
        Ok((logps, state))
    }

    /// The scored rows (sequence, row in the batch, target token), HEAD_CHUNK at a time: their
    /// log-softmax(logits / T) rows are handed to `f`.
    fn head_chunks(
        &self,
        cpu: &Cpu,
        seqs: &[TrainSeq],
        st: &TrainState,
        temperature: f32,
        mut f: impl FnMut(&[(usize, usize, u32)], &[f32]),
    ) {
        let c = &self.config;
        let h = c.hidden;
        let final_x = &st.store[c.num_layers * st.num_tokens * h..];
        let mut scored = Vec::new();
        let mut start = 0;
        for (i, s) in seqs.iter().enumerate() {
            for a in s.prompt_len..s.tokens.len() {
                scored.push((i, start + a - 1, s.tokens[a]));
            }
            start += s.tokens.len();
        }
        let mut xs = Vec::new();
        let mut normed = Vec::new();
        let mut logits = Vec::new();
        for chunk in scored.chunks(HEAD_CHUNK) {
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
    /// of every completion token (`grad_logp`, as `train_forward` returned the log-probs).
    #[allow(clippy::too_many_arguments)]
    pub fn train_backward(
        &self,
        cpu: &Cpu,
        seqs: &[TrainSeq],
        adapter: &AdapterWeights,
        temperature: f32,
        st: &TrainState,
        grad_logp: &[Vec<f32>],
        grads: &mut [f32],
    ) -> Result<(), ModelError> {
        let c = &self.config;
        let (h, t) = (c.hidden, st.num_tokens);
        assert_eq!(grads.len(), adapter.layout.num_params);
        // dL/dx of the final hidden state: through the LM head (frozen) and the final RMSNorm.
        let mut dnormed_all = vec![0.0f32; t * h];
        let mut done: Vec<usize> = vec![0; seqs.len()];
        let inv_t = if temperature > 0.0 {
            1.0 / temperature
        } else {
            1.0
        };
        let mut dz = Vec::new();
        let mut dn = Vec::new();
        self.head_chunks(cpu, seqs, st, temperature, |chunk, rows| {
            dz.resize(rows.len(), 0.0);
            for (k, &(i, _, tok)) in chunk.iter().enumerate() {
                let g = grad_logp[i][done[i]];
                done[i] += 1;
                let row = &rows[k * c.vocab_size..(k + 1) * c.vocab_size];
                let d = &mut dz[k * c.vocab_size..(k + 1) * c.vocab_size];
                // log p = log_softmax(z / T): dL/dz = g·(onehot − softmax)/T.
                for (dv, lp) in d.iter_mut().zip(row) {
                    *dv = -g * lp.exp() * inv_t;
                }
                d[tok as usize] += g * inv_t;
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
                dnormed_all[r * h..(r + 1) * h].copy_from_slice(&dn[k * h..(k + 1) * h]);
            }
        });
        let final_x = &st.store[c.num_layers * t * h..];
        let mut dx = vec![0.0f32; t * h];
        cpu.rmsnorm_backward(final_x, &self.output_norm, c.eps, &dnormed_all, &mut dx);

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
        let rope = rope_table(&positions, c.rope_dim, c.rope_base);
        let mut scratch = AdapterScratch::default();
        let (qd, kvd, f) = (c.q_dim(), c.kv_dim(), c.ffn);
        let z = |n: usize| vec![0.0f32; n];
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        for (l, layer) in self.layers.iter().enumerate().rev() {
            // Recompute the layer from its checkpoint.
            let x0 = &st.store[l * t * h..(l + 1) * t * h];
            let (mut n, mut q, mut k, mut v) = (z(t * h), z(t * qd), z(t * kvd), z(t * kvd));
            cpu.rmsnorm(x0, &layer.attn_norm, c.eps, &mut n);
            self.project(
                cpu,
                l,
                &n,
                &mut [
                    Projection {
                        target: Target::Q,
                        weight: &layer.wq,
                        y: &mut q,
                    },
                    Projection {
                        target: Target::K,
                        weight: &layer.wk,
                        y: &mut k,
                    },
                    Projection {
                        target: Target::V,
                        weight: &layer.wv,
                        y: &mut v,
                    },
                ],
                &groups,
                &mut scratch,
            );
            cpu.rope(&mut q, &rope, c.num_heads, c.head_dim, c.rope_dim);
            cpu.rope(&mut k, &rope, c.num_kv_heads, c.head_dim, c.rope_dim);
            let mut att = z(t * qd);
            cpu.attention(
                &q,
                &mut att,
                &attn,
                st.cache.layer(l),
                c.num_heads,
                c.num_kv_heads,
                c.head_dim,
                scale,
            );
            let mut hx = z(t * h);
            self.project(
                cpu,
                l,
                &att,
                &mut [Projection {
                    target: Target::O,
                    weight: &layer.wo,
                    y: &mut hx,
                }],
                &groups,
                &mut scratch,
            );
            add_in_place(&mut hx, x0);
            let mut m = z(t * h);
            cpu.rmsnorm(&hx, &layer.ffn_norm, c.eps, &mut m);
            let (mut gate, mut up, mut act) = (z(t * f), z(t * f), z(t * f));
            self.project(
                cpu,
                l,
                &m,
                &mut [
                    Projection {
                        target: Target::Gate,
                        weight: &layer.w_gate,
                        y: &mut gate,
                    },
                    Projection {
                        target: Target::Up,
                        weight: &layer.w_up,
                        y: &mut up,
                    },
                ],
                &groups,
                &mut scratch,
            );
            cpu.swiglu(&gate, &up, &mut act);

            // Backward: dx holds dL/d(layer output).
            let dact = self.linear_backward_adapted(
                cpu,
                adapter,
                l,
                Target::Down,
                &layer.w_down,
                &act,
                &dx,
                grads,
            );
            let (mut dgate, mut dup) = (z(t * f), z(t * f));
            cpu.swiglu_backward(&gate, &up, &dact, &mut dgate, &mut dup);
            let mut dm = self.linear_backward_adapted(
                cpu,
                adapter,
                l,
                Target::Gate,
                &layer.w_gate,
                &m,
                &dgate,
                grads,
            );
            let dm_up = self.linear_backward_adapted(
                cpu,
                adapter,
                l,
                Target::Up,
                &layer.w_up,
                &m,
                &dup,
                grads,
            );
            add_in_place(&mut dm, &dm_up);
            let mut dh = z(t * h);
            cpu.rmsnorm_backward(&hx, &layer.ffn_norm, c.eps, &dm, &mut dh);
            add_in_place(&mut dh, &dx);
            let datt = self.linear_backward_adapted(
                cpu,
                adapter,
                l,
                Target::O,
                &layer.wo,
                &att,
                &dh,
                grads,
            );
            let (mut dq, mut dk, mut dv) = (z(t * qd), z(t * kvd), z(t * kvd));
            for (i, a) in attn.iter().enumerate() {
                attention_backward_seq(
                    cpu,
                    &self.config,
                    &attn,
                    i,
                    seqs[i].prefix,
                    (&q, &k, &v, &datt),
                    (&mut dq, &mut dk, &mut dv),
                );
                debug_assert_eq!(a.first_pos, st.first_pos[i]);
            }
            cpu.rope_backward(&mut dq, &rope, c.num_heads, c.head_dim, c.rope_dim);
            cpu.rope_backward(&mut dk, &rope, c.num_kv_heads, c.head_dim, c.rope_dim);
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
fn attention_backward_seq(
    cpu: &Cpu,
    c: &super::LlamaConfig,
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
    cpu.attention_backward(
        &q[qr.clone()],
        &kk,
        &vv,
        &datt[qr.clone()],
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        1.0 / (c.head_dim as f32).sqrt(),
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
