// The trainer's backward on the GPU, its first kernel: the input gradient of a frozen product,
// dx (n, cols) = dy (n, rows) · W, W (rows, cols) in any storage format, read as stored (never
// dequantized as a whole). Written here: the backward needs W's columns against dy's rows, which
// no product kernel of this file reads, and a fixed order of sums (so that a token's gradient is
// the same bits alone or in any batch), which cuBLAS does not promise.
#pragma once

#define FW_LB_THREADS 256
// Rows decoded a pass (a thread each) and tokens a block (a warp each).
#define FW_LB_ROWS 256
#define FW_LB_TOKENS 8
// A decoded unit's stride in shared memory: 33 floats, so that both the writes (a thread a row)
// and the reads (a lane a column) fall in 32 different banks.
#define FW_LB_STRIDE 33

// Grid (cols / 32 units, ceil(n / FW_LB_TOKENS)), FW_LB_THREADS threads. Each pass decodes unit u
// of up to FW_LB_ROWS rows into shared memory (a thread a row, `fw_unit_any`: the CPU's values
// bit for bit) beside those rows of dy for the block's tokens; then each thread (column
// 32u + lane, token t0 + warp) adds dy[t][i] · W[i][c] over them in order (fmaf). So dx[t][c] is
// Σ over i = 0 .. rows in order, whatever the batch and wherever the token sits in it.
extern "C" __global__ void __launch_bounds__(FW_LB_THREADS)
    fw_linear_backward(const uint8_t* __restrict__ w, int ty, int rows, long long row_bytes,
                       const float* __restrict__ dy, int n, int cols, float* __restrict__ dx) {
  __shared__ float ws[FW_LB_ROWS * FW_LB_STRIDE];
  __shared__ float ds[FW_LB_TOKENS * FW_LB_ROWS];
  const int u = blockIdx.x, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int t0 = blockIdx.y * FW_LB_TOKENS, t = t0 + warp;
  float acc = 0.0f;
  for (int i0 = 0; i0 < rows; i0 += FW_LB_ROWS) {
    const int m = min(FW_LB_ROWS, rows - i0);
    // The pass before has read what this one overwrites.
    __syncthreads();
    if ((int)threadIdx.x < m) {
      float v[32];
      fw_unit_any(ty, w + (size_t)(i0 + threadIdx.x) * row_bytes, u, v);
#pragma unroll
      for (int k = 0; k < 32; k++) ws[threadIdx.x * FW_LB_STRIDE + k] = v[k];
    }
    for (int e = threadIdx.x; e < FW_LB_TOKENS * m; e += FW_LB_THREADS) {
      const int j = e / m, i = e % m;
      ds[j * FW_LB_ROWS + i] = t0 + j < n ? dy[(size_t)(t0 + j) * rows + i0 + i] : 0.0f;
    }
    __syncthreads();
    if (t < n) {
      const float* d = ds + warp * FW_LB_ROWS;
      for (int i = 0; i < m; i++) acc = fmaf(d[i], ws[i * FW_LB_STRIDE + lane], acc);
    }
  }
  if (t < n) dx[(size_t)t * cols + 32 * u + lane] = acc;
}
