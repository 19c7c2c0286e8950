// The weight products (y = x · Wᵀ from GGUF blocks as stored), in the layouts the host picks from
// (`cuda::Products`). Every layout keeps one order of sums for each (row, token), the
// contract that makes a row's result independent of its batch and of the layout:
//
//   64 slots per row; slot i takes units i, i + 64, i + 128, … (32 values each) in order, adding
//   each unit's 32 products v[j]·x[j] in order with fmaf from 0; slots 0..31 are summed by
//   `fw_warp_sum`'s butterfly, so are slots 32..63, and the row's value is the first sum plus the
//   second (one rounding).
//
// `fw_matmul_body` (a block of 2 warps a row, thread i slot i) is the layout proven first on an
// H200; the others give its bits (kernels/tests/cuda.rs checks every layout against it, bit for
// bit). Included by kernels.cu after its warp helpers.
#pragma once

// A unit's span in the stored row: units come in groups (a K-quant block holds 8, the 32-value
// formats' blocks 1, F32/F16/BF16 are taken 32 values at a time) of `fw_group_bytes` bytes.
template <int TY>
__device__ constexpr int fw_group_units() {
  return fw_block_values(TY) == 256 ? 8 : 1;
}
template <int TY>
__device__ constexpr int fw_group_bytes() {
  return fw_block_values(TY) == 1 ? 32 * fw_block_bytes(TY) : fw_block_bytes(TY);
}

// The stage a layout keeps per weight row: a chunk's bytes, its alignment offset and fw_words'
// reads up to 8 bytes past a unit, in 16-byte words.
template <int TY>
__device__ constexpr int fw_stage_words() {
  return (FW_MM_UNITS / fw_group_units<TY>() * fw_group_bytes<TY>() + 16 + 16 + 15) / 16;
}

// Copy bytes [g, g + len) of global memory into `stage` so that stage + off mirrors g, off = g's
// offset in its 16-byte word (fw_words then reads the same alignment): the aligned 16-byte words
// by every thread at once (a thread's loads issued before any is stored: all in flight together),
// the last < 16 bytes one by one. Nothing is read past g + len; the aligned start may lie before g
// but not before its allocation (allocations are 256-byte aligned). Returns off. CAP: the stage's
// size in 16-byte words. T threads take part (tid = 0 .. T, T ≥ 16): a block's, or a warp's.
template <int CAP, int T = FW_MM_WARPS * FW_WARP>
__device__ __forceinline__ int fw_stage(const uint8_t* __restrict__ g, int len, uint4* stage,
                                        int tid = threadIdx.x) {
  const uintptr_t a = (uintptr_t)g & ~(uintptr_t)15, end = (uintptr_t)g + len;
  const int words = (int)(((end & ~(uintptr_t)15) - a) / 16);
  constexpr int PER = (CAP + T - 1) / T;
  uint4 w[PER];
#pragma unroll
  for (int k = 0; k < PER; k++) {
    const int i = tid + k * T;
    if (i < words) w[k] = __ldg((const uint4*)a + i);
  }
#pragma unroll
  for (int k = 0; k < PER; k++) {
    const int i = tid + k * T;
    if (i < words) stage[i] = w[k];
  }
  const int tail = (int)(end - (end & ~(uintptr_t)15));
  if (tid < tail) ((uint8_t*)stage)[16 * words + tid] = __ldg((const uint8_t*)(end & ~(uintptr_t)15) + tid);
  return (int)((uintptr_t)g - a);
}

// x[0..32·cu] of one token into `xs`, unit u's 32 values at xs[FW_XS_STRIDE·u ..]: thread t
// reads its unit as 8 float4s (one LDS.128 for 4 values), and the pad of 4 puts the 8 threads of
// each quarter-warp's load on distinct banks (36t + 4k ≡ 4(t + k) mod 32). A thread's loads go
// out 4 at a time (8 at once held 32 registers, and the decode product spilled).
#define FW_XS_STRIDE 36
__device__ __forceinline__ void fw_stage_x(const float* __restrict__ x, int cu, float* xs) {
  constexpr int T = FW_MM_WARPS * FW_WARP, PER = FW_MM_UNITS * 8 / T;  // float4s a thread
#pragma unroll
  for (int k0 = 0; k0 < PER; k0 += 4) {
    float4 v[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
      const int i = threadIdx.x + (k0 + k) * T;  // float4 i: unit i / 8, values 4·(i % 8) ..
      if (i < 8 * cu) v[k] = __ldg((const float4*)x + i);
    }
#pragma unroll
    for (int k = 0; k < 4; k++) {
      const int i = threadIdx.x + (k0 + k) * T;
      if (i < 8 * cu) {
        *(float4*)(xs + FW_XS_STRIDE * (i / 8) + 4 * (i % 8)) = v[k];
      }
    }
  }
}

// y (n, rows) = x (n, cols) · Wᵀ, W `rows` rows of `row_bytes` bytes in format TY. One block of
// FW_MM_WARPS warps per weight row (grid (rows, ceil(n / NT))), the row taken FW_MM_UNITS units
// (32 values each) at a time, one unit a thread: the chunk's weight bytes are staged in shared
// memory (every load in flight at once), each thread dequantizes its unit once (`fw_unit_fast`,
// the CPU's values bit for bit), then for each token the chunk of x is staged (padded: no bank
// conflicts) and the thread adds its 32 products in order. The H200's profile found the previous
// layout (4 values a thread, a unit's scales decoded for each 4) issue-bound at ~40 instructions a
// weight. Each thread's sum runs over its units in order, each warp sums its lanes, then the
// warps' sums are added in warp order: a (row, token)'s sum runs in the same order whatever n and
// NT are (batch-invariant). NT is 1 for a batch of one token (decode), else FW_MM_TOKENS.
template <int TY, int NT>
__device__ __forceinline__ void fw_matmul_body(const uint8_t* __restrict__ w, int rows, int cols,
                                               long long row_bytes, const float* __restrict__ x,
                                               int n, float* __restrict__ y) {
  constexpr int GU = fw_group_units<TY>(), GB = fw_group_bytes<TY>(), CAP = fw_stage_words<TY>();
  __shared__ uint4 stage[CAP];
  __shared__ __align__(16) float xs[FW_XS_STRIDE * FW_MM_UNITS];
  __shared__ float sums[NT][FW_MM_WARPS];
  const int lane = threadIdx.x % FW_WARP, warp = threadIdx.x / FW_WARP;
  const int r = blockIdx.x;
  const int t0 = blockIdx.y * NT;
  const int nt = min(NT, n - t0);
  const uint8_t* row = w + (size_t)r * row_bytes;
  float acc[NT];
#pragma unroll
  for (int t = 0; t < NT; t++) acc[t] = 0.0f;
  const int units = cols / 32;
  for (int c0 = 0; c0 < units; c0 += FW_MM_UNITS) {
    const int cu = min(FW_MM_UNITS, units - c0);
    const int off = fw_stage<CAP>(row + (size_t)(c0 / GU) * GB, cu / GU * GB, stage);
    fw_stage_x(x + (size_t)t0 * cols + 32 * c0, cu, xs);
    __syncthreads();
    const bool mine = (int)threadIdx.x < cu;
    float v[32];
    fw_unit_fast<TY>((const uint8_t*)stage + off, mine ? threadIdx.x : 0, v);
#pragma unroll
    for (int t = 0; t < NT; t++) {
      if (NT > 1 && t >= nt) break;  // nt is the block's: every thread breaks together
      if (t > 0) {
        __syncthreads();  // the previous token's reads of xs are done
        fw_stage_x(x + (size_t)(t0 + t) * cols + 32 * c0, cu, xs);
        __syncthreads();
      }
      if (mine) {
        const float4* xu = (const float4*)(xs + FW_XS_STRIDE * threadIdx.x);
        float a = acc[t];
#pragma unroll
        for (int k = 0; k < 8; k++) {
          const float4 xv = xu[k];
          a = fmaf(v[4 * k], xv.x, a);
          a = fmaf(v[4 * k + 1], xv.y, a);
          a = fmaf(v[4 * k + 2], xv.z, a);
          a = fmaf(v[4 * k + 3], xv.w, a);
        }
        acc[t] = a;
      }
    }
    __syncthreads();  // the chunk's weight reads are done before the next is staged
  }
#pragma unroll
  for (int t = 0; t < NT; t++) {
    const float s = fw_warp_sum(acc[t]);
    if (lane == 0) sums[t][warp] = s;
  }
  __syncthreads();
  if ((int)threadIdx.x < nt) {
    float s = sums[threadIdx.x][0];
#pragma unroll
    for (int k = 1; k < FW_MM_WARPS; k++) s = fw_add(s, sums[threadIdx.x][k]);
    y[(size_t)(t0 + threadIdx.x) * rows + r] = s;
  }
}


// 32 floats at p (16-byte aligned: a unit of x, or of an f32 row) into v, through the read-only
// cache, 16 bytes a load.
__device__ __forceinline__ void fw_ldg_unit(const float* __restrict__ p, float* v) {
  const float4* p4 = (const float4*)p;
#pragma unroll
  for (int k = 0; k < 8; k++) {
    const float4 w = __ldg(p4 + k);
    v[4 * k] = w.x, v[4 * k + 1] = w.y, v[4 * k + 2] = w.z, v[4 * k + 3] = w.w;
  }
}

// a + Σ v[j]·x[j] over j = 0 .. 32 in order, each step an fmaf: one unit's share of a slot's sum.
// x (a unit of one token's activations, 128-byte aligned) is read from global memory through the
// read-only cache, 16 bytes at a time.
__device__ __forceinline__ float fw_dot_unit(const float* v, const float* __restrict__ x, float a) {
  const float4* x4 = (const float4*)x;
#pragma unroll
  for (int k = 0; k < 8; k++) {
    const float4 xv = __ldg(x4 + k);
    a = fmaf(v[4 * k], xv.x, a);
    a = fmaf(v[4 * k + 1], xv.y, a);
    a = fmaf(v[4 * k + 2], xv.z, a);
    a = fmaf(v[4 * k + 3], xv.w, a);
  }
  return a;
}

// One (row, token)'s sum by one warp: row · x over `cols` values, returned to every lane. Lane l
// keeps slots l and l + 32 (`fw_matmul_body`'s warps 0 and 1): per chunk of 64 units the warp
// stages the row's bytes in `stage` (its own part of shared memory, fw_stage_words<TY>() words),
// then lane l dequantizes units l and l + 32 and adds their products to the two slots' sums, x
// read straight from global memory. No barrier but the warp's own: the callers' warps may return
// early. Same bits as every layout of fw_matmul.
template <int TY>
__device__ __forceinline__ float fw_matmul_warp_row(const uint8_t* __restrict__ row, int cols,
                                                    const float* __restrict__ x, uint4* stage,
                                                    int lane) {
  constexpr int GU = fw_group_units<TY>(), GB = fw_group_bytes<TY>(), CAP = fw_stage_words<TY>();
  float acc[2] = {0.0f, 0.0f};
  const int units = cols / 32;
  for (int c0 = 0; c0 < units; c0 += FW_MM_UNITS) {
    const int cu = min(FW_MM_UNITS, units - c0);
    const int off = fw_stage<CAP, FW_WARP>(row + (size_t)(c0 / GU) * GB, cu / GU * GB, stage, lane);
    __syncwarp();
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const int u = lane + FW_WARP * h;
      if (u < cu) {
        float v[32];
        fw_unit_fast<TY>((const uint8_t*)stage + off, u, v);
        acc[h] = fw_dot_unit(v, x + 32 * (size_t)(c0 + u), acc[h]);
      }
    }
    __syncwarp();  // the chunk's reads of the stage are done before the next is staged
  }
  return fw_add(fw_warp_sum(acc[0]), fw_warp_sum(acc[1]));
}

// Decode, a warp a row: y (rows) = x (cols) · Wᵀ for one token. Grid ceil(rows / FW_MMW_WARPS)
// blocks of FW_MMW_WARPS warps, warp w of block b computing row FW_MMW_WARPS·b + w alone
// (`fw_matmul_warp_row`): no block barrier, and x read through the cache (the same x for every
// row) instead of staged by every row's block with two barriers, as the block layout does. Same
// bits as fw_matmul1. Slower than the block layout on an H200 (the 1B shape's batch-1 decode: 379
// against 455 tokens/s, 2026-11-27), so not the default.
template <int TY>
__device__ __forceinline__ void fw_matmul_warp_body(const uint8_t* __restrict__ w, int rows, int cols,
                                                    long long row_bytes, const float* __restrict__ x,
                                                    float* __restrict__ y) {
  __shared__ uint4 stage[FW_MMW_WARPS][fw_stage_words<TY>()];
  const int lane = threadIdx.x % FW_WARP, warp = threadIdx.x / FW_WARP;
  const int r = blockIdx.x * FW_MMW_WARPS + warp;
  if (r >= rows) return;  // the whole warp: nothing below waits on another warp
  const float s = fw_matmul_warp_row<TY>(w + (size_t)r * row_bytes, cols, x, stage[warp], lane);
  if (lane == 0) y[r] = s;
}

// Batches, a tile a block: y (n, rows) = x (n, cols) · Wᵀ, a block of 2 warps for R rows × NT
// tokens (grid (ceil(rows / R), ceil(n / NT))), thread i slot i as in fw_matmul_body. Per chunk
// the block stages its rows' bytes, thread i dequantizes unit i of every row of the tile once
// (held in registers), then for each token reads its unit of x straight from global memory and
// adds it to every row's sum: a weight is decoded once per NT tokens and a value of x read once
// per R rows, with no barrier per token. (The row layout stages x for each token of each row
// between two barriers; prefill and batch 8-64 fell back on the H200 when that came in, which
// points at it, though no profile isolated it.) Same bits as fw_matmul_body. With NT = 1 it is
// a decode layout (`DecodeProduct::Tile4`, `Tile2`).
template <int TY, int R, int NT>
__device__ __forceinline__ void fw_matmul_tile_body(const uint8_t* __restrict__ w, int rows, int cols,
                                                    long long row_bytes, const float* __restrict__ x,
                                                    int n, float* __restrict__ y) {
  constexpr int GU = fw_group_units<TY>(), GB = fw_group_bytes<TY>(), CAP = fw_stage_words<TY>();
  __shared__ uint4 stage[R][CAP];
  __shared__ float sums[R * NT][FW_MM_WARPS];
  const int lane = threadIdx.x % FW_WARP, warp = threadIdx.x / FW_WARP;
  const int r0 = blockIdx.x * R, t0 = blockIdx.y * NT;
  const int nr = min(R, rows - r0), nt = min(NT, n - t0);
  float acc[R][NT];
#pragma unroll
  for (int r = 0; r < R; r++)
#pragma unroll
    for (int t = 0; t < NT; t++) acc[r][t] = 0.0f;
  const int units = cols / 32;
  for (int c0 = 0; c0 < units; c0 += FW_MM_UNITS) {
    const int cu = min(FW_MM_UNITS, units - c0);
    int off[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
      // A tile past the last row stages that row again (its sums are not written): every value
      // read below was written.
      const uint8_t* row = w + (size_t)(r0 + min(r, nr - 1)) * row_bytes;
      off[r] = fw_stage<CAP>(row + (size_t)(c0 / GU) * GB, cu / GU * GB, stage[r]);
    }
    __syncthreads();
    if (NT == 1 && (int)threadIdx.x < cu) {
      // One token (the decode tiles): its unit of x in registers first, then each row's unit
      // decoded and added in turn (a row's values live only while they are added: the tile's
      // order below held R units' values at once, 167 registers for Q4_K at R = 4).
      float xr[32];
      fw_ldg_unit(x + (size_t)t0 * cols + 32 * (size_t)(c0 + threadIdx.x), xr);
#pragma unroll
      for (int r = 0; r < R; r++) {
        float v[32];
        fw_unit_fast<TY>((const uint8_t*)stage[r] + off[r], threadIdx.x, v);
        float a = acc[r][0];
#pragma unroll
        for (int j = 0; j < 32; j++) a = fmaf(v[j], xr[j], a);
        acc[r][0] = a;
      }
    } else if ((int)threadIdx.x < cu) {
      float v[R][32];
#pragma unroll
      for (int r = 0; r < R; r++) fw_unit_fast<TY>((const uint8_t*)stage[r] + off[r], threadIdx.x, v[r]);
#pragma unroll
      for (int t = 0; t < NT; t++) {
        // Past the batch's last token (the block's nt: every thread skips together), a token's
        // reads are left out; a `break` here left the loop rolled and the sums in local memory.
        if (t >= nt) continue;
        const float4* x4 = (const float4*)(x + (size_t)(t0 + t) * cols + 32 * (size_t)(c0 + threadIdx.x));
#pragma unroll
        for (int k = 0; k < 8; k++) {
          const float4 xv = __ldg(x4 + k);
#pragma unroll
          for (int r = 0; r < R; r++) {
            float a = acc[r][t];
            a = fmaf(v[r][4 * k], xv.x, a);
            a = fmaf(v[r][4 * k + 1], xv.y, a);
            a = fmaf(v[r][4 * k + 2], xv.z, a);
            a = fmaf(v[r][4 * k + 3], xv.w, a);
            acc[r][t] = a;
          }
        }
      }
    }
    __syncthreads();  // the chunk's reads of the stage are done before the next is staged
  }
#pragma unroll
  for (int r = 0; r < R; r++)
#pragma unroll
    for (int t = 0; t < NT; t++) {
      const float s = fw_warp_sum(acc[r][t]);
      if (lane == 0) sums[r * NT + t][warp] = s;
    }
  __syncthreads();
  for (int k = threadIdx.x; k < R * NT; k += FW_MM_WARPS * FW_WARP) {
    const int r = k / NT, t = k % NT;
    if (r < nr && t < nt) {
      float s = sums[k][0];
#pragma unroll
      for (int q = 1; q < FW_MM_WARPS; q++) s = fw_add(s, sums[k][q]);
      y[(size_t)(t0 + t) * rows + r0 + r] = s;
    }
  }
}
