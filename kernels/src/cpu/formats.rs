//! A runtime type to its monomorphized kernels: `per_format!` (products, backward,
//! dequantization on every path) and the row dequantization by runtime type.

#![allow(clippy::missing_safety_doc)]

use super::dequant::dequant_row;
use super::isa::Isa;
use super::simd::{Avx2, Avx512, Simd};
use crate::quant::QuantType;

/// `$body` with `$F` the `Format` of the runtime type `$ty`: the one place a type picks its
/// monomorphized kernels (products, backward, dequantization, on every path).
macro_rules! per_format {
    ($ty:expr, $F:ident => $body:expr) => {{
        use $crate::cpu::dequant as fmt;
        use $crate::cpu::dequant_k as kfmt;
        use $crate::quant::QuantType as T;
        match $ty {
            T::F32 => {
                type $F = fmt::F32;
                $body
            }
            T::F16 => {
                type $F = fmt::F16;
                $body
            }
            T::BF16 => {
                type $F = fmt::BF16;
                $body
            }
            T::Q4_0 => {
                type $F = fmt::Q4_0;
                $body
            }
            T::Q4_1 => {
                type $F = fmt::Q4_1;
                $body
            }
            T::Q5_0 => {
                type $F = fmt::Q5_0;
                $body
            }
            T::Q5_1 => {
                type $F = fmt::Q5_1;
                $body
            }
            T::Q8_0 => {
                type $F = fmt::Q8_0;
                $body
            }
            T::Q2K => {
                type $F = kfmt::Q2K;
                $body
            }
            T::Q3K => {
                type $F = kfmt::Q3K;
                $body
            }
            T::Q4K => {
                type $F = kfmt::Q4K;
                $body
            }
            T::Q5K => {
                type $F = kfmt::Q5K;
                $body
            }
            T::Q6K => {
                type $F = kfmt::Q6K;
                $body
            }
            T::IQ4NL => {
                type $F = fmt::IQ4NL;
                $body
            }
            T::IQ4XS => {
                type $F = kfmt::IQ4XS;
                $body
            }
        }
    }};
}
pub(crate) use per_format;

/// Dequantize `dst.len()` values of a row with the fast path of `isa`.
pub fn dequantize_row(isa: Isa, ty: QuantType, src: &[u8], dst: &mut [f32]) {
    let rb = ty.row_bytes(dst.len()).expect("whole blocks");
    assert!(src.len() >= rb);
    // SAFETY: sizes checked above; the ISA was detected.
    unsafe {
        match isa {
            Isa::Reference => crate::reference::dequantize_row(ty, src, dst),
            Isa::Avx512 => dequant_avx512(ty, src.as_ptr(), dst.as_mut_ptr(), dst.len()),
            Isa::Avx2 => dequant_avx2(ty, src.as_ptr(), dst.as_mut_ptr(), dst.len()),
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn dequant_avx512(ty: QuantType, src: *const u8, dst: *mut f32, n: usize) {
    dequant_any::<Avx512>(ty, src, dst, n)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequant_avx2(ty: QuantType, src: *const u8, dst: *mut f32, n: usize) {
    dequant_any::<Avx2>(ty, src, dst, n)
}

#[inline(always)]
unsafe fn dequant_any<S: Simd>(ty: QuantType, src: *const u8, dst: *mut f32, n: usize) {
    per_format!(ty, F => dequant_row::<S, F>(src, dst, n))
}
