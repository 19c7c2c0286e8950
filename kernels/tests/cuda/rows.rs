//! The row-wise adapter ops (`AdapterRows`: what decode graphs with adapters launch) against the
//! per-group ops the eager steps launch, bit for bit, and their checks before launch.

use super::gpu;
use crate::common::Rng;
use flywheel_kernels::cuda::{AdapterEntry, Gpu, LoraLayout};
use flywheel_kernels::QuantType;

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// y (rows, out) += s·B(A x) for one row by the eager ops: matmul of A's bytes, block_matmul of
/// Bᵀ, axpy.
fn lora_eager(g: &Gpu, a: &[f32], bt: &[f32], r: usize, s: f32, x: &[f32], y: &mut [f32]) {
    let (inp, out) = (x.len(), y.len());
    let da = g.upload(&f32_bytes(a)).unwrap();
    let mut h = g.zeros::<f32>(r).unwrap();
    g.matmul_raw(
        QuantType::F32,
        &da,
        r,
        inp,
        &g.upload(x).unwrap(),
        1,
        &mut h,
    )
    .unwrap();
    let mut d = g.zeros::<f32>(out).unwrap();
    g.block_matmul(&h, &g.upload(bt).unwrap(), 1, 1, r, out, &mut d)
        .unwrap();
    let mut dy = g.upload(y).unwrap();
    g.axpy(&mut dy, &d, s, out).unwrap();
    y.copy_from_slice(&g.download(&dy).unwrap());
}

#[test]
fn adapters_row_by_row_equal_the_group_ops_bit_for_bit() {
    let Some(mut g) = gpu() else { return };
    let mut rng = Rng(21);
    // Module 0: 64 → 96; module 1: 2144 → 48 (67 units of 32: past one 64-unit slot pass).
    let dims = vec![(64usize, 96usize), (2144, 48)];
    let mut rows = g.adapter_rows(3, dims.clone(), 8).unwrap();
    // Slot 0: OFT (blocks of 16) on module 0, LoRA r=4 on module 1; slot 1: LoRA r=8 on
    // module 0 only; slot 2: nothing.
    let oft = rng.vec(64 * 16, 0.3);
    let (a0, bt0) = (rng.vec(8 * 64, 0.2), rng.vec(8 * 96, 0.2));
    let (a1, bt1) = (rng.vec(4 * 2144, 0.2), rng.vec(4 * 48, 0.2));
    let d_oft = g.upload(&oft).unwrap();
    let (da0, dbt0) = (g.upload(&f32_bytes(&a0)).unwrap(), g.upload(&bt0).unwrap());
    let (da1, dbt1) = (g.upload(&f32_bytes(&a1)).unwrap(), g.upload(&bt1).unwrap());
    let e_oft = g.oft_entry(&rows, 0, &d_oft.slice(..), 16).unwrap();
    let e_l1 = g
        .lora_entry(&rows, 1, &da1.slice(..), &dbt1.slice(..), 4, 0.5)
        .unwrap();
    let e_l0 = g
        .lora_entry(&rows, 0, &da0.slice(..), &dbt0.slice(..), 8, 2.0)
        .unwrap();
    g.set_slot(&mut rows, 0, &[e_oft, e_l1]).unwrap();
    g.set_slot(&mut rows, 1, &[e_l0, AdapterEntry::default()])
        .unwrap();
    let slots = [0i32, -1, 1, 2, 1];
    let n = slots.len();
    g.set_rows(&mut rows, &slots).unwrap();

    // OFT on module 0: slot 0's row rotated, every other row copied.
    let x = rng.vec(n * 64, 1.0);
    let dx = g.upload(&x).unwrap();
    let mut out = g.zeros::<f32>(n * 64).unwrap();
    g.oft_rows(&rows, 0, &dx, n, &mut out).unwrap();
    let got = g.download(&out).unwrap();
    let mut rot = g.zeros::<f32>(64).unwrap();
    g.block_matmul(&dx.slice(..64), &d_oft, 1, 4, 16, 16, &mut rot)
        .unwrap();
    assert_eq!(&got[..64], &g.download(&rot).unwrap()[..], "OFT row");
    assert_eq!(&got[64..], &x[64..], "rows without OFT are copies");

    // LoRA on module 0 (slot 1's rows 2 and 4) and module 1 (slot 0's row 0), A·x in each layout.
    for (layout, (m, want_rows)) in LoraLayout::ALL
        .into_iter()
        .flat_map(|l| [(0usize, vec![(2usize, 8usize)]), (1, vec![(0, 4)])].map(|c| (l, c)))
    {
        g.set_lora_layout(layout);
        let (inp, out_d) = dims[m];
        let x = rng.vec(n * inp, 1.0);
        let y0 = rng.vec(n * out_d, 1.0);
        let mut dy = g.upload(&y0).unwrap();
        let mut h = g.zeros::<f32>(n * 8).unwrap();
        g.lora_rows(&rows, m, &g.upload(&x).unwrap(), n, 8, &mut h, &mut dy)
            .unwrap();
        let got = g.download(&dy).unwrap();
        let mut want = y0.clone();
        for t in 0..n {
            let adapted = match (m, slots[t]) {
                (0, 1) => Some((&a0, &bt0, 8, 2.0)),
                (1, 0) => Some((&a1, &bt1, 4, 0.5)),
                _ => None,
            };
            if let Some((a, bt, r, s)) = adapted {
                let yr = &mut want[t * out_d..(t + 1) * out_d];
                lora_eager(&g, a, bt, r, s, &x[t * inp..(t + 1) * inp], yr);
            }
        }
        assert!(want_rows
            .iter()
            .all(|&(t, _)| want[t * out_d..][..out_d] != y0[t * out_d..][..out_d]));
        assert_eq!(got, want, "LoRA on module {m}, {}", layout.name());
    }
    g.set_lora_layout(LoraLayout::default());

    // Checked before launch: shapes, slots, ranks.
    assert!(g.oft_entry(&rows, 0, &d_oft.slice(..100), 16).is_err());
    assert!(g.oft_entry(&rows, 0, &d_oft.slice(..), 12).is_err());
    assert!(g
        .lora_entry(&rows, 1, &da0.slice(..), &dbt0.slice(..), 8, 1.0)
        .is_err());
    assert!(g.oft_entry(&rows, 2, &d_oft.slice(..), 16).is_err());
    assert!(g.set_slot(&mut rows, 3, &[e_oft, e_l1]).is_err());
    assert!(g.set_slot(&mut rows, 0, &[e_oft]).is_err());
    assert!(g.set_rows(&mut rows, &[0, 3]).is_err());
    let (mut h, mut y) = (g.zeros::<f32>(64).unwrap(), g.zeros::<f32>(n * 96).unwrap());
    let dx = g.upload(&rng.vec(n * 64, 1.0)).unwrap();
    assert!(
        g.lora_rows(&rows, 0, &dx, n, 4, &mut h, &mut y).is_err(),
        "a rank past r_max"
    );
    assert!(
        g.lora_rows(&rows, 0, &dx, n + 1, 8, &mut h, &mut y)
            .is_err(),
        "rows not set"
    );
}
