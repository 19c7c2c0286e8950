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
    let mut packed = [0u8; 12];
    for j in 0..4 {
        packed[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
        packed[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6);
        packed[j + 8] = (sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4);
    }
    out.extend_from_slice(&packed);
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
