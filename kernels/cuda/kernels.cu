// Flywheel's CUDA kernels: the model's forward ops over GGUF blocks as stored (the base is never
// dequantized as a whole on the GPU either), f32 activations, a paged KV cache in the CPU's
// layout (so the block manager's tables mean the same on both). Each kernel has its CPU twin in
// `flywheel_kernels::cpu`/`reference`; `kernels/tests/cuda.rs` compares them on a GPU.
//
// Written here rather than taken from a crate: no crate runs GGUF's block formats on CUDA from
// Rust, and the CPU layout of the KV cache (K transposed per block) is ours.
//
// Launch shapes are the host's (`cuda::launch`); every kernel checks its own bounds.
#include "common.cuh"
#include "units.cuh"

#define FW_WARP 32
// Tokens a matmul block keeps in registers: one pass over a weight row serves this many.
#define FW_MM_TOKENS 16
// Warps per matmul block: the warps of one weight row (`MM_WARPS` in cuda/launch.rs).
#define FW_MM_WARPS 2
// Units (32 values) a matmul block takes at a time: one a thread.
#define FW_MM_UNITS (FW_MM_WARPS * FW_WARP)
// Warps per block of the warp-a-row decode product (`MMW_WARPS` in cuda/launch.rs): a row each.
#define FW_MMW_WARPS 4
// The batch product's tiles, rows × tokens a block (`BatchProduct` in cuda/mod.rs): more rows
// read x fewer times, more tokens decode the weights fewer times; both take registers (4 × 8
// takes ~250 of them, 2 × 16 ~150), which the speed run weighs on a GPU.
// Blocks per SM the decode product is compiled for (registers: 64 K / (64 threads · 10) = 102;
// at 12 and 16 it spilled).
#define FW_MM1_BLOCKS 10
// Threads per block of the row kernels (RMSNorm, log-softmax, argmax, embedding).
#define FW_ROW_THREADS 256
// Warps per block of the attention kernel.
#define FW_ATT_WARPS 4

__device__ __forceinline__ float fw_warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float fw_warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// A block-wide sum (blockDim.x a multiple of 32, at most 1024); every thread gets the total.
// The order is fixed by the block's shape alone, so a row's result never depends on its batch.
__device__ float fw_block_sum(float v) {
  __shared__ float part[32];
  const int lane = threadIdx.x % FW_WARP, warp = threadIdx.x / FW_WARP;
  v = fw_warp_sum(v);
  __syncthreads();
  if (lane == 0) part[warp] = v;
  __syncthreads();
  const int warps = blockDim.x / FW_WARP;
  v = lane < warps ? part[lane] : 0.0f;
  return fw_warp_sum(v);
}
__device__ float fw_block_max(float v) {
  __shared__ float part[32];
  const int lane = threadIdx.x % FW_WARP, warp = threadIdx.x / FW_WARP;
  v = fw_warp_max(v);
  __syncthreads();
  if (lane == 0) part[warp] = v;
  __syncthreads();
  const int warps = blockDim.x / FW_WARP;
  v = lane < warps ? part[lane] : -INFINITY;
  return fw_warp_max(v);
}

#include "products.cuh"
#include "adapters.cuh"
#include "moe.cuh"
#include "int8.cuh"
#include "draw.cuh"
#include "backward.cuh"

// Rows of a table (the token embedding) dequantized: out (n, cols) = table[tokens[i]].
// Grid (n), FW_ROW_THREADS threads, one unit per thread per step: the CPU's values exactly.
template <int TY>
__device__ __forceinline__ void fw_embed_body(const uint8_t* __restrict__ table,
                                              long long row_bytes, const uint32_t* __restrict__ tokens,
                                              int cols, float* __restrict__ out) {
  const int i = blockIdx.x;
  const uint8_t* row = table + (size_t)tokens[i] * row_bytes;
  for (int u = threadIdx.x; u < cols / 32; u += blockDim.x) {
    float v[32];
    fw_unit<TY>(row, u, v);
    float* o = out + (size_t)i * cols + u * 32;
#pragma unroll
    for (int j = 0; j < 32; j++) o[j] = v[j];
  }
}

#define FW_PER_TYPE(NAME, TY)                                                                   \
  extern "C" __global__ void __launch_bounds__(FW_MM_WARPS * FW_WARP)                           \
      fw_matmul_##NAME(const uint8_t* w, int rows, int cols,                                     \
                                              long long row_bytes, const float* x, int n,       \
                                              float* y) {                                        \
    fw_matmul_body<TY, FW_MM_TOKENS>(w, rows, cols, row_bytes, x, n, y);                        \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(FW_MM_WARPS * FW_WARP, FW_MM1_BLOCKS)            \
      fw_matmul1_##NAME(const uint8_t* w, int rows, int cols,                                    \
                                               long long row_bytes, const float* x, int n,      \
                                               float* y) {                                       \
    fw_matmul_body<TY, 1>(w, rows, cols, row_bytes, x, n, y);                                   \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(FW_MMW_WARPS * FW_WARP)                          \
      fw_matmulw_##NAME(const uint8_t* w, int rows, int cols, long long row_bytes,               \
                        const float* x, int n, float* y) {                                       \
    fw_matmul_warp_body<TY>(w, rows, cols, row_bytes, x, y);                                     \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(FW_MM_WARPS * FW_WARP)                           \
      fw_matmul_t4x8_##NAME(const uint8_t* w, int rows, int cols, long long row_bytes,           \
                            const float* x, int n, float* y) {                                   \
    fw_matmul_tile_body<TY, 4, 8>(w, rows, cols, row_bytes, x, n, y);                            \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(FW_MM_WARPS * FW_WARP)                           \
      fw_matmul_t4x1_##NAME(const uint8_t* w, int rows, int cols, long long row_bytes,           \
                            const float* x, int n, float* y) {                                   \
    fw_matmul_tile_body<TY, 4, 1>(w, rows, cols, row_bytes, x, n, y);                            \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(FW_MM_WARPS * FW_WARP)                           \
      fw_matmul_t2x1_##NAME(const uint8_t* w, int rows, int cols, long long row_bytes,           \
                            const float* x, int n, float* y) {                                   \
    fw_matmul_tile_body<TY, 2, 1>(w, rows, cols, row_bytes, x, n, y);                            \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(FW_MM_WARPS * FW_WARP)                           \
      fw_matmul_t2x16_##NAME(const uint8_t* w, int rows, int cols, long long row_bytes,          \
                             const float* x, int n, float* y) {                                  \
    fw_matmul_tile_body<TY, 2, 16>(w, rows, cols, row_bytes, x, n, y);                           \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(FW_MMW_WARPS * FW_WARP)                          \
      fw_matmul_experts_##NAME(const uint64_t* experts, const uint32_t* expert, int ne, int out, \
                               int cols, long long row_bytes, const float* x, int xdiv,          \
                               float* y) {                                                       \
    fw_matmul_experts_body<TY>(experts, expert, ne, out, cols, row_bytes, x, xdiv, y);           \
  }                                                                                              \
  extern "C" __global__ void fw_embed_##NAME(const uint8_t* table, long long row_bytes,          \
                                             const uint32_t* tokens, int cols, float* out) {     \
    fw_embed_body<TY>(table, row_bytes, tokens, cols, out);                                     \
  }

FW_PER_TYPE(f32, FW_F32)
FW_PER_TYPE(f16, FW_F16)
FW_PER_TYPE(bf16, FW_BF16)
FW_PER_TYPE(q4_0, FW_Q4_0)
FW_PER_TYPE(q4_1, FW_Q4_1)
FW_PER_TYPE(q5_0, FW_Q5_0)
FW_PER_TYPE(q5_1, FW_Q5_1)
FW_PER_TYPE(q8_0, FW_Q8_0)
FW_PER_TYPE(q4_k, FW_Q4K)
FW_PER_TYPE(q6_k, FW_Q6K)
FW_PER_TYPE(q2_k, FW_Q2K)
FW_PER_TYPE(q3_k, FW_Q3K)
FW_PER_TYPE(q5_k, FW_Q5K)
FW_PER_TYPE(iq4_nl, FW_IQ4NL)
FW_PER_TYPE(iq4_xs, FW_IQ4XS)

// The int8 products in the lanes layout (`cuda::Int8Layout`; decode's by default): a thread a lane
// (`fw_i8_lane`), 16 threads a (row, token), FW_I8L_ROWS rows a block; each row's bytes staged in
// shared memory FW_I8_CHUNK blocks at a time by its 16 threads (`fw_stage`: every load in flight
// at once, where the quads layout (`fw_matmul_i8_body`) reads its row 16 bytes a step from
// global memory, four threads a row, and an H200 ran the 1B shape's int8 decode at 0.38x the f32
// decode's speed), x read through the cache. Grid (ceil(rows / FW_I8L_ROWS), ceil(n / NT)). Each
// lane's steps and the 16 lanes' sum are fw_i8_thread's and fw_i8_tree's: the quads layout's
// bits, the CPU's.
#define FW_I8L_ROWS 8
template <int TY>
__device__ constexpr int fw_i8_stage_words() {
  return (int)((fw_i8_offset<TY>(FW_I8_CHUNK) + 16 + 16 + 15) / 16);
}
template <int TY, int NT>
__device__ __forceinline__ void fw_matmul_i8_lanes_body(const uint8_t* __restrict__ w, int rows,
                                                        int cols, long long row_bytes,
                                                        const int8_t* __restrict__ xq,
                                                        const float* __restrict__ xd,
                                                        const int* __restrict__ xs, int n,
                                                        float* __restrict__ y) {
  constexpr int CAP = fw_i8_stage_words<TY>();
  __shared__ uint4 stage[FW_I8L_ROWS][CAP];
  const int L = threadIdx.x & 15, slot = threadIdx.x >> 4;
  const int r = blockIdx.x * FW_I8L_ROWS + slot;
  const int t0 = blockIdx.y * NT, nt = min(NT, n - t0);
  const int xb = fw_q8_blocks(cols), nb = cols / 32;
  // A row past the last computes the last again (every thread takes part in the shuffles).
  const uint8_t* row = w + (size_t)min(r, rows - 1) * row_bytes;
  const size_t x0 = (size_t)t0 * xb;
  float a[NT], m[NT];
#pragma unroll
  for (int t = 0; t < NT; t++) a[t] = m[t] = 0.0f;
  for (int b0 = 0; b0 < nb; b0 += FW_I8_CHUNK) {
    const long long lo = fw_i8_offset<TY>(b0), hi = fw_i8_offset<TY>(min(nb, b0 + FW_I8_CHUNK));
    const int off = fw_stage<CAP, 16>(row + lo, (int)(hi - lo), stage[slot], L);
    __syncwarp();
    fw_i8_lane<TY, NT>((const uint8_t*)stage[slot] + off, b0, nb, L, xq + x0 * 32, xd + x0,
                       xs + x0, xb, nt, a, m);
    __syncwarp();  // the chunk's reads of the stage are done before the next is staged
  }
#pragma unroll
  for (int t = 0; t < NT; t++) {
    float s = fw_i8_has_min(TY) ? fw_add(a[t], m[t]) : a[t];
    // fw_i8_tree: A[L] + A[L + 8], then lanes L and L + 4, L and L + 2, L and L + 1.
#pragma unroll
    for (int k = 8; k >= 1; k /= 2) s = fw_add(s, __shfl_down_sync(0xffffffffu, s, k, 16));
    if (L == 0 && r < rows && t < nt) y[(size_t)(t0 + t) * rows + r] = s;
  }
}

// The int8 products (int8.cuh), for the formats `reference::int8_applies` names: in the quads
// layout (i8, i8b) and the lanes layout (i8l, i8lb), a token a thread (decode) or FW_I8_TOKENS
// (batches; the same bits), and a mixture of experts' rows (quads).
#define FW_I8_TOKENS 8
#define FW_PER_INT8(NAME, TY)                                                                    \
  extern "C" __global__ void __launch_bounds__(4 * FW_I8_ROWS)                                   \
      fw_matmul_i8_##NAME(const uint8_t* w, int rows, int cols, long long row_bytes,             \
                          const int8_t* xq, const float* xd, const int* xs, int n, float* y) {    \
    fw_matmul_i8_body<TY, 1>(w, rows, cols, row_bytes, xq, xd, xs, n, y);                        \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(4 * FW_I8_ROWS)                                   \
      fw_matmul_i8b_##NAME(const uint8_t* w, int rows, int cols, long long row_bytes,            \
                           const int8_t* xq, const float* xd, const int* xs, int n, float* y) {   \
    fw_matmul_i8_body<TY, FW_I8_TOKENS>(w, rows, cols, row_bytes, xq, xd, xs, n, y);             \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(16 * FW_I8L_ROWS)                                 \
      fw_matmul_i8l_##NAME(const uint8_t* w, int rows, int cols, long long row_bytes,            \
                           const int8_t* xq, const float* xd, const int* xs, int n, float* y) {   \
    fw_matmul_i8_lanes_body<TY, 1>(w, rows, cols, row_bytes, xq, xd, xs, n, y);                  \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(16 * FW_I8L_ROWS)                                 \
      fw_matmul_i8lb_##NAME(const uint8_t* w, int rows, int cols, long long row_bytes,           \
                            const int8_t* xq, const float* xd, const int* xs, int n, float* y) {  \
    fw_matmul_i8_lanes_body<TY, FW_I8_TOKENS>(w, rows, cols, row_bytes, xq, xd, xs, n, y);       \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(4 * FW_I8_ROWS)                                   \
      fw_matmul_experts_i8_##NAME(const uint64_t* experts, const uint32_t* expert, int ne,       \
                                  int out, int cols, long long row_bytes, const int8_t* xq,      \
                                  const float* xd, const int* xs, int xdiv, float* y) {          \
    fw_matmul_experts_i8_body<TY>(experts, expert, ne, out, cols, row_bytes, xq, xd, xs, xdiv, y); \
  }

FW_PER_INT8(q4_0, FW_Q4_0)
FW_PER_INT8(q4_1, FW_Q4_1)
FW_PER_INT8(q8_0, FW_Q8_0)
FW_PER_INT8(q4_k, FW_Q4K)
FW_PER_INT8(q6_k, FW_Q6K)
FW_PER_INT8(q3_k, FW_Q3K)
FW_PER_INT8(q5_k, FW_Q5K)
FW_PER_INT8(iq4_nl, FW_IQ4NL)
FW_PER_INT8(iq4_xs, FW_IQ4XS)

extern "C" __global__ void fw_quantize_q8(const float* x, int n, int cols, int8_t* xq, float* xd,
                                          int* xs) {
  fw_quantize_q8_body(x, n, cols, xq, xd, xs);
}

// An RMSNorm row's second pass: o = x · scale · weight (each product rounded once), scale from
// the row's sum of squares ss, 8 values a thread at a time with their loads issued together.
// WRITTEN: x was written by this launch (read with plain loads, not the read-only cache).
template <bool WRITTEN>
__device__ __forceinline__ void fw_norm_write(const float* xr, const float* __restrict__ weight,
                                              float ss, float eps, int d, float* __restrict__ o) {
  const float scale = 1.0f / sqrtf(ss / (float)d + eps);
  const int T = blockDim.x;
  for (int c0 = threadIdx.x; c0 < d; c0 += 8 * T) {
    float v[8], g[8];
#pragma unroll
    for (int k = 0; k < 8; k++) {
      const bool in = c0 + k * T < d;
      v[k] = in ? (WRITTEN ? xr[c0 + k * T] : __ldg(xr + c0 + k * T)) : 0.0f;
      g[k] = in ? __ldg(weight + c0 + k * T) : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < 8; k++)
      if (c0 + k * T < d) o[c0 + k * T] = fw_mul(fw_mul(v[k], scale), g[k]);
  }
}

// out = x / sqrt(mean(x²) + eps) · weight per row of d; grid (rows), FW_ROW_THREADS threads.
extern "C" __global__ void fw_rmsnorm(const float* __restrict__ x, const float* __restrict__ weight,
                                      float eps, int d, float* __restrict__ out) {
  const float* xr = x + (size_t)blockIdx.x * d;
  float* o = out + (size_t)blockIdx.x * d;
  float ss = 0.0f;
  // 8 values a thread at a time, their loads issued together (predicated; the unrolled loop's
  // SASS had a branch before each load, one load in flight at a time); the sum in the same
  // order, a value past the row adding 0·0.
  const int T = blockDim.x;
  for (int c0 = threadIdx.x; c0 < d; c0 += 8 * T) {
    float v[8];
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = c0 + k * T < d ? __ldg(xr + c0 + k * T) : 0.0f;
#pragma unroll
    for (int k = 0; k < 8; k++) ss = fmaf(v[k], v[k], ss);
  }
  fw_norm_write<false>(xr, weight, fw_block_sum(ss), eps, d, o);
}

// x += y, then out = RMSNorm(x)·weight, per row of d: fw_residual_add then fw_rmsnorm in one
// launch (the residual stream and the next block's norm). Each thread adds the values it then
// squares, in fw_rmsnorm's order, and reads back only its own writes, so the bits are the two
// kernels'. Grid (rows), FW_ROW_THREADS threads; out must not overlap x.
extern "C" __global__ void fw_add_rmsnorm(float* __restrict__ x, const float* __restrict__ y,
                                          const float* __restrict__ weight, float eps, int d,
                                          float* __restrict__ out) {
  float* xr = x + (size_t)blockIdx.x * d;
  const float* yr = y + (size_t)blockIdx.x * d;
  float* o = out + (size_t)blockIdx.x * d;
  float ss = 0.0f;
  const int T = blockDim.x;
  for (int c0 = threadIdx.x; c0 < d; c0 += 8 * T) {
    float v[8];
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = c0 + k * T < d ? fw_add(xr[c0 + k * T], __ldg(yr + c0 + k * T)) : 0.0f;
#pragma unroll
    for (int k = 0; k < 8; k++)
      if (c0 + k * T < d) xr[c0 + k * T] = v[k];
#pragma unroll
    for (int k = 0; k < 8; k++) ss = fmaf(v[k], v[k], ss);
  }
  // This thread's own writes above are read back with plain loads.
  fw_norm_write<true>(xr, weight, fw_block_sum(ss), eps, d, o);
}

// Pair `pair` of one head (xh) turned by its token's row of `ops::rope_table` ((cos, sin) per
// pair): `neox` picks (i, i + half) over (2i, 2i+1). The CPU's operations in its order, each
// rounded once: equal to `ops::rope` bit for bit.
__device__ __forceinline__ void fw_rope_pair(float* __restrict__ xh, const float* __restrict__ tr,
                                             int pair, int half, int neox) {
  const float c = tr[2 * pair], s = tr[2 * pair + 1];
  const int p = neox ? pair : 2 * pair, q = neox ? pair + half : 2 * pair + 1;
  const float a = xh[p], b = xh[q];
  xh[p] = fw_sub(fw_mul(a, c), fw_mul(b, s));
  xh[q] = fw_add(fw_mul(a, s), fw_mul(b, c));
}

// RoPE in place on n rows of n_heads heads. One thread per (token, head, pair).
extern "C" __global__ void fw_rope(float* __restrict__ x, const float* __restrict__ table, int n,
                                   int n_heads, int head_dim, int rope_dim, int neox) {
  const int half = rope_dim / 2;
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)n * n_heads * half) return;
  const int pair = (int)(i % half);
  const int h = (int)((i / half) % n_heads);
  const int t = (int)(i / ((long long)half * n_heads));
  fw_rope_pair(x + ((size_t)t * n_heads + h) * head_dim, table + (size_t)t * rope_dim, pair, half, neox);
}

// RoPE on queries (n rows of hq heads) and keys (n rows of hk heads) in one launch: fw_rope's
// arithmetic on each. One thread per (token, head of q then k, pair).
extern "C" __global__ void fw_rope_qk(float* __restrict__ q, float* __restrict__ k,
                                      const float* __restrict__ table, int n, int hq, int hk,
                                      int head_dim, int rope_dim, int neox) {
  const int half = rope_dim / 2, heads = hq + hk;
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)n * heads * half) return;
  const int pair = (int)(i % half);
  const int h = (int)((i / half) % heads);
  const int t = (int)(i / ((long long)half * heads));
  float* xh = h < hq ? q + ((size_t)t * hq + h) * head_dim : k + ((size_t)t * hk + (h - hq)) * head_dim;
  fw_rope_pair(xh, table + (size_t)t * rope_dim, pair, half, neox);
}

// out = silu(gate) · up.
extern "C" __global__ void fw_swiglu(const float* __restrict__ gate, const float* __restrict__ up,
                                     long long n, float* __restrict__ out) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float g = gate[i];
  out[i] = g / (1.0f + expf(-g)) * up[i];
}

// out = gelu_tanh(gate) · up (Gemma's MLP), through ½(1 + tanh v) = 1 / (1 + e^(−2v)).
extern "C" __global__ void fw_geglu(const float* __restrict__ gate, const float* __restrict__ up,
                                    long long n, float* __restrict__ out) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float g = gate[i];
  const float v = 0.7978845608028654f * (g + 0.044715f * g * g * g);
  out[i] = g / (1.0f + expf(-2.0f * v)) * up[i];
}

// x += y (the residual stream).
extern "C" __global__ void fw_residual_add(float* __restrict__ x, const float* __restrict__ y, long long n) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = fw_add(x[i], y[i]);
}

// x *= s (Gemma's embedding scale), one rounding as on the CPU.
extern "C" __global__ void fw_scale(float* __restrict__ x, float s, long long n) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = fw_mul(x[i], s);
}

// y += s · d (a LoRA delta, scaled then added: the CPU's two roundings).
extern "C" __global__ void fw_axpy(float* __restrict__ y, const float* __restrict__ d, float s,
                                   long long n) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = fw_add(y[i], fw_mul(d[i], s));
}

// Every row of y (rows of d) plus the bias b (d values): Qwen2's q/k/v biases.
extern "C" __global__ void fw_add_bias(float* __restrict__ y, const float* __restrict__ b,
                                       long long n, int d) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = fw_add(y[i], b[i % d]);
}

// out (m, d) = rows idx[0..m] of x (the rows whose logits are wanted).
extern "C" __global__ void fw_gather_rows(const float* __restrict__ x,
                                          const uint32_t* __restrict__ idx, int m, int d,
                                          float* __restrict__ out) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)m * d) return;
  const int j = (int)(i / d), c = (int)(i % d);
  out[i] = x[(size_t)idx[j] * d + c];
}

// Block-diagonal product (adapters: OFT's rotations, LoRA's B):
// out[t][q·m + j] = Σ_i x[t][q·k + i] · mats[q][i][j], one thread per output, i in order.
extern "C" __global__ void fw_block_matmul(const float* __restrict__ x,
                                           const float* __restrict__ mats, int n, int nb, int k,
                                           int m, float* __restrict__ out) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)n * nb * m) return;
  const int j = (int)(i % m);
  const int q = (int)((i / m) % nb);
  const long long t = i / ((long long)m * nb);
  const float* xr = x + (size_t)t * nb * k + (size_t)q * k;
  const float* mq = mats + (size_t)q * k * m + j;
  float acc = 0.0f;
  for (int a = 0; a < k; a++) acc = fmaf(xr[a], mq[(size_t)a * m], acc);
  out[i] = acc;
}

// A mixture of experts' output: y[t] = Σ_s weight[t·k + s] · out[row_of[t·k + s]], the sum from
// 0 in the order of the token's choices, each product and sum rounded once (the CPU's order).
extern "C" __global__ void fw_moe_combine(const float* __restrict__ out,
                                          const uint32_t* __restrict__ row_of,
                                          const float* __restrict__ weight, int t, int k, int h,
                                          float* __restrict__ y) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)t * h) return;
  const int tok = (int)(i / h), c = (int)(i % h);
  float acc = 0.0f;
  for (int s = 0; s < k; s++) {
    const int j = tok * k + s;
    acc = fw_add(acc, fw_mul(weight[j], out[(size_t)row_of[j] * h + c]));
  }
  y[i] = acc;
}

// Per-token metadata of a packed batch, shared by the cache writer and attention: token t sits at
// position pos[t] of a sequence whose block table starts at block_tables[table_at[t]].
struct FwTokens {
  const uint32_t* block_tables;
  const int* table_at;
  const int* pos;
};

// Attention in chunks of positions (and fw_load, the cache's values as f32).
#include "attention.cuh"

__device__ __forceinline__ void fw_store(float* p, float v) { *p = v; }
__device__ __forceinline__ void fw_store(uint16_t* p, float v) {
  *p = __half_as_ushort(__float2half_rn(v));
}

// Write n tokens' K and V rows (n, kv_dim) into the cache at their positions; halves round to
// nearest even, as the CPU's writer (`ops::round_to_f16`). One thread per (token, value).
template <typename E>
__device__ __forceinline__ void fw_kv_write_body(const float* __restrict__ k,
                                                 const float* __restrict__ v, int n, int kv_dim,
                                                 int block_size, FwTokens toks, E* kc, E* vc) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)n * kv_dim) return;
  const int t = (int)(i / kv_dim), c = (int)(i % kv_dim);
  const uint32_t* bt = toks.block_tables + toks.table_at[t];
  const int pos = toks.pos[t];
  fw_store(kc + fw_k_index(bt, pos, c, block_size, kv_dim), k[i]);
  fw_store(vc + fw_v_offset(bt, pos, block_size, kv_dim) + c, v[i]);
}

// Causal grouped-query attention over the paged cache: out (n, n_heads·head_dim) for queries q
// of the same shape, token t seeing positions fw_first_key(pos[t], window) ..= pos[t]; with
// softcap > 0 (Gemma 2) the scaled scores are softcap·tanh(s / softcap) before the softmax.
// Grid (n, n_heads), FW_ATT_WARPS warps. A warp takes 32 positions at a time, one per lane: the
// lane scores its key (K is transposed per block, so the warp's loads of one dim are adjacent),
// then the warp adds the 32 weighted V rows, lane l holding dims l, l+32, …; an online softmax
// per warp, the warps merged at the end. A query's result depends on its own keys only.
template <typename E>
__device__ __forceinline__ void fw_attention_body(const float* __restrict__ q,
                                                  float* __restrict__ out, FwTokens toks,
                                                  const E* __restrict__ kc,
                                                  const E* __restrict__ vc, int n_heads,
                                                  int n_kv_heads, int head_dim, int block_size,
                                                  float scale, int window, float softcap) {
  __shared__ float qs[FW_ATT_MAX_DIM];
  __shared__ float wm[FW_ATT_WARPS], wl[FW_ATT_WARPS];
  __shared__ float wacc[FW_ATT_WARPS][FW_ATT_MAX_DIM];
  const int t = blockIdx.x, h = blockIdx.y;
  const int lane = threadIdx.x % FW_WARP, warp = threadIdx.x / FW_WARP;
  const int kvh = h / (n_heads / n_kv_heads);
  const int kv_dim = n_kv_heads * head_dim;
  const uint32_t* bt = toks.block_tables + toks.table_at[t];
  const int pos = toks.pos[t];
  const int lo = fw_first_key(pos, window);
  const float* qh = q + ((size_t)t * n_heads + h) * head_dim;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) qs[d] = qh[d] * scale;
  __syncthreads();

  const int per_lane = (head_dim + FW_WARP - 1) / FW_WARP;
  float acc[FW_ATT_MAX_DIM / FW_WARP];
#pragma unroll
  for (int j = 0; j < FW_ATT_MAX_DIM / FW_WARP; j++) acc[j] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  for (int p0 = lo + warp * FW_WARP; p0 <= pos; p0 += FW_ATT_WARPS * FW_WARP) {
    const int p = p0 + lane;
    float sc = -INFINITY;
    if (p <= pos) {
      const size_t k0 = fw_k_index(bt, p, kvh * head_dim, block_size, kv_dim);
      float dot = 0.0f;
      // 8 of a key's loads in flight at a time (16 spilled on sm_80). Measured on the H200: a
      // decode step's attention took 23 µs a layer before and after (from 4), as it did with the
      // V rows' slots looked up by lanes below: its time goes elsewhere (docs/gpu.md).
#pragma unroll 8
      for (int d = 0; d < head_dim; d++) dot = fmaf(qs[d], fw_load(kc + k0 + (size_t)d * block_size), dot);
      sc = dot;
    }
    // A select, not a branch on p: a branch here gave the kernel a stack frame on sm_80.
    if (softcap > 0.0f) sc = p <= pos ? softcap * tanhf(sc / softcap) : -INFINITY;
    const float m_new = fmaxf(m, fw_warp_max(sc));
    const float pr = p <= pos ? expf(sc - m_new) : 0.0f;
    const float corr = expf(m - m_new);  // 0 on the first chunk (m = −inf)
    l = l * corr + fw_warp_sum(pr);
#pragma unroll
    for (int j = 0; j < FW_ATT_MAX_DIM / FW_WARP; j++) acc[j] *= corr;
    const int last = min(FW_WARP, pos - p0 + 1);
    // Each lane looks up its own position's V row (in parallel); the loop below takes them by
    // shuffle, so that its V loads wait on no block-table load.
    const int pl = min(p, pos);
    const int my_slot = (int)bt[pl / block_size] * block_size + pl % block_size;
#pragma unroll 8
    for (int i = 0; i < last; i++) {
      const float w = __shfl_sync(0xffffffffu, pr, i);
      // fw_v_offset of position p0 + i, from lane i's slot.
      const E* vr = vc + (size_t)__shfl_sync(0xffffffffu, my_slot, i) * kv_dim + kvh * head_dim;
#pragma unroll
      for (int j = 0; j < FW_ATT_MAX_DIM / FW_WARP; j++) {
        const int d = lane + FW_WARP * j;
        if (j < per_lane && d < head_dim) acc[j] = fmaf(w, fw_load(vr + d), acc[j]);
      }
    }
    m = m_new;
  }
  if (lane == 0) {
    wm[warp] = m;
    wl[warp] = l;
  }
#pragma unroll
  for (int j = 0; j < FW_ATT_MAX_DIM / FW_WARP; j++) {
    const int d = lane + FW_WARP * j;
    if (j < per_lane && d < head_dim) wacc[warp][d] = acc[j];
  }
  __syncthreads();
  float mt = -INFINITY;
  for (int w = 0; w < FW_ATT_WARPS; w++) mt = fmaxf(mt, wm[w]);
  float lt = 0.0f;
  for (int w = 0; w < FW_ATT_WARPS; w++) lt += wm[w] == -INFINITY ? 0.0f : wl[w] * expf(wm[w] - mt);
  float* oh = out + ((size_t)t * n_heads + h) * head_dim;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float s = 0.0f;
    for (int w = 0; w < FW_ATT_WARPS; w++)
      if (wm[w] != -INFINITY) s += wacc[w][d] * expf(wm[w] - mt);
    oh[d] = s / lt;
  }
}

#define FW_PER_KV(NAME, E)                                                                       \
  extern "C" __global__ void fw_kv_write_##NAME(const float* k, const float* v, int n, int kv_dim, \
                                                int block_size, FwTokens toks, E* kc, E* vc) {     \
    fw_kv_write_body<E>(k, v, n, kv_dim, block_size, toks, kc, vc);                               \
  }                                                                                                \
  extern "C" __global__ void __launch_bounds__(FW_ATT_WARPS * FW_WARP)                           \
      fw_attention_##NAME(const float* q, float* out, FwTokens toks, const E* kc, const E* vc,    \
                          int n_heads, int n_kv_heads, int head_dim, int block_size, float scale,  \
                          int window, float softcap) {                                             \
    fw_attention_body<E>(q, out, toks, kc, vc, n_heads, n_kv_heads, head_dim, block_size, scale,  \
                         window, softcap);                                                         \
  }

FW_PER_KV(f32, float)
FW_PER_KV(f16, uint16_t)

// Log-softmax of each row of `vocab` logits at temperature 1/inv_temp, in place; grid (rows),
// FW_ROW_THREADS threads.
extern "C" __global__ void fw_log_softmax(float* __restrict__ x, int vocab, float inv_temp) {
  float* r = x + (size_t)blockIdx.x * vocab;
  float mx = -INFINITY;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) mx = fmaxf(mx, r[i] * inv_temp);
  mx = fw_block_max(mx);
  float s = 0.0f;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) s += expf(r[i] * inv_temp - mx);
  const float lse = mx + logf(fw_block_sum(s));
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) r[i] = r[i] * inv_temp - lse;
}

// The index of each row's largest value (the first of equals, as the CPU's greedy sampler).
extern "C" __global__ void fw_argmax(const float* __restrict__ x, int vocab, uint32_t* __restrict__ out) {
  __shared__ float bv[32];
  __shared__ int bi[32];
  const float* r = x + (size_t)blockIdx.x * vocab;
  float v = -INFINITY;
  int at = vocab;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x)
    if (r[i] > v) {
      v = r[i];
      at = i;
    }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, at, o);
    if (ov > v || (ov == v && oi < at)) {
      v = ov;
      at = oi;
    }
  }
  const int lane = threadIdx.x % FW_WARP, warp = threadIdx.x / FW_WARP;
  if (lane == 0) {
    bv[warp] = v;
    bi[warp] = at;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < (int)(blockDim.x / FW_WARP); w++)
      if (bv[w] > v || (bv[w] == v && bi[w] < at)) {
        v = bv[w];
        at = bi[w];
      }
    out[blockIdx.x] = (uint32_t)(at == vocab ? 0 : at);
  }
}
