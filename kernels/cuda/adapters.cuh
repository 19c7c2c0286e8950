// Adapters applied row by row from a directory on the GPU (`cuda::AdapterEntry`), so that one
// captured decode graph serves whichever adapter versions a step's sequences use: the graph reads
// each row's slot (`row_slot`, -1: no adapter) and the slot's entry for a module at every replay,
// and a published version is a new entry, not a new graph. Each kernel computes a row's values
// with the arithmetic of the per-group ops the eager steps launch (fw_block_matmul, fw_matmul's
// order of sums, fw_axpy), so a row's bits are the same through a graph or eagerly.
// Included by kernels.cu after products.cuh.
#pragma once

// One module (a layer's projection, or the LM head) of one adapter version: OFT's block-diagonal
// rotations, or LoRA's A (r × in, f32 as bytes) and Bᵀ (r × out) with its scale; null where the
// version does not adapt the module. `cuda::AdapterEntry` on the host (40 bytes).
struct FwAdapterEntry {
  const float* oft;
  const uint8_t* lora_a;
  const float* lora_bt;
  int r;
  int block;
  float scale;
  int pad;
};

// The entry of row t's version for module m, or null (no adapter, or none on this module).
__device__ __forceinline__ const FwAdapterEntry* fw_entry(const int* __restrict__ row_slot,
                                                          const FwAdapterEntry* __restrict__ dir,
                                                          int modules, int m, int t) {
  const int slot = row_slot[t];
  return slot < 0 ? nullptr : dir + (size_t)slot * modules + m;
}

// out[t] = x[t] through its version's OFT rotation of module m (out[q·b + j] = Σ_i x[q·b + i] ·
// R[q][i][j], fw_block_matmul's sum), or a copy of x[t] where there is none. One thread per value
// of n rows of d.
extern "C" __global__ void fw_oft_rows(const float* __restrict__ x, const int* __restrict__ row_slot,
                                       const FwAdapterEntry* __restrict__ dir, int modules, int m,
                                       int n, int d, float* __restrict__ out) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)n * d) return;
  const int t = (int)(i / d), c = (int)(i % d);
  const FwAdapterEntry* e = fw_entry(row_slot, dir, modules, m, t);
  if (e == nullptr || e->oft == nullptr) {
    out[i] = x[i];
    return;
  }
  const int b = e->block, q = c / b, j = c % b;
  const float* xr = x + (size_t)t * d + (size_t)q * b;
  const float* mq = e->oft + (size_t)q * b * b + j;
  float acc = 0.0f;
  for (int a = 0; a < b; a++) acc = fmaf(xr[a], mq[(size_t)a * b], acc);
  out[i] = acc;
}

// LoRA's first product: h[t][j] = A row j · x[t] (d values) for j < r of row t's version of
// module m, in the products' order of sums (`fw_matmul_warp_row`: the bits of fw_matmul_f32 in
// any layout). A warp a value: grid (ceil(r_max / FW_MMW_WARPS), n), FW_MMW_WARPS warps; h keeps
// hs values a row. Rows without LoRA on m, and j ≥ r, are left alone.
extern "C" __global__ void __launch_bounds__(FW_MMW_WARPS * FW_WARP)
    fw_lora_a_rows(const float* __restrict__ x, const int* __restrict__ row_slot,
                   const FwAdapterEntry* __restrict__ dir, int modules, int m, int d, int hs,
                   float* __restrict__ h) {
  __shared__ uint4 stage[FW_MMW_WARPS][fw_stage_words<FW_F32>()];
  const int lane = threadIdx.x % FW_WARP, warp = threadIdx.x / FW_WARP;
  const int t = blockIdx.y, j = blockIdx.x * FW_MMW_WARPS + warp;
  const FwAdapterEntry* e = fw_entry(row_slot, dir, modules, m, t);
  if (e == nullptr || e->lora_a == nullptr || j >= e->r || j >= hs) return;  // the whole warp
  const float s = fw_matmul_warp_row<FW_F32>(e->lora_a + (size_t)j * d * 4, d, x + (size_t)t * d,
                                             stage[warp], lane);
  if (lane == 0) h[(size_t)t * hs + j] = s;
}

// The same values by a block of 2 warps a value (`FLYWHEEL_CUDA_LORA=block`): thread i takes
// slot i (units i, i + 64, …, as fw_matmul_body), its units of A (f32 rows, 16-byte aligned)
// and x read straight from global memory, the warps' sums added as fw_matmul_warp_row adds its
// two: the same bits, with twice the warps and half the chain a thread. (On an H200 the warp
// layout took 12.5 µs a launch in batch-1 decode: an r = 16 module is 16 warps on the card.)
// Grid (r_max, n), FW_MM_WARPS warps.
extern "C" __global__ void __launch_bounds__(FW_MM_WARPS * FW_WARP)
    fw_lora_a_block(const float* __restrict__ x, const int* __restrict__ row_slot,
                    const FwAdapterEntry* __restrict__ dir, int modules, int m, int d, int hs,
                    float* __restrict__ h) {
  __shared__ float sums[FW_MM_WARPS];
  const int lane = threadIdx.x % FW_WARP, warp = threadIdx.x / FW_WARP;
  const int t = blockIdx.y, j = blockIdx.x;
  const FwAdapterEntry* e = fw_entry(row_slot, dir, modules, m, t);
  if (e == nullptr || e->lora_a == nullptr || j >= e->r || j >= hs) return;  // the whole block
  const float* a = (const float*)(e->lora_a + (size_t)j * d * 4);
  const float* xt = x + (size_t)t * d;
  float acc = 0.0f;
  for (int u = threadIdx.x; u < d / 32; u += FW_MM_UNITS) {
    float v[32];
    fw_ldg_unit(a + 32 * (size_t)u, v);
    acc = fw_dot_unit(v, xt + 32 * (size_t)u, acc);
  }
  const float s = fw_warp_sum(acc);
  if (lane == 0) sums[warp] = s;
  __syncthreads();
  if (threadIdx.x == 0) h[(size_t)t * hs + j] = fw_add(sums[0], sums[1]);
}

// LoRA's second product and its scaled add: y[t][c] += s · Σ_i h[t][i] · Bᵀ[i][c] (i < r, from 0
// in order: fw_block_matmul's sum; then fw_axpy's two roundings) for the rows whose version has
// LoRA on module m. One thread per value of n rows of d (the module's outputs).
extern "C" __global__ void fw_lora_b_rows(const float* __restrict__ h, int hs,
                                          const int* __restrict__ row_slot,
                                          const FwAdapterEntry* __restrict__ dir, int modules,
                                          int m, int n, int d, float* __restrict__ y) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)n * d) return;
  const int t = (int)(i / d), c = (int)(i % d);
  const FwAdapterEntry* e = fw_entry(row_slot, dir, modules, m, t);
  if (e == nullptr || e->lora_bt == nullptr) return;
  const float* hr = h + (size_t)t * hs;
  const float* bt = e->lora_bt + c;
  float acc = 0.0f;
  const int r = min(e->r, hs);  // the host checks r ≤ hs; this keeps the reads in h regardless
  for (int a = 0; a < r; a++) acc = fmaf(hr[a], bt[(size_t)a * d], acc);
  y[i] = fw_add(y[i], fw_mul(acc, e->scale));
}
