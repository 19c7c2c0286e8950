//! Simple (round-to-nearest) quantizers for every block format. Used by tests and by writers of
//! small GGUF files; not tuned for quality like llama.cpp's, but every block they write is valid.

use super::{f32_to_bf16, f32_to_f16, QuantType, QK, QK_K};

/// Quantize `x` (a whole number of blocks) into `ty`'s blocks.
pub fn quantize(ty: QuantType, x: &[f32]) -> Vec<u8> {
    assert_eq!(
        x.len() % ty.block_size(),
        0,
        "length must be a multiple of the block size"
    );
    let mut out = Vec::with_capacity(x.len() / ty.block_size() * ty.block_bytes());
    match ty {
        QuantType::F32 => x
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        QuantType::F16 => x
            .iter()
            .for_each(|v| out.extend_from_slice(&f32_to_f16(*v).to_le_bytes())),
        QuantType::BF16 => x
            .iter()
            .for_each(|v| out.extend_from_slice(&f32_to_bf16(*v).to_le_bytes())),
        QuantType::Q4_0 => x.chunks(QK).for_each(|b| q4_0(b, &mut out)),
        QuantType::Q4_1 => x.chunks(QK).for_each(|b| q4_1(b, &mut out)),
        QuantType::Q5_0 => x.chunks(QK).for_each(|b| q5_0(b, &mut out)),
        QuantType::Q5_1 => x.chunks(QK).for_each(|b| q5_1(b, &mut out)),
        QuantType::Q8_0 => x.chunks(QK).for_each(|b| q8_0(b, &mut out)),
        QuantType::Q4K => x.chunks(QK_K).for_each(|b| q4_k(b, &mut out)),
        QuantType::Q6K => x.chunks(QK_K).for_each(|b| q6_k(b, &mut out)),
        QuantType::Q2K => x.chunks(QK_K).for_each(|b| q2_k(b, &mut out)),
        QuantType::Q3K => x.chunks(QK_K).for_each(|b| q3_k(b, &mut out)),
        QuantType::Q5K => x.chunks(QK_K).for_each(|b| q5_k(b, &mut out)),
        QuantType::IQ4NL => x.chunks(QK).for_each(|b| iq4_nl(b, &mut out)),
        QuantType::IQ4XS => x.chunks(QK_K).for_each(|b| iq4_xs(b, &mut out)),
    }
    out
}

fn q4_0(x: &[f32], out: &mut Vec<u8>) {
    // As ggml: the value of largest magnitude maps to -8.
    let mut amax = 0.0f32;
    let mut max = 0.0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out.extend_from_slice(&f32_to_f16(d).to_le_bytes());
    for j in 0..QK / 2 {
        let lo = ((x[j] * id + 8.5) as i32).clamp(0, 15) as u8;
        let hi = ((x[j + QK / 2] * id + 8.5) as i32).clamp(0, 15) as u8;
        out.push(lo | (hi << 4));
    }
}

fn q4_1(x: &[f32], out: &mut Vec<u8>) {
    let min = x.iter().cloned().fold(f32::INFINITY, f32::min);
    let max = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let d = (max - min) / 15.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out.extend_from_slice(&f32_to_f16(d).to_le_bytes());
    out.extend_from_slice(&f32_to_f16(min).to_le_bytes());
    for j in 0..QK / 2 {
        let lo = (((x[j] - min) * id + 0.5) as i32).clamp(0, 15) as u8;
        let hi = (((x[j + QK / 2] - min) * id + 0.5) as i32).clamp(0, 15) as u8;
        out.push(lo | (hi << 4));
    }
}

/// 5-bit codes of a block into Q5's layout: low nibbles as Q4's, bit 4 of value j in bit j of qh.
fn push_q5(q: &[u8; QK], out: &mut Vec<u8>) {
    let mut qh = 0u32;
    for (j, &v) in q.iter().enumerate() {
        qh |= ((v as u32 >> 4) & 1) << j;
    }
    out.extend_from_slice(&qh.to_le_bytes());
    for j in 0..QK / 2 {
        out.push((q[j] & 0xF) | ((q[j + QK / 2] & 0xF) << 4));
    }
}

fn q5_0(x: &[f32], out: &mut Vec<u8>) {
    // As ggml: the value of largest magnitude maps to -16.
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    let d = max / -16.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out.extend_from_slice(&f32_to_f16(d).to_le_bytes());
    let mut q = [0u8; QK];
    for (c, &v) in q.iter_mut().zip(x) {
        *c = ((v * id + 16.5) as i32).clamp(0, 31) as u8;
    }
    push_q5(&q, out);
}

fn q5_1(x: &[f32], out: &mut Vec<u8>) {
    let min = x.iter().cloned().fold(f32::INFINITY, f32::min);
    let max = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let d = (max - min) / 31.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out.extend_from_slice(&f32_to_f16(d).to_le_bytes());
    out.extend_from_slice(&f32_to_f16(min).to_le_bytes());
    let mut q = [0u8; QK];
    for (c, &v) in q.iter_mut().zip(x) {
        *c = (((v - min) * id + 0.5) as i32).clamp(0, 31) as u8;
    }
    push_q5(&q, out);
}

fn q8_0(x: &[f32], out: &mut Vec<u8>) {
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out.extend_from_slice(&f32_to_f16(d).to_le_bytes());
    for &v in x {
        out.push(((v * id).round() as i32).clamp(-127, 127) as i8 as u8);
    }
}

fn q4_k(x: &[f32], out: &mut Vec<u8>) {
    // Eight sub-blocks of 32: value = d*sc*q - dmin*m, with 6-bit sc and m.
    let mut scales = [0.0f32; 8];
    let mut mins = [0.0f32; 8];
    for (s, sub) in x.chunks(32).enumerate() {
        let lo = sub.iter().cloned().fold(f32::INFINITY, f32::min).min(0.0);
        let hi = sub.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        scales[s] = (hi - lo) / 15.0;
        mins[s] = -lo;
    }
    let max_scale = scales.iter().cloned().fold(0.0f32, f32::max);
    let max_min = mins.iter().cloned().fold(0.0f32, f32::max);
    let d = f16_round(max_scale / 63.0);
    let dmin = f16_round(max_min / 63.0);
    let mut sc = [0u8; 8];
    let mut m = [0u8; 8];
    for s in 0..8 {
        sc[s] = if d > 0.0 {
            (scales[s] / d).round().clamp(0.0, 63.0) as u8
        } else {
            0
        };
        m[s] = if dmin > 0.0 {
            (mins[s] / dmin).round().clamp(0.0, 63.0) as u8
        } else {
            0
        };
    }
    out.extend_from_slice(&f32_to_f16(d).to_le_bytes());
    out.extend_from_slice(&f32_to_f16(dmin).to_le_bytes());
    out.extend_from_slice(&pack_k4(&sc, &m));
    let mut q = [0u8; 256];
    for s in 0..8 {
        let step = d * sc[s] as f32;
        let off = dmin * m[s] as f32;
        for l in 0..32 {
            let v = x[s * 32 + l];
            q[s * 32 + l] = if step > 0.0 {
                ((v + off) / step).round().clamp(0.0, 15.0) as u8
            } else {
                0
            };
        }
    }
    // Each 64-value chunk: 32 bytes, low nibbles = first 32 values, high nibbles = next 32.
    for c in 0..4 {
        for l in 0..32 {
            out.push(q[c * 64 + l] | (q[c * 64 + 32 + l] << 4));
        }
    }
}

fn q6_k(x: &[f32], out: &mut Vec<u8>) {
    // Sixteen sub-blocks of 16: value = d*sc*(q-32), with i8 sc and q in 0..64.
    let mut scales = [0.0f32; 16];
    for (s, sub) in x.chunks(16).enumerate() {
        scales[s] = sub.iter().fold(0.0f32, |a, v| a.max(v.abs())) / 31.0;
    }
    let max_scale = scales.iter().cloned().fold(0.0f32, f32::max);
    let d = f16_round(max_scale / 127.0);
    let mut sc = [0i8; 16];
    for s in 0..16 {
        sc[s] = if d > 0.0 {
            (scales[s] / d).round().clamp(-128.0, 127.0) as i8
        } else {
            0
        };
    }
    let mut q = [0u8; 256];
    for i in 0..256 {
        let step = d * sc[i / 16] as f32;
        let v = if step != 0.0 {
            (x[i] / step).round().clamp(-32.0, 31.0) as i32
        } else {
            0
        };
        q[i] = (v + 32) as u8;
    }
    let mut ql = [0u8; 128];
    let mut qh = [0u8; 64];
    for half in 0..2 {
        let (qv, l0, h0) = (&q[half * 128..], half * 64, half * 32);
        for l in 0..32 {
            ql[l0 + l] = (qv[l] & 0xF) | ((qv[l + 64] & 0xF) << 4);
            ql[l0 + l + 32] = (qv[l + 32] & 0xF) | ((qv[l + 96] & 0xF) << 4);
            qh[h0 + l] = (qv[l] >> 4)
                | ((qv[l + 32] >> 4) << 2)
                | ((qv[l + 64] >> 4) << 4)
                | ((qv[l + 96] >> 4) << 6);
        }
    }
    out.extend_from_slice(&ql);
    out.extend_from_slice(&qh);
    out.extend(sc.iter().map(|s| *s as u8));
    out.extend_from_slice(&f32_to_f16(d).to_le_bytes());
}

fn f16_round(x: f32) -> f32 {
    super::f16_to_f32(f32_to_f16(x))
}

/// Per sub-block of `x`, the affine step and offset of `levels` levels: (max − min)/levels and
/// −min (min at most 0).
fn affine(x: &[f32], sub: usize, levels: f32) -> (Vec<f32>, Vec<f32>) {
    x.chunks(sub)
        .map(|c| {
            let lo = c.iter().cloned().fold(f32::INFINITY, f32::min).min(0.0);
            let hi = c.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            ((hi - lo) / levels, -lo)
        })
        .unzip()
}

/// Integer multiples of a super-scale for `v` (in 0..=max): the f16 super-scale and the codes.
fn super_scale(v: &[f32], max: f32) -> (f32, Vec<u8>) {
    let d = f16_round(v.iter().cloned().fold(0.0f32, f32::max) / max);
    let q = v
        .iter()
        .map(|&s| {
            if d > 0.0 {
                (s / d).round().clamp(0.0, max) as u8
            } else {
                0
            }
        })
        .collect();
    (d, q)
}

/// Affine codes in 0..=levels of each value given its sub-block's step and offset.
fn affine_codes(x: &[f32], sub: usize, step: &[f32], off: &[f32], levels: f32) -> Vec<u8> {
    x.iter()
        .enumerate()
        .map(|(i, &v)| {
            let (st, o) = (step[i / sub], off[i / sub]);
            if st > 0.0 {
                ((v + o) / st).round().clamp(0.0, levels) as u8
            } else {
                0
            }
        })
        .collect()
}

fn q2_k(x: &[f32], out: &mut Vec<u8>) {
    // Sixteen sub-blocks of 16: value = d*sc*q - dmin*m, 4-bit sc and m, q in 0..4.
    let (steps, offs) = affine(x, 16, 3.0);
    let (d, sc) = super_scale(&steps, 15.0);
    let (dmin, m) = super_scale(&offs, 15.0);
    let step: Vec<f32> = sc.iter().map(|&s| d * s as f32).collect();
    let off: Vec<f32> = m.iter().map(|&s| dmin * s as f32).collect();
    let q = affine_codes(x, 16, &step, &off, 3.0);
    out.extend((0..16).map(|k| sc[k] | (m[k] << 4)));
    for h in 0..2 {
        for l in 0..32 {
            out.push((0..4).fold(0u8, |b, s| b | (q[128 * h + 32 * s + l] << (2 * s))));
        }
    }
    out.extend_from_slice(&f32_to_f16(d).to_le_bytes());
    out.extend_from_slice(&f32_to_f16(dmin).to_le_bytes());
}

fn q3_k(x: &[f32], out: &mut Vec<u8>) {
    // Sixteen sub-blocks of 16: value = d*(sc-32)*q, q in -4..4 (the largest magnitude to -4).
    let subs: Vec<f32> = x.chunks(16).map(|c| signed_amax(c) / -4.0).collect();
    let (d, sc) = signed_scales(&subs);
    let q: Vec<u8> = x
        .iter()
        .enumerate()
        .map(|(v, &val)| {
            let step = d * sc[v / 16] as f32;
            let q = if step != 0.0 {
                (val / step).round().clamp(-4.0, 3.0) as i32
            } else {
                0
            };
            (q + 4) as u8
        })
        .collect();
    let mut hmask = [0u8; 32];
    for (v, &c) in q.iter().enumerate() {
        hmask[v % 32] |= (c >> 2) << (v / 32);
    }
    out.extend_from_slice(&hmask);
    for h in 0..2 {
        for l in 0..32 {
            out.push((0..4).fold(0u8, |b, s| b | ((q[128 * h + 32 * s + l] & 3) << (2 * s))));
        }
    }
    let mut packed = [0u8; 12];
    for (k, &s) in sc.iter().enumerate() {
        let u = (s + 32) as u8;
        packed[k % 8] |= (u & 0xF) << (4 * (k / 8));
        packed[8 + k % 4] |= (u >> 4) << (2 * (k / 4));
    }
    out.extend_from_slice(&packed);
    out.extend_from_slice(&f32_to_f16(d).to_le_bytes());
}

fn q5_k(x: &[f32], out: &mut Vec<u8>) {
    // Eight sub-blocks of 32: value = d*sc*q - dmin*m, 6-bit sc and m (packed as Q4_K's), q in
    // 0..32.
    let (steps, offs) = affine(x, 32, 31.0);
    let (d, sc) = super_scale(&steps, 63.0);
    let (dmin, m) = super_scale(&offs, 63.0);
    let step: Vec<f32> = sc.iter().map(|&s| d * s as f32).collect();
    let off: Vec<f32> = m.iter().map(|&s| dmin * s as f32).collect();
    let q = affine_codes(x, 32, &step, &off, 31.0);
    out.extend_from_slice(&f32_to_f16(d).to_le_bytes());
    out.extend_from_slice(&f32_to_f16(dmin).to_le_bytes());
    out.extend_from_slice(&pack_k4(&sc, &m));
    out.extend((0..32).map(|l| (0..8).fold(0u8, |b, j| b | ((q[32 * j + l] >> 4) << j))));
    for c in 0..4 {
        for l in 0..32 {
            out.push((q[c * 64 + l] & 0xF) | ((q[c * 64 + 32 + l] & 0xF) << 4));
        }
    }
}

/// The codebook index nearest to `v` (in units of the block's scale).
fn iq4_code(v: f32) -> u8 {
    (0..16u8)
        .min_by(|&a, &b| {
            let da = (v - super::IQ4_VALUES[a as usize] as f32).abs();
            let db = (v - super::IQ4_VALUES[b as usize] as f32).abs();
            da.total_cmp(&db)
        })
        .unwrap_or(0)
}

/// 32 values as IQ4 nibbles at scale `step` (value l's nibble: byte l % 16, high for l ≥ 16).
fn iq4_nibbles(x: &[f32], step: f32, out: &mut Vec<u8>) {
    let inv = if step != 0.0 { 1.0 / step } else { 0.0 };
    for l in 0..16 {
        out.push(iq4_code(x[l] * inv) | (iq4_code(x[l + 16] * inv) << 4));
    }
}

/// The value of largest magnitude, with its sign.
fn signed_amax(x: &[f32]) -> f32 {
    x.iter()
        .fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m })
}

fn iq4_nl(x: &[f32], out: &mut Vec<u8>) {
    // The largest magnitude maps to the codebook's −127.
    let d = f16_round(signed_amax(x) / -127.0);
    out.extend_from_slice(&f32_to_f16(d).to_le_bytes());
    iq4_nibbles(x, d, out);
}

fn iq4_xs(x: &[f32], out: &mut Vec<u8>) {
    // Eight sub-blocks of 32 at d*(sc-32), sc of 6 bits.
    let subs: Vec<f32> = x.chunks(32).map(|c| signed_amax(c) / -127.0).collect();
    let (d, sc) = signed_scales(&subs);
    let (mut lo, mut hi) = ([0u8; 4], 0u16);
    for (j, &s) in sc.iter().enumerate() {
        let u = (s + 32) as u8;
        lo[j / 2] |= (u & 0xF) << (4 * (j % 2));
        hi |= ((u >> 4) as u16) << (2 * j);
    }
    out.extend_from_slice(&f32_to_f16(d).to_le_bytes());
    out.extend_from_slice(&hi.to_le_bytes());
    out.extend_from_slice(&lo);
    for (j, c) in x.chunks(32).enumerate() {
        iq4_nibbles(c, d * sc[j] as f32, out);
    }
}

/// Q4_K's and Q5_K's eight 6-bit scales and mins in their 12 bytes (`reference::scale_min_k4`
/// reads them back).
fn pack_k4(sc: &[u8], m: &[u8]) -> [u8; 12] {
    let mut packed = [0u8; 12];
    for j in 0..4 {
        packed[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
        packed[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6);
        packed[j + 8] = (sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4);
    }
    packed
}

/// Signed sub-block scales as 6-bit codes − 32 times an f16 super-scale (Q3_K's and IQ4_XS's):
/// the super-scale and the codes (−32..31).
fn signed_scales(subs: &[f32]) -> (f32, Vec<i32>) {
    let d = f16_round(subs.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 31.0);
    let sc = subs
        .iter()
        .map(|&s| {
            if d > 0.0 {
                (s / d).round().clamp(-32.0, 31.0) as i32
            } else {
                0
            }
        })
        .collect();
    (d, sc)
}
