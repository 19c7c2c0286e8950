// `fw_unit_fast`: `fw_unit`'s values, bit for bit, with the unit's bytes loaded as 32-bit words
// (aligned loads and funnel shifts for the formats whose blocks are only 2-byte aligned) instead
// of byte by byte, and extracted from registers. The product kernels use it: with byte loads a
// warp issued ~30 dependent loads per unit and decode ran at ~6% of the card's bandwidth (the
// first H200 run, docs/gpu.md). `twin.cu` checks it equals `fw_unit` on every machine, at every
// byte alignment.
//
// On the device a read runs up to 4 bytes past the unit's last byte (the aligned word after it):
// the product kernels call it on their rows staged in shared memory, with that room kept.
#pragma once
#include "common.cuh"

// N little-endian u32 words from p, at any alignment.
template <int N>
FW_HD void fw_words(const uint8_t* p, uint32_t* w) {
#ifdef __CUDA_ARCH__
  const uintptr_t a = (uintptr_t)p;
  const uint32_t* q = (const uint32_t*)(a & ~(uintptr_t)3);
  const uint32_t sh = (uint32_t)(a & 3) * 8;
  // Plain loads, not __ldg: the product kernels read their staged rows from shared memory,
  // where the word after the last is always there to read (the stage keeps room for it), so it
  // is read whether or not p is aligned (a conditional load compiled to a branch per unit).
  uint32_t prev = q[0];
#pragma unroll
  for (int i = 0; i < N; i++) {
    const uint32_t next = q[i + 1];
    w[i] = __funnelshift_r(prev, next, sh);
    prev = next;
  }
#else
  // The same aligned loads and shifts on the host, so that the twin checks them too.
  const uintptr_t a = (uintptr_t)p;
  const uint8_t* q = p - (a & 3);
  const uint32_t sh = (uint32_t)(a & 3) * 8;
  uint32_t prev, next;
  memcpy(&prev, q, 4);
  for (int i = 0; i < N; i++) {
    next = 0;
    if (i + 1 < N || sh) memcpy(&next, q + 4 * (i + 1), 4);
    w[i] = sh ? (prev >> sh) | (next << (32 - sh)) : prev;
    prev = next;
  }
#endif
}

// Byte i (a constant after unrolling) of little-endian words w.
#define FW_BYTE(w, i) (((w)[(i) >> 2] >> (8 * ((i) & 3))) & 0xFFu)

// CUDA's __byte_perm: byte n of the result is byte s<4n+2:4n> of the 8 bytes {x, y} (x's
// bytes 0..3, then y's); the selector's nibbles here never set their top bit.
FW_HD uint32_t fw_byte_perm(uint32_t x, uint32_t y, uint32_t s) {
#ifdef __CUDA_ARCH__
  return __byte_perm(x, y, s);
#else
  const uint64_t v = (uint64_t)x | ((uint64_t)y << 32);
  uint32_t r = 0;
  for (int n = 0; n < 4; n++) r |= (uint32_t)((v >> (8 * ((s >> (4 * n)) & 7))) & 0xFF) << (8 * n);
  return r;
#endif
}

// (float)(byte k of w) − bias, exactly (a byte and an integer bias ≤ 256: every value and the
// difference are integers below 2²⁴), without an integer-to-float conversion: one byte
// permute makes the bits of 2²³ + byte (0x4B000000 | byte), one subtraction takes 2²³ + bias
// away. The conversion it replaces runs at 16 a clock an SM (the CUDA guide's throughput
// table: a quarter of FP32's rate on sm_80, an eighth on sm_90), and the products decode one
// code a weight: the same values; the speed is the next lent GPU's to measure.
FW_HD float fw_code(uint32_t w, int k, int bias) {
#ifdef __CUDA_ARCH__
  // PTX's prmt d, a, b, c with c (the selector) an immediate (k is a constant after unrolling)
  // and 2²³'s bits in a register: left to the compiler, both constants, it moved each of the
  // four selectors into a register again for every unit.
  uint32_t bits;
#define FW_PRMT(SEL) asm("prmt.b32 %0, %1, %2, " #SEL ";" : "=r"(bits) : "r"(w), "r"(0x4B000000u))
  switch (k) {
    case 0: FW_PRMT(0x7540); break;
    case 1: FW_PRMT(0x7541); break;
    case 2: FW_PRMT(0x7542); break;
    default: FW_PRMT(0x7543); break;
  }
#undef FW_PRMT
#else
  const uint32_t bits = fw_byte_perm(w, 0x4B000000u, 0x7540u | (uint32_t)k);
#endif
  return fw_sub(fw_bits_to_float(bits), (float)(8388608 + bias));
}

FW_HD uint32_t fw_u16_at(const uint8_t* p) {
#ifdef __CUDA_ARCH__
  return *(const uint16_t*)p;  // every 16-bit field of these formats is 2-byte aligned
#else
  return fw_u16(p);
#endif
}

// The 6-bit scale and min of sub-block j of Q4_K/Q5_K from the 12 scale bytes as 3 words
// (`fw_scale_min_k4` without indexing bytes by a run-time value).
FW_HD void fw_scale_min_k4_words(int j, const uint32_t* s, uint32_t* sc, uint32_t* m) {
  const int k = 8 * (j & 3);
  const uint32_t b0 = (s[0] >> k) & 0xFF, b1 = (s[1] >> k) & 0xFF, b2 = (s[2] >> k) & 0xFF;
  if (j < 4) {
    *sc = b0 & 63;
    *m = b1 & 63;
  } else {
    *sc = (b2 & 0xF) | ((b0 >> 6) << 4);
    *m = (b2 >> 4) | ((b1 >> 6) << 4);
  }
}

template <int TY>
FW_HD void fw_unit_fast(const uint8_t* row, int u, float* out) {
  if (TY == FW_F32) {
    uint32_t w[32];
    fw_words<32>(row + (size_t)u * 128, w);
#pragma unroll
    for (int j = 0; j < 32; j++) out[j] = fw_bits_to_float(w[j]);
  } else if (TY == FW_F16 || TY == FW_BF16) {
    uint32_t w[16];
    fw_words<16>(row + (size_t)u * 64, w);
#pragma unroll
    for (int j = 0; j < 32; j++) {
      const uint32_t h = (w[j / 2] >> (16 * (j % 2))) & 0xFFFF;
      out[j] = TY == FW_F16 ? fw_f16((uint16_t)h) : fw_bits_to_float(h << 16);
    }
  } else if (TY == FW_Q4_0 || TY == FW_IQ4NL) {
    const uint8_t* b = row + (size_t)u * 18;
    const float d = fw_f16((uint16_t)fw_u16_at(b));
    uint32_t q[4];
    fw_words<4>(b + 2, q);
#pragma unroll
    for (int j = 0; j < 16; j++) {
      if (TY == FW_Q4_0) {
        // Low nibbles then high ones, a word's four bytes at a time.
        out[j] = fw_mul(fw_code(q[j / 4] & 0x0F0F0F0Fu, j % 4, 8), d);
        out[j + 16] = fw_mul(fw_code((q[j / 4] >> 4) & 0x0F0F0F0Fu, j % 4, 8), d);
      } else {
        const uint32_t c = FW_BYTE(q, j);
        out[j] = fw_mul(d, fw_iq4((int)c));
        out[j + 16] = fw_mul(d, fw_iq4((int)(c >> 4)));
      }
    }
  } else if (TY == FW_Q4_1) {
    const uint8_t* b = row + (size_t)u * 20;
    uint32_t w[5];
    fw_words<5>(b, w);
    const float d = fw_f16((uint16_t)(w[0] & 0xFFFF)), m = fw_f16((uint16_t)(w[0] >> 16));
#pragma unroll
    for (int j = 0; j < 16; j++) {
      const uint32_t c = w[1 + j / 4];
      out[j] = fw_add(fw_mul(fw_code(c & 0x0F0F0F0Fu, j % 4, 0), d), m);
      out[j + 16] = fw_add(fw_mul(fw_code((c >> 4) & 0x0F0F0F0Fu, j % 4, 0), d), m);
    }
  } else if (TY == FW_Q5_0 || TY == FW_Q5_1) {
    const bool q51 = TY == FW_Q5_1;
    const uint8_t* b = row + (size_t)u * (q51 ? 24 : 22);
    const float d = fw_f16((uint16_t)fw_u16_at(b)), m = q51 ? fw_f16((uint16_t)fw_u16_at(b + 2)) : 0.0f;
    uint32_t w[5];  // qh, then the 16 nibble bytes
    fw_words<5>(b + (q51 ? 4 : 2), w);
    const uint32_t qh = w[0];
    // Value j's fifth bit is bit j of qh (j + 16's, bit j + 16): four of them spread to bit 4 of
    // each byte of a word of codes.
    const auto spread = [](uint32_t b4) {
      return ((b4 & 1u) << 4) | ((b4 & 2u) << 11) | ((b4 & 4u) << 18) | ((b4 & 8u) << 25);
    };
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const uint32_t lo = (w[1 + i] & 0x0F0F0F0Fu) | spread((qh >> (4 * i)) & 0xFu);
      const uint32_t hi = ((w[1 + i] >> 4) & 0x0F0F0F0Fu) | spread((qh >> (16 + 4 * i)) & 0xFu);
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const int j = 4 * i + k;
        if (q51) {
          out[j] = fw_add(fw_mul(fw_code(lo, k, 0), d), m);
          out[j + 16] = fw_add(fw_mul(fw_code(hi, k, 0), d), m);
        } else {
          out[j] = fw_mul(fw_code(lo, k, 16), d);
          out[j + 16] = fw_mul(fw_code(hi, k, 16), d);
        }
      }
    }
  } else if (TY == FW_Q8_0) {
    const uint8_t* b = row + (size_t)u * 34;
    const float d = fw_f16((uint16_t)fw_u16_at(b));
    uint32_t q[8];
    fw_words<8>(b + 2, q);
#pragma unroll
    // A signed byte v is (v ^ 0x80) − 128 read unsigned.
    for (int j = 0; j < 32; j++) out[j] = fw_mul(fw_code(q[j / 4] ^ 0x80808080u, j % 4, 128), d);
  } else if (TY == FW_Q4K || TY == FW_Q5K) {
    const bool q5 = TY == FW_Q5K;
    const uint8_t* b = row + (size_t)(u / 8) * (q5 ? 176 : 144);
    const int s = u % 8;
    uint32_t hd[4];  // d, dmin; the 12 scale bytes
    fw_words<4>(b, hd);
    const float d = fw_f16((uint16_t)(hd[0] & 0xFFFF)), dmin = fw_f16((uint16_t)(hd[0] >> 16));
    uint32_t sc, mn;
    fw_scale_min_k4_words(s, hd + 1, &sc, &mn);
    const float d1 = fw_mul(d, (float)sc), m1 = fw_mul(dmin, (float)mn);
    uint32_t q[8], h[8];
    fw_words<8>(b + (q5 ? 48 : 16) + 32 * (s / 2), q);
    if (q5) fw_words<8>(b + 16, h);
    const int shift = (s % 2) * 4;
    // Each word's four codes at once: the nibbles (and Q5_K's fifth bits, bit s of each byte)
    // moved into place by whole-word shifts and masks.
#pragma unroll
    for (int i = 0; i < 8; i++) {
      q[i] = (q[i] >> shift) & 0x0F0F0F0Fu;
      if (q5) q[i] |= ((h[i] >> s) & 0x01010101u) << 4;
    }
#pragma unroll
    for (int l = 0; l < 32; l++) out[l] = fw_sub(fw_mul(d1, fw_code(q[l / 4], l % 4, 0)), m1);
  } else if (TY == FW_Q2K) {
    const uint8_t* b = row + (size_t)(u / 8) * 84;
    const int s = u % 8;
    const uint32_t dm = (uint32_t)fw_u16_at(b + 80) | ((uint32_t)fw_u16_at(b + 82) << 16);
    const float d = fw_f16((uint16_t)(dm & 0xFFFF)), dmin = fw_f16((uint16_t)(dm >> 16));
    const uint32_t scs = fw_u16_at(b + 2 * s);
    uint32_t q[8];
    fw_words<8>(b + 16 + 32 * (s / 4), q);
    const int shift = 2 * (s % 4);
    float dl[2], ml[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
      const uint32_t sc = (scs >> (8 * i)) & 0xFF;
      dl[i] = fw_mul(d, (float)(sc & 0xF));
      ml[i] = fw_mul(dmin, (float)(sc >> 4));
    }
#pragma unroll
    for (int i = 0; i < 8; i++) q[i] = (q[i] >> shift) & 0x03030303u;
#pragma unroll
    for (int l = 0; l < 32; l++)
      out[l] = fw_sub(fw_mul(dl[l / 16], fw_code(q[l / 4], l % 4, 0)), ml[l / 16]);
  } else if (TY == FW_Q3K) {
    const uint8_t* b = row + (size_t)(u / 8) * 110;
    const int s = u % 8;
    const float d = fw_f16((uint16_t)fw_u16_at(b + 108));
    uint32_t hm[8], q[8], sw[3];
    fw_words<8>(b, hm);
    fw_words<8>(b + 32 + 32 * (s / 4), q);
    fw_words<3>(b + 96, sw);
    const int shift = 2 * (s % 4);
    float ds[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
      const int k = 2 * s + i;
      // A select, not sw[(k % 8) / 4]: a run-time index gave the kernels a stack frame.
    const uint32_t lo = (((k % 8) / 4 ? sw[1] : sw[0]) >> (8 * (k % 4)) >> (4 * (k / 8))) & 0xF;
      const uint32_t hi = ((sw[2] >> (8 * (k % 4))) >> (2 * (k / 4))) & 3;
      ds[i] = fw_mul(d, (float)((int)(lo | (hi << 4)) - 32));
    }
    // code + 4 = the 2 low bits | the high-mask bit << 2 (code = low − 4 where the bit is clear).
#pragma unroll
    for (int i = 0; i < 8; i++) q[i] = ((q[i] >> shift) & 0x03030303u) | (((hm[i] >> s) & 0x01010101u) << 2);
#pragma unroll
    for (int l = 0; l < 32; l++) out[l] = fw_mul(ds[l / 16], fw_code(q[l / 4], l % 4, 4));
  } else if (TY == FW_IQ4XS) {
    const uint8_t* b = row + (size_t)(u / 8) * 136;
    const int s = u % 8;
    uint32_t hd[2];  // d, high scale bits; the low scale nibbles
    fw_words<2>(b, hd);
    const uint32_t lo = (hd[1] >> (8 * (s / 2) + 4 * (s % 2))) & 0xF, hi = ((hd[0] >> 16) >> (2 * s)) & 3;
    const float dl = fw_mul(fw_f16((uint16_t)(hd[0] & 0xFFFF)), (float)((int)(lo | (hi << 4)) - 32));
    uint32_t q[4];
    fw_words<4>(b + 8 + 16 * s, q);
#pragma unroll
    for (int l = 0; l < 16; l++) {
      const uint32_t c = FW_BYTE(q, l);
      out[l] = fw_mul(dl, fw_iq4((int)c));
      out[l + 16] = fw_mul(dl, fw_iq4((int)(c >> 4)));
    }
  } else {  // FW_Q6K
    const uint8_t* b = row + (size_t)(u / 8) * 210;
    const int s = u % 8, half = s / 4, k = s % 4;
    uint32_t ql[8], qh[8];
    fw_words<8>(b + 64 * half + (k % 2) * 32, ql);
    fw_words<8>(b + 128 + 32 * half, qh);
    const uint32_t scs = fw_u16_at(b + 192 + 8 * half + 2 * k);
    const float d = fw_f16((uint16_t)fw_u16_at(b + 208));
    const float ds[2] = {fw_mul(d, (float)(int8_t)(uint8_t)(scs & 0xFF)),
                         fw_mul(d, (float)(int8_t)(uint8_t)(scs >> 8))};
    const int lshift = (k / 2) * 4, hshift = 2 * k;
    // Each word's four 6-bit codes at once (low nibble | 2 high bits << 4), then q − 32.
#pragma unroll
    for (int i = 0; i < 8; i++)
      ql[i] = ((ql[i] >> lshift) & 0x0F0F0F0Fu) | (((qh[i] >> hshift) & 0x03030303u) << 4);
#pragma unroll
    for (int l = 0; l < 32; l++) out[l] = fw_mul(ds[l / 16], fw_code(ql[l / 4], l % 4, 32));
  }
}

// The same, the format known only at run time (the host twin).
FW_HD void fw_unit_fast_any(int ty, const uint8_t* row, int u, float* out) {
  switch (ty) {
    case FW_F32: fw_unit_fast<FW_F32>(row, u, out); break;
    case FW_F16: fw_unit_fast<FW_F16>(row, u, out); break;
    case FW_BF16: fw_unit_fast<FW_BF16>(row, u, out); break;
    case FW_Q4_0: fw_unit_fast<FW_Q4_0>(row, u, out); break;
    case FW_Q4_1: fw_unit_fast<FW_Q4_1>(row, u, out); break;
    case FW_Q8_0: fw_unit_fast<FW_Q8_0>(row, u, out); break;
    case FW_Q4K: fw_unit_fast<FW_Q4K>(row, u, out); break;
    case FW_Q5_0: fw_unit_fast<FW_Q5_0>(row, u, out); break;
    case FW_Q5_1: fw_unit_fast<FW_Q5_1>(row, u, out); break;
    case FW_Q2K: fw_unit_fast<FW_Q2K>(row, u, out); break;
    case FW_Q3K: fw_unit_fast<FW_Q3K>(row, u, out); break;
    case FW_Q5K: fw_unit_fast<FW_Q5K>(row, u, out); break;
    case FW_IQ4NL: fw_unit_fast<FW_IQ4NL>(row, u, out); break;
    case FW_IQ4XS: fw_unit_fast<FW_IQ4XS>(row, u, out); break;
    default: fw_unit_fast<FW_Q6K>(row, u, out); break;
  }
}
