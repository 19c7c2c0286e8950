//! The int8 products (`Precision::Int8`) emulated to the bit, and the one activation quantizer
//! that both they and the VNNI kernels (`cpu::int8`) run.
//!
//! Activations are quantized per block of 32 values as llama.cpp's Q8 does (`quantize_block_q8`:
//! d = max|x| / 127, q = x / d rounded to nearest even, −127..127). The weights' own integer
//! codes (Q4_0: q − 8, Q4_1: q, Q8_0: q, Q3_K: q − 4, Q4_K and Q5_K: q, Q6_K: q − 32, IQ4_NL and
//! IQ4_XS: the codebook's value) are dotted with them exactly in integers, and each block's
//! integer sums scaled in f32, in one order whatever the batch and the path. A block of 32
//! weights has a scale per half (values 0..16 and 16..32: Q6_K's and Q3_K's 16-value
//! sub-blocks; the two are equal for the other formats) and, for Q4_1, Q4_K and Q5_K, a min m:
//!
//! - pairs of blocks (b, b+1), b even, in order (a missing last block counts as zeros); 16 f32
//!   lanes A; lane L takes block b + L%2, values 4·(L/2)..4·(L/2)+4, whose half's scale is d_w:
//!   A[L] = fma(Σ_k w_k·x_k as f32, d_w·d_x, A[L]);
//! - Q4_1, Q4_K and Q5_K only: 16 f32 lanes B, blocks in order:
//!   B[b%16] = fma(m, d_x · (Σ of the block's codes as f32), B[b%16]);
//! - y = the lanes (A + B with a min) summed in the AVX-512 `reduce_add` order.
//!
//! A K-quant block's scale and min are its super-block's f16 scales times the block's integer
//! ones (Q4_K, Q5_K: d·sc and −(dmin·m); Q3_K: d·(sc − 32), Q6_K: d·sc per 16 values), products
//! exact in f32.
//!
//! How the kernels lay it out in registers is theirs (`cpu::int8`).

use super::*;

/// Values per block.
pub const Q8_BLOCK: usize = 32;

/// Whether a product in format `ty` over rows of `cols` values takes the int8 path under
/// `Precision::Int8` (the others stay exact f32: a choice by format and shape, never by batch).
pub fn int8_applies(ty: QuantType, cols: usize) -> bool {
    matches!(
        ty,
        QuantType::Q4_0
            | QuantType::Q4_1
            | QuantType::Q8_0
            | QuantType::Q3K
            | QuantType::Q4K
            | QuantType::Q5K
            | QuantType::Q6K
            | QuantType::IQ4NL
            | QuantType::IQ4XS
    ) && cols.is_multiple_of(ty.block_size().max(Q8_BLOCK))
}

/// Whether the int8 products of format `ty` add a min term (lanes B).
pub fn int8_has_min(ty: QuantType) -> bool {
    matches!(ty, QuantType::Q4_1 | QuantType::Q4K | QuantType::Q5K)
}

/// Pairs of blocks in a row of `cols` values.
pub fn q8_pairs(cols: usize) -> usize {
    cols.div_ceil(2 * Q8_BLOCK)
}

/// One block of 32 activations quantized: the codes and the scale d.
pub fn quantize_block_q8(x: &[f32]) -> ([i8; 32], f32) {
    let amax = x[..32].iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut q = [0i8; 32];
    for (c, v) in q.iter_mut().zip(x) {
        *c = (v * inv).round_ties_even() as i8;
    }
    (q, d)
}

/// Block `b` (of 32 values) of a row as the int8 products read it: its 32 integer codes, the
/// scales of its halves (values 0..16, 16..32), its min (0 but for Q4_1 and Q4_K).
pub fn int8_codes(ty: QuantType, row: &[u8], b: usize) -> ([i32; 32], [f32; 2], f32) {
    let bb = ty.block_bytes();
    let mut c = [0i32; 32];
    if ty.block_size() == 256 {
        // Block j of the super-block at `blk`.
        let (blk, j) = (&row[(b / 8) * bb..(b / 8 + 1) * bb], b % 8);
        return if matches!(ty, QuantType::Q4K | QuantType::Q5K) {
            // Q5_K: Q4_K's scales and nibbles (after 32 bytes of fifth bits) plus bit j of qh.
            let q5 = ty == QuantType::Q5K;
            let (d, dmin) = (rd16(blk, 0), rd16(blk, 2));
            let (sc, m) = scale_min_k4(j, &blk[4..16]);
            let qs = &blk[if q5 { 48 } else { 16 } + 32 * (j / 2)..][..32];
            for k in 0..32 {
                let low = (if j % 2 == 0 { qs[k] & 0xF } else { qs[k] >> 4 }) as i32;
                let high = if q5 {
                    ((blk[16 + k] >> j) & 1) as i32
                } else {
                    0
                };
                c[k] = low | (high << 4);
            }
            let dw = d * sc as f32;
            (c, [dw, dw], -(dmin * m as f32))
        } else if ty == QuantType::IQ4XS {
            // Sub-block j's nibbles at 8 + 16j (value k: byte k % 16, high for k ≥ 16), its
            // scale d·(sc − 32).
            for k in 0..32 {
                let code = (blk[8 + 16 * j + k % 16] >> (4 * (k / 16))) & 0xF;
                c[k] = IQ4_VALUES[code as usize] as i32;
            }
            let lo = (blk[4 + j / 2] >> (4 * (j % 2))) & 0xF;
            let hi = ((u16::from_le_bytes([blk[2], blk[3]]) >> (2 * j)) & 3) as u8;
            let dw = rd16(blk, 0) * ((lo | (hi << 4)) as i32 - 32) as f32;
            (c, [dw, dw], 0.0)
        } else if ty == QuantType::Q3K {
            // Low bits as Q2_K's (after 32 bytes of high bits), q = low + 4·high − 4; the
            // halves' 6-bit scales − 32 (sub-blocks 2j, 2j+1).
            let qs = &blk[32 + 32 * (j / 4)..][..32];
            for k in 0..32 {
                let low = ((qs[k] >> (2 * (j % 4))) & 3) as i32;
                c[k] = low + 4 * ((blk[k] >> j) & 1) as i32 - 4;
            }
            let d = rd16(blk, 108);
            let sc = |k: usize| {
                let lo = (blk[96 + k % 8] >> (4 * (k / 8))) & 0xF;
                let hi = (blk[104 + k % 4] >> (2 * (k / 4))) & 3;
                d * ((lo | (hi << 4)) as i32 - 32) as f32
            };
            (c, [sc(2 * j), sc(2 * j + 1)], 0.0)
        } else {
            // Half h of 128 values; in it, group g of 32: low or high nibbles of ql[0..32] or
            // ql[32..64], high bits 2g..2g+2 of qh.
            let (h, g) = (j / 4, j % 4);
            let ql = &blk[64 * h + 32 * (g % 2)..][..32];
            let qh = &blk[128 + 32 * h..][..32];
            for k in 0..32 {
                let lo = if g < 2 { ql[k] & 0xF } else { ql[k] >> 4 };
                c[k] = (lo | (((qh[k] >> (2 * g)) & 3) << 4)) as i32 - 32;
            }
            let d = rd16(blk, 208);
            let sc = |k: usize| d * (blk[192 + 8 * h + 2 * g + k] as i8) as f32;
            (c, [sc(0), sc(1)], 0.0)
        };
    }
    let blk = &row[b * bb..(b + 1) * bb];
    match ty {
        QuantType::Q4_0 | QuantType::Q4_1 => {
            let (at, off) = if ty == QuantType::Q4_0 {
                (2, 8)
            } else {
                (4, 0)
            };
            for k in 0..16 {
                c[k] = (blk[at + k] & 0xF) as i32 - off;
                c[16 + k] = (blk[at + k] >> 4) as i32 - off;
            }
            let m = if ty == QuantType::Q4_1 {
                rd16(blk, 2)
            } else {
                0.0
            };
            (c, [rd16(blk, 0); 2], m)
        }
        QuantType::Q8_0 => {
            for k in 0..32 {
                c[k] = blk[2 + k] as i8 as i32;
            }
            (c, [rd16(blk, 0); 2], 0.0)
        }
        QuantType::IQ4NL => {
            for k in 0..32 {
                let code = (blk[2 + k % 16] >> (4 * (k / 16))) & 0xF;
                c[k] = IQ4_VALUES[code as usize] as i32;
            }
            (c, [rd16(blk, 0); 2], 0.0)
        }
        _ => panic!("no int8 products for {ty:?}"),
    }
}

/// The int8 product (`Precision::Int8`) emulated to the bit: y (n, rows) = x (n, cols) · Wᵀ as
/// the module doc defines it. `int8_applies(ty, cols)` must hold.
pub fn matmul_int8(ty: QuantType, w: &[u8], rows: usize, cols: usize, x: &[f32], y: &mut [f32]) {
    assert!(
        int8_applies(ty, cols),
        "no int8 products for {ty:?} x {cols}"
    );
    let n = x.len() / cols;
    let (np, nb) = (q8_pairs(cols), cols / Q8_BLOCK);
    // A missing last block: zero codes and scale.
    let xq: Vec<Vec<([i8; 32], f32)>> = (0..n)
        .map(|i| {
            (0..2 * np)
                .map(|b| {
                    if b < nb {
                        quantize_block_q8(&x[i * cols + b * 32..])
                    } else {
                        ([0; 32], 0.0)
                    }
                })
                .collect()
        })
        .collect();
    let rb = ty.row_bytes(cols).expect("whole blocks");
    for r in 0..rows {
        let row = &w[r * rb..(r + 1) * rb];
        let wq: Vec<([i32; 32], [f32; 2], f32)> = (0..2 * np)
            .map(|b| {
                if b < nb {
                    int8_codes(ty, row, b)
                } else {
                    ([0; 32], [0.0; 2], 0.0)
                }
            })
            .collect();
        for i in 0..n {
            let (mut a, mut mins) = ([0.0f32; 16], [0.0f32; 16]);
            for p in 0..np {
                for lane in 0..16 {
                    let b = 2 * p + lane % 2;
                    let ((wc, dw, _), (xc, dx)) = (&wq[b], &xq[i][b]);
                    let first = 4 * (lane / 2);
                    let isum: i32 = (first..first + 4).map(|k| wc[k] * xc[k] as i32).sum();
                    a[lane] = (isum as f32).mul_add(dw[first / 16] * dx, a[lane]);
                }
            }
            for b in 0..nb {
                let ((_, _, m), (xc, dx)) = (&wq[b], &xq[i][b]);
                let xsum: i32 = xc.iter().map(|&c| c as i32).sum();
                mins[b % 16] = m.mul_add(dx * xsum as f32, mins[b % 16]);
            }
            if int8_has_min(ty) {
                for l in 0..16 {
                    a[l] += mins[l];
                }
            }
            let h: [f32; 8] = std::array::from_fn(|l| a[l] + a[l + 8]);
            let q4: [f32; 4] = std::array::from_fn(|l| h[l] + h[l + 4]);
            let p2: [f32; 2] = std::array::from_fn(|l| q4[l] + q4[l + 2]);
            y[i * rows + r] = p2[0] + p2[1];
        }
    }
}
