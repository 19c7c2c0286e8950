//! The mixture-of-experts MLP (Qwen3-MoE): a router (experts × hidden) scores each token, the
//! softmax's `used` largest experts run on it (renormalised to sum to one where the model says),
//! and the token's output is the weighted sum of their SwiGLU outputs.
//!
//! The expert products are grouped by expert: the rows routed to an expert are gathered and run
//! as one product over that expert's quantized weights (each active expert's weights read once
//! per batch, dequantized a tile at a time inside the kernel, never as a whole), all experts'
//! products in one parallel region. Every row's arithmetic (routing, products, the weighted sum
//! in the order of the token's choices) is the same whatever shares its batch, so the result is
//! batch-invariant to the bit like the dense MLP.
//!
//! Backward: the experts are frozen; the gradient reaches the MLP's input through each chosen
//! expert (dx = the expert's products' transposes) and through the routing weights (the router
//! is frozen, but its softmax weights the experts' outputs: dz = the softmax's Jacobian times
//! ⟨dy, expert output⟩, then dx += dz · W_router).

use super::{Decoder, Experts, MoeConfig, Weight};
use flywheel_kernels::{Cpu, Matmul};

/// One token's choice: the expert and its weight in the token's output.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Choice {
    pub expert: u32,
    pub weight: f32,
}

/// What the MoE forward computed, kept for the backward (and reused as scratch by serving).
#[derive(Default)]
pub(super) struct MoeActs {
    /// T × experts: the router's softmax.
    pub probs: Vec<f32>,
    /// T × used: each token's choices, best first.
    pub choices: Vec<Choice>,
    /// The (token, slot) of each expert row, grouped by expert in expert order.
    pub rows: Vec<(u32, u32)>,
    /// Rows routed to each expert.
    pub counts: Vec<usize>,
    /// Expert rows × hidden: the gathered inputs.
    pub xs: Vec<f32>,
    /// Expert rows × expert_ffn: gate and up products, and SwiGLU of them.
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    pub act: Vec<f32>,
    /// Expert rows × hidden: each expert's output for the row.
    pub out: Vec<f32>,
    /// The grouped row of each (token, slot): the inverse of `rows`.
    pub row_of: Vec<usize>,
}

impl MoeActs {
    pub fn bytes(c: &MoeConfig, hidden: usize, t: usize) -> usize {
        let rows = t * c.used;
        (t * c.experts + rows * (5 + 2 * hidden + 3 * c.expert_ffn)) * 4
    }
}

/// The rows routed to each expert, as ranges of the grouped rows.
pub(super) fn ranges(
    counts: &[usize],
) -> impl Iterator<Item = (usize, std::ops::Range<usize>)> + '_ {
    let mut at = 0;
    counts.iter().enumerate().filter_map(move |(e, &n)| {
        let r = at..at + n;
        at += n;
        (n > 0).then_some((e, r))
    })
}

impl Decoder {
    /// y (T, hidden) = the mixture of experts of `m` (T, hidden); `a` receives what the backward
    /// needs (its buffers are reused from call to call).
    pub(super) fn moe_forward(
        &self,
        cpu: &Cpu,
        x: &Experts,
        m: &[f32],
        y: &mut [f32],
        a: &mut MoeActs,
    ) {
        let c = self.config.moe.expect("a MoE layer has a MoE config");
        let h = self.config.hidden;
        let (ne, k, f) = (c.experts, c.used, c.expert_ffn);
        let t = m.len() / h;
        a.probs.resize(t * ne, 0.0);
        cpu.matmul(x.router.ty, self.bytes(&x.router), ne, h, m, &mut a.probs);
        route(&c, t, a);
        let n = t * k;
        a.xs.resize(n * h, 0.0);
        for (r, &(tok, _)) in a.rows.iter().enumerate() {
            let tok = tok as usize;
            a.xs[r * h..(r + 1) * h].copy_from_slice(&m[tok * h..(tok + 1) * h]);
        }
        a.gate.resize(n * f, 0.0);
        a.up.resize(n * f, 0.0);
        a.act.resize(n * f, 0.0);
        a.out.resize(n * h, 0.0);
        // Every active expert's gate and up products in one parallel region, then its down.
        {
            let mut jobs = Vec::new();
            let (mut gs, mut us) = (&mut a.gate[..], &mut a.up[..]);
            for (e, r) in ranges(&a.counts) {
                let (g, g_rest) = std::mem::take(&mut gs).split_at_mut(r.len() * f);
                let (u, u_rest) = std::mem::take(&mut us).split_at_mut(r.len() * f);
                (gs, us) = (g_rest, u_rest);
                let xe = &a.xs[r.start * h..r.end * h];
                jobs.push(self.expert_job(&x.gate[e], xe, g));
                jobs.push(self.expert_job(&x.up[e], xe, u));
            }
            cpu.matmul_many(&mut jobs);
        }
        cpu.swiglu(&a.gate, &a.up, &mut a.act);
        {
            let mut jobs = Vec::new();
            let mut os = &mut a.out[..];
            for (e, r) in ranges(&a.counts) {
                let (o, rest) = std::mem::take(&mut os).split_at_mut(r.len() * h);
                os = rest;
                jobs.push(self.expert_job(&x.down[e], &a.act[r.start * f..r.end * f], o));
            }
            cpu.matmul_many(&mut jobs);
        }
        // Each token's output: its experts' outputs weighted, summed in the order of its choices.
        for (tok, yt) in y.chunks_mut(h).enumerate().take(t) {
            yt.fill(0.0);
            for s in 0..k {
                let w = a.choices[tok * k + s].weight;
                let r = a.row_of[tok * k + s];
                for (o, v) in yt.iter_mut().zip(&a.out[r * h..(r + 1) * h]) {
                    *o += w * v;
                }
            }
        }
    }

    fn expert_job<'a>(&'a self, w: &'a Weight, x: &'a [f32], y: &'a mut [f32]) -> Matmul<'a> {
        Matmul {
            ty: w.ty,
            w: self.bytes(w),
            rows: w.rows,
            cols: w.cols,
            x,
            y,
        }
    }

    /// dL/dm (T, hidden) of the MoE of `m` given dL/dy (`dy`), from what its forward kept.
    pub(super) fn moe_backward(&self, cpu: &Cpu, x: &Experts, a: &MoeActs, dy: &[f32]) -> Vec<f32> {
        let c = self.config.moe.expect("a MoE layer has a MoE config");
        let h = self.config.hidden;
        let (ne, k, f) = (c.experts, c.used, c.expert_ffn);
        let t = dy.len() / h;
        let mut dm = vec![0.0f32; t * h];
        // Through each expert: its rows' output gradient is the token's, times its weight.
        let mut dz = vec![0.0f32; t * ne];
        let mut dots = vec![0.0f32; t * k];
        for (e, r) in ranges(&a.counts) {
            let n = r.len();
            let mut dout = vec![0.0f32; n * h];
            for (i, &(tok, slot)) in a.rows[r.clone()].iter().enumerate() {
                let (tok, slot) = (tok as usize, slot as usize);
                let w = a.choices[tok * k + slot].weight;
                let g = &dy[tok * h..(tok + 1) * h];
                let o = &a.out[(r.start + i) * h..(r.start + i + 1) * h];
                dots[tok * k + slot] = g.iter().zip(o).map(|(p, q)| p * q).sum();
                for (d, v) in dout[i * h..(i + 1) * h].iter_mut().zip(g) {
                    *d = w * v;
                }
            }
            let fr = r.start * f..r.end * f;
            let mut dact = vec![0.0f32; n * f];
            let down = &x.down[e];
            cpu.linear_backward(down.ty, self.bytes(down), h, f, &dout, &mut dact);
            let (mut dg, mut du) = (vec![0.0f32; n * f], vec![0.0f32; n * f]);
            cpu.swiglu_backward(&a.gate[fr.clone()], &a.up[fr], &dact, &mut dg, &mut du);
            let (mut dx, mut dxu) = (vec![0.0f32; n * h], vec![0.0f32; n * h]);
            let (gw, uw) = (&x.gate[e], &x.up[e]);
            cpu.linear_backward(gw.ty, self.bytes(gw), f, h, &dg, &mut dx);
            cpu.linear_backward(uw.ty, self.bytes(uw), f, h, &du, &mut dxu);
            for (i, &(tok, _)) in a.rows[r].iter().enumerate() {
                let tok = tok as usize;
                let src = dx[i * h..(i + 1) * h].iter().zip(&dxu[i * h..(i + 1) * h]);
                for (d, (p, q)) in dm[tok * h..(tok + 1) * h].iter_mut().zip(src) {
                    *d += p + q;
                }
            }
        }
        // Through the routing weights into the router's logits.
        for tok in 0..t {
            let ch = &a.choices[tok * k..(tok + 1) * k];
            let g = &dots[tok * k..(tok + 1) * k];
            let z = &mut dz[tok * ne..(tok + 1) * ne];
            // Σ_s w_s g_s: the weights' own softmax (renormalised: over the chosen experts;
            // else over all of them, each chosen weight its probability).
            let wg: f32 = ch.iter().zip(g).map(|(c, g)| c.weight * g).sum();
            if c.norm_topk {
                for (c, g) in ch.iter().zip(g) {
                    z[c.expert as usize] = c.weight * (g - wg);
                }
            } else {
                let p = &a.probs[tok * ne..(tok + 1) * ne];
                for (j, zj) in z.iter_mut().enumerate() {
                    *zj = -p[j] * wg;
                }
                for (c, g) in ch.iter().zip(g) {
                    z[c.expert as usize] += c.weight * g;
                }
            }
        }
        let mut dr = vec![0.0f32; t * h];
        let rw = &x.router;
        cpu.linear_backward(rw.ty, self.bytes(rw), ne, h, &dz, &mut dr);
        dm.iter_mut().zip(&dr).for_each(|(a, b)| *a += b);
        dm
    }
}

/// Route `t` tokens by their router logits in `a.probs` (T × experts; turned into the softmax):
/// each token's `used` largest experts (the lower index first on a tie), their weights
/// renormalised where the model says, and the rows grouped by expert (`group`).
pub(super) fn route(c: &MoeConfig, t: usize, a: &mut MoeActs) {
    let (ne, k) = (c.experts, c.used);
    debug_assert_eq!(a.probs.len(), t * ne);
    a.choices.clear();
    for p in a.probs.chunks_mut(ne) {
        softmax(p);
        let first = a.choices.len();
        for _ in 0..k {
            let mut best: Option<usize> = None;
            for (e, &v) in p.iter().enumerate() {
                let taken = a.choices[first..].iter().any(|ch| ch.expert as usize == e);
                if !taken && best.is_none_or(|b| v > p[b]) {
                    best = Some(e);
                }
            }
            let e = best.expect("k <= experts");
            a.choices.push(Choice {
                expert: e as u32,
                weight: p[e],
            });
        }
        if c.norm_topk {
            let chosen = &mut a.choices[first..];
            let sum: f32 = chosen.iter().map(|ch| ch.weight).sum();
            chosen.iter_mut().for_each(|ch| ch.weight /= sum);
        }
    }
    group(c, t, a);
}

/// Group the rows of `t` tokens' choices (`a.choices`, `used` a token) by expert, tokens in order
/// within an expert (`rows`, `row_of`, `counts`). The CPU and the GPU forward share it (the GPU's
/// choices come from its own router, `fw_moe_route`).
pub(super) fn group(c: &MoeConfig, t: usize, a: &mut MoeActs) {
    let (ne, k) = (c.experts, c.used);
    debug_assert_eq!(a.choices.len(), t * k);
    a.counts.clear();
    a.counts.resize(ne, 0);
    for ch in &a.choices {
        a.counts[ch.expert as usize] += 1;
    }
    // Each choice's grouped row: its expert's first row plus the choices before it there
    // (no allocation: the buffers are reused from call to call, as on the serving path).
    a.rows.clear();
    a.rows.resize(t * k, (0, 0));
    a.row_of.clear();
    a.row_of.resize(t * k, 0);
    let mut first = 0;
    for e in 0..ne {
        let n = a.counts[e];
        a.counts[e] = first;
        first += n;
    }
    for (i, ch) in a.choices.iter().enumerate() {
        let e = ch.expert as usize;
        let r = a.counts[e];
        a.rows[r] = ((i / k) as u32, (i % k) as u32);
        a.row_of[i] = r;
        a.counts[e] += 1;
    }
    // `counts[e]` is now the end of expert e's rows: back to the counts.
    let mut start = 0;
    for e in 0..ne {
        let end = a.counts[e];
        a.counts[e] = end - start;
        start = end;
    }
}

/// Softmax of a row in place (f32, in order).
fn softmax(p: &mut [f32]) {
    let max = p.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for v in p.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    p.iter_mut().for_each(|v| *v /= sum);
}
