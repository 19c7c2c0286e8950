// Helpers shared by the device kernels (kernels.cu) and their host twin (twin.cu): GGUF block
// dequantization and the paged KV cache's index arithmetic. Compiled by nvcc for the GPU and for
// the host from this one source, so that `kernels/tests/cuda_twin.rs` checks on every machine,
// GPU or not, that the GPU's arithmetic equals the CPU kernels' (`reference::dequantize_row`,
// `PagedKv::k_index`), bit for bit.
#pragma once
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define FW_HD __host__ __device__ __forceinline__
#else
#define FW_HD inline
#endif

#ifdef __CUDA_ARCH__
#include <cuda_fp16.h>
#endif

// The storage formats, numbered as `cuda::type_code` numbers `QuantType`.
enum FwType {
  FW_F32 = 0,
  FW_F16 = 1,
  FW_BF16 = 2,
  FW_Q4_0 = 3,
  FW_Q4_1 = 4,
  FW_Q8_0 = 5,
  FW_Q4K = 6,
  FW_Q6K = 7,
  FW_Q5_0 = 8,
  FW_Q5_1 = 9,
  FW_Q2K = 10,
  FW_Q3K = 11,
  FW_Q5K = 12,
  FW_IQ4NL = 13,
  FW_IQ4XS = 14,
};

// One product and one sum, each rounded once: nvcc would fuse `a * b - c` into an FMA, which the
// CPU's dequantization does not do. These keep the GPU's values equal to the CPU's.
FW_HD float fw_mul(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
FW_HD float fw_add(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
FW_HD float fw_sub(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

FW_HD float fw_bits_to_float(uint32_t bits) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(bits);
#else
  float f;
  memcpy(&f, &bits, 4);
  return f;
#endif
}

// An IEEE half's bits as f32 (exact either way).
FW_HD float fw_f16(uint16_t h) {
#ifdef __CUDA_ARCH__
  return __half2float(__ushort_as_half(h));
#else
  uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (exp == 0) {
    // zero or subnormal: man · 2^-24, exact in f32
    float f = (float)man * 5.9604644775390625e-8f;
    return sign ? -f : f;
  }
  if (exp == 31) return fw_bits_to_float(sign | 0x7f800000u | (man << 13));
  return fw_bits_to_float(sign | ((exp + 112) << 23) | (man << 13));
#endif
}

FW_HD uint16_t fw_u16(const uint8_t* p) { return (uint16_t)(p[0] | (p[1] << 8)); }

// llama.cpp's get_scale_min_k4: the 6-bit scale and min of sub-block j of a Q4_K block.
FW_HD void fw_scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Bytes per block and values per block of each format.
FW_HD constexpr int fw_block_bytes(int ty) {
  switch (ty) {
    case FW_F32: return 4;
    case FW_F16: case FW_BF16: return 2;
    case FW_Q4_0: return 18;
    case FW_Q4_1: return 20;
    case FW_Q8_0: return 34;
    case FW_Q4K: return 144;
    case FW_Q5_0: return 22;
    case FW_Q5_1: return 24;
    case FW_Q2K: return 84;
    case FW_Q3K: return 110;
    case FW_Q5K: return 176;
    case FW_IQ4NL: return 18;
    case FW_IQ4XS: return 136;
    default: return 210;  // FW_Q6K
  }
}
FW_HD constexpr int fw_block_values(int ty) {
  switch (ty) {
    case FW_F32: case FW_F16: case FW_BF16: return 1;
    case FW_Q4_0: case FW_Q4_1: case FW_Q5_0: case FW_Q5_1: case FW_Q8_0: case FW_IQ4NL: return 32;
    default: return 256;  // the K-quants and IQ4_XS
  }
}

// IQ4_NL's and IQ4_XS's codebook (`quant::IQ4_VALUES`: −127, −104, −83, −65, −49, −35, −22, −10,
// 1, 13, 25, 38, 53, 69, 89, 113) as bytes of two constants: an indexed local array would put a
// stack frame in every product kernel.
// The value comes out as a float by its bits, not a conversion (see units.cuh's fw_code): the
// signed byte v read as v + 128 (its top bit flipped) below 2²³'s bits, then 2²³ + 128 taken away.
FW_HD float fw_iq4(int code) {
  code &= 0xF;
  const uint64_t half = code < 8 ? 0xf6eaddcfbfad9881ull : 0x7159453526190d01ull;
  const uint32_t b = (uint32_t)(half >> (8 * (code & 7))) & 0xFFu;
  return fw_sub(fw_bits_to_float((b ^ 0x80u) | 0x4B000000u), 8388736.0f);
}

// Unit `u` of a row: its values 32u .. 32u+32, dequantized into out[0..32]. A unit is a whole
// block of the 32-value formats and one eighth of a K-quant block; the kernels work unit by unit.
template <int TY>
FW_HD void fw_unit(const uint8_t* row, int u, float* out) {
  if (TY == FW_F32) {
    const uint8_t* p = row + (size_t)u * 128;
    for (int j = 0; j < 32; j++) {
      uint32_t b;
      memcpy(&b, p + 4 * j, 4);
      out[j] = fw_bits_to_float(b);
    }
  } else if (TY == FW_F16) {
    const uint8_t* p = row + (size_t)u * 64;
    for (int j = 0; j < 32; j++) out[j] = fw_f16(fw_u16(p + 2 * j));
  } else if (TY == FW_BF16) {
    const uint8_t* p = row + (size_t)u * 64;
    for (int j = 0; j < 32; j++) out[j] = fw_bits_to_float((uint32_t)fw_u16(p + 2 * j) << 16);
  } else if (TY == FW_Q4_0) {
    const uint8_t* b = row + (size_t)u * 18;
    const float d = fw_f16(fw_u16(b));
    for (int j = 0; j < 16; j++) {
      out[j] = fw_mul((float)((b[2 + j] & 0xF) - 8), d);
      out[j + 16] = fw_mul((float)((b[2 + j] >> 4) - 8), d);
    }
  } else if (TY == FW_Q4_1) {
    const uint8_t* b = row + (size_t)u * 20;
    const float d = fw_f16(fw_u16(b)), m = fw_f16(fw_u16(b + 2));
    for (int j = 0; j < 16; j++) {
      out[j] = fw_add(fw_mul((float)(b[4 + j] & 0xF), d), m);
      out[j + 16] = fw_add(fw_mul((float)(b[4 + j] >> 4), d), m);
    }
  } else if (TY == FW_Q5_0 || TY == FW_Q5_1) {
    // bit 4 of value j is bit j of qh (a little-endian u32)
    const bool q51 = TY == FW_Q5_1;
    const uint8_t* b = row + (size_t)u * (q51 ? 24 : 22);
    const float d = fw_f16(fw_u16(b)), m = q51 ? fw_f16(fw_u16(b + 2)) : 0.0f;
    const uint8_t* h = b + (q51 ? 4 : 2);
    const uint32_t qh = (uint32_t)h[0] | ((uint32_t)h[1] << 8) | ((uint32_t)h[2] << 16) | ((uint32_t)h[3] << 24);
    const uint8_t* qs = h + 4;
    for (int j = 0; j < 16; j++) {
      const int q0 = (qs[j] & 0xF) | (((qh >> j) & 1) << 4);
      const int q1 = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      if (q51) {
        out[j] = fw_add(fw_mul((float)q0, d), m);
        out[j + 16] = fw_add(fw_mul((float)q1, d), m);
      } else {
        out[j] = fw_mul((float)(q0 - 16), d);
        out[j + 16] = fw_mul((float)(q1 - 16), d);
      }
    }
  } else if (TY == FW_Q8_0) {
    const uint8_t* b = row + (size_t)u * 34;
    const float d = fw_f16(fw_u16(b));
    for (int j = 0; j < 32; j++) out[j] = fw_mul((float)(int8_t)b[2 + j], d);
  } else if (TY == FW_Q4K) {
    const uint8_t* b = row + (size_t)(u / 8) * 144;
    const int s = u % 8;
    const float d = fw_f16(fw_u16(b)), dmin = fw_f16(fw_u16(b + 2));
    uint8_t sc, mn;
    fw_scale_min_k4(s, b + 4, &sc, &mn);
    const float d1 = fw_mul(d, (float)sc), m1 = fw_mul(dmin, (float)mn);
    const uint8_t* q = b + 16 + 32 * (s / 2);
    const int shift = (s % 2) * 4;
    for (int l = 0; l < 32; l++) out[l] = fw_sub(fw_mul(d1, (float)((q[l] >> shift) & 0xF)), m1);
  } else if (TY == FW_Q2K) {  // 16 scale/min bytes, 64 bytes of 2-bit codes, d, dmin
    const uint8_t* b = row + (size_t)(u / 8) * 84;
    const int s = u % 8;
    const float d = fw_f16(fw_u16(b + 80)), dmin = fw_f16(fw_u16(b + 82));
    const uint8_t* q = b + 16 + 32 * (s / 4);
    const int shift = 2 * (s % 4);
    for (int l = 0; l < 32; l++) {
      const uint8_t sc = b[2 * s + l / 16];
      const float dl = fw_mul(d, (float)(sc & 0xF)), ml = fw_mul(dmin, (float)(sc >> 4));
      out[l] = fw_sub(fw_mul(dl, (float)((q[l] >> shift) & 3)), ml);
    }
  } else if (TY == FW_Q3K) {  // 32 high-bit bytes, 64 bytes of 2-bit codes, 12 scale bytes, d
    const uint8_t* b = row + (size_t)(u / 8) * 110;
    const int s = u % 8;
    const float d = fw_f16(fw_u16(b + 108));
    const uint8_t* q = b + 32 + 32 * (s / 4);
    const int shift = 2 * (s % 4);
    for (int l = 0; l < 32; l++) {
      const int k = 2 * s + l / 16;
      const int lo = (b[96 + k % 8] >> (4 * (k / 8))) & 0xF, hi = (b[104 + k % 4] >> (2 * (k / 4))) & 3;
      const int code = ((q[l] >> shift) & 3) - 4 * (1 - ((b[l] >> s) & 1));
      out[l] = fw_mul(fw_mul(d, (float)((lo | (hi << 4)) - 32)), (float)code);
    }
  } else if (TY == FW_Q5K) {  // d, dmin, 12 scale bytes (as Q4_K), 32 high-bit bytes, nibbles
    const uint8_t* b = row + (size_t)(u / 8) * 176;
    const int s = u % 8;
    const float d = fw_f16(fw_u16(b)), dmin = fw_f16(fw_u16(b + 2));
    uint8_t sc, mn;
    fw_scale_min_k4(s, b + 4, &sc, &mn);
    const float d1 = fw_mul(d, (float)sc), m1 = fw_mul(dmin, (float)mn);
    const uint8_t* q = b + 48 + 32 * (s / 2);
    const int shift = (s % 2) * 4;
    for (int l = 0; l < 32; l++) {
      const int code = ((q[l] >> shift) & 0xF) | (((b[16 + l] >> s) & 1) << 4);
      out[l] = fw_sub(fw_mul(d1, (float)code), m1);
    }
  } else if (TY == FW_IQ4NL) {
    const uint8_t* b = row + (size_t)u * 18;
    const float d = fw_f16(fw_u16(b));
    for (int l = 0; l < 32; l++) out[l] = fw_mul(d, fw_iq4(b[2 + l % 16] >> (4 * (l / 16))));
  } else if (TY == FW_IQ4XS) {  // d, high scale bits (u16), low scale nibbles, nibbles
    const uint8_t* b = row + (size_t)(u / 8) * 136;
    const int s = u % 8;
    const int lo = (b[4 + s / 2] >> (4 * (s % 2))) & 0xF, hi = (fw_u16(b + 2) >> (2 * s)) & 3;
    const float dl = fw_mul(fw_f16(fw_u16(b)), (float)((lo | (hi << 4)) - 32));
    const uint8_t* q = b + 8 + 16 * s;
    for (int l = 0; l < 32; l++) out[l] = fw_mul(dl, fw_iq4(q[l % 16] >> (4 * (l / 16))));
  } else {  // FW_Q6K: 128 low-bit bytes, 64 high-bit bytes, 16 scales, d
    const uint8_t* b = row + (size_t)(u / 8) * 210;
    const int s = u % 8, half = s / 4, k = s % 4;
    const uint8_t* ql = b + 64 * half + (k % 2) * 32;
    const uint8_t* qh = b + 128 + 32 * half;
    const uint8_t* sc = b + 192 + 8 * half + 2 * k;
    const float d = fw_f16(fw_u16(b + 208));
    const int lshift = (k / 2) * 4, hshift = 2 * k;
    for (int l = 0; l < 32; l++) {
      const int q = (int)(((ql[l] >> lshift) & 0xF) | (((qh[l] >> hshift) & 3) << 4)) - 32;
      out[l] = fw_mul(fw_mul(d, (float)(int8_t)sc[l / 16]), (float)q);
    }
  }
}

// The same, the format known only at run time (the host twin).
FW_HD void fw_unit_any(int ty, const uint8_t* row, int u, float* out) {
  switch (ty) {
    case FW_F32: fw_unit<FW_F32>(row, u, out); break;
    case FW_F16: fw_unit<FW_F16>(row, u, out); break;
    case FW_BF16: fw_unit<FW_BF16>(row, u, out); break;
    case FW_Q4_0: fw_unit<FW_Q4_0>(row, u, out); break;
    case FW_Q4_1: fw_unit<FW_Q4_1>(row, u, out); break;
    case FW_Q8_0: fw_unit<FW_Q8_0>(row, u, out); break;
    case FW_Q4K: fw_unit<FW_Q4K>(row, u, out); break;
    case FW_Q5_0: fw_unit<FW_Q5_0>(row, u, out); break;
    case FW_Q5_1: fw_unit<FW_Q5_1>(row, u, out); break;
    case FW_Q2K: fw_unit<FW_Q2K>(row, u, out); break;
    case FW_Q3K: fw_unit<FW_Q3K>(row, u, out); break;
    case FW_Q5K: fw_unit<FW_Q5K>(row, u, out); break;
    case FW_IQ4NL: fw_unit<FW_IQ4NL>(row, u, out); break;
    case FW_IQ4XS: fw_unit<FW_IQ4XS>(row, u, out); break;
    default: fw_unit<FW_Q6K>(row, u, out); break;
  }
}

// The paged KV cache (`reference::PagedKv`): V row of position `pos` at
// (block_table[pos / bs] · bs + pos % bs) · kv_dim; K transposed within each block, value c of
// slot s of block b at b · bs · kv_dim + c · bs + s.
FW_HD size_t fw_v_offset(const uint32_t* block_table, int pos, int block_size, int kv_dim) {
  return ((size_t)block_table[pos / block_size] * block_size + pos % block_size) * kv_dim;
}
FW_HD size_t fw_k_index(const uint32_t* block_table, int pos, int c, int block_size, int kv_dim) {
  return (size_t)block_table[pos / block_size] * block_size * kv_dim + (size_t)c * block_size +
         pos % block_size;
}

// The first position a query at `pos` sees: everything, or the last `window` (> 0) positions.
FW_HD int fw_first_key(int pos, int window) {
  return (window > 0 && pos + 1 > window) ? pos + 1 - window : 0;
}
