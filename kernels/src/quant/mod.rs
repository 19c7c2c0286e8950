//! Block formats of GGUF tensors: layout (`#[repr(C)]` structs with size asserts), type ids, f16/bf16.

/// A tensor storage format. Each format stores `block_size()` values in `block_bytes()` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    IQ4NL,
    IQ4XS,
}

pub const QK: usize = 32;
pub const QK_K: usize = 256;

/// Q4_0: 32 values as `((nibble) - 8) * d`; low nibbles hold values 0..16, high nibbles 16..32.
#[repr(C)]
pub struct BlockQ4_0 {
    pub d: u16,
    pub qs: [u8; QK / 2],
}
/// Q4_1: 32 values as `nibble * d + m`.
#[repr(C)]
pub struct BlockQ4_1 {
    pub d: u16,
    pub m: u16,
    pub qs: [u8; QK / 2],
}
/// Q5_0: 32 values as `(q - 16) * d`, q of 5 bits: the low 4 in nibbles as Q4_0's (values 0..16
/// low, 16..32 high), bit 4 of value j in bit j of `qh` (little-endian u32).
#[repr(C)]
pub struct BlockQ5_0 {
    pub d: u16,
    pub qh: [u8; 4],
    pub qs: [u8; QK / 2],
}
/// Q5_1: 32 values as `q * d + m`, q of 5 bits laid out as Q5_0's.
#[repr(C)]
pub struct BlockQ5_1 {
    pub d: u16,
    pub m: u16,
    pub qh: [u8; 4],
    pub qs: [u8; QK / 2],
}
/// Q8_0: 32 values as `qs[j] * d`.
#[repr(C)]
pub struct BlockQ8_0 {
    pub d: u16,
    pub qs: [i8; QK],
}
/// Q4_K: 256 values in 8 sub-blocks of 32, each with a 6-bit scale and a 6-bit min.
#[repr(C)]
pub struct BlockQ4K {
    pub d: u16,
    pub dmin: u16,
    pub scales: [u8; 12],
    pub qs: [u8; QK_K / 2],
}
/// Q2_K: 256 values in 16 sub-blocks of 16 as `d·sc·q − dmin·m`, q of 2 bits (byte l of each
/// 32-byte half holds values l, l+32, l+64, l+96 of that half at bits 0, 2, 4, 6), a 4-bit
/// scale (low nibble) and min (high nibble) per sub-block.
#[repr(C)]
pub struct BlockQ2K {
    pub scales: [u8; QK_K / 16],
    pub qs: [u8; QK_K / 4],
    pub d: u16,
    pub dmin: u16,
}
/// Q3_K: 256 values in 16 sub-blocks of 16 as `d·(sc − 32)·(q − 4·(1 − h))`: q's 2 low bits as
/// Q2_K's, the high bit h of value v in bit v/32 of `hmask[v % 32]`, 6-bit scales (low nibbles in
/// bytes 0..8, two high bits in bytes 8..12).
#[repr(C)]
pub struct BlockQ3K {
    pub hmask: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 4],
    pub scales: [u8; 12],
    pub d: u16,
}
/// Q5_K: Q4_K's scales and mins with a fifth bit: bit j of `qh[l]` is bit 4 of value l of
/// sub-block j.
#[repr(C)]
pub struct BlockQ5K {
    pub d: u16,
    pub dmin: u16,
    pub scales: [u8; 12],
    pub qh: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 2],
}
/// IQ4_NL: 32 values as `d · IQ4_VALUES[nibble]` (nibbles as Q4_0's).
#[repr(C)]
pub struct BlockIQ4NL {
    pub d: u16,
    pub qs: [u8; QK / 2],
}
/// IQ4_XS: 256 values in 8 sub-blocks of 32 as `d · (sc − 32) · IQ4_VALUES[nibble]`, 6-bit
/// scales (low nibbles in `scales_l`, two high bits each in `scales_h`); sub-block j's nibbles
/// are bytes 16j.. as IQ4_NL's.
#[repr(C)]
pub struct BlockIQ4XS {
    pub d: u16,
    pub scales_h: u16,
    pub scales_l: [u8; QK_K / 64],
    pub qs: [u8; QK_K / 2],
}
/// The non-linear 4-bit codebook of IQ4_NL and IQ4_XS.
pub const IQ4_VALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];
/// Q6_K: 256 values in 16 sub-blocks of 16, each with an 8-bit signed scale; 4 low bits + 2 high bits.
#[repr(C)]
pub struct BlockQ6K {
    pub ql: [u8; QK_K / 2],
    pub qh: [u8; QK_K / 4],
    pub scales: [i8; QK_K / 16],
    pub d: u16,
}

const _: () = assert!(std::mem::size_of::<BlockQ4_0>() == 18);
const _: () = assert!(std::mem::size_of::<BlockQ4_1>() == 20);
const _: () = assert!(std::mem::size_of::<BlockQ5_0>() == 22);
const _: () = assert!(std::mem::size_of::<BlockQ5_1>() == 24);
const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 34);
const _: () = assert!(std::mem::size_of::<BlockQ4K>() == 144);
const _: () = assert!(std::mem::size_of::<BlockQ6K>() == 210);
const _: () = assert!(std::mem::size_of::<BlockQ2K>() == 84);
const _: () = assert!(std::mem::size_of::<BlockQ3K>() == 110);
const _: () = assert!(std::mem::size_of::<BlockQ5K>() == 176);
const _: () = assert!(std::mem::size_of::<BlockIQ4NL>() == 18);
const _: () = assert!(std::mem::size_of::<BlockIQ4XS>() == 136);

impl QuantType {
    pub const ALL: [QuantType; 15] = [
        QuantType::F32,
        QuantType::F16,
        QuantType::BF16,
        QuantType::Q4_0,
        QuantType::Q4_1,
        QuantType::Q5_0,
        QuantType::Q5_1,
        QuantType::Q8_0,
        QuantType::Q2K,
        QuantType::Q3K,
        QuantType::Q4K,
        QuantType::Q5K,
        QuantType::Q6K,
        QuantType::IQ4NL,
        QuantType::IQ4XS,
    ];

    /// The ggml type id used in GGUF tensor infos.
    pub fn ggml_id(self) -> u32 {
        match self {
            QuantType::F32 => 0,
            QuantType::F16 => 1,
            QuantType::Q4_0 => 2,
            QuantType::Q4_1 => 3,
            QuantType::Q5_0 => 6,
            QuantType::Q5_1 => 7,
            QuantType::Q8_0 => 8,
            QuantType::Q2K => 10,
            QuantType::Q3K => 11,
            QuantType::Q4K => 12,
            QuantType::Q5K => 13,
            QuantType::Q6K => 14,
            QuantType::IQ4NL => 20,
            QuantType::IQ4XS => 23,
            QuantType::BF16 => 30,
        }
    }

    pub fn from_ggml_id(id: u32) -> Option<QuantType> {
        QuantType::ALL.into_iter().find(|t| t.ggml_id() == id)
    }

    /// The name ggml gives the type (for error messages).
    pub fn name(self) -> &'static str {
        match self {
            QuantType::F32 => "F32",
            QuantType::F16 => "F16",
            QuantType::BF16 => "BF16",
            QuantType::Q4_0 => "Q4_0",
            QuantType::Q4_1 => "Q4_1",
            QuantType::Q5_0 => "Q5_0",
            QuantType::Q5_1 => "Q5_1",
            QuantType::Q8_0 => "Q8_0",
            QuantType::Q2K => "Q2_K",
            QuantType::Q3K => "Q3_K",
            QuantType::Q4K => "Q4_K",
            QuantType::Q5K => "Q5_K",
            QuantType::Q6K => "Q6_K",
            QuantType::IQ4NL => "IQ4_NL",
            QuantType::IQ4XS => "IQ4_XS",
        }
    }

    /// Values per block.
    pub const fn block_size(self) -> usize {
        match self {
            QuantType::F32 | QuantType::F16 | QuantType::BF16 => 1,
            QuantType::Q4_0
            | QuantType::Q4_1
            | QuantType::Q5_0
            | QuantType::Q5_1
            | QuantType::Q8_0
            | QuantType::IQ4NL => QK,
            QuantType::Q2K
            | QuantType::Q3K
            | QuantType::Q4K
            | QuantType::Q5K
            | QuantType::Q6K
            | QuantType::IQ4XS => QK_K,
        }
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            QuantType::F32 => 4,
            QuantType::F16 | QuantType::BF16 => 2,
            QuantType::Q4_0 => std::mem::size_of::<BlockQ4_0>(),
            QuantType::Q4_1 => std::mem::size_of::<BlockQ4_1>(),
            QuantType::Q5_0 => std::mem::size_of::<BlockQ5_0>(),
            QuantType::Q5_1 => std::mem::size_of::<BlockQ5_1>(),
            QuantType::Q8_0 => std::mem::size_of::<BlockQ8_0>(),
            QuantType::Q4K => std::mem::size_of::<BlockQ4K>(),
            QuantType::Q6K => std::mem::size_of::<BlockQ6K>(),
            QuantType::Q2K => std::mem::size_of::<BlockQ2K>(),
            QuantType::Q3K => std::mem::size_of::<BlockQ3K>(),
            QuantType::Q5K => std::mem::size_of::<BlockQ5K>(),
            QuantType::IQ4NL => std::mem::size_of::<BlockIQ4NL>(),
            QuantType::IQ4XS => std::mem::size_of::<BlockIQ4XS>(),
        }
    }

    /// Bytes of one row of `n` values, or `None` when `n` is not a whole number of blocks.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_size()) {
            return None;
        }
        Some(n / self.block_size() * self.block_bytes())
    }
}

/// IEEE half to f32 (exact; handles subnormals, infinities and NaN).
#[inline]
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = if exp == 0 {
        if man == 0 {
            sign
        } else {
            // subnormal: value = man * 2^-24
            let v = man as f32 * (1.0 / 16_777_216.0);
            return if sign != 0 { -v } else { v };
        }
    } else if exp == 31 {
        sign | 0x7f80_0000 | (man << 13)
    } else {
        sign | ((exp + 112) << 23) | (man << 13)
    };
    f32::from_bits(bits)
}

/// f32 to IEEE half, round to nearest even (used by tests and writers, never on hot paths).
pub fn f32_to_f16(x: f32) -> u16 {
    let bits = x.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let exp = ((bits >> 23) & 0xff) as i32;
    let man = bits & 0x7f_ffff;
    if exp == 255 {
        return sign | 0x7c00 | if man != 0 { 0x200 } else { 0 };
    }
    let e = exp - 127 + 15;
    if e >= 31 {
        return sign | 0x7c00;
    }
    if e <= 0 {
        if e < -10 {
            return sign;
        }
        let m = man | 0x80_0000;
        let shift = (14 - e) as u32;
        let half = 1u32 << (shift - 1);
        let rem = m & ((1 << shift) - 1);
        let mut r = m >> shift;
        if rem > half || (rem == half && (r & 1) == 1) {
            r += 1;
        }
        return sign | r as u16;
    }
    let mut r = ((e as u32) << 10) | (man >> 13);
    let rem = man & 0x1fff;
    if rem > 0x1000 || (rem == 0x1000 && (r & 1) == 1) {
        r += 1;
    }
    sign | r as u16
}

#[inline]
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

pub fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) | 0x40) as u16;
    }
    let round = ((bits >> 16) & 1) + 0x7fff;
    ((bits + round) >> 16) as u16
}

pub mod quantize;
