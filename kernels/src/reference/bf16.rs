//! The BF16 products (`Precision::Bf16`) emulated to the bit: rounding as the hardware rounds,
//! `vdpbf16ps`'s pairing and order, the AVX-512 lane sum. The truth `cpu::bf16` is tested against.

use super::*;

/// `x` rounded to BF16 as AVX512_BF16 rounds (`vcvtne2ps2bf16`): to nearest even, denormals to
/// signed zero, NaN quieted; returned as the f32 it stands for.
pub fn bf16_round(x: f32) -> f32 {
    let b = x.to_bits();
    if x.is_nan() {
        return f32::from_bits((b | 0x0040_0000) & 0xffff_0000);
    }
    if b & 0x7f80_0000 == 0 {
        return f32::from_bits(b & 0x8000_0000);
    }
    let lsb = (b >> 16) & 1;
    f32::from_bits(b.wrapping_add(0x7fff + lsb) & 0xffff_0000)
}

/// Denormal results flushed to signed zero (AVX512_BF16's dot products).
fn ftz(x: f32) -> f32 {
    if x != 0.0 && x.is_subnormal() {
        f32::from_bits(x.to_bits() & 0x8000_0000)
    } else {
        x
    }
}

/// The BF16 product (`Precision::Bf16`) emulated to the bit: weights dequantized then rounded,
/// activations rounded (`bf16_round`); per 32 columns, lane j of 16 adds the products of columns
/// 2j+1 then 2j (`vdpbf16ps`: f32 adds, denormals flushed), columns in order; then the lanes are
/// summed in the AVX-512 `reduce_add` order (j + j+8, then + j+4, then + j+2, then + j+1).
/// `cols` a multiple of 32.
pub fn matmul_bf16(ty: QuantType, w: &[u8], rows: usize, cols: usize, x: &[f32], y: &mut [f32]) {
    assert!(
        cols.is_multiple_of(32),
        "BF16 products take rows of 32k values"
    );
    let n = x.len() / cols;
    let rb = ty
        .row_bytes(cols)
        .expect("cols must be a whole number of blocks");
    let xb: Vec<f32> = x.iter().map(|&v| bf16_round(v)).collect();
    let mut wrow = vec![0.0f32; cols];
    for r in 0..rows {
        dequantize_row(ty, &w[r * rb..(r + 1) * rb], &mut wrow);
        for v in wrow.iter_mut() {
            *v = bf16_round(*v);
        }
        for i in 0..n {
            let xi = &xb[i * cols..(i + 1) * cols];
            let mut lane = [0.0f32; 16];
            for c in (0..cols).step_by(32) {
                for (l, acc) in lane.iter_mut().enumerate() {
                    for e in [2 * l + 1, 2 * l] {
                        *acc = ftz(*acc + ftz(wrow[c + e] * xi[c + e]));
                    }
                }
            }
            let h: [f32; 8] = std::array::from_fn(|l| lane[l] + lane[l + 8]);
            let q: [f32; 4] = std::array::from_fn(|l| h[l] + h[l + 4]);
            let p: [f32; 2] = std::array::from_fn(|l| q[l] + q[l + 2]);
            y[i * rows + r] = p[0] + p[1];
        }
    }
}

/// The BF16 input gradient (`Precision::Bf16`) emulated to the bit: dx[i][c] sums, per pair of
/// weight rows (2p, 2p+1) in order, W[2p+1][c]·dy[i][2p+1] then W[2p][c]·dy[i][2p] (f32 adds,
/// denormals flushed), weights and dy rounded to BF16 (`bf16_round`); an odd last row pairs with
/// zero. `cols` a multiple of 16.
pub fn linear_backward_bf16(
    ty: QuantType,
    w: &[u8],
    rows: usize,
    cols: usize,
    dy: &[f32],
    dx: &mut [f32],
) {
    let n = dy.len() / rows;
    let rb = ty.row_bytes(cols).expect("whole blocks");
    let mut wm = vec![0.0f32; rows * cols];
    for r in 0..rows {
        dequantize_row(
            ty,
            &w[r * rb..(r + 1) * rb],
            &mut wm[r * cols..(r + 1) * cols],
        );
    }
    for v in wm.iter_mut() {
        *v = bf16_round(*v);
    }
    for i in 0..n {
        let g: Vec<f32> = dy[i * rows..(i + 1) * rows]
            .iter()
            .map(|&v| bf16_round(v))
            .collect();
        for c in 0..cols {
            let mut acc = 0.0f32;
            for p in 0..rows.div_ceil(2) {
                for r in [2 * p + 1, 2 * p] {
                    if r < rows {
                        acc = ftz(acc + ftz(wm[r * cols + c] * g[r]));
                    } else {
                        acc = ftz(acc + 0.0);
                    }
                }
            }
            dx[i * cols + c] = acc;
        }
    }
}
