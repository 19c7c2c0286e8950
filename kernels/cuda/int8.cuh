// The int8 products (`Precision::Int8`) on the GPU: `reference::int8`'s arithmetic to the bit, so
// that a product here equals the CPU's int8 product (`reference::matmul_int8`, which the CPU's
// VNNI and AVX2 kernels equal) bit for bit. Activations are quantized per block of 32 to int8
// (llama.cpp's Q8); each 4-value group's integer dot product with the weights' own codes is
// exact (`__dp4a`), and only the f32 steps after it are ordered, as the reference orders them:
//
//   16 lanes A; pairs of blocks (b, b+1), b even, in order; lane L takes block b + L%2, values
//   4·(L/2) .. + 4: A[L] = fma(Σ w·x as f32, d_w·d_x, A[L]) (d_w: the scale of that half of the
//   block); with a min (Q4_1, Q4_K, Q5_K) 16 lanes B, blocks in order: B[b%16] = fma(m, d_x ·
//   Σx as f32, B[b%16]), then A[L] += B[L]; then y = ((A[l] + A[l+8]) … ) by halves, as AVX-512's
//   reduce_add: 16 → 8 → 4 → 2 → 1.
//
// On the GPU 4 threads hold one (row, token)'s 16 lanes: thread (h, q) lanes h + 8q + 2i
// (i = 0..3), i.e. values 16q .. 16q + 16 of the odd or even block of each pair, one scale. Its
// share (`fw_i8_thread`) and the sum of the four shares (`fw_i8_tree`) are written once for the
// device and the host twin (`twin.cu`), which `kernels/tests/cuda_twin.rs` checks against the
// reference on every machine; the kernels' shuffles follow fw_i8_tree's order.
//
// Written here: llama.cpp's CUDA kernels sum in their own order (and are not a Rust dependency);
// no crate does GGUF products with a fixed order of sums.
#pragma once
#include <math.h>

#include "common.cuh"
#include "units.cuh"

// The quantized activations' layout (`cuda::Q8Acts`): per token, 2·ceil(nb / 2) blocks (a pair's
// missing second block is zeros), 32 codes each, and per block its scale d and code sum.
FW_HD int fw_q8_blocks(int cols) { return 2 * ((cols / 32 + 1) / 2); }

// One block of 32 activations quantized (`reference::quantize_block_q8`): codes into q, returns
// d; *sum = the codes' sum.
FW_HD float fw_q8_block(const float* x, int8_t* q, int* sum) {
  float amax = 0.0f;
  for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
  const float d = amax / 127.0f;  // IEEE division on both sides (nvcc's default -prec-div=true)
  const float inv = d != 0.0f ? 1.0f / d : 0.0f;
  int s = 0;
  for (int j = 0; j < 32; j++) {
    // Rust's `round_ties_even() as i8`: NaN → 0, saturating (an infinite 1/d makes ±inf).
    const float p = fw_mul(x[j], inv), v = fminf(fmaxf(p, -128.0f), 127.0f);
#ifdef __CUDA_ARCH__
    const int c = __float2int_rn(v);  // to nearest, ties to even
#else
    const int c = (int)lrintf(v);  // the default rounding mode: to nearest, ties to even
#endif
    q[j] = (int8_t)(p != p ? 0 : c);
    s += q[j];
  }
  *sum = s;
  return d;
}

// Σ of the 4 products of signed bytes a[k]·b[k].
FW_HD int fw_dp4a(uint32_t a, uint32_t b) {
#ifdef __CUDA_ARCH__
  return __dp4a((int)a, (int)b, 0);
#else
  int s = 0;
  for (int k = 0; k < 4; k++) s += (int)(int8_t)(a >> (8 * k)) * (int)(int8_t)(b >> (8 * k));
  return s;
#endif
}

// (float)(a · b as 4 signed byte pairs), exactly, with no integer-to-float conversion (those run
// at 16 a clock an SM by the CUDA guide's table, an eighth of FP32's on sm_90, one a dp4a): the dot product added to the
// bits of 1.5·2²³ (0x4B400000) is the float 1.5·2²³ + the sum (|sum| ≤ 4·128·127 < 2²²: the
// exponent stays), and subtracting 1.5·2²³ leaves the sum, exactly.
FW_HD float fw_dp4a_float(uint32_t a, uint32_t b) {
#ifdef __CUDA_ARCH__
  const int bits = __dp4a((int)a, (int)b, 0x4B400000);  // the bits added as dp4a's accumulator
#else
  const int bits = fw_dp4a(a, b) + 0x4B400000;
#endif
  return fw_sub(fw_bits_to_float((uint32_t)bits), 12582912.0f);
}

// (float)v for |v| < 2²², exactly, the same way.
FW_HD float fw_small_int_float(int v) {
  return fw_sub(fw_bits_to_float((uint32_t)(v + 0x4B400000)), 12582912.0f);
}

// Each byte (0 .. 127) minus k, as signed bytes.
FW_HD uint32_t fw_sub_bytes(uint32_t w, uint32_t k) {
  return ((w | 0x80808080u) - k * 0x01010101u) ^ 0x80808080u;
}

// Each byte's low nibble through IQ4's codebook.
FW_HD uint32_t fw_iq4_bytes(uint32_t w) {
  uint32_t o = 0;
  for (int k = 0; k < 4; k++) o |= ((uint32_t)(int)fw_iq4((int)(w >> (8 * k))) & 0xFF) << (8 * k);
  return o;
}

// Where values 16q .. 16q + 16 of block b (32 values) of a row keep their codes: the word of
// values 16q + 4i .. + 4 is at *a + 4i (and, for the formats with a second source of bits,
// fw_i8_two, at *b2 + 4i), to be made codes by fw_i8_mix.
FW_HD constexpr bool fw_i8_two(int ty) { return ty == FW_Q5K || ty == FW_Q6K || ty == FW_Q3K; }
template <int TY>
FW_HD void fw_i8_bases(const uint8_t* row, int b, int q, const uint8_t** a, const uint8_t** b2) {
  const int j = b % 8;
  *b2 = row;
  if (TY == FW_Q4_0 || TY == FW_IQ4NL) {
    *a = row + (size_t)b * 18 + 2;  // d, then 16 bytes: value k the low nibble of byte k, 16 + k its high
  } else if (TY == FW_Q4_1) {
    *a = row + (size_t)b * 20 + 4;
  } else if (TY == FW_Q8_0) {
    *a = row + (size_t)b * 34 + 2 + 16 * q;
  } else if (TY == FW_Q4K || TY == FW_Q5K) {
    // d, dmin, 12 scale bytes, (Q5_K: 32 bytes of fifth bits,) 128 nibble bytes: block j the low
    // (j even) or high nibbles of bytes 32·(j/2) ...
    const bool q5 = TY == FW_Q5K;
    const uint8_t* blk = row + (size_t)(b / 8) * (q5 ? 176 : 144);
    *a = blk + (q5 ? 48 : 16) + 32 * (j / 2) + 16 * q;
    *b2 = blk + 16 + 16 * q;
  } else if (TY == FW_Q6K) {
    // 128 low-bit bytes, 64 high-bit bytes, 16 i8 scales, d: block j in half h = j/4, group g:
    // low or high nibbles of ql[64h + 32·(g%2) ..], bits 2g of qh[32h ..].
    const uint8_t* blk = row + (size_t)(b / 8) * 210;
    *a = blk + 64 * (j / 4) + 32 * (j % 4 % 2) + 16 * q;
    *b2 = blk + 128 + 32 * (j / 4) + 16 * q;
  } else if (TY == FW_Q3K) {
    // 32 bytes of high bits, 64 of low bit pairs, 12 of 6-bit scales, d.
    const uint8_t* blk = row + (size_t)(b / 8) * 110;
    *a = blk + 32 + 32 * (j / 4) + 16 * q;
    *b2 = blk + 16 * q;
  } else {  // FW_IQ4XS: d, high scale bits (u16), 4 bytes of low scale nibbles, 128 nibble bytes
    *a = row + (size_t)(b / 8) * 136 + 8 + 16 * j;
  }
}
// The codes of 4 values as signed bytes from their word w (and w2 from the second source).
template <int TY>
FW_HD uint32_t fw_i8_mix(uint32_t w, uint32_t w2, int b, int q) {
  const int j = b % 8;
  if (TY == FW_Q4_0 || TY == FW_IQ4NL || TY == FW_IQ4XS) {
    const uint32_t nib = (w >> (4 * q)) & 0x0F0F0F0Fu;
    return TY == FW_Q4_0 ? fw_sub_bytes(nib, 8) : fw_iq4_bytes(nib);
  } else if (TY == FW_Q4_1) {
    return (w >> (4 * q)) & 0x0F0F0F0Fu;
  } else if (TY == FW_Q8_0) {
    return w;
  } else if (TY == FW_Q4K || TY == FW_Q5K) {
    const uint32_t c = (w >> (4 * (j % 2))) & 0x0F0F0F0Fu;
    return TY == FW_Q5K ? c | (((w2 >> j) & 0x01010101u) << 4) : c;
  } else if (TY == FW_Q6K) {  // minus 32
    const int g = j % 4;
    const uint32_t l4 = (w >> (4 * (g / 2))) & 0x0F0F0F0Fu;
    return fw_sub_bytes(l4 | (((w2 >> (2 * g)) & 0x03030303u) << 4), 32);
  } else {  // FW_Q3K: ((qs >> 2·(j%4)) & 3) + 4·bit j of hmask − 4
    const uint32_t l2 = (w >> (2 * (j % 4))) & 0x03030303u;
    return fw_sub_bytes(l2 | (((w2 >> j) & 0x01010101u) << 2), 4);
  }
}
// Values 16q + 4i .. + 4 of block b as the int8 products read them: their integer codes as
// signed bytes (byte k = value 16q + 4i + k).
template <int TY>
FW_HD uint32_t fw_i8_word(const uint8_t* row, int b, int q, int i) {
  const uint8_t *a, *b2;
  fw_i8_bases<TY>(row, b, q, &a, &b2);
  uint32_t w, w2 = 0;
  fw_words<1>(a + 4 * i, &w);
  if (fw_i8_two(TY)) fw_words<1>(b2 + 4 * i, &w2);
  return fw_i8_mix<TY>(w, w2, b, q);
}
// The scale of values 16q .. 16q + 16 of block b (fw_i8_word's codes times it are the values).
template <int TY>
FW_HD float fw_i8_scale(const uint8_t* row, int b, int q) {
  if (TY == FW_Q4_0 || TY == FW_IQ4NL) {
    return fw_f16((uint16_t)fw_u16_at(row + (size_t)b * 18));
  } else if (TY == FW_Q4_1) {
    return fw_f16((uint16_t)fw_u16_at(row + (size_t)b * 20));
  } else if (TY == FW_Q8_0) {
    return fw_f16((uint16_t)fw_u16_at(row + (size_t)b * 34));
  } else if (TY == FW_Q4K || TY == FW_Q5K) {
    const uint8_t* blk = row + (size_t)(b / 8) * (TY == FW_Q5K ? 176 : 144);
    uint32_t s[3], sc, m;
    fw_words<3>(blk + 4, s);
    fw_scale_min_k4_words(b % 8, s, &sc, &m);
    return fw_mul(fw_f16((uint16_t)fw_u16_at(blk)), (float)sc);
  } else if (TY == FW_Q6K) {
    const int j = b % 8;
    const uint8_t* blk = row + (size_t)(b / 8) * 210;
    const float d = fw_f16((uint16_t)fw_u16_at(blk + 208));
    return fw_mul(d, (float)(int8_t)blk[192 + 8 * (j / 4) + 2 * (j % 4) + q]);
  } else if (TY == FW_Q3K) {
    // Half q's scale is sub-block 2j + q's 6 bits, minus 32.
    const uint8_t* blk = row + (size_t)(b / 8) * 110;
    const int k = 2 * (b % 8) + q;
    const int sl = (blk[96 + k % 8] >> (4 * (k / 8))) & 0xF, sh = (blk[104 + k % 4] >> (2 * (k / 4))) & 3;
    return fw_mul(fw_f16((uint16_t)fw_u16_at(blk + 108)), (float)((sl | (sh << 4)) - 32));
  } else {
    const int j = b % 8;
    const uint8_t* blk = row + (size_t)(b / 8) * 136;
    const int lo = (blk[4 + j / 2] >> (4 * (j % 2))) & 0xF, hi = (fw_u16_at(blk + 2) >> (2 * j)) & 3;
    return fw_mul(fw_f16((uint16_t)fw_u16_at(blk)), (float)((lo | (hi << 4)) - 32));
  }
}
// Values 16q .. 16q + 16 of block b: c[i] = fw_i8_word(.., i), their words read 4 at a time;
// returns their scale.
template <int TY>
FW_HD float fw_i8_codes(const uint8_t* row, int b, int q, uint32_t* c) {
  const uint8_t *a, *b2;
  fw_i8_bases<TY>(row, b, q, &a, &b2);
  uint32_t w[4], w2[4] = {0, 0, 0, 0};
  fw_words<4>(a, w);
  if (fw_i8_two(TY)) fw_words<4>(b2, w2);
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
  for (int i = 0; i < 4; i++) c[i] = fw_i8_mix<TY>(w[i], w2[i], b, q);
  return fw_i8_scale<TY>(row, b, q);
}
FW_HD constexpr bool fw_i8_has_min(int ty) { return ty == FW_Q4_1 || ty == FW_Q4K || ty == FW_Q5K; }

// Block b's min m (the formats of fw_i8_has_min): Q4_1's m, −(dmin · m_j) for Q4_K and Q5_K.
template <int TY>
FW_HD float fw_i8_min(const uint8_t* row, int b) {
  if (TY == FW_Q4_1) return fw_f16((uint16_t)fw_u16_at(row + (size_t)b * 20 + 2));
  const uint8_t* blk = row + (size_t)(b / 8) * (TY == FW_Q5K ? 176 : 144);
  uint32_t s[3], sc, m;
  fw_words<3>(blk + 4, s);
  fw_scale_min_k4_words(b % 8, s, &sc, &m);
  return -fw_mul(fw_f16((uint16_t)fw_u16_at(blk + 2)), (float)m);
}

// Thread (h, q)'s share of NT tokens' sums over a row of nb blocks: its lanes h + 8q + 2i
// (i = 0..3), with the min lanes added, into a[t][i]. xq/xd/xs: the first token's codes, scales
// and code sums (`fw_q8_blocks(cols)` = xb blocks a token); tokens past nt are left at 0.
template <int TY, int NT>
FW_HD void fw_i8_thread(const uint8_t* row, int nb, int h, int q, const int8_t* xq,
                        const float* xd, const int* xs, int xb, int nt, float (*a)[4]) {
  for (int t = 0; t < NT; t++)
    for (int i = 0; i < 4; i++) a[t][i] = 0.0f;
  const int np = (nb + 1) / 2;
  for (int p = 0; p < np; p++) {
    const int b = 2 * p + h;
    uint32_t c[4] = {0, 0, 0, 0};
    float dw = 0.0f;  // a missing block's weights are zeros, as its activations are
    if (b < nb) dw = fw_i8_codes<TY>(row, b, q, c);
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
    for (int t = 0; t < NT; t++) {
      if (t >= nt) continue;
      const int8_t* xc = xq + ((size_t)t * xb + b) * 32 + 16 * q;
      uint32_t x4[4];
#ifdef __CUDA_ARCH__
      const uint4 v = __ldg((const uint4*)xc);  // 16-byte aligned: blocks of 32, offsets of 16
      x4[0] = v.x, x4[1] = v.y, x4[2] = v.z, x4[3] = v.w;
#else
      memcpy(x4, xc, 16);
#endif
      const float s = fw_mul(dw, xd[(size_t)t * xb + b]);
      for (int i = 0; i < 4; i++) a[t][i] = fmaf(fw_dp4a_float(c[i], x4[i]), s, a[t][i]);
    }
  }
  if (fw_i8_has_min(TY)) {
    for (int i = 0; i < 4; i++) {
      float m[NT];
      for (int t = 0; t < NT; t++) m[t] = 0.0f;
      for (int b = h + 8 * q + 2 * i; b < nb; b += 16) {
        const float mb = fw_i8_min<TY>(row, b);
        for (int t = 0; t < NT; t++) {
          if (t >= nt) continue;
          const size_t k = (size_t)t * xb + b;
          m[t] = fmaf(mb, fw_mul(xd[k], fw_small_int_float(xs[k])), m[t]);  // |Σ| ≤ 32·127
        }
      }
      for (int t = 0; t < NT; t++) a[t][i] = fw_add(a[t][i], m[t]);
    }
  }
}

// The (row, token)'s value from its four threads' shares s[h + 2q] (fw_i8_thread's a[t]): the
// reference's halving sums, A[l] + A[l + 8] (thread q = 0's lane plus q = 1's), then within
// thread q = 0: lanes l and l + 4 (i, i + 2), l and l + 2 (i = 0, 1), then h = 0's plus h = 1's.
FW_HD float fw_i8_tree(const float (*s)[4]) {
  float y[2];
  for (int h = 0; h < 2; h++) {
    float v[4];
    for (int i = 0; i < 4; i++) v[i] = fw_add(s[h][i], s[h + 2][i]);
    y[h] = fw_add(fw_add(v[0], v[2]), fw_add(v[1], v[3]));
  }
  return fw_add(y[0], y[1]);
}

// The lanes layout (`fw_matmul_i8_lanes_body`): a thread a lane. Lane L (0 .. 16) of a (row,
// token) is fw_i8_thread's lane i = (L >> 1) & 3 of thread (h, q) = (L & 1, L >> 3): block
// b = 2p + h of each pair p, values 16q + 4i .. + 4, and (with a min) the blocks b ≡ L mod 16.
// Its share of the pairs of blocks [b0, b0 + FW_I8_CHUNK) (b0 a multiple of FW_I8_CHUNK), the
// chunk's bytes at `chunk` (the row's from block b0 on), carried in a[t] (the pairs' sums) and
// m[t] (the mins'): fw_i8_thread's steps for that lane, in its order, a chunk at a time. NT
// tokens from xq/xd/xs as fw_i8_thread takes them; tokens past nt are left alone.
#define FW_I8_CHUNK 64
template <int TY, int NT>
FW_HD void fw_i8_lane(const uint8_t* chunk, int b0, int nb, int L, const int8_t* xq,
                      const float* xd, const int* xs, int xb, int nt, float* a, float* m) {
  const int h = L & 1, i = (L >> 1) & 3, q = L >> 3;
  const int pend = min((nb + 1) / 2, (b0 + FW_I8_CHUNK) / 2);
  // Unrolled: a thread's loads of several pairs go out together (a decode product has few
  // blocks an SM, and each step waits on its loads).
#ifdef __CUDA_ARCH__
#pragma unroll 4
#endif
  for (int p = b0 / 2; p < pend; p++) {
    const int b = 2 * p + h;
    uint32_t c = 0;
    float dw = 0.0f;  // a missing block's weights are zeros, as its activations are
    if (b < nb) {
      c = fw_i8_word<TY>(chunk, b - b0, q, i);
      dw = fw_i8_scale<TY>(chunk, b - b0, q);
    }
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
    for (int t = 0; t < NT; t++) {
      if (t >= nt) continue;
      const int8_t* xc = xq + ((size_t)t * xb + b) * 32 + 16 * q + 4 * i;
#ifdef __CUDA_ARCH__
      const uint32_t xw = __ldg((const uint32_t*)xc);
#else
      uint32_t xw;
      memcpy(&xw, xc, 4);
#endif
      a[t] = fmaf(fw_dp4a_float(c, xw), fw_mul(dw, xd[(size_t)t * xb + b]), a[t]);
    }
  }
  if (fw_i8_has_min(TY)) {
    for (int b = b0 + L; b < min(nb, b0 + FW_I8_CHUNK); b += 16) {
      const float mb = fw_i8_min<TY>(chunk, b - b0);
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
      for (int t = 0; t < NT; t++) {
        if (t >= nt) continue;
        const size_t k = (size_t)t * xb + b;
        m[t] = fmaf(mb, fw_mul(xd[k], fw_small_int_float(xs[k])), m[t]);
      }
    }
  }
}
// Bytes of a row from block b (a multiple of FW_I8_CHUNK) on: b / 8 K-quant super-blocks, or b
// blocks of 32 values.
template <int TY>
FW_HD constexpr long long fw_i8_offset(int b) {
  return fw_block_values(TY) == 256 ? (long long)(b / 8) * fw_block_bytes(TY)
                                    : (long long)b * fw_block_bytes(TY);
}
#ifdef __CUDA_ARCH__
// Activations quantized (fw_q8_block): x (n, cols) into codes (n, xb·32), scales and code sums
// (n, xb), xb = fw_q8_blocks(cols); a pair's missing block is written as zeros. A thread a block.
__device__ __forceinline__ void fw_quantize_q8_body(const float* __restrict__ x, int n, int cols,
                                                    int8_t* __restrict__ xq, float* __restrict__ xd,
                                                    int* __restrict__ xs) {
  const int xb = fw_q8_blocks(cols), nb = cols / 32;
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)n * xb) return;
  const int t = (int)(i / xb), b = (int)(i % xb);
  int8_t q[32];
  int sum = 0;
  float d = 0.0f;
  if (b < nb) {
    float v[32];
    const float4* x4 = (const float4*)(x + (size_t)t * cols + 32 * b);
#pragma unroll
    for (int k = 0; k < 8; k++) {
      const float4 f = __ldg(x4 + k);
      v[4 * k] = f.x, v[4 * k + 1] = f.y, v[4 * k + 2] = f.z, v[4 * k + 3] = f.w;
    }
    d = fw_q8_block(v, q, &sum);
  } else {
#pragma unroll
    for (int k = 0; k < 32; k++) q[k] = 0;
  }
  uint4* o = (uint4*)(xq + i * 32);
  uint32_t w[8];
  memcpy(w, q, 32);
  o[0] = make_uint4(w[0], w[1], w[2], w[3]);
  o[1] = make_uint4(w[4], w[5], w[6], w[7]);
  xd[i] = d;
  xs[i] = sum;
}

// fw_i8_tree by shuffles within a quad of threads (a[i]: thread (h, q)'s lanes): q = 1's lanes
// added to q = 0's, then h = 1's sum to h = 0's. The quad's first thread holds the value.
__device__ __forceinline__ float fw_i8_quad_sum(const float* a) {
  float v[4];
#pragma unroll
  for (int i = 0; i < 4; i++) v[i] = fw_add(a[i], __shfl_down_sync(0xffffffffu, a[i], 2, 4));
  const float s = fw_add(fw_add(v[0], v[2]), fw_add(v[1], v[3]));
  return fw_add(s, __shfl_down_sync(0xffffffffu, s, 1, 4));
}

// Rows of an int8 product: FW_I8_ROWS a block of 4·FW_I8_ROWS threads, 4 a (row, token).
#define FW_I8_ROWS 32

// y (n, rows) = x · Wᵀ with x quantized (fw_quantize_q8_body's buffers): grid (ceil(rows /
// FW_I8_ROWS), ceil(n / NT)), NT tokens a thread. A (row, token)'s value is the same whatever NT
// and the batch: its arithmetic is fw_i8_thread's and fw_i8_tree's alone.
template <int TY, int NT>
__device__ __forceinline__ void fw_matmul_i8_body(const uint8_t* __restrict__ w, int rows, int cols,
                                                  long long row_bytes, const int8_t* __restrict__ xq,
                                                  const float* __restrict__ xd,
                                                  const int* __restrict__ xs, int n,
                                                  float* __restrict__ y) {
  const int quad = threadIdx.x & 3, h = quad & 1, q = quad >> 1;
  const int r = blockIdx.x * FW_I8_ROWS + (int)(threadIdx.x >> 2);
  const int t0 = blockIdx.y * NT, nt = min(NT, n - t0);
  const int xb = fw_q8_blocks(cols);
  // A row past the last computes the last again (every thread takes part in the shuffles).
  const uint8_t* row = w + (size_t)min(r, rows - 1) * row_bytes;
  const size_t x0 = (size_t)t0 * xb;
  float a[NT][4];
  fw_i8_thread<TY, NT>(row, cols / 32, h, q, xq + x0 * 32, xd + x0, xs + x0, xb, nt, a);
#pragma unroll
  for (int t = 0; t < NT; t++) {
    const float s = fw_i8_quad_sum(a[t]);
    if (quad == 0 && r < rows && t < nt) y[(size_t)(t0 + t) * rows + r] = s;
  }
}

// A mixture of experts' rows in int8 (`fw_matmul_experts_body`'s shape): y[r][j] = W_{expert[r]}
// row j · x[r / xdiv], x quantized (n = rows / xdiv tokens), each row the bits of its expert's
// int8 product. Grid (rows, ceil(out / FW_I8_ROWS)), 4·FW_I8_ROWS threads, 4 an output.
template <int TY>
__device__ __forceinline__ void fw_matmul_experts_i8_body(
    const uint64_t* __restrict__ experts, const uint32_t* __restrict__ expert, int ne, int out,
    int cols, long long row_bytes, const int8_t* __restrict__ xq, const float* __restrict__ xd,
    const int* __restrict__ xs, int xdiv, float* __restrict__ y) {
  const int quad = threadIdx.x & 3;
  const int r = blockIdx.x, j = blockIdx.y * FW_I8_ROWS + (int)(threadIdx.x >> 2);
  const uint32_t e = expert[r];
  if (e >= (uint32_t)ne) return;  // the whole block: e is the block's
  // An output past the last computes the last again (every thread takes part in the shuffles).
  const uint8_t* row = (const uint8_t*)experts[e] + (size_t)min(j, out - 1) * row_bytes;
  const int xb = fw_q8_blocks(cols);
  const size_t x0 = (size_t)(r / xdiv) * xb;
  float a[1][4];
  fw_i8_thread<TY, 1>(row, cols / 32, quad & 1, quad >> 1, xq + x0 * 32, xd + x0, xs + x0, xb, 1, a);
  const float s = fw_i8_quad_sum(a[0]);
  if (quad == 0 && j < out) y[(size_t)r * out + j] = s;
}
#endif
