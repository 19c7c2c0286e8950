//! The GPU forward's pieces below a layer: a mixture of experts, attention over the cache, the
//! residual with its optional post-norm; and after the layers, the output norm and the LM head.

use super::*;
use flywheel_kernels::cuda::Q8Acts;
use flywheel_kernels::reference::{int8_applies, AttnOpts};

/// One layer's experts on the GPU.
pub(super) struct Experts<'a> {
    pub(super) router: &'a DeviceMatrix,
    pub(super) gate: &'a [DeviceMatrix],
    pub(super) up: &'a [DeviceMatrix],
    pub(super) down: &'a [DeviceMatrix],
    /// With the gate's, up's and down's expert tables: route on the device (decode steps).
    pub(super) tables: Option<&'a [ExpertTable; 3]>,
}

impl Experts<'_> {
    /// y (n, h) = the mixture of experts of m (n, h), routed on the device (`fw_moe_route`) in
    /// every step, so that a token's experts and weights are the same bits whichever step
    /// computes it (a prefill, a decode graph, the trainer's forward). With the expert tables
    /// (decode steps): each (token, choice) row's expert product row by row, nothing read back
    /// (graphs hold it). Else: the choices read back and grouped by expert on the host
    /// (`moe::group`, the CPU's), the rows gathered by expert, each expert's rows one product per
    /// projection (each row the bits of the row-by-row product). Then each token's outputs
    /// weighted in the order of its choices. `q8` (int8
    /// decoders): the router's and experts' products in int8 where the CPU's are (their formats
    /// and widths), each row the bits of its expert's int8 product.
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
        mut q8: Option<&mut Q8Acts>,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), ModelError> {
        let (ne, k, f) = (mc.experts, mc.used, mc.expert_ffn);
        // Int8 decoders: each product in int8 where the CPU's would be (its format and width).
        let int8 = |ty: QuantType, cols: usize| q8.is_some() && int8_applies(ty, cols);
        let (router, gate8, up8, down8) = (
            int8(self.router.ty, h),
            int8(self.gate[0].ty, h),
            int8(self.up[0].ty, h),
            int8(self.down[0].ty, f),
        );
        // The router's input quantized serves the gate's and up's rows routed on the device.
        if router || ((gate8 || up8) && self.tables.is_some()) {
            g.quantize_q8(m, n, h, q8.as_deref_mut().expect("int8"))?;
        }
        if router {
            g.matmul_int8(self.router, q8.as_deref().expect("int8"), &mut b.logits)?;
        } else {
            g.matmul(self.router, m, n, &mut b.logits)?;
        }
        // Each token's choices: `b.tok` holds their experts, `b.weight` their weights (t·k + s),
        // `b.row_of` the outputs in the order of the choices (t·k + s). More experts a token than
        // the router kernel keeps: routed on the host in every step instead (`moe::route`, the
        // CPU's; no expert tables, no graphs), so every step still routes alike.
        let on_device = k <= MOE_MAX_USED;
        if on_device {
            g.moe_route(
                &b.logits,
                n,
                ne,
                k,
                mc.norm_topk,
                &mut b.tok,
                &mut b.weight,
                &mut b.row_of,
            )?;
        }
        if let Some([gt, ut, dt]) = self.tables {
            // On the device: each (token, choice) row its expert's product.
            for (t, out, on) in [(gt, &mut b.gate, gate8), (ut, &mut b.up, up8)] {
                match q8.as_deref() {
                    Some(q) if on => g.matmul_experts_int8(t, &b.tok, n * k, q, k, out)?,
                    _ => g.matmul_experts(t, &b.tok, n * k, m, k, out)?,
                }
            }
            g.swiglu(&b.gate, &b.up, n * k * f, &mut b.act)?;
            match q8.as_deref_mut() {
                Some(q) if down8 => {
                    g.quantize_q8(&b.act, n * k, f, q)?;
                    g.matmul_experts_int8(dt, &b.tok, n * k, q, 1, &mut b.out)?;
                }
                _ => g.matmul_experts(dt, &b.tok, n * k, &b.act, 1, &mut b.out)?,
            }
            g.moe_combine(&b.out, &b.row_of, &b.weight, n, k, h, y)?;
            return Ok(());
        }
        if on_device {
            // The choices read back and grouped by expert here; the weights stay as routed.
            let (mut experts, mut weights) = (vec![0u32; n * k], vec![0f32; n * k]);
            g.read_into(&b.tok.slice(..n * k), &mut experts)?;
            g.read_into(&b.weight.slice(..n * k), &mut weights)?;
            host.choices.clear();
            host.choices.extend(
                experts
                    .iter()
                    .zip(&weights)
                    .map(|(&expert, &weight)| Choice { expert, weight }),
            );
            check_experts(&host.choices, ne)?;
            group(mc, n, host);
        } else {
            host.probs.resize(n * ne, 0.0);
            g.read_into(&b.logits.slice(..n * ne), &mut host.probs)?;
            route(mc, n, host);
            let weight: Vec<f32> = host.choices.iter().map(|ch| ch.weight).collect();
            g.write(&weight, &mut b.weight)?;
        }
        let tok: Vec<u32> = host.rows.iter().map(|&(t, _)| t).collect();
        let row_of: Vec<u32> = host.row_of.iter().map(|&r| r as u32).collect();
        g.write(&tok, &mut b.tok)?;
        g.write(&row_of, &mut b.row_of)?;
        g.gather_rows(m, &b.tok, n * k, h, &mut b.xs)?;
        if gate8 || up8 {
            g.quantize_q8(&b.xs, n * k, h, q8.as_deref_mut().expect("int8"))?;
        }
        for (e, r) in ranges(&host.counts) {
            let span = r.start * f..r.end * f;
            let xs = b.xs.slice(r.start * h..r.end * h);
            for (w, out, on) in [
                (&self.gate[e], &mut b.gate, gate8),
                (&self.up[e], &mut b.up, up8),
            ] {
                let mut o = out.slice_mut(span.clone());
                match q8.as_deref() {
                    Some(q) if on => g.matmul_int8_range(w, q, r.clone(), &mut o)?,
                    _ => g.matmul(w, &xs, r.len(), &mut o)?,
                }
            }
        }
        g.swiglu(&b.gate, &b.up, n * k * f, &mut b.act)?;
        if down8 {
            g.quantize_q8(&b.act, n * k, f, q8.as_deref_mut().expect("int8"))?;
        }
        for (e, r) in ranges(&host.counts) {
            let mut out = b.out.slice_mut(r.start * h..r.end * h);
            match q8.as_deref() {
                Some(q) if down8 => g.matmul_int8_range(&self.down[e], q, r, &mut out)?,
                _ => {
                    let act = b.act.slice(r.start * f..r.end * f);
                    g.matmul(&self.down[e], &act, r.len(), &mut out)?
                }
            }
        }
        g.moe_combine(&b.out, &b.row_of, &b.weight, n, k, h, y)?;
        Ok(())
    }
}

/// Every choice's expert one of the layer's `ne` (the router kernel's output, read back).
fn check_experts(choices: &[Choice], ne: usize) -> Result<(), ModelError> {
    match choices.iter().find(|c| c.expert as usize >= ne) {
        Some(c) => Err(ModelError::Gpu(format!(
            "the router chose expert {} of {ne}",
            c.expert
        ))),
        None => Ok(()),
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

/// x += y, or x += RMSNorm(y)·w through `n_buf` where the family norms a block's output (Gemma
/// 3's post-norms); then, with `next`, n_buf = RMSNorm(x)·next (the next block's norm). Without a
/// post-norm the two run as one launch (`add_rmsnorm`: the same bits as the two kernels).
pub(super) fn residual_then_norm(
    g: &Gpu,
    x: &mut CudaSlice<f32>,
    y: &CudaSlice<f32>,
    n_buf: &mut CudaSlice<f32>,
    post_norm: &Option<CudaSlice<f32>>,
    next: Option<&CudaSlice<f32>>,
    (eps, n, h): (f32, usize, usize),
) -> Result<(), GpuError> {
    match (post_norm, next) {
        (None, Some(w)) => return g.add_rmsnorm(x, y, w, eps, n, n_buf),
        (None, None) => g.add(x, y, n * h)?,
        (Some(w), _) => {
            g.rmsnorm(y, w, eps, n, n_buf)?;
            g.add(x, &*n_buf, n * h)?;
        }
    }
    if let Some(w) = next {
        g.rmsnorm(&*x, w, eps, n, n_buf)?;
    }
    Ok(())
}

impl GpuDecoder {
    /// normed (rows.len(), hidden) = the output norm of the rows `rows` of x.
    pub(super) fn final_norm(&mut self, model: &Decoder, rows: &[u32]) -> Result<(), ModelError> {
        self.gpu.write(rows, &mut self.acts.rows)?;
        self.norm_rows(model, rows.len())
    }

    /// normed = the output norm of the first m rows named in `acts.rows`.
    pub(super) fn norm_rows(&mut self, model: &Decoder, m: usize) -> Result<(), ModelError> {
        let (c, a, g) = (&model.config, &mut self.acts, &self.gpu);
        g.gather_rows(&a.x, &a.rows, m, c.hidden, &mut a.xs)?;
        g.rmsnorm(&a.xs, &self.output_norm, c.eps, m, &mut a.normed)?;
        Ok(())
    }

    /// logits (m, vocab) = normed · Woutᵀ.
    pub(super) fn head(&mut self, m: usize) -> Result<(), ModelError> {
        let w = self.output.as_ref().unwrap_or(&self.embd);
        self.gpu
            .matmul(w, &self.acts.normed, m, &mut self.acts.logits)?;
        Ok(())
    }
}
