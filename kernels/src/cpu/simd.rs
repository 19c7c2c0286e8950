//! A thin SIMD layer: one trait, implemented for AVX2 (8 lanes) and AVX-512 (16 lanes), so that each
//! kernel is written once, generically, and compiled per ISA inside a `#[target_feature]` entry point.
//! Every method is `#[inline(always)]`: it must inline into the feature-enabled caller.

#![allow(clippy::missing_safety_doc)]

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// A vector ISA. All methods are unsafe: callers guarantee the CPU has the features and that
/// pointers are valid for `LANES` elements.
pub trait Simd: Copy {
    const LANES: usize;
    type V: Copy;
    type I: Copy;
    unsafe fn zero() -> Self::V;
    unsafe fn splat(x: f32) -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    unsafe fn store(p: *mut f32, v: Self::V);
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn sub(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn div(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn max(a: Self::V, b: Self::V) -> Self::V;
    /// a * b + c
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    unsafe fn reduce_add(v: Self::V) -> f32;
    unsafe fn reduce_max(v: Self::V) -> f32;
    /// `LANES` bytes, zero-extended to i32 lanes.
    unsafe fn load_u8(p: *const u8) -> Self::I;
    /// `LANES` bytes, sign-extended to i32 lanes.
    unsafe fn load_i8(p: *const u8) -> Self::I;
    /// `LANES` u16, zero-extended to i32 lanes.
    unsafe fn load_u16(p: *const u8) -> Self::I;
    /// `LANES` IEEE halves converted to f32.
    unsafe fn load_f16(p: *const u8) -> Self::V;
    unsafe fn and_i(a: Self::I, m: i32) -> Self::I;
    unsafe fn or_i(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn add_i(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn splat_i(x: i32) -> Self::I;
    unsafe fn srl<const N: u32>(a: Self::I) -> Self::I;
    unsafe fn sll<const N: u32>(a: Self::I) -> Self::I;
    /// i32 -> f32 value conversion.
    unsafe fn cvt(a: Self::I) -> Self::V;
    /// f32 -> i32, rounding to nearest.
    unsafe fn cvt_round(a: Self::V) -> Self::I;
    /// Bit reinterpretation i32 -> f32.
    unsafe fn cast(a: Self::I) -> Self::V;
    /// Round to nearest integer (as f32).
    unsafe fn round(a: Self::V) -> Self::V;
    /// One IEEE half to f32 (F16C).
    #[inline(always)]
    unsafe fn f16(p: *const u8) -> f32 {
        let h = u16::from_le_bytes([*p, *p.add(1)]);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
    }
    /// Hint that the cache line at `p` will be read soon.
    #[inline(always)]
    unsafe fn prefetch(p: *const u8) {
        _mm_prefetch::<_MM_HINT_T0>(p as *const i8)
    }
}

#[derive(Clone, Copy)]
pub struct Avx2;
#[derive(Clone, Copy)]
pub struct Avx512;

#[cfg(target_arch = "x86_64")]
impl Simd for Avx2 {
    const LANES: usize = 8;
    type V = __m256;
    type I = __m256i;
    #[inline(always)]
    unsafe fn zero() -> __m256 {
        _mm256_setzero_ps()
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> __m256 {
        _mm256_set1_ps(x)
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m256) {
        _mm256_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn add(a: __m256, b: __m256) -> __m256 {
        _mm256_add_ps(a, b)
    }
    #[inline(always)]
    unsafe fn sub(a: __m256, b: __m256) -> __m256 {
        _mm256_sub_ps(a, b)
    }
    #[inline(always)]
    unsafe fn mul(a: __m256, b: __m256) -> __m256 {
        _mm256_mul_ps(a, b)
    }
    #[inline(always)]
    unsafe fn div(a: __m256, b: __m256) -> __m256 {
        _mm256_div_ps(a, b)
    }
    #[inline(always)]
    unsafe fn max(a: __m256, b: __m256) -> __m256 {
        _mm256_max_ps(a, b)
    }
    #[inline(always)]
    unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
        _mm256_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn reduce_add(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }
    #[inline(always)]
    unsafe fn reduce_max(v: __m256) -> f32 {
        let s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_max_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }
    #[inline(always)]
    unsafe fn load_u8(p: *const u8) -> __m256i {
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i))
    }
    #[inline(always)]
    unsafe fn load_i8(p: *const u8) -> __m256i {
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i))
    }
    #[inline(always)]
    unsafe fn load_u16(p: *const u8) -> __m256i {
        _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i))
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u8) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
    #[inline(always)]
    unsafe fn and_i(a: __m256i, m: i32) -> __m256i {
        _mm256_and_si256(a, _mm256_set1_epi32(m))
    }
    #[inline(always)]
    unsafe fn or_i(a: __m256i, b: __m256i) -> __m256i {
        _mm256_or_si256(a, b)
    }
    #[inline(always)]
    unsafe fn add_i(a: __m256i, b: __m256i) -> __m256i {
        _mm256_add_epi32(a, b)
    }
    #[inline(always)]
    unsafe fn splat_i(x: i32) -> __m256i {
        _mm256_set1_epi32(x)
    }
    #[inline(always)]
    unsafe fn srl<const N: u32>(a: __m256i) -> __m256i {
        _mm256_srl_epi32(a, _mm_cvtsi32_si128(N as i32))
    }
    #[inline(always)]
    unsafe fn sll<const N: u32>(a: __m256i) -> __m256i {
        _mm256_sll_epi32(a, _mm_cvtsi32_si128(N as i32))
    }
    #[inline(always)]
    unsafe fn cvt(a: __m256i) -> __m256 {
        _mm256_cvtepi32_ps(a)
    }
    #[inline(always)]
    unsafe fn cvt_round(a: __m256) -> __m256i {
        _mm256_cvtps_epi32(a)
    }
    #[inline(always)]
    unsafe fn cast(a: __m256i) -> __m256 {
        _mm256_castsi256_ps(a)
    }
    #[inline(always)]
    unsafe fn round(a: __m256) -> __m256 {
        _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(a)
    }
}

#[cfg(target_arch = "x86_64")]
impl Simd for Avx512 {
    const LANES: usize = 16;
    type V = __m512;
    type I = __m512i;
    #[inline(always)]
    unsafe fn zero() -> __m512 {
        _mm512_setzero_ps()
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> __m512 {
        _mm512_set1_ps(x)
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m512 {
        _mm512_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m512) {
        _mm512_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn add(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(a, b)
    }
    #[inline(always)]
    unsafe fn sub(a: __m512, b: __m512) -> __m512 {
        _mm512_sub_ps(a, b)
    }
    #[inline(always)]
    unsafe fn mul(a: __m512, b: __m512) -> __m512 {
        _mm512_mul_ps(a, b)
    }
    #[inline(always)]
    unsafe fn div(a: __m512, b: __m512) -> __m512 {
        _mm512_div_ps(a, b)
    }
    #[inline(always)]
    unsafe fn max(a: __m512, b: __m512) -> __m512 {
        _mm512_max_ps(a, b)
    }
    #[inline(always)]
    unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
        _mm512_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn reduce_add(v: __m512) -> f32 {
        let lo = _mm512_castps512_ps256(v);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        Avx2::reduce_add(_mm256_add_ps(lo, hi))
    }
    #[inline(always)]
    unsafe fn reduce_max(v: __m512) -> f32 {
        let lo = _mm512_castps512_ps256(v);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        Avx2::reduce_max(_mm256_max_ps(lo, hi))
    }
    #[inline(always)]
    unsafe fn load_u8(p: *const u8) -> __m512i {
        _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i))
    }
    #[inline(always)]
    unsafe fn load_i8(p: *const u8) -> __m512i {
        _mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i))
    }
    #[inline(always)]
    unsafe fn load_u16(p: *const u8) -> __m512i {
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i))
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u8) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }
    #[inline(always)]
    unsafe fn and_i(a: __m512i, m: i32) -> __m512i {
        _mm512_and_si512(a, _mm512_set1_epi32(m))
    }
    #[inline(always)]
    unsafe fn or_i(a: __m512i, b: __m512i) -> __m512i {
        _mm512_or_si512(a, b)
    }
    #[inline(always)]
    unsafe fn add_i(a: __m512i, b: __m512i) -> __m512i {
        _mm512_add_epi32(a, b)
    }
    #[inline(always)]
    unsafe fn splat_i(x: i32) -> __m512i {
        _mm512_set1_epi32(x)
    }
    #[inline(always)]
    unsafe fn srl<const N: u32>(a: __m512i) -> __m512i {
        _mm512_srli_epi32::<N>(a)
    }
    #[inline(always)]
    unsafe fn sll<const N: u32>(a: __m512i) -> __m512i {
        _mm512_slli_epi32::<N>(a)
    }
    #[inline(always)]
    unsafe fn cvt(a: __m512i) -> __m512 {
        _mm512_cvtepi32_ps(a)
    }
    #[inline(always)]
    unsafe fn cvt_round(a: __m512) -> __m512i {
        _mm512_cvtps_epi32(a)
    }
    #[inline(always)]
    unsafe fn cast(a: __m512i) -> __m512 {
        _mm512_castsi512_ps(a)
    }
    #[inline(always)]
    unsafe fn round(a: __m512) -> __m512 {
        _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(a)
    }
}

/// exp(x) for every lane: Cody–Waite range reduction and a degree-6 polynomial (about 2 ulp),
/// clamped so that very negative inputs give 0 and large ones +inf-free large values.
#[inline(always)]
pub unsafe fn exp<S: Simd>(x: S::V) -> S::V {
    let x = S::max(x, S::splat(-87.3));
    let x = S::sub(S::zero(), S::max(S::sub(S::zero(), x), S::splat(-88.3)));
    let n = S::round(S::mul(x, S::splat(std::f32::consts::LOG2_E)));
    let r = S::fma(n, S::splat(-0.693_145_75), x);
    let r = S::fma(n, S::splat(-1.428_606_8e-6), r);
    let mut p = S::splat(1.0 / 720.0);
    p = S::fma(p, r, S::splat(1.0 / 120.0));
    p = S::fma(p, r, S::splat(1.0 / 24.0));
    p = S::fma(p, r, S::splat(1.0 / 6.0));
    p = S::fma(p, r, S::splat(0.5));
    p = S::fma(p, r, S::splat(1.0));
    p = S::fma(p, r, S::splat(1.0));
    let e = S::sll::<23>(S::add_i(S::cvt_round(n), S::splat_i(127)));
    S::mul(p, S::cast(e))
}
