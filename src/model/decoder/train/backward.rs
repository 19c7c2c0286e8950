//! The training backward (layer by layer, last first): each layer's kept activations, or the
//! layer recomputed from its checkpoint by the forward's own block (the same bits), then the
//! gradient through the MLP (dense SwiGLU/GeGLU with its adapted projections and post-norm, or
//! the frozen experts and their routing), the norms, attention (P recomputed, sliding windows
//! kept), RoPE and the residuals — into the adapter's parameters only.

use super::*;

impl Decoder {
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
        if adapter.layout.head().is_some() {
            self.head_lora_backward(cpu, seqs, adapter, &st, grad_logp, &mut dnormed_all, grads);
        }
        let mut dx = vec![0.0f32; t * h];
        cpu.rmsnorm_backward(&st.final_x, &self.output_norm, c.eps, &dnormed_all, &mut dx);
        drop(dnormed_all);

        let batch = train_batch(seqs, &st.tables, &st.first_pos, Some(adapter));
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
            attn_window: &attn,
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
                    c.attn_opts(l),
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
    c: &crate::model::decoder::DecoderConfig,
    window: flywheel_kernels::reference::AttnOpts,
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

impl Decoder {
    /// LoRA on the LM head: the head's chunks again (the coefficients dL/dlog π are known only
    /// now), each scored row's d log π/dz times its coefficient through the delta s·B(A n): into
    /// dL/dA, dL/dB (`grads`) and dL/dn (`dnormed`, added to the frozen head's part).
    #[allow(clippy::too_many_arguments)]
    fn head_lora_backward(
        &self,
        cpu: &Cpu,
        seqs: &[TrainSeq],
        adapter: &AdapterWeights,
        st: &TrainState,
        grad_logp: &[Vec<f32>],
        dnormed: &mut [f32],
        grads: &mut [f32],
    ) {
        let (Some(m), Method::Lora(cfg)) = (adapter.layout.head(), &adapter.layout.config.method)
        else {
            return;
        };
        let (h, vocab) = (m.in_dim, m.out_dim);
        let (ra, rb) = (m.tensors[0].range.clone(), m.tensors[1].range.clone());
        assert_eq!(ra.end, rb.start, "lora_A then lora_B");
        let (ga, gb) = grads[ra.start..rb.end].split_at_mut(ra.len());
        let (a, b) = (adapter.tensor(&m.tensors[0]), adapter.tensor(&m.tensors[1]));
        let mut done = vec![0usize; seqs.len()];
        let (mut dz, mut dn) = (Vec::new(), Vec::new());
        let (temperature, inv_t) = (st.temperature, inv_temperature(st.temperature));
        let final_x = &st.final_x;
        self.head_chunks(
            cpu,
            seqs,
            final_x,
            Some(adapter),
            temperature,
            |chunk, rows, slopes, normed| {
                dz.resize(rows.len(), 0.0);
                for (k, &(i, _, tok)) in chunk.iter().enumerate() {
                    let d = &mut dz[k * vocab..(k + 1) * vocab];
                    logit_grad(
                        cpu,
                        &rows[k * vocab..(k + 1) * vocab],
                        tok,
                        inv_t,
                        slopes,
                        k,
                        d,
                    );
                    let g = grad_logp[i][done[i]];
                    done[i] += 1;
                    d.iter_mut().for_each(|v| *v *= g);
                }
                dn.clear();
                dn.resize(chunk.len() * h, 0.0);
                lora::module_backward(cpu, a, b, cfg.r, cfg.scale(), normed, &dz, &mut dn, ga, gb);
                for (k, &(_, r, _)) in chunk.iter().enumerate() {
                    add_in_place(&mut dnormed[r * h..(r + 1) * h], &dn[k * h..(k + 1) * h]);
                }
            },
        );
    }
}
