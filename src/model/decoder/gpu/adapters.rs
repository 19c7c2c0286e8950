//! Adapters on the GPU: each version's tensors copied once (and a slot of the directory that
//! decode graphs read, `AdapterRows`), and a projection through the step's adapters — group by
//! group in eager steps, row by row from the directory inside a decode graph — and LoRA on the LM
//! head.

use super::*;
use crate::adapter::ModuleLayout;
use flywheel_kernels::cuda::{CudaView, Q8Acts};
use flywheel_kernels::reference::int8_applies;

/// Adapter versions kept on the GPU beyond those the current step uses.
const ADAPTERS_KEPT: usize = 8;
/// Slots of the directory decode graphs read: versions a graph can serve at once (a version
/// without one is served by eager launches).
pub(super) const ADAPTER_SLOTS: usize = 32;
/// The largest LoRA rank the GPU runs (its `lora_h` rows).
pub(super) const LORA_MAX_R: usize = 256;

/// An adapter version on the GPU: its derived tensors (OFT's rotations, LoRA's Bᵀ) and, for
/// LoRA, its parameters as bytes (A is read as an f32 matrix).
pub(super) struct GpuAdapter {
    derived: CudaSlice<f32>,
    params: Option<CudaSlice<u8>>,
    last_step: u64,
    /// Its slot of the directory (`AdapterRows`), if one was free.
    slot: Option<usize>,
}

/// What a decode graph with adapters launches: per module (`AdapterLayout::modules`' index), 1 if
/// some version of the step rotates its input (OFT), 2 if some adds LoRA; and the largest LoRA
/// rank. Steps with the same signature replay one graph whatever versions their rows use.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) struct AdapterSig {
    modules: Vec<u8>,
    max_r: usize,
}

const OFT_BIT: u8 = 1;
const LORA_BIT: u8 = 2;

/// Each module's (inputs, outputs) in `AdapterLayout::modules`' order: every layer's targets,
/// then the LM head.
pub(super) fn module_dims(c: &super::super::DecoderConfig) -> Vec<(usize, usize)> {
    use crate::adapter::AdapterBase;
    let shape = c.adapter_shape();
    (0..c.num_layers)
        .flat_map(|_| Target::ALL)
        .chain([Target::Head])
        .map(|t| t.dims(&shape))
        .collect()
}

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
            let mut a = GpuAdapter {
                derived,
                params,
                last_step: self.step,
                slot: None,
            };
            // A slot of the directory for decode graphs; a version whose entries the directory
            // cannot hold (or with no slot free) is served by eager launches.
            if let Some(slot) = self.free_slots.pop() {
                match self.entries(w, &a) {
                    Ok(entries) => {
                        self.gpu.set_slot(&mut self.rowwise, slot, &entries)?;
                        a.slot = Some(slot);
                    }
                    Err(e) => {
                        self.free_slots.push(slot);
                        tracing::debug!("adapter version served eagerly on the GPU: {e}");
                    }
                }
            }
            self.adapters.insert(w.uid(), a);
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
                    if let Some(slot) = self.adapters.remove(&key).and_then(|a| a.slot) {
                        self.free_slots.push(slot);
                    }
                }
            }
        }
        Ok(())
    }

    /// A version's directory entries, one per module: its tensors' addresses on the GPU.
    fn entries(&self, w: &AdapterWeights, a: &GpuAdapter) -> Result<Vec<AdapterEntry>, ModelError> {
        let (g, rows) = (&self.gpu, &self.rowwise);
        let mut out = vec![AdapterEntry::default(); rows.modules()];
        for (i, m) in w.layout.modules.iter().enumerate() {
            let Some(m) = m else { continue };
            if i >= out.len() {
                return Err(ModelError::Gpu(format!(
                    "adapter module {i} of {}",
                    out.len()
                )));
            }
            let at = m.derived_offset;
            out[i] = match &w.layout.config.method {
                Method::Oft(o) => {
                    let b = o.block_size;
                    let r = a.derived.slice(at..at + m.in_dim * b);
                    g.oft_entry(rows, i, &r, b)?
                }
                Method::Lora(cfg) => {
                    let (am, bt) = a.lora(m, cfg.r);
                    g.lora_entry(rows, i, &am, &bt, cfg.r, cfg.scale())?
                }
            };
        }
        Ok(out)
    }

    /// The signature of a decode step's adapters, with each row's slot written for the graph
    /// (rows past the batch's: none); None where a version has no slot or a rank past the GPU's.
    pub(super) fn adapter_rows(
        &mut self,
        groups: &[AdapterGroup],
        n: usize,
    ) -> Result<Option<AdapterSig>, ModelError> {
        let mut sig = AdapterSig {
            modules: vec![0; self.rowwise.modules()],
            max_r: 0,
        };
        let mut slots = vec![-1i32; n];
        for grp in groups {
            let w = grp.weights;
            let Some(slot) = self.adapters[&w.uid()].slot else {
                return Ok(None);
            };
            let bit = match &w.layout.config.method {
                Method::Oft(_) => OFT_BIT,
                Method::Lora(cfg) => {
                    sig.max_r = sig.max_r.max(cfg.r);
                    LORA_BIT
                }
            };
            for (i, m) in w.layout.modules.iter().enumerate() {
                if m.is_some() {
                    sig.modules[i] |= bit;
                }
            }
            for r in &grp.rows {
                for t in r.clone() {
                    slots[t] = slot as i32;
                }
            }
        }
        if sig.max_r > LORA_MAX_R {
            return Ok(None);
        }
        self.gpu.set_rows(&mut self.rowwise, &slots)?;
        Ok(Some(sig))
    }
}

/// A decode graph's adapters: the directory and the signature the graph was captured for.
#[derive(Clone, Copy)]
pub(super) struct Rowwise<'a> {
    pub(super) rows: &'a AdapterRows,
    pub(super) sig: &'a AdapterSig,
}

impl Rowwise<'_> {
    fn bits(&self, m: usize) -> u8 {
        self.sig.modules.get(m).copied().unwrap_or(0)
    }

    /// logits (n, vocab) += s·B(A normed) for the rows whose version adapts the LM head.
    pub(super) fn head(
        &self,
        g: &Gpu,
        n: usize,
        normed: &CudaSlice<f32>,
        lora_h: &mut CudaSlice<f32>,
        logits: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        let m = self.rows.modules() - 1;
        if self.bits(m) & LORA_BIT == 0 {
            return Ok(());
        }
        g.lora_rows(self.rows, m, normed, n, self.sig.max_r, lora_h, logits)
    }
}

impl GpuAdapter {
    /// A LoRA module's A (r × in f32, as bytes) and Bᵀ (r × out) in this version's buffers.
    fn lora(&self, m: &ModuleLayout, r: usize) -> (CudaView<'_, u8>, CudaView<'_, f32>) {
        let params = self.params.as_ref().expect("LoRA keeps its parameters");
        let a = &m.tensors[0].range;
        let at = m.derived_offset;
        (
            params.slice(a.start * 4..a.end * 4),
            self.derived.slice(at..at + r * m.out_dim),
        )
    }
}

fn f32_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and every byte pattern is a valid u8.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
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
    /// Inside a decode graph: the adapters row by row from the directory (`groups` is empty).
    pub(super) rowwise: Option<Rowwise<'a>>,
    /// Int8 decoders: where inputs are quantized, and whose unrotated input it holds now.
    pub(super) q8: Option<&'a mut Q8Acts>,
    pub(super) q8_holds: Option<Target>,
}

/// The base's product y = x · Wᵀ: in int8 where the decoder runs int8 (`q8`) and the CPU would
/// (`int8_applies`: the format and width), else in f32. K and V take the quantized input Q left,
/// Up the one Gate left (`holds`), when theirs is the same unrotated input (the body's order: q,
/// k, v of one normed x; gate, up of another): the bits of quantizing it again.
#[allow(clippy::too_many_arguments)]
fn base(
    g: &Gpu,
    q8: Option<&mut Q8Acts>,
    holds: &mut Option<Target>,
    target: Target,
    w: &DeviceMatrix,
    x: &CudaSlice<f32>,
    rotated: bool,
    n: usize,
    y: &mut CudaSlice<f32>,
) -> Result<(), ModelError> {
    let Some(q) = q8.filter(|_| int8_applies(w.ty, w.cols)) else {
        return Ok(g.matmul(w, x, n, y)?);
    };
    let shares = match target {
        Target::K | Target::V => Some(Target::Q),
        Target::Up => Some(Target::Gate),
        _ => None,
    };
    if rotated || shares.is_none_or(|s| *holds != Some(s)) || q.holds() != (n, w.cols) {
        g.quantize_q8(x, n, w.cols, q)?;
        *holds = (!rotated).then_some(target);
    }
    Ok(g.matmul_int8(w, q, y)?)
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
        if let Some(rw) = self.rowwise {
            // The module's index in `AdapterLayout::modules`: layer by layer, target by target.
            let m = self.l * NUM_TARGETS + target.index();
            let bits = rw.bits(m);
            if bits & OFT_BIT != 0 {
                g.oft_rows(rw.rows, m, x, n, self.rotated)?;
                let (q8, holds) = (self.q8.as_deref_mut(), &mut self.q8_holds);
                base(g, q8, holds, target, w, self.rotated, true, n, y)?;
            } else {
                let (q8, holds) = (self.q8.as_deref_mut(), &mut self.q8_holds);
                base(g, q8, holds, target, w, x, false, n, y)?;
            }
            if bits & LORA_BIT != 0 {
                g.lora_rows(rw.rows, m, x, n, rw.sig.max_r, self.lora_h, y)?;
            }
            return Ok(());
        }
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
            let (q8, holds) = (self.q8.as_deref_mut(), &mut self.q8_holds);
            base(g, q8, holds, target, w, self.rotated, true, n, y)?;
        } else {
            let (q8, holds) = (self.q8.as_deref_mut(), &mut self.q8_holds);
            base(g, q8, holds, target, w, x, false, n, y)?;
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
            let (a, bt) = self.adapters[&grp.weights.uid()].lora(m, cfg.r);
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
        let (a, bt) = adapters[&grp.weights.uid()].lora(m, cfg.r);
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
