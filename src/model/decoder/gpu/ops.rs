//! The GPU forward's pieces below a layer: a projection through the step's adapters, a
//! mixture of experts, attention over the cache, the residual with its optional post-norm.

use super::*;
use flywheel_kernels::reference::AttnOpts;

impl GpuDecoder {
    /// Copy the step's adapter versions to the GPU (once per version), dropping versions no step
    /// has used for a while beyond `ADAPTERS_KEPT`.
    pub(super) fn upload_adapters(&mut self, groups: &[AdapterGroup]) -> Result<(), ModelError> {
        for grp in groups {
            let w = grp.weights;
            if let Some(a) = self.adapters.get_mut(&w.uid()) {
                a.last_step = self.step;
                continue;
            }
            let params = match &w.layout.config.method {
                Method::Lora(_) => Some(self.gpu.upload(f32_bytes(&w.params))?),
                Method::Oft(_) => None,
            };
            let derived = self.gpu.upload(if w.derived.is_empty() {
                &[0.0]
            } else {
                &w.derived
            })?;
            self.adapters.insert(
                w.uid(),
                GpuAdapter {
                    derived,
                    params,
                    last_step: self.step,
                },
            );
        }
        if self.adapters.len() > ADAPTERS_KEPT + groups.len() {
            let mut ages: Vec<(u64, u64)> = self
                .adapters
                .iter()
                .map(|(k, a)| (a.last_step, *k))
                .collect();
            ages.sort_unstable();
            let excess = self.adapters.len() - ADAPTERS_KEPT - groups.len();
            for (step, key) in ages.into_iter().take(excess) {
                if step != self.step {
                    self.adapters.remove(&key);
                }
            }
        }
        Ok(())
    }
}

/// One layer's experts on the GPU.
pub(super) struct Experts<'a> {
    pub(super) router: &'a DeviceMatrix,
    pub(super) gate: &'a [DeviceMatrix],
    pub(super) up: &'a [DeviceMatrix],
    pub(super) down: &'a [DeviceMatrix],
}

impl Experts<'_> {
    /// y (n, h) = the mixture of experts of m (n, h): the router's logits read back and routed on
    /// the host (`moe::route`, the CPU's), the rows gathered by expert, each expert's rows one
    /// product per projection, then each token's outputs weighted in the order of its choices.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run(
        &self,
        g: &Gpu,
        mc: &MoeConfig,
        m: &CudaSlice<f32>,
        n: usize,
        h: usize,
        b: &mut MoeBufs,
        host: &mut MoeActs,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), ModelError> {
        let (ne, k, f) = (mc.experts, mc.used, mc.expert_ffn);
        g.matmul(self.router, m, n, &mut b.logits)?;
        host.probs.resize(n * ne, 0.0);
        g.read_into(&b.logits.slice(..n * ne), &mut host.probs)?;
        route(mc, n, host);
        let tok: Vec<u32> = host.rows.iter().map(|&(t, _)| t).collect();
        let row_of: Vec<u32> = host.row_of.iter().map(|&r| r as u32).collect();
        let weight: Vec<f32> = host.choices.iter().map(|ch| ch.weight).collect();
        g.write(&tok, &mut b.tok)?;
        g.write(&row_of, &mut b.row_of)?;
        g.write(&weight, &mut b.weight)?;
        g.gather_rows(m, &b.tok, n * k, h, &mut b.xs)?;
        for (e, r) in ranges(&host.counts) {
            let xs = b.xs.slice(r.start * h..r.end * h);
            let span = r.start * f..r.end * f;
            g.matmul(
                &self.gate[e],
                &xs,
                r.len(),
                &mut b.gate.slice_mut(span.clone()),
            )?;
            g.matmul(&self.up[e], &xs, r.len(), &mut b.up.slice_mut(span))?;
        }
        g.swiglu(&b.gate, &b.up, n * k * f, &mut b.act)?;
        for (e, r) in ranges(&host.counts) {
            let act = b.act.slice(r.start * f..r.end * f);
            let mut out = b.out.slice_mut(r.start * h..r.end * h);
            g.matmul(&self.down[e], &act, r.len(), &mut out)?;
        }
        g.moe_combine(&b.out, &b.row_of, &b.weight, n, k, h, y)?;
        Ok(())
    }
}

/// The capture mode and instantiation flags of the decode graphs.
pub(super) mod cudarc_mode {
    use flywheel_kernels::cuda::sys;
    /// Only this thread's CUDA calls are part of the capture (the trainer's are not).
    pub const THREAD_LOCAL: sys::CUstreamCaptureMode =
        sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
    pub const INSTANTIATE_DEFAULT: sys::CUgraphInstantiate_flags = sys::CUgraphInstantiate_flags(0);
}

fn f32_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and every byte pattern is a valid u8.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
}

/// Write the step's K and V into a layer's cache, then att = Attn(q, cache).
#[allow(clippy::too_many_arguments)]
pub(super) fn attend<E: GpuKv>(
    g: &Gpu,
    q: &CudaSlice<f32>,
    k: &CudaSlice<f32>,
    v: &CudaSlice<f32>,
    att: &mut CudaSlice<f32>,
    meta: &Tokens,
    kv_dim: usize,
    kc: &mut CudaSlice<E>,
    vc: &mut CudaSlice<E>,
    (heads, kv_heads, hd, scale, window): (usize, usize, usize, f32, AttnOpts),
) -> Result<(), GpuError> {
    g.kv_write(k, v, meta, kv_dim, kc, vc)?;
    g.attention(q, att, meta, kc, vc, heads, kv_heads, hd, scale, window)
}

/// x += y, or x += RMSNorm(y)·w through `scratch` where the family norms a block's output
/// (Gemma 3's post-norms).
#[allow(clippy::too_many_arguments)]
pub(super) fn residual(
    g: &Gpu,
    x: &mut CudaSlice<f32>,
    y: &CudaSlice<f32>,
    scratch: &mut CudaSlice<f32>,
    post_norm: &Option<CudaSlice<f32>>,
    eps: f32,
    n: usize,
    h: usize,
) -> Result<(), GpuError> {
    match post_norm {
        Some(w) => {
            g.rmsnorm(y, w, eps, n, scratch)?;
            g.add(x, &*scratch, n * h)
        }
        None => g.add(x, y, n * h),
    }
}

/// One layer's projections through the step's adapter groups: OFT rotates a group's rows of the
/// input first (into `rotated`), LoRA adds s·B(A x) to a group's rows after the base product,
/// row range by row range (each row's arithmetic is its own: batch-invariant).
pub(super) struct Projector<'a> {
    pub(super) g: &'a Gpu,
    pub(super) adapters: &'a HashMap<u64, GpuAdapter>,
    pub(super) groups: &'a [AdapterGroup<'a>],
    pub(super) l: usize,
    pub(super) rotated: &'a mut CudaSlice<f32>,
    pub(super) lora_h: &'a mut CudaSlice<f32>,
    pub(super) lora_d: &'a mut CudaSlice<f32>,
}

impl Projector<'_> {
    pub(super) fn run(
        &mut self,
        target: Target,
        w: &DeviceMatrix,
        x: &CudaSlice<f32>,
        n: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), ModelError> {
        let g = self.g;
        let (inp, out) = (w.cols, w.rows);
        let mut rotated = false;
        for grp in self.groups {
            let Method::Oft(o) = &grp.weights.layout.config.method else {
                continue;
            };
            let Some(m) = grp.weights.layout.module(self.l, target) else {
                continue;
            };
            let dev = &self.adapters[&grp.weights.uid()];
            if !rotated {
                rotated = true;
                g.copy(x, self.rotated, n * inp)?;
            }
            let b = o.block_size;
            let r = dev
                .derived
                .slice(m.derived_offset..m.derived_offset + inp * b);
            for rows in &grp.rows {
                let span = span(rows, inp);
                let xs = x.slice(span.clone());
                let mut os = self.rotated.slice_mut(span);
                g.block_matmul(&xs, &r, rows.len(), inp / b, b, b, &mut os)?;
            }
        }
        if rotated {
            g.matmul(w, &*self.rotated, n, y)?;
        } else {
            g.matmul(w, x, n, y)?;
        }
        for grp in self.groups {
            let Method::Lora(cfg) = &grp.weights.layout.config.method else {
                continue;
            };
            let Some(m) = grp.weights.layout.module(self.l, target) else {
                continue;
            };
            if cfg.r > self.lora_h.len() / n.max(1) {
                return Err(ModelError::Unsupported(format!(
                    "LoRA rank {} on the GPU",
                    cfg.r
                )));
            }
            let dev = &self.adapters[&grp.weights.uid()];
            let params = dev.params.as_ref().expect("LoRA keeps its parameters");
            let a_range = &m.tensors[0].range;
            let a = params.slice(a_range.start * 4..a_range.end * 4);
            let bt = dev
                .derived
                .slice(m.derived_offset..m.derived_offset + cfg.r * out);
            for rows in &grp.rows {
                let k = rows.len();
                let xs = x.slice(span(rows, inp));
                g.matmul_raw(QuantType::F32, &a, cfg.r, inp, &xs, k, self.lora_h)?;
                g.block_matmul(&*self.lora_h, &bt, k, 1, cfg.r, out, self.lora_d)?;
                let mut ys = y.slice_mut(span(rows, out));
                g.axpy(&mut ys, &*self.lora_d, cfg.scale(), k * out)?;
            }
        }
        Ok(())
    }
}

fn span(rows: &Range<usize>, width: usize) -> Range<usize> {
    rows.start * width..rows.end * width
}

/// LoRA on the LM head for one head pass: logits[j] += s·B(A normed[j]) for each row j of
/// `chunk` (the pass's token rows) whose sequence's adapter adapts the head (`Decoder::head_lora`,
/// the CPU's: A's product, Bᵀ's, then the scaled delta added). The rows go run by run of
/// consecutive rows of one group, in pieces `lora_d` holds, so that no row is gathered or
/// scattered.
#[allow(clippy::too_many_arguments)]
pub(super) fn head_lora(
    g: &Gpu,
    adapters: &HashMap<u64, GpuAdapter>,
    groups: &[AdapterGroup],
    chunk: &[u32],
    normed: &CudaSlice<f32>,
    logits: &mut CudaSlice<f32>,
    lora_h: &mut CudaSlice<f32>,
    lora_d: &mut CudaSlice<f32>,
) -> Result<(), ModelError> {
    for grp in groups {
        let (Some(m), Method::Lora(cfg)) =
            (grp.weights.layout.head(), &grp.weights.layout.config.method)
        else {
            continue;
        };
        let (h, vocab) = (m.in_dim, m.out_dim);
        let piece = (lora_d.len() / vocab).min(lora_h.len() / cfg.r.max(1));
        if piece == 0 {
            return Err(ModelError::Unsupported(format!(
                "LoRA rank {} on the GPU's LM head",
                cfg.r
            )));
        }
        let dev = &adapters[&grp.weights.uid()];
        let params = dev.params.as_ref().expect("LoRA keeps its parameters");
        let a_range = &m.tensors[0].range;
        let a = params.slice(a_range.start * 4..a_range.end * 4);
        let bt = dev
            .derived
            .slice(m.derived_offset..m.derived_offset + cfg.r * vocab);
        let mine = |j: usize| grp.rows.iter().any(|r| r.contains(&(chunk[j] as usize)));
        let mut j = 0;
        while j < chunk.len() {
            if !mine(j) {
                j += 1;
                continue;
            }
            let mut end = j + 1;
            while end < chunk.len() && end - j < piece && mine(end) {
                end += 1;
            }
            let k = end - j;
            let xs = normed.slice(j * h..end * h);
            g.matmul_raw(QuantType::F32, &a, cfg.r, h, &xs, k, lora_h)?;
            g.block_matmul(&*lora_h, &bt, k, 1, cfg.r, vocab, lora_d)?;
            let mut ys = logits.slice_mut(j * vocab..end * vocab);
            g.axpy(&mut ys, &*lora_d, cfg.scale(), k * vocab)?;
            j = end;
        }
    }
    Ok(())
}
