//! The CUDA kernels against the CPU's (feature `cuda`). On every machine: ptxas's report (no
//! spills, registers and shared memory within the devices' limits, every kernel for sm_80 and
//! sm_90). On a GPU: each op against its CPU twin at a stated tolerance, or bit for bit where the
//! arithmetic is the same (dequantization, RoPE, the cache's writes), batch invariance, and a
//! CUDA graph's replay against eager launches. Without a GPU those say so and pass, unless
//! FLYWHEEL_REQUIRE_GPU=1 (the proof script's setting), where they fail.
#![cfg(feature = "cuda")]

#[path = "cuda/attention.rs"]
mod attention;
#[path = "cuda/backward.rs"]
mod backward;
mod common;
#[path = "cuda/draw.rs"]
mod draw;
#[path = "cuda/int8.rs"]
mod int8;
#[path = "cuda/moe.rs"]
mod moe;
#[path = "cuda/ptxas.rs"]
mod ptxas;
#[path = "cuda/rows.rs"]
mod rows;

use common::{seq, Rng};
use flywheel_kernels::cpu::ops;
use flywheel_kernels::cuda::{BatchProduct, DecodeProduct, Gpu, Products};
use flywheel_kernels::quant::quantize::quantize;
use flywheel_kernels::reference::{self, RopeLayout};
use flywheel_kernels::QuantType;

/// The GPU, or None after saying why there is none (a failure where one is required).
fn gpu() -> Option<Gpu> {
    match Gpu::open(0) {
        Ok(g) => {
            eprintln!("GPU: {}", g.describe());
            Some(g)
        }
        Err(e) if std::env::var("FLYWHEEL_REQUIRE_GPU").as_deref() == Ok("1") => {
            panic!("FLYWHEEL_REQUIRE_GPU=1 and no GPU: {e}")
        }
        Err(e) => {
            eprintln!("skipped: no GPU here ({e})");
            None
        }
    }
}

/// |a − b| ≤ tol · scale at every index, else the first index that is not.
fn close(got: &[f32], want: &[f32], tol: impl Fn(usize) -> f32) -> Result<(), String> {
    assert_eq!(got.len(), want.len());
    // A NaN is never within tolerance.
    let within = |i: usize| (got[i] - want[i]).abs() <= tol(i);
    match (0..got.len()).find(|&i| !within(i)) {
        None => Ok(()),
        Some(i) => Err(format!(
            "at {i}: {} vs {} (tolerance {})",
            got[i],
            want[i],
            tol(i)
        )),
    }
}

fn dequantize(ty: QuantType, w: &[u8], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; rows * cols];
    let rb = ty.row_bytes(cols).unwrap();
    for r in 0..rows {
        reference::dequantize_row(
            ty,
            &w[r * rb..(r + 1) * rb],
            &mut out[r * cols..(r + 1) * cols],
        );
    }
    out
}

/// Matmul of every format against the reference's f64 sums, within 1e-5 of Σ|w·x| (f32 sums of
/// up to 8448 terms in another order); each token's row equal, bit for bit, to the same token
/// alone (batch invariance), and every product layout (`Products`) equal to the default's bit for
/// bit; embedding rows equal to the CPU's dequantization bit for bit.
#[test]
fn matmul_and_embedding_match_the_cpu_for_every_format() {
    let Some(mut g) = gpu() else { return };
    // Each decode layout beside the default batch one and each batch layout beside the default
    // decode one (a decode layout runs one token, a batch layout more: every kernel is launched).
    let d = Products::default();
    let layouts: Vec<Products> = DecodeProduct::ALL
        .map(|decode| Products { decode, ..d })
        .into_iter()
        .chain(
            BatchProduct::ALL
                .into_iter()
                .filter(|&b| b != d.batch)
                .map(|batch| Products { batch, ..d }),
        )
        .collect();
    // Under racecheck (`scripts/gpu_proof.sh check`) the whole test ran past 3 minutes and the
    // sanitizer ended it with no report (2026-11-27, an H200): FLYWHEEL_CUDA_TEST_QUICK keeps the
    // narrowest and widest rows and 1 and 13 tokens, every format and layout still launched.
    let quick = std::env::var_os("FLYWHEEL_CUDA_TEST_QUICK").is_some();
    let ns: &[usize] = if quick { &[1, 13] } else { &[1, 3, 8, 13, 17] };
    let mut rng = Rng(3);
    for ty in QuantType::ALL {
        // The widest rows take several of the kernels' staging chunks (4 KB each).
        let col_sizes: &[usize] = match (ty.block_size() == 256, quick) {
            (true, false) => &[256, 1024, 8448],
            (true, true) => &[256, 8448],
            (false, false) => &[96, 1024, 8288],
            (false, true) => &[96, 8288],
        };
        for &cols in col_sizes {
            let rows = 67;
            let w = quantize(ty, &rng.vec(rows * cols, 1.0));
            let wf = dequantize(ty, &w, rows, cols);
            let dw = g.matrix(ty, rows, cols, &w).unwrap();
            for &n in ns {
                let x = rng.vec(n * cols, 1.0);
                let mut want = vec![0f32; n * rows];
                reference::matmul(ty, &w, rows, cols, &x, &mut want);
                let dx = g.upload(&x).unwrap();
                let mut dy = g.zeros::<f32>(n * rows).unwrap();
                g.matmul(&dw, &dx, n, &mut dy).unwrap();
                let got = g.download(&dy).unwrap();
                let mag: Vec<f32> = (0..n * rows)
                    .map(|i| {
                        let (t, r) = (i / rows, i % rows);
                        (0..cols)
                            .map(|c| (wf[r * cols + c] * x[t * cols + c]).abs())
                            .sum()
                    })
                    .collect();
                close(&got[..n * rows], &want, |i| 1e-5 * mag[i] + 1e-6)
                    .unwrap_or_else(|e| panic!("{} {rows}×{cols}, n={n}: {e}", ty.name()));
                // Batch invariance: each token alone gives the same bits (in the default layout
                // every token, in the others the first and the last: a launch each keeps the
                // proof's memcheck of this test short); so does the batch in every layout.
                for &p in &layouts {
                    g.set_products(p);
                    let mut dy = g.zeros::<f32>(n * rows).unwrap();
                    g.matmul(&dw, &dx, n, &mut dy).unwrap();
                    assert!(
                        g.download(&dy).unwrap() == got,
                        "{} {rows}×{cols}, n={n}: {} differs from {}",
                        ty.name(),
                        p.describe(),
                        Products::default().describe()
                    );
                    let alone: Vec<usize> = if p == Products::default() {
                        (0..n).collect()
                    } else {
                        vec![0, n - 1]
                    };
                    for t in alone {
                        let one = g.upload(&x[t * cols..(t + 1) * cols]).unwrap();
                        let mut y1 = g.zeros::<f32>(rows).unwrap();
                        g.matmul(&dw, &one, 1, &mut y1).unwrap();
                        let y1 = g.download(&y1).unwrap();
                        assert_eq!(
                            &y1[..rows],
                            &got[t * rows..(t + 1) * rows],
                            "{}: token {t} of {n} differs from itself alone ({})",
                            ty.name(),
                            p.describe()
                        );
                    }
                }
                g.set_products(Products::default());
            }
            let tokens = [0u32, 66, 5, 5, 31];
            let mut out = g.zeros::<f32>(tokens.len() * cols).unwrap();
            g.embed_checked(&dw, &tokens, &mut out).unwrap();
            let got = g.download(&out).unwrap();
            for (i, &t) in tokens.iter().enumerate() {
                let want = &wf[t as usize * cols..(t as usize + 1) * cols];
                let row = &got[i * cols..(i + 1) * cols];
                assert!(
                    row.iter()
                        .zip(want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{}: embedding row {t} differs from the CPU's dequantization",
                    ty.name()
                );
            }
            assert!(g.embed_checked(&dw, &[rows as u32], &mut out).is_err());
        }
    }
}

#[test]
fn row_and_elementwise_ops_match_the_cpu() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(5);
    let (rows, d) = (7, 576);
    let x = rng.vec(rows * d, 2.0);
    let w = rng.vec(d, 1.0);
    let mut want = vec![0f32; rows * d];
    reference::rmsnorm(&x, &w, 1e-5, &mut want);
    let (dx, dw) = (g.upload(&x).unwrap(), g.upload(&w).unwrap());
    let mut out = g.zeros::<f32>(rows * d).unwrap();
    g.rmsnorm(&dx, &dw, 1e-5, rows, &mut out).unwrap();
    close(&g.download(&out).unwrap(), &want, |i| {
        2e-6 + 2e-6 * want[i].abs()
    })
    .unwrap_or_else(|e| panic!("rmsnorm: {e}"));
    // The residual add and the next norm in one launch: the two kernels' bits, at widths that
    // leave threads with fewer values than others (576, 2100) and several passes (5000).
    for d in [576usize, 2100, 5000] {
        let (x, y, w) = (
            rng.vec(rows * d, 2.0),
            rng.vec(rows * d, 2.0),
            rng.vec(d, 1.0),
        );
        let (dy, dw) = (g.upload(&y).unwrap(), g.upload(&w).unwrap());
        let mut x1 = g.upload(&x).unwrap();
        let mut want = g.zeros::<f32>(rows * d).unwrap();
        g.add(&mut x1, &dy, rows * d).unwrap();
        g.rmsnorm(&x1, &dw, 1e-5, rows, &mut want).unwrap();
        let mut x2 = g.upload(&x).unwrap();
        let mut got = g.zeros::<f32>(rows * d).unwrap();
        g.add_rmsnorm(&mut x2, &dy, &dw, 1e-5, rows, &mut got)
            .unwrap();
        assert_eq!(
            g.download(&x2).unwrap(),
            g.download(&x1).unwrap(),
            "add_rmsnorm x {d}"
        );
        assert_eq!(
            g.download(&got).unwrap(),
            g.download(&want).unwrap(),
            "add_rmsnorm {d}"
        );
    }

    // RoPE: the CPU's arithmetic in its order, so the same bits, in both layouts.
    let (n, heads, hd, rd) = (5, 3, 64, 32);
    let positions = [0u32, 1, 17, 300, 4095];
    let table = ops::rope_table(&positions, rd, 10000.0, None);
    for layout in [RopeLayout::Adjacent, RopeLayout::Neox] {
        let x = rng.vec(n * heads * hd, 1.0);
        let mut want = x.clone();
        ops::rope(&mut want, &table, heads, hd, rd, layout);
        let mut dx = g.upload(&x).unwrap();
        let dt = g.upload(&table).unwrap();
        g.rope(&mut dx, &dt, n, heads, hd, rd, layout).unwrap();
        assert_eq!(g.download(&dx).unwrap(), want, "rope {layout:?}");
        // Queries and keys (here 3 and 2 heads) in one launch: the same bits.
        let k = rng.vec(n * 2 * hd, 1.0);
        let mut want_k = k.clone();
        ops::rope(&mut want_k, &table, 2, hd, rd, layout);
        let (mut dq, mut dk) = (g.upload(&x).unwrap(), g.upload(&k).unwrap());
        g.rope_qk(&mut dq, &mut dk, &dt, n, (heads, 2), hd, rd, layout)
            .unwrap();
        assert_eq!(g.download(&dq).unwrap(), want, "rope_qk q {layout:?}");
        assert_eq!(g.download(&dk).unwrap(), want_k, "rope_qk k {layout:?}");
    }

    // SwiGLU and GeGLU: expf against f64's exp, a few ulps.
    let m = 10_000;
    let gate = rng.vec(m, 8.0);
    let up = rng.vec(m, 2.0);
    let (dg, du) = (g.upload(&gate).unwrap(), g.upload(&up).unwrap());
    let mut dout = g.zeros::<f32>(m).unwrap();
    let mut want = vec![0f32; m];
    reference::swiglu(&gate, &up, &mut want);
    g.swiglu(&dg, &du, m, &mut dout).unwrap();
    close(&g.download(&dout).unwrap(), &want, |i| {
        1e-6 + 1e-5 * want[i].abs()
    })
    .unwrap_or_else(|e| panic!("swiglu: {e}"));
    reference::geglu(&gate, &up, &mut want);
    g.geglu(&dg, &du, m, &mut dout).unwrap();
    close(&g.download(&dout).unwrap(), &want, |i| {
        1e-6 + 1e-5 * want[i].abs()
    })
    .unwrap_or_else(|e| panic!("geglu: {e}"));

    // The residual add: one rounding, the same bits.
    let mut dx = g.upload(&gate).unwrap();
    g.add(&mut dx, &du, m).unwrap();
    let want: Vec<f32> = gate.iter().zip(&up).map(|(a, b)| a + b).collect();
    assert_eq!(g.download(&dx).unwrap(), want, "add");

    // Scale, axpy and bias: the CPU's roundings, the same bits.
    let mut dx = g.upload(&gate).unwrap();
    g.scale(&mut dx, 1.7, m).unwrap();
    let want: Vec<f32> = gate.iter().map(|a| a * 1.7).collect();
    assert_eq!(g.download(&dx).unwrap(), want, "scale");
    g.axpy(&mut dx, &du, 0.3, m).unwrap();
    let want: Vec<f32> = want.iter().zip(&up).map(|(a, b)| a + b * 0.3).collect();
    assert_eq!(g.download(&dx).unwrap(), want, "axpy");
    let bias = rng.vec(100, 1.0);
    let mut dx = g.upload(&gate).unwrap();
    g.add_bias(&mut dx, &g.upload(&bias).unwrap(), m / 100)
        .unwrap();
    let want: Vec<f32> = gate
        .iter()
        .enumerate()
        .map(|(i, a)| a + bias[i % 100])
        .collect();
    assert_eq!(g.download(&dx).unwrap(), want, "add_bias");
    // Gathered rows are copies; a view of a buffer works in place of the buffer.
    let idx = [7u32, 0, 99, 7];
    let mut rows_out = g.zeros::<f32>(4 * 100).unwrap();
    let di = g.upload(&idx).unwrap();
    g.gather_rows(&dg.slice(..), &di, 4, 100, &mut rows_out)
        .unwrap();
    let want: Vec<f32> = idx
        .iter()
        .flat_map(|&r| gate[r as usize * 100..][..100].to_vec())
        .collect();
    assert_eq!(g.download(&rows_out).unwrap(), want, "gather_rows");
    // Block-diagonal products (OFT's rotations, LoRA's B) against f64 sums.
    let (bn, nb, bk, bm) = (5, 3, 32, 16);
    let bx = rng.vec(bn * nb * bk, 1.0);
    let mats = rng.vec(nb * bk * bm, 1.0);
    let mut want = vec![0f32; bn * nb * bm];
    reference::block_matmul(&bx, &mats, nb, bk, bm, &mut want);
    let mut dout = g.zeros::<f32>(bn * nb * bm).unwrap();
    let (dbx, dm) = (g.upload(&bx).unwrap(), g.upload(&mats).unwrap());
    g.block_matmul(&dbx, &dm, bn, nb, bk, bm, &mut dout)
        .unwrap();
    close(&g.download(&dout).unwrap(), &want, |_| 1e-5 * bk as f32)
        .unwrap_or_else(|e| panic!("block_matmul: {e}"));

    // The MoE's weighted sum: the CPU's order and roundings, the same bits.
    let (mt, mk, mh) = (3, 2, 64);
    let out = rng.vec(mt * mk * mh, 1.0);
    let row_of: Vec<u32> = vec![5, 0, 1, 4, 3, 2];
    let wts = rng.vec(mt * mk, 1.0);
    let mut y = g.zeros::<f32>(mt * mh).unwrap();
    let (dout, drow, dw) = (
        g.upload(&out).unwrap(),
        g.upload(&row_of).unwrap(),
        g.upload(&wts).unwrap(),
    );
    g.moe_combine(&dout, &drow, &dw, mt, mk, mh, &mut y)
        .unwrap();
    let mut want = vec![0f32; mt * mh];
    for t in 0..mt {
        for s in 0..mk {
            let (w, r) = (wts[t * mk + s], row_of[t * mk + s] as usize);
            for c in 0..mh {
                want[t * mh + c] += w * out[r * mh + c];
            }
        }
    }
    assert_eq!(g.download(&y).unwrap(), want, "moe_combine");

    // Log-softmax at temperature 0.7 against f64 sums; argmax with ties (the first wins).
    let (r, vocab) = (3, 49_152);
    let mut logits = rng.vec(r * vocab, 12.0);
    logits[vocab + 100] = 50.0;
    logits[vocab + 40_000] = 50.0;
    let mut dl = g.upload(&logits).unwrap();
    let mut best = g.zeros::<u32>(r).unwrap();
    g.argmax(&dl, r, vocab, &mut best).unwrap();
    let want_best: Vec<u32> = logits
        .chunks(vocab)
        .map(|row| {
            let mx = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            row.iter().position(|&v| v == mx).unwrap() as u32
        })
        .collect();
    assert_eq!(g.download(&best).unwrap(), want_best);
    assert_eq!(want_best[1], 100);
    g.log_softmax(&mut dl, r, vocab, 0.7).unwrap();
    let mut want: Vec<f32> = logits.iter().map(|v| v / 0.7).collect();
    want.chunks_mut(vocab).for_each(reference::log_softmax);
    close(&g.download(&dl).unwrap(), &want, |i| {
        1e-4 + 1e-6 * want[i].abs()
    })
    .unwrap_or_else(|e| panic!("log_softmax: {e}"));
}

/// Bad arguments are refused on the host, before a kernel could read out of bounds.
#[test]
fn bad_shapes_are_refused_before_launch() {
    let Some(g) = gpu() else { return };
    let w = quantize(QuantType::Q4_0, &vec![0.5; 64 * 64]);
    assert!(g
        .matrix(QuantType::Q4_0, 64, 64, &w[..w.len() - 1])
        .is_err());
    let dw = g.matrix(QuantType::Q4_0, 64, 64, &w).unwrap();
    let x = g.zeros::<f32>(64).unwrap();
    let mut y = g.zeros::<f32>(64).unwrap();
    assert!(
        g.matmul(&dw, &x, 2, &mut y).is_err(),
        "x too short for 2 tokens"
    );
    let table = [3u32];
    let past = [seq(0, 1, 0, &table)];
    assert!(
        g.tokens(&past, 16, 3).is_err(),
        "block 3 of a 3-block cache"
    );
    let long = [seq(0, 1, 16, &[0])];
    assert!(
        g.tokens(&long, 16, 3).is_err(),
        "position 16 in one block of 16"
    );
    let toks = g.tokens(&[seq(0, 1, 0, &[0])], 16, 1).unwrap();
    let kc = g.zeros::<f32>(16 * 64).unwrap();
    let mut out = g.zeros::<f32>(64).unwrap();
    assert!(
        g.attention(&x, &mut out, &toks, &kc, &kc, 2, 0, 32, 1.0, None)
            .is_err(),
        "0 KV heads"
    );
    assert!(
        g.attention(&x, &mut out, &toks, &kc, &kc, 3, 2, 32, 1.0, None)
            .is_err(),
        "3 over 2"
    );
}

/// A CUDA graph of a forward's ops replays equal to eager launches, with inputs rewritten between
/// replays (the decode loop's pattern), and after its weights' buffer is rewritten in place.
#[test]
fn a_captured_graph_replays_equal_to_eager_launches() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(9);
    let (rows, cols, n) = (256, 512, 4);
    let w = quantize(QuantType::Q4_0, &rng.vec(rows * cols, 1.0));
    let dw = g.matrix(QuantType::Q4_0, rows, cols, &w).unwrap();
    let norm = g.upload(&rng.vec(rows, 1.0)).unwrap();
    let mut x = g.zeros::<f32>(n * cols).unwrap();
    let mut y = g.zeros::<f32>(n * rows).unwrap();
    let mut z = g.zeros::<f32>(n * rows).unwrap();
    let step = |x: &cudarc::driver::CudaSlice<f32>, y: &mut _, z: &mut _| {
        g.matmul(&dw, x, n, y).unwrap();
        g.rmsnorm(y, &norm, 1e-6, n, z).unwrap();
        g.add(z, y, n * rows).unwrap();
    };
    let eager = |input: &[f32]| -> Vec<f32> {
        let dx = g.upload(input).unwrap();
        let mut y = g.zeros::<f32>(n * rows).unwrap();
        let mut z = g.zeros::<f32>(n * rows).unwrap();
        g.matmul(&dw, &dx, n, &mut y).unwrap();
        g.rmsnorm(&y, &norm, 1e-6, n, &mut z).unwrap();
        g.add(&mut z, &y, n * rows).unwrap();
        g.download(&z).unwrap()
    };
    let s = g.stream().clone();
    s.begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    step(&x, &mut y, &mut z);
    let graph = s
        .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("a graph");
    for round in 0..3 {
        let input = rng.vec(n * cols, 1.0);
        g.write(&input, &mut x).unwrap();
        graph.launch().unwrap();
        assert_eq!(g.download(&z).unwrap(), eager(&input), "replay {round}");
    }
}
