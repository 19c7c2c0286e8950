//! A mixture of experts on the GPU for decode graphs: the router's choices against the CPU's
//! rule (softmax, the largest k in order, renormalised), and each row's expert product against
//! that expert's `matmul`, bit for bit.

use super::gpu;
use crate::common::Rng;
use flywheel_kernels::cuda::DeviceMatrix;
use flywheel_kernels::quant::quantize::quantize;
use flywheel_kernels::QuantType;

/// `moe::route`'s rule for one token: softmax (exp(v − max) / Σ), k times the largest not taken
/// (the first of equals), renormalised with `norm`.
fn route(v: &[f32], k: usize, norm: bool) -> Vec<(u32, f32)> {
    let mx = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = v.iter().map(|x| (x - mx).exp()).collect();
    let sum: f32 = e.iter().sum();
    let p: Vec<f32> = e.iter().map(|x| x / sum).collect();
    let mut out: Vec<(u32, f32)> = Vec::new();
    for _ in 0..k {
        let mut best: Option<usize> = None;
        for (i, &x) in p.iter().enumerate() {
            if !out.iter().any(|c| c.0 as usize == i) && best.is_none_or(|b| x > p[b]) {
                best = Some(i);
            }
        }
        out.push((best.unwrap() as u32, p[best.unwrap()]));
    }
    if norm {
        let s: f32 = out.iter().map(|c| c.1).sum();
        out.iter_mut().for_each(|c| c.1 /= s);
    }
    out
}

#[test]
fn the_router_chooses_as_the_cpu_and_each_row_takes_its_experts_product() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(31);
    for (n, ne, k, norm) in [
        (5usize, 8usize, 3usize, true),
        (4, 16, 1, false),
        (3, 4, 4, true),
    ] {
        let logits = rng.vec(n * ne, 4.0);
        let (mut e, mut w, mut r) = (
            g.zeros::<u32>(n * k).unwrap(),
            g.zeros::<f32>(n * k).unwrap(),
            g.zeros::<u32>(n * k).unwrap(),
        );
        g.moe_route(
            &g.upload(&logits).unwrap(),
            n,
            ne,
            k,
            norm,
            &mut e,
            &mut w,
            &mut r,
        )
        .unwrap();
        let (e, w, r) = (
            g.download(&e).unwrap(),
            g.download(&w).unwrap(),
            g.download(&r).unwrap(),
        );
        for t in 0..n {
            let want = route(&logits[t * ne..(t + 1) * ne], k, norm);
            for (s, &(we, ww)) in want.iter().enumerate() {
                let j = t * k + s;
                assert_eq!(e[j], we, "token {t} choice {s} ({n}×{ne}, k {k})");
                assert!(
                    (w[j] - ww).abs() <= 1e-6 * ww.abs().max(1e-3),
                    "weight {} vs {ww}",
                    w[j]
                );
                assert_eq!(r[j] as usize, j);
            }
        }
    }
    assert!(g
        .moe_route(
            &g.zeros::<f32>(8).unwrap(),
            1,
            8,
            17,
            true,
            &mut g.zeros::<u32>(17).unwrap(),
            &mut g.zeros::<f32>(17).unwrap(),
            &mut g.zeros::<u32>(17).unwrap()
        )
        .is_err());

    // Three Q4_K experts of 40 × 256; rows (token, choice) of 2 tokens × 3 choices.
    let (rows, cols) = (40, 256);
    let experts: Vec<DeviceMatrix> = (0..3)
        .map(|_| {
            let w = quantize(QuantType::Q4K, &rng.vec(rows * cols, 1.0));
            g.matrix(QuantType::Q4K, rows, cols, &w).unwrap()
        })
        .collect();
    let table = g.expert_table(&experts).unwrap();
    let which = [2u32, 0, 1, 1, 1, 0];
    let de = g.upload(&which).unwrap();
    for xdiv in [3usize, 1] {
        let xs = rng.vec(which.len().div_ceil(xdiv) * cols, 1.0);
        let mut y = g.zeros::<f32>(which.len() * rows).unwrap();
        g.matmul_experts(
            &table,
            &de,
            which.len(),
            &g.upload(&xs).unwrap(),
            xdiv,
            &mut y,
        )
        .unwrap();
        let got = g.download(&y).unwrap();
        for (i, &ex) in which.iter().enumerate() {
            let x = g.upload(&xs[(i / xdiv) * cols..][..cols]).unwrap();
            let mut want = g.zeros::<f32>(rows).unwrap();
            g.matmul(&experts[ex as usize], &x, 1, &mut want).unwrap();
            assert_eq!(
                &got[i * rows..(i + 1) * rows],
                &g.download(&want).unwrap()[..],
                "row {i} (expert {ex}, xdiv {xdiv})"
            );
        }
    }
    let odd = g
        .matrix(
            QuantType::Q4_0,
            rows,
            cols,
            &quantize(QuantType::Q4_0, &rng.vec(rows * cols, 1.0)),
        )
        .unwrap();
    assert!(g.expert_table(&[]).is_err());
    let mixed = [experts.into_iter().next().unwrap(), odd];
    assert!(g.expert_table(&mixed).is_err(), "experts of two formats");
}
