//! Causal grouped-query attention backward over one sequence (the training backward).
//!
//! Two kernels, equal up to rounding: a tiled one for head sizes that are a multiple of the SIMD
//! width (up to 8 vectors): per query head, blocks of `BQ` query rows against all the keys they
//! see, as small register-blocked matrix products (S = Q Kᵀ, dP = dO Vᵀ, dQ = dS K,
//! dKᵀ += Qᵀ dS, dVᵀ += dOᵀ P), one task per query head with private dK, dV partials summed
//! afterwards in head order (so the result does not depend on the thread count); and a
//! row-at-a-time kernel for other head sizes, one task per KV head.

// Safety of every `unsafe fn` here: the CPU has the features of `S`; sizes are checked by the
// public entry point.
#![allow(clippy::missing_safety_doc)]

use super::isa::Isa;
use super::pool::Tasks;
use super::simd::{exp, Avx2, Avx512, Simd};
use super::small_gemm::gemm;
use crate::reference::{softcap, AttnOpts};

/// Query rows per block of the tiled kernel.
const BQ: usize = 8;

/// Causal grouped-query attention backward over one sequence: k and v (n, Hkv·d) for positions
/// 0..n as the forward used them (after RoPE), q (t, H·d) for the last t positions (t ≤ n; t < n
/// when earlier positions are a shared prefix whose queries are handled elsewhere), dout (t, H·d)
/// → dq (=), dk, dv (n, Hkv·d; every row written, prefix rows included). P is recomputed from q
/// and K (never stored): per query row i at position p = n − t + i and head h,
/// s_j = scale·q·k_j (j ≤ p), P = softmax(s), dP_j = dout·v_j, dS = P ⊙ (dP − Σ_j P_j dP_j),
/// dq = scale·Σ dS_j k_j, dk_j += scale·dS_j q, dv_j += P_j dout. Query heads sharing a KV head sum
/// into its dk, dv.
#[allow(clippy::too_many_arguments)]
///
/// With a window, the row at position p sees only keys p − window + 1 ..= p (a sliding-window
/// layer): P is zero outside, so nothing flows to the keys it does not see. With a soft-cap c
/// (Gemma 2) P = softmax(c·tanh(s / c)) and dS is scaled by 1 − tanh²(s / c) (`AttnOpts`).
pub fn attention_backward(
    isa: Isa,
    pool: Tasks,
    (q, k, v, dout): (&[f32], &[f32], &[f32], &[f32]),
    (n_heads, n_kv_heads, head_dim): (usize, usize, usize),
    scale: f32,
    opts: AttnOpts,
    (dq, dk, dv): (&mut [f32], &mut [f32], &mut [f32]),
) {
    let window = opts.window;
    let (qd, kvd) = (n_heads * head_dim, n_kv_heads * head_dim);
    let t = q.len() / qd;
    let tk = k.len() / kvd;
    assert!(q.len() == t * qd && dout.len() == t * qd && dq.len() == t * qd && t <= tk);
    assert!(k.len() == tk * kvd && v.len() == tk * kvd && dk.len() == tk * kvd);
    assert!(dv.len() == tk * kvd);
    let lanes = isa.lanes();
    let tiled = head_dim.is_multiple_of(lanes) && head_dim <= 8 * lanes;
    let nkp = tk.next_multiple_of(lanes);
    // Tiled: per query head, its dKᵀ and dVᵀ partials (head_dim × nkp each).
    let mut parts = vec![
        0.0f32;
        if tiled {
            n_heads * 2 * head_dim * nkp
        } else {
            0
        }
    ];
    let job = AttnJob {
        q: q.as_ptr(),
        k: k.as_ptr(),
        v: v.as_ptr(),
        dout: dout.as_ptr(),
        dq: dq.as_mut_ptr(),
        dk: dk.as_mut_ptr(),
        dv: dv.as_mut_ptr(),
        parts: parts.as_mut_ptr(),
        t,
        off: tk - t,
        group: n_heads / n_kv_heads,
        head_dim,
        qd,
        kvd,
        scale,
        window: window.unwrap_or(usize::MAX),
        softcap: opts.softcap,
    };
    assert!(window != Some(0), "a window holds at least one key");
    let task = |g: usize| {
        // SAFETY: a tiled task h writes only query head h's columns of dq and its own partials;
        // a row task g only KV head g's columns of dk, dv and its query heads' of dq. The ISA is
        // detected at start-up.
        unsafe {
            match (isa, tiled) {
                (Isa::Avx512, true) => tiled_avx512(&job, g),
                (Isa::Avx2, true) => tiled_avx2(&job, g),
                (Isa::Avx512, false) => rows_avx512(&job, g),
                (Isa::Avx2, false) => rows_avx2(&job, g),
                (Isa::Reference, _) => unreachable!("the reference has its own twin"),
            }
        }
    };
    if !tiled {
        pool.run(n_kv_heads, &task);
        return;
    }
    pool.run(n_heads, &task);
    // dk, dv of KV head g: its query heads' partials summed in head order.
    let (hd, group) = (head_dim, n_heads / n_kv_heads);
    for g in 0..n_kv_heads {
        for r in 0..tk {
            for d in 0..hd {
                let (mut sk, mut sv) = (0.0f32, 0.0f32);
                for h in g * group..(g + 1) * group {
                    let base = h * 2 * hd * nkp + d * nkp + r;
                    sk += parts[base];
                    sv += parts[base + hd * nkp];
                }
                dk[r * kvd + g * hd + d] = sk;
                dv[r * kvd + g * hd + d] = sv;
            }
        }
    }
}

struct AttnJob {
    q: *const f32,
    k: *const f32,
    v: *const f32,
    dout: *const f32,
    dq: *mut f32,
    dk: *mut f32,
    dv: *mut f32,
    /// The tiled kernel's per-head dKᵀ, dVᵀ partials.
    parts: *mut f32,
    t: usize,
    /// Position of the first query row among the K/V rows.
    off: usize,
    group: usize,
    head_dim: usize,
    qd: usize,
    kvd: usize,
    scale: f32,
    /// Keys a row sees: its own and the `window − 1` before it (usize::MAX: all).
    window: usize,
    softcap: Option<f32>,
}
// SAFETY: tasks write disjoint memory (see `attention_backward`).
unsafe impl Sync for AttnJob {}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn tiled_avx512(j: &AttnJob, h: usize) {
    tiled::<Avx512>(j, h)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tiled_avx2(j: &AttnJob, h: usize) {
    tiled::<Avx2>(j, h)
}

/// Query head h, blocks of BQ query rows (see the module comment).
#[inline(always)]
unsafe fn tiled<S: Simd>(j: &AttnJob, h: usize) {
    let l = S::LANES;
    let (t, off, hd, qd, kvd) = (j.t, j.off, j.head_dim, j.qd, j.kvd);
    let nk = off + t;
    let nkp = nk.next_multiple_of(l);
    let (qc, kc) = (h * hd, (h / j.group) * hd);
    // Kᵀ and Vᵀ of the KV head (hd × nkp, zero past nk): scores are vectors over keys.
    let mut kt = vec![0.0f32; hd * nkp];
    let mut vt = vec![0.0f32; hd * nkp];
    for r in 0..nk {
        for d in 0..hd {
            kt[d * nkp + r] = *j.k.add(r * kvd + kc + d);
            vt[d * nkp + r] = *j.v.add(r * kvd + kc + d);
        }
    }
    let dkt = j.parts.add(h * 2 * hd * nkp);
    let dvt = dkt.add(hd * nkp);
    std::ptr::write_bytes(dkt, 0, 2 * hd * nkp);
    let mut p = vec![0.0f32; BQ * nkp];
    let mut ds = vec![0.0f32; BQ * nkp];
    let mut i0 = 0;
    while i0 < t {
        let bq = (t - i0).min(BQ);
        let nkb = off + i0 + bq; // keys the block's last row sees
        let nkbp = nkb.next_multiple_of(l);
        let qb = j.q.add(i0 * qd + qc);
        let db = j.dout.add(i0 * qd + qc);
        gemm::<S>(
            bq,
            nkbp,
            hd,
            (qb, qd, 1),
            (kt.as_ptr(), nkp),
            (p.as_mut_ptr(), nkp),
            false,
        );
        gemm::<S>(
            bq,
            nkbp,
            hd,
            (db, qd, 1),
            (vt.as_ptr(), nkp),
            (ds.as_mut_ptr(), nkp),
            false,
        );
        for r in 0..bq {
            let (pr, dr) = (p.as_mut_ptr().add(r * nkp), ds.as_mut_ptr().add(r * nkp));
            let n = off + i0 + r + 1;
            let lo = n.saturating_sub(j.window);
            match j.softcap {
                None => softmax_grad_row::<S>(pr, dr, lo, n, nkbp, j.scale),
                Some(c) => softmax_grad_row_capped(pr, dr, lo, n, nkbp, j.scale, c),
            }
        }
        let dqb = j.dq.add(i0 * qd + qc);
        gemm::<S>(
            bq,
            hd,
            nkb,
            (ds.as_ptr(), nkp, 1),
            (j.k.add(kc), kvd),
            (dqb, qd),
            false,
        );
        gemm::<S>(
            hd,
            nkbp,
            bq,
            (qb, 1, qd),
            (ds.as_ptr(), nkp),
            (dkt, nkp),
            true,
        );
        gemm::<S>(
            hd,
            nkbp,
            bq,
            (db, 1, qd),
            (p.as_ptr(), nkp),
            (dvt, nkp),
            true,
        );
        i0 += bq;
    }
}

/// One query row: raw scores q·k in `p` and dP in `d` over `width` columns, of which columns
/// `lo..n` are keys the row sees → P (0 outside) in `p` and scale·P ⊙ (dP − Σ P dP) in `d`.
#[inline(always)]
unsafe fn softmax_grad_row<S: Simd>(
    p: *mut f32,
    d: *mut f32,
    lo: usize,
    n: usize,
    width: usize,
    scale: f32,
) {
    let l = S::LANES;
    let mut vmax = S::splat(f32::NEG_INFINITY);
    let mut c = lo;
    while c + l <= n {
        vmax = S::max(vmax, S::load(p.add(c)));
        c += l;
    }
    let mut mx = S::reduce_max(vmax);
    for c in c..n {
        mx = mx.max(*p.add(c));
    }
    let (vs, vm) = (S::splat(scale), S::splat(scale * mx));
    let mut c = 0;
    while c < width {
        S::store(
            p.add(c),
            exp::<S>(S::sub(S::mul(S::load(p.add(c)), vs), vm)),
        );
        c += l;
    }
    for c in (0..lo).chain(n..width) {
        *p.add(c) = 0.0;
    }
    let mut vz = S::zero();
    let mut c = 0;
    while c < width {
        vz = S::add(vz, S::load(p.add(c)));
        c += l;
    }
    let inv = S::splat(1.0 / S::reduce_add(vz));
    let mut vd = S::zero();
    let mut c = 0;
    while c < width {
        let pv = S::mul(S::load(p.add(c)), inv);
        S::store(p.add(c), pv);
        vd = S::fma(pv, S::load(d.add(c)), vd);
        c += l;
    }
    let dd = S::splat(S::reduce_add(vd));
    let mut c = 0;
    while c < width {
        let pv = S::load(p.add(c));
        S::store(
            d.add(c),
            S::mul(S::mul(pv, S::sub(S::load(d.add(c)), dd)), vs),
        );
        c += l;
    }
}

/// `softmax_grad_row` with soft-capped scores (Gemma 2), scalar: c·tanh(scale·raw / c) is what
/// the forward's softmax saw (`reference::softcap`, the same bits), and dS takes the cap's slope
/// 1 − tanh².
unsafe fn softmax_grad_row_capped(
    p: *mut f32,
    d: *mut f32,
    lo: usize,
    n: usize,
    width: usize,
    scale: f32,
    cap: f32,
) {
    let (p, d) = (
        std::slice::from_raw_parts_mut(p, width),
        std::slice::from_raw_parts_mut(d, width),
    );
    let mut slope = vec![0.0f32; n - lo];
    let mut mx = f32::NEG_INFINITY;
    for (x, g) in p[lo..n].iter_mut().zip(&mut slope) {
        let c = softcap(*x * scale, cap);
        let t = c / cap;
        *g = 1.0 - t * t;
        *x = c;
        mx = mx.max(c);
    }
    let mut z = 0.0f32;
    for x in &mut p[lo..n] {
        *x = (*x - mx).exp();
        z += *x;
    }
    let inv = 1.0 / z;
    let mut dd = 0.0f32;
    for c in lo..n {
        p[c] *= inv;
        dd += p[c] * d[c];
    }
    for c in 0..width {
        if (lo..n).contains(&c) {
            d[c] = p[c] * (d[c] - dd) * slope[c - lo] * scale;
        } else {
            (p[c], d[c]) = (0.0, 0.0);
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn rows_avx512(j: &AttnJob, g: usize) {
    rows::<Avx512>(j, g)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_avx2(j: &AttnJob, g: usize) {
    rows::<Avx2>(j, g)
}

/// `y += a·x` over n values.
#[inline(always)]
unsafe fn axpy<S: Simd>(a: f32, x: *const f32, y: *mut f32, n: usize) {
    let l = S::LANES;
    let av = S::splat(a);
    let mut c = 0;
    while c + l <= n {
        S::store(y.add(c), S::fma(av, S::load(x.add(c)), S::load(y.add(c))));
        c += l;
    }
    while c < n {
        *y.add(c) = a.mul_add(*x.add(c), *y.add(c));
        c += 1;
    }
}

/// KV head g and its query heads, a query row at a time (see `attention_backward`).
#[inline(always)]
unsafe fn rows<S: Simd>(j: &AttnJob, g: usize) {
    use super::matmul::dot;
    let (t, off, hd, qd, kvd) = (j.t, j.off, j.head_dim, j.qd, j.kvd);
    let kc = g * hd;
    for r in 0..off + t {
        std::ptr::write_bytes(j.dk.add(r * kvd + kc), 0, hd);
        std::ptr::write_bytes(j.dv.add(r * kvd + kc), 0, hd);
    }
    let mut p = vec![0.0f32; off + t];
    // d(capped score)/d(score) per key (1 without a cap).
    let mut slope = vec![1.0f32; off + t];
    let mut o = vec![0.0f32; hd];
    for h in g * j.group..(g + 1) * j.group {
        let qc = h * hd;
        for i in 0..t {
            let qi = j.q.add(i * qd + qc);
            let di = j.dout.add(i * qd + qc);
            let lo = (off + i + 1).saturating_sub(j.window);
            let mut mx = f32::NEG_INFINITY;
            for (jj, pj) in p.iter_mut().enumerate().take(off + i + 1).skip(lo) {
                *pj = j.scale * dot::<S>(qi, j.k.add(jj * kvd + kc), hd);
                if let Some(c) = j.softcap {
                    *pj = softcap(*pj, c);
                    let t = *pj / c;
                    slope[jj] = 1.0 - t * t;
                }
                mx = mx.max(*pj);
            }
            let mut z = 0.0f32;
            for pj in &mut p[lo..=off + i] {
                *pj = (*pj - mx).exp();
                z += *pj;
            }
            o.fill(0.0);
            let inv = 1.0 / z;
            for (jj, pj) in p.iter_mut().enumerate().take(off + i + 1).skip(lo) {
                *pj *= inv;
                axpy::<S>(*pj, j.v.add(jj * kvd + kc), o.as_mut_ptr(), hd);
            }
            let dot_do = dot::<S>(di, o.as_ptr(), hd);
            let dqi = j.dq.add(i * qd + qc);
            std::ptr::write_bytes(dqi, 0, hd);
            for (jj, pj) in p.iter().enumerate().take(off + i + 1).skip(lo) {
                let dp = dot::<S>(di, j.v.add(jj * kvd + kc), hd);
                let ds = pj * (dp - dot_do) * slope[jj] * j.scale;
                axpy::<S>(ds, j.k.add(jj * kvd + kc), dqi, hd);
                axpy::<S>(ds, qi, j.dk.add(jj * kvd + kc), hd);
                axpy::<S>(*pj, di, j.dv.add(jj * kvd + kc), hd);
            }
        }
    }
}
