//! A layer's projections sharing one input, each through the adapters of the batch's groups:
//! OFT rotates a group's rows of the input first, LoRA adds s·B(A x) to a group's rows after; the
//! base products run as one parallel region, without allocating (the serving hot path).

use super::*;

impl Decoder {
    /// The projections of layer `l` that share the input `x` (T, in), as one parallel region of
    /// base products, each through the adapters of `groups`: OFT groups' rows of the input are
    /// rotated first (into scratch, one input per projection), LoRA deltas are added after.
    pub fn project(
        &self,
        cpu: &Cpu,
        l: usize,
        x: &[f32],
        jobs: &mut [Projection],
        groups: &[AdapterGroup],
        scratch: &mut AdapterScratch,
    ) {
        let in_dim = jobs[0].weight.cols;
        let t = x.len() / in_dim;
        let jobs_len = jobs.len();
        // OFT: a rotated copy of the input for each projection some group rotates.
        assert!(jobs.len() <= 3, "at most three projections share an input");
        let mut rotated = [false; 3];
        for (j, p) in jobs.iter().enumerate() {
            for g in groups {
                let Method::Oft(o) = &g.weights.layout.config.method else {
                    continue;
                };
                let Some(m) = g.weights.layout.module(l, p.target) else {
                    continue;
                };
                let buf = &mut scratch.rotated[j];
                if !rotated[j] {
                    rotated[j] = true;
                    buf.resize(t * in_dim, 0.0);
                    buf.copy_from_slice(x);
                }
                for rows in &g.rows {
                    let span = rows.start * in_dim..rows.end * in_dim;
                    let r = g.weights.derived(m);
                    cpu.oft_rotate(&x[span.clone()], r, o.block_size, &mut buf[span]);
                }
            }
        }
        {
            // One parallel region for the projections, without allocating (engine hot path).
            let rot = &scratch.rotated;
            let mut mm = jobs.iter_mut().enumerate().map(|(j, p)| Matmul {
                ty: p.weight.ty,
                w: self.bytes(p.weight),
                rows: p.weight.rows,
                cols: p.weight.cols,
                x: if rotated[j] { &rot[j] } else { x },
                y: &mut *p.y,
            });
            let mut next = || mm.next().expect("counted");
            match jobs_len {
                1 => cpu.matmul_many(&mut [next()]),
                2 => cpu.matmul_many(&mut [next(), next()]),
                _ => cpu.matmul_many(&mut [next(), next(), next()]),
            }
        }
        // LoRA: y[rows] += s·B(A x[rows]), one gathered product per group and projection.
        for p in jobs.iter_mut() {
            for g in groups {
                let Method::Lora(cfg) = &g.weights.layout.config.method else {
                    continue;
                };
                let Some(m) = g.weights.layout.module(l, p.target) else {
                    continue;
                };
                let s = &mut scratch.lora;
                s.x.clear();
                for rows in &g.rows {
                    s.x.extend_from_slice(&x[rows.start * in_dim..rows.end * in_dim]);
                }
                lora::delta(
                    cpu,
                    g.weights.tensor(&m.tensors[0]),
                    g.weights.derived(m),
                    cfg.r,
                    cfg.scale(),
                    &s.x,
                    &mut s.h,
                    &mut s.d,
                );
                let out = m.out_dim;
                let mut i = 0;
                for rows in &g.rows {
                    let ys = &mut p.y[rows.start * out..rows.end * out];
                    let ds = &s.d[i * out..(i + rows.len()) * out];
                    add_in_place(ys, ds);
                    i += rows.len();
                }
            }
        }
    }
}

impl Decoder {
    /// LoRA on the LM head: logits[j] += s·B(A normed[j]) for the logit rows `rows` (positions in
    /// `normed`/`logits`) of one adapter version, before any soft-cap. Serving (per group of a
    /// mixed batch) and training (per chunk) both add it through here: the same bits.
    pub(crate) fn head_lora(
        &self,
        cpu: &Cpu,
        adapter: &AdapterWeights,
        rows: &[usize],
        normed: &[f32],
        logits: &mut [f32],
        s: &mut LoraScratch,
    ) {
        let (Some(m), Method::Lora(cfg)) = (adapter.layout.head(), &adapter.layout.config.method)
        else {
            return;
        };
        let (h, vocab) = (m.in_dim, m.out_dim);
        s.x.clear();
        for &j in rows {
            s.x.extend_from_slice(&normed[j * h..(j + 1) * h]);
        }
        lora::delta(
            cpu,
            adapter.tensor(&m.tensors[0]),
            adapter.derived(m),
            cfg.r,
            cfg.scale(),
            &s.x,
            &mut s.h,
            &mut s.d,
        );
        for (i, &j) in rows.iter().enumerate() {
            add_in_place(
                &mut logits[j * vocab..(j + 1) * vocab],
                &s.d[i * vocab..(i + 1) * vocab],
            );
        }
    }
}
