//! OFT as PEFT ≥ 0.18 defines it (the input-centric OFTv2): each targeted linear's input is split
//! into blocks of b values and block k is multiplied by an orthogonal R_k, x̃_k = x_k · R_k, before
//! the frozen product y = x̃ · Wᵀ. The quantized W is used as stored; only the input turns.
//!
//! R_k comes from b(b−1)/2 parameters θ_k: U = θ_k in the strict upper triangle (row-major, the
//! order of `triu_indices(b, b, 1)`), Q = U − Uᵀ, and
//! - Cayley–Neumann (default, n terms): R = I + 2Q + 2Q² + … + 2Q^{n−2} + Q^{n−1}, accumulated in
//!   PEFT's order (`_cayley_batch`); n = 1 gives I, n = 2 gives I + 2Q, and PEFT's loop makes
//!   n = 3 the same as n = 4 (I + 2Q + 2Q² + Q³);
//! - exact Cayley (`use_cayley_neumann: false`, PEFT's sign): R = (I − Q)(I + Q)⁻¹.
//!
//! R is built once per adapter version (`AdapterWeights::new`), never per token.

use super::OftConfig;
use flywheel_kernels::{Cpu, Isa, ThreadPool};
use std::time::Duration;

/// Number of skew parameters of one b×b block.
pub fn num_block_params(b: usize) -> usize {
    b * (b - 1) / 2
}

/// The skew-symmetric Q (b×b, row-major) of one block's parameters.
pub fn skew(theta: &[f32], b: usize, q: &mut [f32]) {
    debug_assert_eq!(theta.len(), num_block_params(b));
    q.fill(0.0);
    let mut p = 0;
    for i in 0..b {
        for j in i + 1..b {
            q[i * b + j] = theta[p];
            q[j * b + i] = -theta[p];
            p += 1;
        }
    }
}

/// R of every block of one module: `theta` is (in/b, b(b−1)/2), `out` (in/b, b, b). The
/// Cayley–Neumann powers of all blocks are taken together with the vector block kernel on the
/// calling thread (`cpu` should be a one-thread seam: this runs on the publisher's thread).
pub fn rotations_with(cpu: &Cpu, cfg: &OftConfig, theta: &[f32], out: &mut [f32]) {
    let b = cfg.block_size;
    let np = num_block_params(b);
    let nb = out.len() / (b * b);
    debug_assert_eq!(theta.len(), nb * np);
    if theta.iter().all(|v| *v == 0.0) {
        for r in out.chunks_mut(b * b) {
            identity(r, b);
        }
        return;
    }
    let mut q = vec![0.0f32; nb * b * b];
    for (k, qk) in q.chunks_mut(b * b).enumerate() {
        skew(&theta[k * np..(k + 1) * np], b, qk);
    }
    if !cfg.use_cayley_neumann {
        for (qk, r) in q.chunks(b * b).zip(out.chunks_mut(b * b)) {
            cayley_exact(qk, b, r);
        }
        return;
    }
    // Interleaved (b, nb·b) layout: row t holds row t of every block, so that P·Q of all blocks
    // is one block-diagonal product of b rows.
    let w = nb * b;
    let inter = |blocks: &[f32], dst: &mut [f32]| {
        for k in 0..nb {
            for t in 0..b {
                dst[t * w + k * b..t * w + (k + 1) * b]
                    .copy_from_slice(&blocks[k * b * b + t * b..k * b * b + (t + 1) * b]);
            }
        }
    };
    let mut r = vec![0.0f32; b * w];
    for k in 0..nb {
        for t in 0..b {
            r[t * w + k * b + t] = 1.0;
        }
    }
    let terms = cfg.num_cayley_neumann_terms;
    if terms > 1 {
        let mut p = vec![0.0f32; b * w];
        inter(&q, &mut p);
        add_scaled(&mut r, &p, 2.0);
        if terms > 2 {
            // PEFT's schedule: Q², then (terms − 4) more powers with weight 2, then one with 1.
            let mut next = vec![0.0f32; b * w];
            cpu.block_matmul(&p, &q, nb, b, b, &mut next);
            std::mem::swap(&mut p, &mut next);
            add_scaled(&mut r, &p, 2.0);
            for _ in 3..terms - 1 {
                cpu.block_matmul(&p, &q, nb, b, b, &mut next);
                std::mem::swap(&mut p, &mut next);
                add_scaled(&mut r, &p, 2.0);
            }
            cpu.block_matmul(&p, &q, nb, b, b, &mut next);
            add_scaled(&mut r, &next, 1.0);
        }
    }
    for k in 0..nb {
        for t in 0..b {
            out[k * b * b + t * b..k * b * b + (t + 1) * b]
                .copy_from_slice(&r[t * w + k * b..t * w + (k + 1) * b]);
        }
    }
}

/// `rotations_with` on a one-thread seam of the best ISA.
pub fn rotations(cfg: &OftConfig, theta: &[f32], out: &mut [f32]) {
    let cpu = Cpu::new(Isa::detect(), ThreadPool::new(1, Duration::ZERO));
    rotations_with(&cpu, cfg, theta, out)
}

fn identity(r: &mut [f32], b: usize) {
    r.fill(0.0);
    for i in 0..b {
        r[i * b + i] = 1.0;
    }
}

fn add_scaled(r: &mut [f32], m: &[f32], s: f32) {
    for (a, b) in r.iter_mut().zip(m) {
        *a += s * b;
    }
}

/// R = (I − Q)(I + Q)⁻¹ in f64, with `invert` (I + Q is always invertible for skew Q).
fn cayley_exact(q: &[f32], b: usize, r: &mut [f32]) {
    let (mut imq, mut ipq) = (vec![0.0f64; b * b], vec![0.0f64; b * b]);
    for (e, qv) in q.iter().enumerate() {
        let id = if e / b == e % b { 1.0 } else { 0.0 };
        imq[e] = id - *qv as f64;
        ipq[e] = id + *qv as f64;
    }
    for (o, v) in r.iter_mut().zip(mat_mul(&imq, &invert(&ipq, b), b)) {
        *o = v as f32;
    }
}

/// PEFT's Cayley–Neumann coefficients: R = Σ_m c_m Q^m (c_0 = 1; then 2, …, 2, 1 up to the last
/// power max(terms − 1, 3); terms 1 and 2 give I and I + 2Q).
pub fn neumann_coefficients(terms: usize) -> Vec<f64> {
    match terms {
        0 | 1 => vec![1.0],
        2 => vec![1.0, 2.0],
        _ => {
            let last = (terms - 1).max(3);
            (0..=last)
                .map(|m| match m {
                    0 => 1.0,
                    m if m == last => 1.0,
                    _ => 2.0,
                })
                .collect()
        }
    }
}

fn mat_mul(a: &[f64], b: &[f64], n: usize) -> Vec<f64> {
    let mut c = vec![0.0; n * n];
    for i in 0..n {
        for k in 0..n {
            let aik = a[i * n + k];
            for j in 0..n {
                c[i * n + j] += aik * b[k * n + j];
            }
        }
    }
    c
}

fn transpose(a: &[f64], n: usize) -> Vec<f64> {
    let mut t = vec![0.0; n * n];
    for i in 0..n {
        for j in 0..n {
            t[j * n + i] = a[i * n + j];
        }
    }
    t
}

/// The gradient with respect to θ of ⟨G_k, R_k(θ_k)⟩ for every block, added to `dtheta`
/// (nb, b(b−1)/2); `g` (nb, b, b) holds dL/dR_k. In f64 per block.
/// - Cayley–Neumann, R = Σ c_m Q^m: dL/dQ = Σ_m c_m Σ_{a+e=m−1} (Qᵀ)^a G (Qᵀ)^e, summed by the
///   recursion B_1 = G, B_{m+1} = Qᵀ B_m + G (Qᵀ)^m.
/// - exact Cayley, R = (I − Q)(I + Q)⁻¹: dL/dQ = −(I + R)ᵀ G (I + Q)⁻ᵀ.
///
/// Then dθ for entry (i, j), i < j, is dL/dQ[i][j] − dL/dQ[j][i].
pub fn rotation_backward(cfg: &OftConfig, theta: &[f32], g: &[f32], dtheta: &mut [f32]) {
    let b = cfg.block_size;
    let np = num_block_params(b);
    let nb = g.len() / (b * b);
    let mut q32 = vec![0.0f32; b * b];
    for k in 0..nb {
        skew(&theta[k * np..(k + 1) * np], b, &mut q32);
        let q: Vec<f64> = q32.iter().map(|v| *v as f64).collect();
        let gk: Vec<f64> = g[k * b * b..(k + 1) * b * b]
            .iter()
            .map(|v| *v as f64)
            .collect();
        let qt = transpose(&q, b);
        let dq = if cfg.use_cayley_neumann {
            let c = neumann_coefficients(cfg.num_cayley_neumann_terms);
            let mut dq = vec![0.0f64; b * b];
            let mut bm = gk.clone(); // B_1
            let mut qt_pow = qt.clone(); // (Qᵀ)^1
            for (m, cm) in c.iter().enumerate().skip(1) {
                for (d, v) in dq.iter_mut().zip(&bm) {
                    *d += cm * v;
                }
                if m + 1 < c.len() {
                    let left = mat_mul(&qt, &bm, b);
                    let right = mat_mul(&gk, &qt_pow, b);
                    bm = left.iter().zip(&right).map(|(x, y)| x + y).collect();
                    qt_pow = mat_mul(&qt_pow, &qt, b);
                }
            }
            dq
        } else {
            let mut r = vec![0.0f32; b * b];
            cayley_exact(&q32, b, &mut r);
            let mut ipr: Vec<f64> = r.iter().map(|v| *v as f64).collect();
            let mut ipq = q.clone();
            for i in 0..b {
                ipr[i * b + i] += 1.0;
                ipq[i * b + i] += 1.0;
            }
            let inv = invert(&ipq, b);
            let t = mat_mul(
                &mat_mul(&transpose(&ipr, b), &gk, b),
                &transpose(&inv, b),
                b,
            );
            t.iter().map(|v| -v).collect()
        };
        let mut p = 0;
        for i in 0..b {
            for j in i + 1..b {
                dtheta[k * np + p] += (dq[i * b + j] - dq[j * b + i]) as f32;
                p += 1;
            }
        }
    }
}

/// Inverse by Gauss–Jordan with partial pivoting (f64).
fn invert(a: &[f64], n: usize) -> Vec<f64> {
    let mut m = a.to_vec();
    let mut inv: Vec<f64> = (0..n * n)
        .map(|e| if e / n == e % n { 1.0 } else { 0.0 })
        .collect();
    for col in 0..n {
        let piv = (col..n)
            .max_by(|&x, &y| m[x * n + col].abs().total_cmp(&m[y * n + col].abs()))
            .unwrap_or(col);
        for j in 0..n {
            m.swap(piv * n + j, col * n + j);
            inv.swap(piv * n + j, col * n + j);
        }
        let d = m[col * n + col];
        for j in 0..n {
            m[col * n + j] /= d;
            inv[col * n + j] /= d;
        }
        for i in 0..n {
            if i != col {
                let f = m[i * n + col];
                for j in 0..n {
                    m[i * n + j] -= f * m[col * n + j];
                    inv[i * n + j] -= f * inv[col * n + j];
                }
            }
        }
    }
    inv
}

/// Backward of one OFT-adapted projection's rotation, x̃ = x · diag(R_k): with `dxr` = dL/dx̃
/// (T, in) (the frozen linear's input gradient), writes dx = dL/dx (T, in) (`=`) and adds dL/dθ
/// to `dtheta` (`+=`). `rot` is the version's R blocks (in/b, b, b).
#[allow(clippy::too_many_arguments)]
pub fn module_backward(
    cpu: &Cpu,
    cfg: &OftConfig,
    theta: &[f32],
    rot: &[f32],
    x: &[f32],
    dxr: &[f32],
    dx: &mut [f32],
    dtheta: &mut [f32],
) {
    let b = cfg.block_size;
    let nb = rot.len() / (b * b);
    // dx_k = dx̃_k · R_kᵀ
    let mut rt = vec![0.0f32; rot.len()];
    for k in 0..nb {
        for i in 0..b {
            for j in 0..b {
                rt[k * b * b + j * b + i] = rot[k * b * b + i * b + j];
            }
        }
    }
    cpu.block_matmul(dxr, &rt, nb, b, b, dx);
    // G_k = Σ_t x_kᵀ · dx̃_k, then through R(θ).
    let mut g = vec![0.0f32; rot.len()];
    cpu.block_outer(x, dxr, nb, b, b, &mut g);
    rotation_backward(cfg, theta, &g, dtheta);
}

#[cfg(test)]
mod tests {
    use super::*;
    use flywheel_kernels::ThreadPool;

    fn cfg(b: usize, terms: usize, neumann: bool) -> OftConfig {
        OftConfig {
            block_size: b,
            use_cayley_neumann: neumann,
            num_cayley_neumann_terms: terms,
        }
    }

    fn rng_vec(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut r = crate::util::Rng::new(seed);
        (0..n)
            .map(|_| ((r.next_f64() * 2.0 - 1.0) as f32) * scale)
            .collect()
    }

    /// f64 matrix power series written the obvious way: I + 2·Σ_{j=1}^{m−1} Q^j + Q^m with
    /// m = n − 1, except that PEFT's code gives n = 3 the terms of n = 4.
    fn series(q: &[f64], b: usize, n: usize) -> Vec<f64> {
        let n = if n == 3 { 4 } else { n };
        let mul = |x: &[f64], y: &[f64]| {
            let mut z = vec![0.0; b * b];
            for i in 0..b {
                for j in 0..b {
                    z[i * b + j] = (0..b).map(|k| x[i * b + k] * y[k * b + j]).sum();
                }
            }
            z
        };
        let mut r: Vec<f64> = (0..b * b)
            .map(|e| if e / b == e % b { 1.0 } else { 0.0 })
            .collect();
        let mut p = r.clone();
        for j in 1..n {
            p = mul(&p, q);
            let c = if j == n - 1 { 1.0 } else { 2.0 };
            for (a, v) in r.iter_mut().zip(&p) {
                *a += c * v;
            }
        }
        r
    }

    #[test]
    fn skew_fills_the_upper_triangle_row_major() {
        let mut q = vec![0.0; 9];
        skew(&[1.0, 2.0, 3.0], 3, &mut q);
        assert_eq!(q, vec![0.0, 1.0, 2.0, -1.0, 0.0, 3.0, -2.0, -3.0, 0.0]);
    }

    #[test]
    fn cayley_neumann_is_the_power_series() {
        for (b, terms) in [(4, 5), (8, 5), (6, 3), (5, 7)] {
            let theta = rng_vec(2 * num_block_params(b), 7 + b as u64, 0.2);
            let mut out = vec![0.0; 2 * b * b];
            rotations(&cfg(b, terms, true), &theta, &mut out);
            for k in 0..2 {
                let mut q = vec![0.0; b * b];
                skew(
                    &theta[k * num_block_params(b)..][..num_block_params(b)],
                    b,
                    &mut q,
                );
                let q64: Vec<f64> = q.iter().map(|v| *v as f64).collect();
                let want = series(&q64, b, terms);
                for (g, w) in out[k * b * b..(k + 1) * b * b].iter().zip(&want) {
                    assert!((*g as f64 - w).abs() < 1e-5, "b={b} n={terms}: {g} vs {w}");
                }
            }
        }
    }

    #[test]
    fn exact_cayley_is_orthogonal_and_follows_peft_sign() {
        let b = 6;
        let theta = rng_vec(num_block_params(b), 3, 0.3);
        let mut r = vec![0.0; b * b];
        rotations(&cfg(b, 5, false), &theta, &mut r);
        let mut q = vec![0.0; b * b];
        skew(&theta, b, &mut q);
        // R (I + Q) = I − Q, and Rᵀ R = I.
        for i in 0..b {
            for j in 0..b {
                let lhs: f32 = (0..b)
                    .map(|k| r[i * b + k] * (q[k * b + j] + if k == j { 1.0 } else { 0.0 }))
                    .sum();
                let rhs = if i == j { 1.0 } else { 0.0 } - q[i * b + j];
                assert!((lhs - rhs).abs() < 1e-5);
                let rtr: f32 = (0..b).map(|k| r[k * b + i] * r[k * b + j]).sum();
                assert!((rtr - if i == j { 1.0 } else { 0.0 }).abs() < 1e-5);
            }
        }
        // For small Q the exact form is near Neumann(−Q): the transpose of the default form.
        let small: Vec<f32> = theta.iter().map(|v| v * 0.01).collect();
        let (mut e, mut n) = (vec![0.0; b * b], vec![0.0; b * b]);
        rotations(&cfg(b, 5, false), &small, &mut e);
        rotations(&cfg(b, 5, true), &small, &mut n);
        for i in 0..b {
            for j in 0..b {
                assert!((e[i * b + j] - n[j * b + i]).abs() < 1e-6);
            }
        }
    }

    #[test]
    fn zero_parameters_give_the_identity_exactly() {
        let b = 4;
        let mut r = vec![7.0; 3 * b * b];
        rotations(
            &cfg(b, 5, true),
            &vec![0.0; 3 * num_block_params(b)],
            &mut r,
        );
        for k in 0..3 {
            for i in 0..b {
                for j in 0..b {
                    assert_eq!(r[k * b * b + i * b + j], if i == j { 1.0 } else { 0.0 });
                }
            }
        }
    }

    /// f64 R(θ) for one block, as the series or the exact form.
    fn r64(theta: &[f64], b: usize, cfg: &OftConfig) -> Vec<f64> {
        let mut q = vec![0.0; b * b];
        let mut p = 0;
        for i in 0..b {
            for j in i + 1..b {
                q[i * b + j] = theta[p];
                q[j * b + i] = -theta[p];
                p += 1;
            }
        }
        let id: Vec<f64> = (0..b * b)
            .map(|e| if e / b == e % b { 1.0 } else { 0.0 })
            .collect();
        if cfg.use_cayley_neumann {
            let c = neumann_coefficients(cfg.num_cayley_neumann_terms);
            let mut r = id.clone();
            let mut pw = id.clone();
            for cm in c.iter().skip(1) {
                pw = mat_mul(&pw, &q, b);
                for (a, v) in r.iter_mut().zip(&pw) {
                    *a += cm * v;
                }
            }
            r
        } else {
            let imq: Vec<f64> = id.iter().zip(&q).map(|(a, b)| a - b).collect();
            let ipq: Vec<f64> = id.iter().zip(&q).map(|(a, b)| a + b).collect();
            mat_mul(&imq, &invert(&ipq, b), b)
        }
    }

    #[test]
    fn module_backward_matches_finite_differences() {
        let cpu = flywheel_kernels::Cpu::new(Isa::detect(), ThreadPool::new(2, Duration::ZERO));
        for (b, terms, neumann) in [
            (4, 5, true),
            (6, 3, true),
            (5, 7, true),
            (4, 2, true),
            (4, 5, false),
        ] {
            let cfg = cfg(b, terms, neumann);
            let (nb, t) = (2, 3);
            let np = num_block_params(b);
            let theta = rng_vec(nb * np, 40 + b as u64, 0.3);
            let x = rng_vec(t * nb * b, 41, 1.0);
            let dxr = rng_vec(t * nb * b, 42, 1.0);
            let mut rot = vec![0.0; nb * b * b];
            rotations(&cfg, &theta, &mut rot);
            let mut dx = vec![0.0; x.len()];
            let mut dth = vec![0.0; theta.len()];
            module_backward(&cpu, &cfg, &theta, &rot, &x, &dxr, &mut dx, &mut dth);
            // L(θ, x) = Σ dxr ⊙ (x · diag R_k(θ_k)) in f64.
            let loss = |th: &[f64], xs: &[f64]| -> f64 {
                let mut l = 0.0;
                for k in 0..nb {
                    let r = r64(&th[k * np..(k + 1) * np], b, &cfg);
                    for tt in 0..t {
                        for j in 0..b {
                            let y: f64 = (0..b)
                                .map(|i| xs[tt * nb * b + k * b + i] * r[i * b + j])
                                .sum();
                            l += dxr[tt * nb * b + k * b + j] as f64 * y;
                        }
                    }
                }
                l
            };
            let th64: Vec<f64> = theta.iter().map(|v| *v as f64).collect();
            let x64: Vec<f64> = x.iter().map(|v| *v as f64).collect();
            let h = 1e-6;
            for p in 0..theta.len() {
                let (mut a, mut c) = (th64.clone(), th64.clone());
                a[p] += h;
                c[p] -= h;
                let num = (loss(&a, &x64) - loss(&c, &x64)) / (2.0 * h);
                assert!(
                    (num - dth[p] as f64).abs() < 1e-4 * (1.0 + num.abs()),
                    "b={b} n={terms} exact={} θ[{p}]: {} vs {num}",
                    !neumann,
                    dth[p]
                );
            }
            for e in 0..x.len() {
                let (mut a, mut c) = (x64.clone(), x64.clone());
                a[e] += h;
                c[e] -= h;
                let num = (loss(&th64, &a) - loss(&th64, &c)) / (2.0 * h);
                assert!(
                    (num - dx[e] as f64).abs() < 1e-4 * (1.0 + num.abs()),
                    "b={b} x[{e}]"
                );
            }
        }
    }
}
