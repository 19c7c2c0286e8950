//! LoRA as PEFT defines it: y = W x + s·B(A x), A (r, in), B (out, r), s = α/r (α/√r with rsLoRA).
//! The quantized W is used as stored (never merged). h = A x runs through the batch-invariant f32
//! `matmul` (dot form over `in`); B h through the row-times-matrix kernel with Bᵀ (built once per
//! version), r FMAs per output and no horizontal sums. Both keep a row's result independent of its
//! batch.

use flywheel_kernels::{Cpu, Matmul, QuantType};

/// Reinterpret f32 values as the little-endian bytes `matmul` reads for an F32 weight.
pub fn f32_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding or invalid bit patterns; u8 has alignment 1; the length is exact.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

/// The LoRA delta of `n` rows: `d (n, out) = s · (x (n, in) · Aᵀ) · Bᵀ`, with `bt` = Bᵀ (r, out)
/// and `h` (n, r) scratch.
#[allow(clippy::too_many_arguments)]
pub fn delta(
    cpu: &Cpu,
    a: &[f32],
    bt: &[f32],
    r: usize,
    scale: f32,
    x: &[f32],
    h: &mut Vec<f32>,
    d: &mut Vec<f32>,
) {
    let in_dim = a.len() / r;
    let out_dim = bt.len() / r;
    let n = x.len() / in_dim;
    h.resize(n * r, 0.0);
    d.resize(n * out_dim, 0.0);
    cpu.matmul_many_exact(&mut [Matmul {
        ty: QuantType::F32,
        w: f32_bytes(a),
        rows: r,
        cols: in_dim,
        x,
        y: h,
    }]);
    cpu.block_matmul(h, bt, 1, r, out_dim, d);
    for v in d.iter_mut() {
        *v *= scale;
    }
}

/// Backward of one LoRA delta y += s·(x·Aᵀ)·Bᵀ, with `dy` = dL/dy (n, out): adds the delta's part
/// of dL/dx to `dx` (n, in) (the frozen linear's part is written first, `=`), and dL/dA, dL/dB to
/// `da` (r, in) and `db` (out, r) (`+=`, PEFT's layout).
#[allow(clippy::too_many_arguments)]
pub fn module_backward(
    cpu: &Cpu,
    a: &[f32],
    b: &[f32],
    r: usize,
    scale: f32,
    x: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    da: &mut [f32],
    db: &mut [f32],
) {
    let in_dim = a.len() / r;
    let out_dim = b.len() / r;
    let n = x.len() / in_dim;
    // h = x·Aᵀ, as in the forward.
    let mut h = vec![0.0f32; n * r];
    cpu.matmul_many_exact(&mut [Matmul {
        ty: QuantType::F32,
        w: f32_bytes(a),
        rows: r,
        cols: in_dim,
        x,
        y: &mut h,
    }]);
    let dys: Vec<f32> = dy.iter().map(|g| g * scale).collect();
    // dB += (s·dy)ᵀ·h
    cpu.block_outer(&dys, &h, 1, out_dim, r, db);
    // dh = (s·dy)·B
    let mut dh = vec![0.0f32; n * r];
    cpu.block_matmul(&dys, b, 1, out_dim, r, &mut dh);
    // dA += dhᵀ·x
    cpu.block_outer(&dh, x, 1, r, in_dim, da);
    // dx += dh·A
    let mut t = vec![0.0f32; n * in_dim];
    cpu.block_matmul(&dh, a, 1, r, in_dim, &mut t);
    for (d, v) in dx.iter_mut().zip(&t) {
        *d += v;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flywheel_kernels::{Isa, ThreadPool};

    fn vals(n: usize, seed: u64) -> Vec<f32> {
        let mut r = crate::util::Rng::new(seed);
        (0..n).map(|_| (r.next_f64() * 2.0 - 1.0) as f32).collect()
    }

    #[test]
    fn module_backward_matches_finite_differences() {
        let cpu = Cpu::new(Isa::detect(), ThreadPool::new(2, std::time::Duration::ZERO));
        let (n, in_dim, out_dim, r, s) = (3, 40, 24, 4, 1.7f32);
        let (a, b, x, dy) = (
            vals(r * in_dim, 1),
            vals(out_dim * r, 2),
            vals(n * in_dim, 3),
            vals(n * out_dim, 4),
        );
        let mut dx = vec![0.0f32; n * in_dim];
        let (mut da, mut db) = (vec![0.0f32; a.len()], vec![0.0f32; b.len()]);
        module_backward(&cpu, &a, &b, r, s, &x, &dy, &mut dx, &mut da, &mut db);
        let loss = |a: &[f64], b: &[f64], x: &[f64]| -> f64 {
            let mut l = 0.0;
            for t in 0..n {
                let h: Vec<f64> = (0..r)
                    .map(|i| {
                        (0..in_dim)
                            .map(|j| a[i * in_dim + j] * x[t * in_dim + j])
                            .sum()
                    })
                    .collect();
                for o in 0..out_dim {
                    let y: f64 = (0..r).map(|i| b[o * r + i] * h[i]).sum::<f64>() * s as f64;
                    l += dy[t * out_dim + o] as f64 * y;
                }
            }
            l
        };
        let f64s = |v: &[f32]| v.iter().map(|x| *x as f64).collect::<Vec<f64>>();
        let (a64, b64, x64) = (f64s(&a), f64s(&b), f64s(&x));
        let h = 1e-6;
        let check = |which: usize, got: &[f32]| {
            for e in 0..got.len() {
                let mut p = [a64.clone(), b64.clone(), x64.clone()];
                p[which][e] += h;
                let up = loss(&p[0], &p[1], &p[2]);
                p[which][e] -= 2.0 * h;
                let down = loss(&p[0], &p[1], &p[2]);
                let num = (up - down) / (2.0 * h);
                assert!(
                    (num - got[e] as f64).abs() < 1e-4 * (1.0 + num.abs()),
                    "{which} [{e}]: {} vs {num}",
                    got[e]
                );
            }
        };
        check(0, &da);
        check(1, &db);
        check(2, &dx);
    }
}
