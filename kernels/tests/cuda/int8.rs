//! The int8 products on the GPU (`Precision::Int8`): quantize_q8 + matmul_int8 against the CPU's
//! int8 arithmetic (`reference::matmul_int8`) bit for bit, for every format the CPU runs in int8,
//! one token and batches alike (the host twin checks the same arithmetic on every machine,
//! `tests/cuda_twin.rs`; this checks the kernels: their threads, shuffles and launches).

use super::gpu;
use crate::common::Rng;
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
    let Some(g) = gpu() else { return };
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
                g.quantize_q8(&dx, n, cols, &mut q).unwrap();
                assert_eq!(q.holds(), (n, cols));
                let mut dy = g.zeros::<f32>(n * rows).unwrap();
                g.matmul_int8(&dw, &q, &mut dy).unwrap();
                let got = g.download(&dy).unwrap();
                assert!(
                    same(&got[..n * rows], &want),
                    "{} {rows}×{cols}, n={n}: the GPU's int8 product differs from the CPU's \
                     (first at {:?})",
                    ty.name(),
                    (0..n * rows).find(|&i| got[i].to_bits() != want[i].to_bits())
                );
                // The last token alone: the decode kernel.
                let t = n - 1;
                let one = g.upload(&x[t * cols..(t + 1) * cols]).unwrap();
                g.quantize_q8(&one, 1, cols, &mut q).unwrap();
                let mut y1 = g.zeros::<f32>(rows).unwrap();
                g.matmul_int8(&dw, &q, &mut y1).unwrap();
                let y1 = g.download(&y1).unwrap();
                assert!(
                    same(&y1[..rows], &want[t * rows..]),
                    "{}: token {t} of {n} alone differs",
                    ty.name()
                );
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 9 * 3 * 5, "every int8 format, width and batch");
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
