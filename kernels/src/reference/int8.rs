//! The int8 products (`Precision::Int8`) emulated to the bit, and the one activation quantizer
//! that both they and the VNNI kernels (`cpu::int8`) run.
//!
//! Activations are quantized per block of 32 values as llama.cpp's Q8 does: d = max|x| / 127,
//! q = x / d rounded to nearest even (−127..127). The weights' own integer codes (Q4_0: q − 8,
//! Q4_1: q, Q8_0: q) are dotted with them exactly in integers; each block's integer sums are
//! scaled in f32. The layout is the kernels', so that one 512-bit register holds two blocks:
//!
//! - per pair of blocks (b, b+1) 64 bytes: x_b[0..16], x_{b+1}[0..16], x_b[16..32],
//!   x_{b+1}[16..32] (a missing last block reads as zeros);
//! - lane L (0..16) of a pair sums the 4 bytes 4L..4L+4: block b + (L/4)%2, values
//!   4·((L/8)·4 + L%4) onwards;
//! - per pair 16 lanes of f32 `d` (the lane's block scale) and `s` (d times the lane's 4 codes
//!   summed: Q4_1's min term).
//!
//! One output y[i][r]: 16 f32 lanes A, pairs in order; per lane A = fma(isum, dw·dx, A), then
//! for Q4_1 A = fma(m, s, A) (m the block's min); the lanes summed in the AVX-512 `reduce_add`
//! order. No term depends on the batch.

use super::*;

/// Values per block and bytes of codes per pair of blocks.
pub const Q8_BLOCK: usize = 32;
pub const Q8_PAIR_BYTES: usize = 64;

/// Whether a product in format `ty` over rows of `cols` values takes the int8 path under
/// `Precision::Int8` (the others stay exact f32: a choice by format and shape, never by batch).
pub fn int8_applies(ty: QuantType, cols: usize) -> bool {
    matches!(ty, QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q8_0)
        && cols.is_multiple_of(Q8_BLOCK)
}

/// Pairs of blocks in a row of `cols` values.
pub fn q8_pairs(cols: usize) -> usize {
    cols.div_ceil(2 * Q8_BLOCK)
}

/// Quantize rows of `cols` values (`cols` a multiple of 32) into the pair layout above: `q` holds
/// q8_pairs(cols)·64 codes per row, `d` and `s` q8_pairs(cols)·16 lanes per row.
pub fn quantize_rows_q8(x: &[f32], cols: usize, q: &mut [i8], d: &mut [f32], s: &mut [f32]) {
    assert!(cols.is_multiple_of(Q8_BLOCK), "int8 rows take 32k values");
    let np = q8_pairs(cols);
    let n = x.len() / cols;
    assert!(q.len() >= n * np * Q8_PAIR_BYTES && d.len() >= n * np * 16 && s.len() >= n * np * 16);
    for i in 0..n {
        let xr = &x[i * cols..(i + 1) * cols];
        for p in 0..np {
            let (qp, dp, sp) = (
                &mut q[(i * np + p) * 64..(i * np + p + 1) * 64],
                &mut d[(i * np + p) * 16..(i * np + p + 1) * 16],
                &mut s[(i * np + p) * 16..(i * np + p + 1) * 16],
            );
            for half in 0..2 {
                let b = 2 * p + half;
                let mut codes = [0i8; 32];
                let mut scale = 0.0f32;
                if (b + 1) * Q8_BLOCK <= cols {
                    let xb = &xr[b * 32..(b + 1) * 32];
                    let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                    scale = amax / 127.0;
                    let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
                    for (c, v) in codes.iter_mut().zip(xb) {
                        *c = (v * inv).round_ties_even() as i8;
                    }
                }
                for k in 0..16 {
                    qp[half * 16 + k] = codes[k];
                    qp[32 + half * 16 + k] = codes[16 + k];
                }
                for l in 0..4 {
                    for (lane, first) in [(half * 4 + l, 4 * l), (8 + half * 4 + l, 16 + 4 * l)] {
                        let sum: i32 = codes[first..first + 4].iter().map(|&c| c as i32).sum();
                        dp[lane] = scale;
                        sp[lane] = scale * sum as f32;
                    }
                }
            }
        }
    }
}

/// Block `b` of a row as the int8 products read it: its 32 integer codes, its scale, its min
/// (0 but for Q4_1).
pub fn int8_codes(ty: QuantType, row: &[u8], b: usize) -> ([i32; 32], f32, f32) {
    let bb = ty.block_bytes();
    let blk = &row[b * bb..(b + 1) * bb];
    let half = |at: usize| f16_to_f32(u16::from_le_bytes([blk[at], blk[at + 1]]));
    let mut c = [0i32; 32];
    match ty {
        QuantType::Q4_0 | QuantType::Q4_1 => {
            let (at, off) = if ty == QuantType::Q4_0 { (2, 8) } else { (4, 0) };
            for k in 0..16 {
                c[k] = (blk[at + k] & 0xF) as i32 - off;
                c[16 + k] = (blk[at + k] >> 4) as i32 - off;
            }
            let m = if ty == QuantType::Q4_1 { half(2) } else { 0.0 };
            (c, half(0), m)
        }
        QuantType::Q8_0 => {
            for k in 0..32 {
                c[k] = blk[2 + k] as i8 as i32;
            }
            (c, half(0), 0.0)
        }
        _ => panic!("no int8 products for {ty:?}"),
    }
}

/// The int8 product (`Precision::Int8`) emulated to the bit: y (n, rows) = x (n, cols) · Wᵀ as
/// the module doc defines it. `int8_applies(ty, cols)` must hold.
pub fn matmul_int8(ty: QuantType, w: &[u8], rows: usize, cols: usize, x: &[f32], y: &mut [f32]) {
    assert!(int8_applies(ty, cols), "no int8 products for {ty:?} x {cols}");
    let n = x.len() / cols;
    let (np, nb) = (q8_pairs(cols), cols / Q8_BLOCK);
    let mut q = vec![0i8; n * np * 64];
    let mut d = vec![0.0f32; n * np * 16];
    let mut s = vec![0.0f32; n * np * 16];
    quantize_rows_q8(x, cols, &mut q, &mut d, &mut s);
    let rb = ty.row_bytes(cols).expect("whole blocks");
    for r in 0..rows {
        let row = &w[r * rb..(r + 1) * rb];
        // Missing last block: zero codes, scale and min (as the kernels mask it).
        let blocks: Vec<([i32; 32], f32, f32)> = (0..2 * np)
            .map(|b| {
                if b < nb {
                    int8_codes(ty, row, b)
                } else {
                    ([0; 32], 0.0, 0.0)
                }
            })
            .collect();
        for i in 0..n {
            let mut acc = [0.0f32; 16];
            for p in 0..np {
                for (lane, a) in acc.iter_mut().enumerate() {
                    let (codes, dw, m) = &blocks[2 * p + (lane / 4) % 2];
                    let first = 4 * ((lane / 8) * 4 + lane % 4);
                    let xq = &q[(i * np + p) * 64 + 4 * lane..][..4];
                    let isum: i32 = (0..4).map(|k| codes[first + k] * xq[k] as i32).sum();
                    let at = (i * np + p) * 16 + lane;
                    *a = (isum as f32).mul_add(dw * d[at], *a);
                    if ty == QuantType::Q4_1 {
                        *a = m.mul_add(s[at], *a);
                    }
                }
            }
            let h: [f32; 8] = std::array::from_fn(|l| acc[l] + acc[l + 8]);
            let q4: [f32; 4] = std::array::from_fn(|l| h[l] + h[l + 4]);
            let p2: [f32; 2] = std::array::from_fn(|l| q4[l] + q4[l + 2]);
            y[i * rows + r] = p2[0] + p2[1];
        }
    }
}
