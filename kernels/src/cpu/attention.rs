//! Causal grouped-query attention over the paged KV cache (K transposed per block, V row-major;
//! see `reference::PagedKv`), generic over the ISA, with its twin in `reference`. Each query's
//! result is computed the same way whatever else is in the batch.

use super::isa::Isa;
use super::job::scratch as thread_scratch;
use super::ops::{exp_shifted, max_of};
use super::pool::Tasks;
use super::simd::{Avx2, Avx512, Simd};
use crate::reference::{self, AttnOpts, AttnSeq, KvElem, PagedKv, F16};
use std::cell::RefCell;

thread_local! {
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

const QUERIES_PER_TASK: usize = 16;

/// A KV element the SIMD kernels load: f32 as it is, halves widened (F16C).
pub trait KvLoad: KvElem {
    /// # Safety
    /// `p` must point at `S::LANES` readable elements; the CPU must have `S`'s ISA.
    unsafe fn load<S: Simd>(p: *const Self) -> S::V;
}

impl KvLoad for f32 {
    #[inline(always)]
    unsafe fn load<S: Simd>(p: *const f32) -> S::V {
        S::load(p)
    }
}

impl KvLoad for F16 {
    #[inline(always)]
    unsafe fn load<S: Simd>(p: *const F16) -> S::V {
        S::load_f16(p as *const u8)
    }
}

struct AttnArgs<'a, E: KvElem> {
    q: *const f32,
    out: *mut f32,
    kv: PagedKv<'a, E>,
    n_heads: usize,
    group: usize,
    head_dim: usize,
    scale: f32,
    /// Keys a query sees: its own position and the `window − 1` before it (usize::MAX: all).
    window: usize,
    /// Soft-capping of the scaled scores (`reference::softcap`).
    softcap: Option<f32>,
}
unsafe impl<E: KvElem> Sync for AttnArgs<'_, E> {}

/// Soft-caps scores in place (`reference::softcap`, scalar: the same bits on every path).
#[inline(always)]
unsafe fn cap_scores(p: *mut f32, n: usize, cap: Option<f32>) {
    if let Some(c) = cap {
        for x in std::slice::from_raw_parts_mut(p, n) {
            *x = reference::softcap(*x, c);
        }
    }
}

/// The first key position a query at `pos` sees through a sliding window of `window` keys.
#[inline(always)]
fn first_key(pos: usize, window: usize) -> usize {
    (pos + 1).saturating_sub(window)
}

/// Causal grouped-query attention over paged KV; q and out are (num_tokens, n_heads * head_dim).
/// With a window, a query at position p sees keys p − window + 1 ..= p (a sliding-window layer);
/// with a soft-cap, the scaled scores are capped before the softmax (`AttnOpts`).
#[allow(clippy::too_many_arguments)]
pub fn attention<E: KvLoad>(
    isa: Isa,
    pool: Tasks,
    q: &[f32],
    out: &mut [f32],
    seqs: &[AttnSeq],
    kv: PagedKv<E>,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    scale: f32,
    opts: AttnOpts,
) {
    let window = opts.window;
    assert_eq!(q.len(), out.len());
    assert!(window != Some(0), "a window holds at least one key");
    assert_eq!(n_heads % n_kv_heads, 0);
    let qdim = n_heads * head_dim;
    for s in seqs {
        assert!(
            (s.q_start + s.q_len) * qdim <= q.len(),
            "sequence rows out of range"
        );
        let n_ctx = s.first_pos + s.q_len;
        assert!(
            n_ctx.div_ceil(kv.block_size) <= s.block_table.len(),
            "block table too short"
        );
    }
    if isa == Isa::Reference {
        reference::attention_windowed(q, out, seqs, kv, n_heads, n_kv_heads, head_dim, scale, opts);
        return;
    }
    let args = AttnArgs {
        q: q.as_ptr(),
        out: out.as_mut_ptr(),
        kv,
        n_heads,
        group: n_heads / n_kv_heads,
        head_dim,
        scale,
        window: window.unwrap_or(usize::MAX),
        softcap: opts.softcap,
    };
    let l = isa.lanes();
    let grouped = kv.block_size.is_multiple_of(l)
        && head_dim.is_multiple_of(l)
        && matches!(head_dim / l, 1 | 2 | 3 | 4 | 6 | 8);
    // Heads per task: the query heads sharing one KV head are scored together (up to 4, and at
    // most 24 V accumulators), so each K and V load serves all of them. Other shapes (block
    // sizes or head dims that are not whole vectors) take the scalar fallback.
    let heads_per_task = if grouped {
        args.group.min(4).min((24 / (head_dim / l)).max(1))
    } else {
        1
    };
    let chunks_per_kv = args.group.div_ceil(heads_per_task);
    let num_head_chunks = n_kv_heads * chunks_per_kv;
    // Tasks: (sequence, head chunk, chunk of queries).
    let mut first = Vec::with_capacity(seqs.len() + 1);
    first.push(0usize);
    for s in seqs {
        let per_chunk = s.q_len.div_ceil(QUERIES_PER_TASK);
        first.push(first.last().copied().unwrap_or(0) + per_chunk * num_head_chunks);
    }
    let total = *first.last().unwrap_or(&0);
    let task = |t: usize| {
        let si = first.partition_point(|&f| f <= t) - 1;
        let s = &seqs[si];
        let local = t - first[si];
        let per_chunk = s.q_len.div_ceil(QUERIES_PER_TASK);
        let (hc, c) = (local / per_chunk, local % per_chunk);
        let i0 = c * QUERIES_PER_TASK;
        let i1 = (i0 + QUERIES_PER_TASK).min(s.q_len);
        let (kvh, sub) = (hc / chunks_per_kv, hc % chunks_per_kv);
        let h0 = kvh * args.group + sub * heads_per_task;
        let g = heads_per_task.min((kvh + 1) * args.group - h0);
        // SAFETY: ISA detected; each task writes its own (rows, heads) slots of out.
        unsafe {
            match (isa, grouped) {
                (Isa::Avx512, true) => attn_grouped_avx512(&args, s, h0, g, i0, i1),
                (Isa::Avx2, true) => attn_grouped_avx2(&args, s, h0, g, i0, i1),
                (Isa::Avx512, false) => attn_avx512(&args, s, h0, i0, i1),
                (Isa::Avx2, false) => attn_avx2(&args, s, h0, i0, i1),
                (Isa::Reference, _) => unreachable!(),
            }
        }
    };
    pool.run(total, &task);
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn attn_grouped_avx512<E: KvLoad>(
    a: &AttnArgs<E>,
    s: &AttnSeq,
    h0: usize,
    g: usize,
    i0: usize,
    i1: usize,
) {
    attn_grouped_dispatch::<Avx512, E>(a, s, h0, g, i0, i1)
}
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attn_grouped_avx2<E: KvLoad>(
    a: &AttnArgs<E>,
    s: &AttnSeq,
    h0: usize,
    g: usize,
    i0: usize,
    i1: usize,
) {
    attn_grouped_dispatch::<Avx2, E>(a, s, h0, g, i0, i1)
}

#[inline(always)]
unsafe fn attn_grouped_dispatch<S: Simd, E: KvLoad>(
    a: &AttnArgs<E>,
    s: &AttnSeq,
    h0: usize,
    g: usize,
    i0: usize,
    i1: usize,
) {
    macro_rules! nv {
        ($g:literal) => {
            match a.head_dim / S::LANES {
                1 => attn_grouped::<S, E, $g, 1>(a, s, h0, i0, i1),
                2 => attn_grouped::<S, E, $g, 2>(a, s, h0, i0, i1),
                3 => attn_grouped::<S, E, $g, 3>(a, s, h0, i0, i1),
                4 => attn_grouped::<S, E, $g, 4>(a, s, h0, i0, i1),
                6 => attn_grouped::<S, E, $g, 6>(a, s, h0, i0, i1),
                _ => attn_grouped::<S, E, $g, 8>(a, s, h0, i0, i1),
            }
        };
    }
    match g {
        1 => nv!(1),
        2 => nv!(2),
        3 => nv!(3),
        _ => nv!(4),
    }
}

/// Attention for the `G` query heads `h0..h0 + G`, which share one KV head, and queries
/// `i0..i1` of `s`: each K vector (16 keys of one dimension, K being transposed per block) and
/// each V row is loaded once for all G heads. Needs block_size and head_dim multiples of LANES,
/// head_dim = NV * LANES.
#[inline(always)]
unsafe fn attn_grouped<S: Simd, E: KvLoad, const G: usize, const NV: usize>(
    a: &AttnArgs<E>,
    s: &AttnSeq,
    h0: usize,
    i0: usize,
    i1: usize,
) {
    let bs = a.kv.block_size;
    let stride = (s.first_pos + i1).div_ceil(bs) * bs + S::LANES;
    let sc = thread_scratch(&SCORES, 4 * G * stride);
    // Queries of a prefill chunk are scored 4 (or 2) at a time so that each K vector loaded
    // serves all of them; every query's scores come out exactly as when scored alone.
    let wide = if S::LANES >= 16 { 12 / G } else { 1 };
    let mut i = i0;
    while i < i1 {
        let qn = match i1 - i {
            n if n >= 4 && wide >= 4 => 4,
            n if n >= 2 && wide >= 2 => 2,
            _ => 1,
        };
        match qn {
            4 => score_queries::<S, E, G, 4>(a, s, h0, i, sc, stride),
            2 => score_queries::<S, E, G, 2>(a, s, h0, i, sc, stride),
            _ => score_queries::<S, E, G, 1>(a, s, h0, i, sc, stride),
        }
        for q in 0..qn {
            finish_query::<S, E, G, NV>(a, s, h0, i + q, sc.add(q * G * stride), stride);
        }
        i += qn;
    }
}

/// Scaled scores of queries `i..i + QT` of `s` for the `G` heads from `h0`, into
/// `sc[(q * G + g) * stride + key]`; keys past a query's own context hold garbage.
#[inline(always)]
unsafe fn score_queries<S: Simd, E: KvLoad, const G: usize, const QT: usize>(
    a: &AttnArgs<E>,
    s: &AttnSeq,
    h0: usize,
    i: usize,
    sc: *mut f32,
    stride: usize,
) {
    let (hd, l) = (a.head_dim, S::LANES);
    let qdim = a.n_heads * hd;
    let kv_off = (h0 / a.group) * hd;
    let (bs, kvd) = (a.kv.block_size, a.kv.kv_dim);
    let kp = a.kv.k.as_ptr();
    let vscale = S::splat(a.scale);
    let n_max = s.first_pos + i + QT;
    let qh: [[*const f32; G]; QT] = std::array::from_fn(|q| {
        std::array::from_fn(|g| a.q.add((s.q_start + i + q) * qdim + (h0 + g) * hd))
    });
    // Blocks wholly before the first query's window are not scored (the later queries' windows
    // start no earlier).
    let first_block = first_key(s.first_pos + i, a.window) / bs;
    let blocks = s.block_table[..n_max.div_ceil(bs)].iter().enumerate();
    for (bi, &blk) in blocks.skip(first_block) {
        let kb = kp.add(blk as usize * bs * kvd + kv_off * bs);
        let mut c = 0;
        while c < bs && bi * bs + c < n_max {
            let mut acc = [[[S::zero(); 2]; G]; QT];
            let mut d = 0;
            while d + 2 <= hd {
                let k0 = E::load::<S>(kb.add(d * bs + c));
                let k1 = E::load::<S>(kb.add((d + 1) * bs + c));
                for q in 0..QT {
                    for g in 0..G {
                        let aq = &mut acc[q][g];
                        aq[0] = S::fma(S::splat(*qh[q][g].add(d)), k0, aq[0]);
                        aq[1] = S::fma(S::splat(*qh[q][g].add(d + 1)), k1, aq[1]);
                    }
                }
                d += 2;
            }
            for (q, accq) in acc.iter().enumerate() {
                for (g, ag) in accq.iter().enumerate() {
                    let v = S::mul(S::add(ag[0], ag[1]), vscale);
                    S::store(sc.add((q * G + g) * stride + bi * bs + c), v);
                }
            }
            c += l;
        }
    }
}

/// Softmax of query `i`'s scores (at `sc`, one row of `stride` per head) and the weighted sum
/// of V rows, written to the output.
#[inline(always)]
unsafe fn finish_query<S: Simd, E: KvLoad, const G: usize, const NV: usize>(
    a: &AttnArgs<E>,
    s: &AttnSeq,
    h0: usize,
    i: usize,
    sc: *mut f32,
    stride: usize,
) {
    let (hd, l) = (a.head_dim, S::LANES);
    let qdim = a.n_heads * hd;
    let kv_off = (h0 / a.group) * hd;
    let (bs, kvd) = (a.kv.block_size, a.kv.kv_dim);
    let vp = a.kv.v.as_ptr();
    let t = s.q_start + i;
    let n_ctx = s.first_pos + i + 1;
    let lo = first_key(s.first_pos + i, a.window);
    // Lanes before lo (outside the window) and past n_ctx hold garbage and are skipped.
    let mut inv_sum = [0.0f32; G];
    for (g, inv) in inv_sum.iter_mut().enumerate() {
        let sg = sc.add(g * stride + lo);
        cap_scores(sg, n_ctx - lo, a.softcap);
        let max = max_of::<S>(sg, n_ctx - lo);
        *inv = 1.0 / exp_shifted::<S>(sg, n_ctx - lo, max);
    }
    // Weighted sums of V rows, block by block.
    let mut acc = [[S::zero(); NV]; G];
    let mut p = lo;
    while p < n_ctx {
        let (bi, c0) = (p / bs, p % bs);
        let base = vp.add(s.block_table[bi] as usize * bs * kvd + kv_off);
        let len = (n_ctx - p).min(bs - c0);
        for c in c0..c0 + len {
            let row = base.add(c * kvd);
            let vv: [S::V; NV] = std::array::from_fn(|j| E::load::<S>(row.add(j * l)));
            for (g, ag) in acc.iter_mut().enumerate() {
                let w = S::splat(*sc.add(g * stride + bi * bs + c));
                for (x, v) in ag.iter_mut().zip(vv.iter()) {
                    *x = S::fma(w, *v, *x);
                }
            }
        }
        p += len;
    }
    for (g, ag) in acc.iter().enumerate() {
        let oh = a.out.add(t * qdim + (h0 + g) * hd);
        let inv = S::splat(inv_sum[g]);
        for (j, x) in ag.iter().enumerate() {
            S::store(oh.add(j * l), S::mul(*x, inv));
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn attn_avx512<E: KvLoad>(a: &AttnArgs<E>, s: &AttnSeq, h: usize, i0: usize, i1: usize) {
    attn_g::<Avx512, E>(a, s, h, i0, i1)
}
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attn_avx2<E: KvLoad>(a: &AttnArgs<E>, s: &AttnSeq, h: usize, i0: usize, i1: usize) {
    attn_g::<Avx2, E>(a, s, h, i0, i1)
}

/// The fallback for shapes the grouped kernel does not take: one head, scalar scores and sums
/// (exp and the softmax sum vectorized).
#[inline(always)]
unsafe fn attn_g<S: Simd, E: KvLoad>(a: &AttnArgs<E>, s: &AttnSeq, h: usize, i0: usize, i1: usize) {
    let hd = a.head_dim;
    let qdim = a.n_heads * hd;
    let kv_off = (h / a.group) * hd;
    let (kp, vp) = (a.kv.k.as_ptr(), a.kv.v.as_ptr());
    let sc = thread_scratch(&SCORES, s.first_pos + i1 + S::LANES);
    for i in i0..i1 {
        let t = s.q_start + i;
        let n_ctx = s.first_pos + i + 1;
        let lo = first_key(s.first_pos + i, a.window);
        let qh = a.q.add(t * qdim + h * hd);
        let mut max = f32::NEG_INFINITY;
        for p in lo..n_ctx {
            let mut acc = 0.0f32;
            for d in 0..hd {
                acc += *qh.add(d) * (*kp.add(a.kv.k_index(s.block_table, p, kv_off + d))).to_f32();
            }
            let mut v = acc * a.scale;
            if let Some(c) = a.softcap {
                v = reference::softcap(v, c);
            }
            *sc.add(p) = v;
            max = max.max(v);
        }
        let inv = 1.0 / exp_shifted::<S>(sc.add(lo), n_ctx - lo, max);
        let oh = a.out.add(t * qdim + h * hd);
        std::ptr::write_bytes(oh, 0, hd);
        for p in lo..n_ctx {
            let off = a.kv.v_offset(s.block_table, p) + kv_off;
            for d in 0..hd {
                *oh.add(d) += *sc.add(p) * (*vp.add(off + d)).to_f32();
            }
        }
        for d in 0..hd {
            *oh.add(d) *= inv;
        }
    }
}
