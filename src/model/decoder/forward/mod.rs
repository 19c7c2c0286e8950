//! The forward pass over a packed batch: each sequence with its own positions, block table and
//! adapter (None: the base). The base products stay one batched product over every row; adapter
//! work is grouped by adapter version: OFT rotates a group's rows of a projection's input before
//! that product, LoRA adds s·B(A x) to a group's rows after it. Every step is row-local and in a
//! fixed order, so a row's logits are the same to the bit whatever shares its batch.
//!
//! Per layer (T = tokens in the batch):
//!   n = RMSNorm(x) * attn_norm                       (T, hidden)
//!   q, k, v = n Wqᵀ, n Wkᵀ, n Wvᵀ  (adapted)          (T, q_dim), (T, kv_dim), (T, kv_dim)
//!   q, k = RoPE(q), RoPE(k)   (adjacent pairs)
//!   x += Attn(q, K, V) Woᵀ    (causal, GQA, over the cache; Wo adapted)
//!   m = RMSNorm(x) * ffn_norm
//!   x += (silu(m Wgateᵀ) ⊙ m Wupᵀ) Wdownᵀ   (each adapted)
//! logits = RMSNorm(x) * output_norm · Woutᵀ (Wout = token_embd when tied), plus a LoRA delta
//! where an adapter targets the LM head

use super::activations::{ActStore, LayerActs};
use super::buffers::{AdapterScratch, ForwardBuffers, LoraScratch};
use super::moe::MoeActs;
use super::pack::{BatchSeq, Packed};
use super::{Activation, Decoder, Mlp, ModelError, Weight};
use crate::adapter::{lora, AdapterWeights, Method, Target};
use crate::model::kv_cache::{KvCache, KvDtype, LayerKv};
use flywheel_kernels::reference::AttnSeq;
use flywheel_kernels::reference::F16;
use flywheel_kernels::{Cpu, Matmul};
use std::ops::Range;

/// Where a block's attention finds K/V: written by this pass for `batch` (the forward), or
/// already in the cache (a training recompute reads what the forward wrote).
pub(super) enum KvAccess<'c, 'b> {
    Write(&'c mut KvCache, &'b [BatchSeq<'b>]),
    Read(&'c KvCache),
}

/// What every block of one pass shares: the sequences' attention spans, the RoPE table of
/// their positions, and the adapter groups of their rows.
pub(super) struct LayerIo<'a> {
    pub attn: &'a [AttnSeq<'a>],
    /// Through the window tables: what a layer the cache keeps windowed reads.
    pub attn_window: &'a [AttnSeq<'a>],
    /// The global layers' RoPE table and the sliding-window layers' (`Llama::rope_tables`).
    pub rope: &'a [f32],
    pub rope_local: &'a [f32],
    pub groups: &'a [AdapterGroup<'a>],
}

impl LayerIo<'_> {
    /// Layer `l`'s RoPE table.
    pub fn rope_of(&self, c: &super::DecoderConfig, l: usize) -> &[f32] {
        match c.window(l) {
            Some(_) => self.rope_local,
            None => self.rope,
        }
    }
}

/// The rows of the batch that run through one adapter version.
pub struct AdapterGroup<'a> {
    pub weights: &'a AdapterWeights,
    pub rows: Vec<Range<usize>>,
}

/// Group the batch's rows by adapter version (by identity), in order of first appearance.
pub fn adapter_groups<'a>(batch: &[BatchSeq<'a>]) -> Vec<AdapterGroup<'a>> {
    let mut groups: Vec<AdapterGroup<'a>> = Vec::new();
    let mut start = 0;
    for s in batch {
        let rows = start..start + s.tokens.len();
        start = rows.end;
        let Some(w) = s.adapter else { continue };
        match groups.iter_mut().find(|g| std::ptr::eq(g.weights, w)) {
            Some(g) => match g.rows.last_mut() {
                Some(last) if last.end == rows.start => last.end = rows.end,
                _ => g.rows.push(rows),
            },
            None => groups.push(AdapterGroup {
                weights: w,
                rows: vec![rows],
            }),
        }
    }
    groups
}

/// One projection of a layer to run: its target, weight and output (T, out).
pub struct Projection<'a> {
    pub target: Target,
    pub weight: &'a Weight,
    pub y: &'a mut [f32],
}

impl Decoder {
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
        self.forward_impl(cpu, cache, batch, bufs, None)
    }

    /// The same forward, also keeping what the training backward needs in `store`: each layer's
    /// input (the checkpoints), and the activations of the layers from `store.keep_from` on.
    pub(super) fn forward_store(
        &self,
        cpu: &Cpu,
        cache: &mut KvCache,
        batch: &[BatchSeq],
        bufs: &mut ForwardBuffers,
        store: &mut ActStore,
    ) -> Result<(), ModelError> {
        self.forward_impl(cpu, cache, batch, bufs, Some(store))
    }

    fn forward_impl(
        &self,
        cpu: &Cpu,
        cache: &mut KvCache,
        batch: &[BatchSeq],
        bufs: &mut ForwardBuffers,
        mut store: Option<&mut ActStore>,
    ) -> Result<(), ModelError> {
        let c = &self.config;
        let hidden = c.hidden;
        let Packed {
            tokens,
            positions,
            attn,
            attn_window,
            logit_rows,
            hidden_rows,
        } = self.pack(batch, cache.block_size)?;
        let groups = adapter_groups(batch);
        let t = tokens.len();
        let (rope, rope_local) = self.rope_tables(&positions);
        let m = logit_rows.len();
        bufs.size(t, m, c);
        self.embed(cpu, &tokens, &mut bufs.x);
        if let Some(st) = store.as_deref_mut() {
            st.checkpoints.clear();
            st.acts.clear();
        }
        for l in 0..self.layers.len() {
            let mut keep = None;
            if let Some(st) = store.as_deref_mut() {
                st.checkpoints.extend_from_slice(&bufs.x);
                keep = (l >= st.keep_from).then(LayerActs::default);
            }
            let io = LayerIo {
                attn: &attn,
                attn_window: &attn_window,
                rope: &rope,
                rope_local: &rope_local,
                groups: &groups,
            };
            let kv = KvAccess::Write(&mut *cache, batch);
            self.layer(cpu, l, bufs, kv, &io, keep.as_mut(), true);
            if let Some(st) = store.as_deref_mut() {
                st.acts.push(keep);
            }
        }
        if !hidden_rows.is_empty() {
            let rows: Vec<f32> = hidden_rows
                .iter()
                .flat_map(|&r| bufs.x[r * hidden..(r + 1) * hidden].iter().copied())
                .collect();
            bufs.hidden.resize(rows.len(), 0.0);
            cpu.rmsnorm(&rows, &self.output_norm, c.eps, &mut bufs.hidden);
        }
        let ForwardBuffers {
            x,
            xs,
            normed,
            logits,
            adapter: scratch,
            ..
        } = bufs;
        for (j, &r) in logit_rows.iter().enumerate() {
            xs[j * hidden..(j + 1) * hidden].copy_from_slice(&x[r * hidden..(r + 1) * hidden]);
        }
        cpu.rmsnorm(xs, &self.output_norm, c.eps, normed);
        if m > 0 {
            cpu.matmul_head(Matmul {
                ty: self.output.ty,
                w: self.bytes(&self.output),
                rows: c.vocab_size,
                cols: hidden,
                x: normed,
                y: logits,
            });
            // LoRA on the LM head: each group's logit rows.
            for g in groups.iter().filter(|g| g.weights.layout.head().is_some()) {
                let rows = &mut scratch.head_rows;
                rows.clear();
                rows.extend(
                    (0..m).filter(|&j| g.rows.iter().any(|rr| rr.contains(&logit_rows[j]))),
                );
                self.head_lora(cpu, g.weights, rows, normed, logits, &mut scratch.lora);
            }
            c.cap_logits(&mut logits[..m * c.vocab_size]);
        }
        Ok(())
    }

    /// Block `l` on the rows of `bufs.x` (T, hidden), in place: h = x + Wo·Attn(RoPE(Wq·n),
    /// RoPE(Wk·n), Wv·n) with n = RMSNorm(x), then x = h + Wdown·SwiGLU(Wgate·m, Wup·m) with
    /// m = RMSNorm(h). With `keep`, the activations the backward needs are copied into it; with
    /// `whole` false it stops after the MLP's gate and up (all a recompute needs). The forward and
    /// the training recompute both run this one function, so their bits agree.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn layer(
        &self,
        cpu: &Cpu,
        l: usize,
        bufs: &mut ForwardBuffers,
        kv: KvAccess,
        io: &LayerIo,
        mut keep: Option<&mut LayerActs>,
        whole: bool,
    ) {
        let c = &self.config;
        let layer = &self.layers[l];
        let kvd = c.kv_dim();
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
            adapter,
            moe,
            k16,
            v16,
            ..
        } = bufs;
        let groups = io.groups;
        cpu.rmsnorm(x, &layer.attn_norm, c.eps, n);
        let mut qkv = [
            (Target::Q, &layer.wq, &mut *q),
            (Target::K, &layer.wk, &mut *k),
            (Target::V, &layer.wv, &mut *v),
        ]
        .map(|(target, weight, y)| Projection { target, weight, y });
        self.project(cpu, l, n, &mut qkv, groups, adapter);
        for (y, b) in [
            (&mut *q, &layer.bq),
            (&mut *k, &layer.bk),
            (&mut *v, &layer.bv),
        ] {
            if let Some(b) = b {
                add_bias(y, b);
            }
        }
        if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
            if let Some(a) = keep.as_deref_mut() {
                (a.q_lin, a.k_lin) = (q.to_vec(), k.to_vec());
            }
            // `att` is free until the attention writes it: the norms' input copy, no allocation.
            head_norm(cpu, q, qn, c.eps, att);
            head_norm(cpu, k, kn, c.eps, att);
        }
        let rope = io.rope_of(c, l);
        cpu.rope(q, rope, c.num_heads, c.head_dim, c.rope_dim, c.rope_layout);
        cpu.rope(
            k,
            rope,
            c.num_kv_heads,
            c.head_dim,
            c.rope_dim,
            c.rope_layout,
        );
        // An f16 cache: K and V rounded to halves here, so that the cache holds exactly what the
        // attention and the backward (the kept or recomputed activations) compute with.
        let f16 = match &kv {
            KvAccess::Write(c, _) => c.dtype(),
            KvAccess::Read(c) => c.dtype(),
        } == KvDtype::F16;
        if f16 {
            // Grown once, then reused from step to step (no allocation per layer).
            k16.resize(k.len(), F16::default());
            v16.resize(v.len(), F16::default());
            cpu.round_to_f16(k, k16);
            cpu.round_to_f16(v, v16);
        }
        if let Some(a) = keep.as_deref_mut() {
            (a.q, a.k, a.v) = (q.to_vec(), k.to_vec(), v.to_vec());
        }
        let cache: &KvCache = match kv {
            KvAccess::Write(cache, batch) => {
                let spans = if cache.windowed(l) {
                    io.attn_window
                } else {
                    io.attn
                };
                for (s, a) in batch.iter().zip(spans) {
                    let table = a.block_table;
                    for i in 0..a.q_len {
                        let (row, pos) = ((a.q_start + i) * kvd, s.first_pos + i);
                        let row = row..row + kvd;
                        if f16 {
                            let (kr, vr) = (&k16[row.clone()], &v16[row]);
                            cache.write_f16(l, table, pos, kr, vr);
                        } else {
                            cache.write(l, table, pos, &k[row.clone()], &v[row]);
                        }
                    }
                }
                cache
            }
            KvAccess::Read(cache) => cache,
        };
        let (heads, kv_heads, hd, scale, window) = (
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.attn_scale,
            c.attn_opts(l),
        );
        let spans = if cache.windowed(l) {
            io.attn_window
        } else {
            io.attn
        };
        match cache.layer(l) {
            LayerKv::F32(kv) => {
                cpu.attention_windowed(q, att, spans, kv, heads, kv_heads, hd, scale, window)
            }
            LayerKv::F16(kv) => {
                cpu.attention_windowed(q, att, spans, kv, heads, kv_heads, hd, scale, window)
            }
        }
        let mut o = [Projection {
            target: Target::O,
            weight: &layer.wo,
            y: &mut *proj,
        }];
        self.project(cpu, l, att, &mut o, groups, adapter);
        match &layer.post_attn_norm {
            // n is free until the MLP's norm: the post-norm's output.
            Some(w) => {
                if let Some(a) = keep.as_deref_mut() {
                    a.o_out = proj.to_vec();
                }
                cpu.rmsnorm(proj, w, c.eps, n);
                add_in_place(x, n);
            }
            None => add_in_place(x, proj),
        }
        if let Some(a) = keep.as_deref_mut() {
            (a.att, a.hx) = (att.to_vec(), x.to_vec());
        }
        cpu.rmsnorm(x, &layer.ffn_norm, c.eps, n);
        let (w_gate, w_up, w_down) = match &layer.mlp {
            Mlp::Dense {
                w_gate,
                w_up,
                w_down,
            } => (w_gate, w_up, w_down),
            Mlp::Moe(experts) => {
                // The experts' products (a recompute needs them all: the backward reads each
                // expert's output).
                match keep {
                    Some(a) => {
                        let mut acts = MoeActs::default();
                        self.moe_forward(cpu, experts, n, proj, &mut acts);
                        a.moe = Some(acts);
                    }
                    None => self.moe_forward(cpu, experts, n, proj, moe),
                }
                if whole {
                    add_in_place(x, proj);
                }
                return;
            }
        };
        let mut mlp = [
            Projection {
                target: Target::Gate,
                weight: w_gate,
                y: &mut *gate,
            },
            Projection {
                target: Target::Up,
                weight: w_up,
                y: &mut *up,
            },
        ];
        self.project(cpu, l, n, &mut mlp, groups, adapter);
        if let Some(a) = keep.as_deref_mut() {
            (a.gate, a.up) = (gate.to_vec(), up.to_vec());
        }
        // A recompute stops here unless the backward needs the MLP's output (its post-norm).
        if !whole && layer.post_ffn_norm.is_none() {
            return;
        }
        match c.activation {
            Activation::Silu => cpu.swiglu(gate, up, act),
            Activation::GeluTanh => cpu.geglu(gate, up, act),
        }
        let mut down = [Projection {
            target: Target::Down,
            weight: w_down,
            y: &mut *proj,
        }];
        self.project(cpu, l, act, &mut down, groups, adapter);
        match &layer.post_ffn_norm {
            Some(w) => {
                if let Some(a) = keep {
                    a.down_out = proj.to_vec();
                }
                cpu.rmsnorm(proj, w, c.eps, n);
                add_in_place(x, n);
            }
            None => add_in_place(x, proj),
        }
    }

    /// Layer `l`'s activations recomputed from its input `x0` by the forward's own block
    /// (`Llama::layer`, so the same bits as if they had been kept), reading K/V from the
    /// training cache.
    pub(super) fn recompute_layer(
        &self,
        cpu: &Cpu,
        l: usize,
        x0: &[f32],
        cache: &KvCache,
        io: &LayerIo,
        bufs: &mut ForwardBuffers,
    ) -> LayerActs {
        bufs.size(x0.len() / self.config.hidden, 0, &self.config);
        bufs.x.copy_from_slice(x0);
        let mut a = LayerActs::default();
        self.layer(cpu, l, bufs, KvAccess::Read(cache), io, Some(&mut a), false);
        a
    }

    /// x (T, hidden) = the embedding rows of `tokens`.
    pub fn embed(&self, cpu: &Cpu, tokens: &[u32], x: &mut [f32]) {
        let hidden = self.config.hidden;
        let erb = self.token_embd.ty.row_bytes(hidden).unwrap_or(0);
        let embd = self.bytes(&self.token_embd);
        for (i, &tok) in tokens.iter().enumerate() {
            let tok = tok as usize;
            let row = &mut x[i * hidden..(i + 1) * hidden];
            cpu.dequantize_row(self.token_embd.ty, &embd[tok * erb..(tok + 1) * erb], row);
            if let Some(s) = self.config.embed_scale {
                row.iter_mut().for_each(|v| *v *= s);
            }
        }
    }
}

/// RMSNorm of every head of `y` (rows of `w.len()` = head_dim), in place; `scratch` holds at
/// least `y.len()` values and is overwritten.
fn head_norm(cpu: &Cpu, y: &mut [f32], w: &[f32], eps: f32, scratch: &mut [f32]) {
    let x = &mut scratch[..y.len()];
    x.copy_from_slice(y);
    cpu.rmsnorm(x, w, eps, y);
}

/// Add `b` to every row of `y` (rows of `b.len()`).
fn add_bias(y: &mut [f32], b: &[f32]) {
    for row in y.chunks_mut(b.len()) {
        add_in_place(row, b);
    }
}

pub(crate) fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

mod project;
