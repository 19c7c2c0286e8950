//! The int8 products on the GPU (`Precision::Int8`): quantize_q8 + matmul_int8 against the CPU's
//! int8 arithmetic (`reference::matmul_int8`) bit for bit, for every format the CPU runs in int8,
//! one token and batches alike (the host twin checks the same arithmetic on every machine,
//! `tests/cuda_twin.rs`; this checks the kernels: their threads, shuffles and launches).

use super::gpu;
use crate::common::Rng;
use flywheel_kernels::cuda::Int8Layout;
use flywheel_kernels::quant::quantize::quantize;
use flywheel_kernels::reference;
use flywheel_kernels::QuantType;

fn same(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
}

#[test]
fn int8_products_equal_the_cpus_bit_for_bit_alone_and_in_batches() {
    let Some(mut g) = gpu() else { return };
    let mut rng = Rng(31);
    let mut q = g.q8_acts(17, 8448).unwrap();
    let mut checked = 0;
    for ty in QuantType::ALL {
        let widths: &[usize] = if ty.block_size() == 256 {
            &[256, 2816, 8448]
        } else {
            &[96, 800, 8288]
        };
        if !reference::int8_applies(ty, widths[0]) {
            continue;
        }
        for &cols in widths {
            let rows = 67;
            let w = quantize(ty, &rng.vec(rows * cols, 1.0));
            let dw = g.matrix(ty, rows, cols, &w).unwrap();
            for n in [1usize, 3, 8, 13, 17] {
                let mut x = rng.vec(n * cols, 2.0);
                x[40..72].fill(0.0); // a block of zeros: d = 0
                let mut want = vec![0f32; n * rows];
                reference::matmul_int8(ty, &w, rows, cols, &x, &mut want);
                let dx = g.upload(&x).unwrap();
                let one = g.upload(&x[(n - 1) * cols..]).unwrap();
                for layout in [Int8Layout::Lanes, Int8Layout::Quads] {
                    g.set_int8_layout(layout);
                    g.quantize_q8(&dx, n, cols, &mut q).unwrap();
                    assert_eq!(q.holds(), (n, cols));
                    let mut dy = g.zeros::<f32>(n * rows).unwrap();
                    g.matmul_int8(&dw, &q, &mut dy).unwrap();
                    let got = g.download(&dy).unwrap();
                    assert!(
                        same(&got[..n * rows], &want),
                        "{} {rows}×{cols}, n={n}, {}: the GPU's int8 product differs from the \
                         CPU's (first at {:?})",
                        ty.name(),
                        layout.name(),
                        (0..n * rows).find(|&i| got[i].to_bits() != want[i].to_bits())
                    );
                    // The last token alone: the decode kernel.
                    g.quantize_q8(&one, 1, cols, &mut q).unwrap();
                    let mut y1 = g.zeros::<f32>(rows).unwrap();
                    g.matmul_int8(&dw, &q, &mut y1).unwrap();
                    let y1 = g.download(&y1).unwrap();
                    assert!(
                        same(&y1[..rows], &want[(n - 1) * rows..]),
                        "{} {rows}×{cols}, {}: token {} of {n} alone differs",
                        ty.name(),
                        layout.name(),
                        n - 1
                    );
                    checked += 1;
                }
                g.set_int8_layout(Int8Layout::default());
            }
        }
    }
    assert_eq!(
        checked,
        9 * 3 * 5 * 2,
        "every int8 format, width, batch and layout"
    );
}

#[test]
fn int8_products_refuse_what_they_do_not_run() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(32);
    let mut q = g.q8_acts(4, 512).unwrap();
    let x = g.upload(&rng.vec(4 * 512, 1.0)).unwrap();
    assert!(
        g.quantize_q8(&x, 5, 256, &mut q).is_err(),
        "more tokens than room"
    );
    assert!(
        g.quantize_q8(&x, 1, 1024, &mut q).is_err(),
        "wider than room"
    );
    assert!(
        g.quantize_q8(&x, 1, 100, &mut q).is_err(),
        "not whole blocks"
    );
    g.quantize_q8(&x, 2, 256, &mut q).unwrap();
    let f16 = g
        .matrix(
            QuantType::F16,
            3,
            256,
            &quantize(QuantType::F16, &rng.vec(768, 1.0)),
        )
        .unwrap();
    let mut y = g.zeros::<f32>(8).unwrap();
    let e = g.matmul_int8(&f16, &q, &mut y).unwrap_err().0;
    assert!(e.contains("no int8 product"), "{e}");
    let q4 = g
        .matrix(
            QuantType::Q4_0,
            3,
            512,
            &quantize(QuantType::Q4_0, &rng.vec(1536, 1.0)),
        )
        .unwrap();
    let e = g.matmul_int8(&q4, &q, &mut y).unwrap_err().0;
    assert!(e.contains("256 values for a matrix of 512"), "{e}");
}

/// A mixture of experts' rows in int8 (`matmul_experts_int8`, decode graphs) and a range of
/// tokens (`matmul_int8_range`, prefill's rows grouped by expert): each row equal to its expert's
/// `matmul_int8` of the same token, bit for bit.
#[test]
fn int8_expert_rows_and_token_ranges_equal_whole_products() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(33);
    for (ty, rows, cols) in [(QuantType::Q4K, 45, 512), (QuantType::Q8_0, 33, 96)] {
        let experts: Vec<_> = (0..3)
            .map(|_| {
                let w = quantize(ty, &rng.vec(rows * cols, 1.0));
                g.matrix(ty, rows, cols, &w).unwrap()
            })
            .collect();
        let table = g.expert_table(&experts).unwrap();
        let (n, k) = (5usize, 2usize);
        let x = g.upload(&rng.vec(n * k * cols, 1.0)).unwrap();
        // Each token's (and each row's) products by every expert, whole.
        let mut q = g.q8_acts(n * k, cols).unwrap();
        let mut whole = Vec::new();
        for m in [n, n * k] {
            g.quantize_q8(&x, m, cols, &mut q).unwrap();
            let per: Vec<Vec<f32>> = experts
                .iter()
                .map(|e| {
                    let mut y = g.zeros::<f32>(m * rows).unwrap();
                    g.matmul_int8(e, &q, &mut y).unwrap();
                    g.download(&y).unwrap()
                })
                .collect();
            whole.push(per);
        }
        let choice: Vec<u32> = (0..n * k).map(|i| ((i * 7 + 1) % 3) as u32).collect();
        let dc = g.upload(&choice).unwrap();
        // xdiv = k: row r reads token r / k (the gate and up); xdiv = 1: its own row (the down).
        for (xdiv, m, per) in [(k, n, &whole[0]), (1, n * k, &whole[1])] {
            g.quantize_q8(&x, m, cols, &mut q).unwrap();
            let mut y = g.zeros::<f32>(n * k * rows).unwrap();
            g.matmul_experts_int8(&table, &dc, n * k, &q, xdiv, &mut y)
                .unwrap();
            let y = g.download(&y).unwrap();
            for r in 0..n * k {
                let (e, t) = (choice[r] as usize, r / xdiv);
                assert!(
                    same(
                        &y[r * rows..(r + 1) * rows],
                        &per[e][t * rows..(t + 1) * rows]
                    ),
                    "{} row {r} (expert {e}, token {t}, xdiv {xdiv})",
                    ty.name()
                );
            }
        }
        // Tokens 3..7 of the n·k rows alone.
        let mut y = g.zeros::<f32>(4 * rows).unwrap();
        g.matmul_int8_range(&experts[1], &q, 3..7, &mut y).unwrap();
        let y = g.download(&y).unwrap();
        assert!(
            same(&y[..4 * rows], &whole[1][1][3 * rows..7 * rows]),
            "{}: a range of tokens differs from the whole product's rows",
            ty.name()
        );
        let mut past = g.zeros::<f32>(2 * rows).unwrap();
        let e = g
            .matmul_int8_range(&experts[1], &q, 9..11, &mut past)
            .unwrap_err()
            .0;
        assert!(e.contains("int8 tokens 9..11 of 10"), "{e}");
    }
}
