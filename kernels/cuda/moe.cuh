// A mixture of experts on the GPU for decode graphs: the router's choices made on the device
// (`fw_moe_route`) and each (token, choice)'s expert product row by row (`fw_matmul_experts`), so
// that no step reads the routing back to the host. Included by kernels.cu after products.cuh.
#pragma once

// The most experts a token uses that the router kernel keeps (`MOE_MAX_USED` in cuda/moe.rs).
#define FW_MOE_MAX_USED 16

// Each token's k choices from its router logits (n rows of ne): softmax, then k times the
// largest probability not yet taken (the first of equals), its probability the choice's weight,
// the k weights divided by their sum (in order) with norm_topk (`moe::route`'s order and
// operations; expf for the CPU's exp, so the weights agree to within its rounding, not bit for
// bit). Writes expert[t·k + s], weight[t·k + s] and row_of[t·k + s] = t·k + s (each choice's
// row of the experts' outputs, for fw_moe_combine). One thread per token.
extern "C" __global__ void fw_moe_route(const float* __restrict__ logits, int n, int ne, int k,
                                        int norm_topk, uint32_t* __restrict__ expert,
                                        float* __restrict__ weight, uint32_t* __restrict__ row_of) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= n || k > FW_MOE_MAX_USED || k > ne) return;
  const float* v = logits + (size_t)t * ne;
  float mx = -INFINITY;
  for (int e = 0; e < ne; e++) mx = fmaxf(mx, v[e]);
  float sum = 0.0f;
  for (int e = 0; e < ne; e++) sum = fw_add(sum, expf(fw_sub(v[e], mx)));
  int chosen[FW_MOE_MAX_USED];
  float w[FW_MOE_MAX_USED];
#pragma unroll
  for (int s = 0; s < FW_MOE_MAX_USED; s++) {
    chosen[s] = -1;
    w[s] = 0.0f;
  }
  // Loops over the choices run to FW_MOE_MAX_USED with s < k tested inside (a `break` left the
  // loop rolled and the choices in local memory).
#pragma unroll
  for (int s = 0; s < FW_MOE_MAX_USED; s++) {
    if (s >= k) continue;
    int best = -1;
    float bp = 0.0f;
    for (int e = 0; e < ne; e++) {
      bool taken = false;
#pragma unroll
      for (int q = 0; q < FW_MOE_MAX_USED; q++) taken |= q < s && chosen[q] == e;
      const float p = expf(fw_sub(v[e], mx)) / sum;
      if (!taken && (best < 0 || p > bp)) {
        best = e;
        bp = p;
      }
    }
    chosen[s] = best;
    w[s] = bp;
  }
  float total = 0.0f;
#pragma unroll
  for (int s = 0; s < FW_MOE_MAX_USED; s++)
    if (s < k) total = fw_add(total, w[s]);
#pragma unroll
  for (int s = 0; s < FW_MOE_MAX_USED; s++) {
    if (s >= k) continue;
    const size_t j = (size_t)t * k + s;
    expert[j] = (uint32_t)chosen[s];
    weight[j] = norm_topk ? w[s] / total : w[s];
    row_of[j] = (uint32_t)j;
  }
}

// Each (token, choice) row's expert product: y[r][j] = W_{expert[r]} row j · x[r / xdiv] for
// r < rows (xdiv = k: the token's normed input to the gate and up; 1: the row's own activations
// to the down), by one warp (`fw_matmul_warp_row`: the products' order of sums, so each row
// equals the eagerly grouped product of its expert bit for bit). `experts` holds each expert's
// matrix address; every expert `out` rows of `cols` values, `row_bytes` a row. Grid
// (rows, ceil(out / FW_MMW_WARPS)), FW_MMW_WARPS warps.
template <int TY>
__device__ __forceinline__ void fw_matmul_experts_body(const uint64_t* __restrict__ experts,
                                                       const uint32_t* __restrict__ expert, int ne,
                                                       int out, int cols, long long row_bytes,
                                                       const float* __restrict__ x, int xdiv,
                                                       float* __restrict__ y) {
  __shared__ uint4 stage[FW_MMW_WARPS][fw_stage_words<TY>()];
  const int lane = threadIdx.x % FW_WARP, warp = threadIdx.x / FW_WARP;
  const int r = blockIdx.x, j = blockIdx.y * FW_MMW_WARPS + warp;
  const uint32_t e = expert[r];
  if (j >= out || e >= (uint32_t)ne) return;  // the whole warp
  const uint8_t* row = (const uint8_t*)experts[e] + (size_t)j * row_bytes;
  const float s = fw_matmul_warp_row<TY>(row, cols, x + (size_t)(r / xdiv) * cols, stage[warp], lane);
  if (lane == 0) y[(size_t)r * out + j] = s;
}
