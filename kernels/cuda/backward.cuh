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

// RMSNorm's backward, its weight frozen: dx = w·dy/r − x·Σ_c(w·dy·x)/(d·r³), r = √(mean(x²) + ε).
// Grid (rows), FW_ROW_THREADS threads; the two sums by `fw_block_sum` (an order fixed by the
// block's shape: a row's gradient never depends on its batch). f32, within rounding of the CPU's.
extern "C" __global__ void fw_rmsnorm_backward(const float* __restrict__ x,
                                               const float* __restrict__ w, float eps,
                                               const float* __restrict__ dy, int d,
                                               float* __restrict__ dx) {
  const size_t at = (size_t)blockIdx.x * d;
  const float *xr = x + at, *gr = dy + at;
  float ss = 0.0f, ux = 0.0f;
  for (int c = threadIdx.x; c < d; c += blockDim.x) {
    ss = fmaf(xr[c], xr[c], ss);
    ux = fmaf(w[c] * gr[c], xr[c], ux);
  }
  ss = fw_block_sum(ss);
  ux = fw_block_sum(ux);
  const float inv = 1.0f / sqrtf(ss / (float)d + eps);
  const float k = ux * inv * inv * inv / (float)d;
  for (int c = threadIdx.x; c < d; c += blockDim.x) dx[at + c] = w[c] * gr[c] * inv - xr[c] * k;
}

// SwiGLU's backward (a = silu(g)·u): du = da·silu(g), dg = da·u·σ(g)·(1 + g·(1 − σ(g))).
extern "C" __global__ void fw_swiglu_backward(const float* __restrict__ gate,
                                              const float* __restrict__ up,
                                              const float* __restrict__ da, long long n,
                                              float* __restrict__ dgate, float* __restrict__ dup) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float g = gate[i], s = 1.0f / (1.0f + expf(-g));
  dup[i] = da[i] * g * s;
  dgate[i] = da[i] * up[i] * s * (1.0f + g * (1.0f - s));
}

// GeGLU's backward (a = gelu_tanh(g)·u): du = da·gelu(g), dg = da·u·gelu'(g).
extern "C" __global__ void fw_geglu_backward(const float* __restrict__ gate,
                                             const float* __restrict__ up,
                                             const float* __restrict__ da, long long n,
                                             float* __restrict__ dgate, float* __restrict__ dup) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float c = 0.7978845608028654f, g = gate[i];
  const float t = tanhf(c * (g + 0.044715f * g * g * g));
  const float dgelu = 0.5f * (1.0f + t) + 0.5f * g * (1.0f - t * t) * c * (1.0f + 3.0f * 0.044715f * g * g);
  dup[i] = da[i] * 0.5f * g * (1.0f + t);
  dgate[i] = da[i] * up[i] * dgelu;
}

// RoPE's backward in place on n rows of n_heads heads: each pair turned by −θ (the transpose of
// `fw_rope`'s turn). One thread per (token, head, pair); `neox` pairs (i, i + half).
extern "C" __global__ void fw_rope_backward(float* __restrict__ x, const float* __restrict__ table,
                                            int n, int n_heads, int head_dim, int rope_dim,
                                            int neox) {
  const int half = rope_dim / 2;
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)n * n_heads * half) return;
  const int pair = (int)(i % half);
  const int h = (int)((i / half) % n_heads);
  const int t = (int)(i / ((long long)half * n_heads));
  float* xh = x + ((size_t)t * n_heads + h) * head_dim;
  const float* tr = table + (size_t)t * rope_dim;
  const float c = tr[2 * pair], s = tr[2 * pair + 1];
  const int p = neox ? pair : 2 * pair, q = neox ? pair + half : 2 * pair + 1;
  const float a = xh[p], b = xh[q];
  xh[p] = a * c + b * s;
  xh[q] = b * c - a * s;
}

// Attention's backward for one sequence, contiguous rows: q, dout, dq (t, n_heads·hd); k, v, dk,
// dv (off + t, n_kv·hd), query i at position off + i seeing keys lo(i) ..= off + i (lo the
// window's first, else 0); scores scale·q·k, soft-capped c·tanh(s/c) where cap > 0 (whose slope
// 1 − tanh² scales dS). Two kernels, every sum in a fixed order: `_q` (a warp a query and head:
// its softmax's log-sum-exp and D = dout·o, kept in `stats`, then dq = Σ_j dS_j·k_j in key
// order) and `_kv` (a warp a key and KV head: dk = Σ dS·q and dv = Σ P·dout over its group's
// heads, then the queries that see it, in order). A lane holds components lane, lane + 32, …
// (hd a multiple of 32, at most 256). The reference is `reference::attention_backward_windowed`.
#define FW_AB_MAXK 8

__device__ __forceinline__ float fw_ab_score(const float* qv, const float* __restrict__ kj, int nk,
                                             float scale, float cap, float* slope) {
  const int lane = threadIdx.x % 32;
  float s = 0.0f;
#pragma unroll
  for (int kk = 0; kk < FW_AB_MAXK; kk++)
    if (kk < nk) s = fmaf(qv[kk], kj[lane + 32 * kk], s);
  s = fw_warp_sum(s) * scale;
  *slope = 1.0f;
  if (cap > 0.0f) {
    const float th = tanhf(s / cap);
    *slope = 1.0f - th * th;
    s = cap * th;
  }
  return s;
}

__device__ __forceinline__ float fw_ab_dot(const float* a, const float* __restrict__ b, int nk) {
  const int lane = threadIdx.x % 32;
  float s = 0.0f;
#pragma unroll
  for (int kk = 0; kk < FW_AB_MAXK; kk++)
    if (kk < nk) s = fmaf(a[kk], b[lane + 32 * kk], s);
  return fw_warp_sum(s);
}

// Grid (t, n_heads), 32 threads.
extern "C" __global__ void fw_attention_backward_q(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ dout, int t, int off, int n_heads, int n_kv, int hd, float scale,
    int window, float cap, float* __restrict__ dq, float* __restrict__ stats) {
  const int i = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
  const int g = h / (n_heads / n_kv), nk = hd / 32;
  const size_t qd = (size_t)n_heads * hd, kvd = (size_t)n_kv * hd;
  const float* qi = q + i * qd + (size_t)h * hd;
  const float* di = dout + i * qd + (size_t)h * hd;
  float qv[FW_AB_MAXK], dv[FW_AB_MAXK], o[FW_AB_MAXK], dqa[FW_AB_MAXK];
#pragma unroll
  for (int kk = 0; kk < FW_AB_MAXK; kk++) {
    qv[kk] = kk < nk ? qi[lane + 32 * kk] : 0.0f;
    dv[kk] = kk < nk ? di[lane + 32 * kk] : 0.0f;
    o[kk] = 0.0f;
    dqa[kk] = 0.0f;
  }
  const int last = off + i, lo = window > 0 ? max(0, last + 1 - window) : 0;
  float m = -INFINITY, z = 0.0f, slope;
  for (int j = lo; j <= last; j++) {
    const float s = fw_ab_score(qv, k + j * kvd + (size_t)g * hd, nk, scale, cap, &slope);
    const float mn = fmaxf(m, s), a = expf(m - mn), e = expf(s - mn);
    z = z * a + e;
    const float* vj = v + j * kvd + (size_t)g * hd;
#pragma unroll
    for (int kk = 0; kk < FW_AB_MAXK; kk++)
      if (kk < nk) o[kk] = fmaf(e, vj[lane + 32 * kk], o[kk] * a);
    m = mn;
  }
  const float lse = m + logf(z);
#pragma unroll
  for (int kk = 0; kk < FW_AB_MAXK; kk++) o[kk] = o[kk] / z;
  float dd = 0.0f;
#pragma unroll
  for (int kk = 0; kk < FW_AB_MAXK; kk++) dd = fmaf(dv[kk], o[kk], dd);
  dd = fw_warp_sum(dd);
  for (int j = lo; j <= last; j++) {
    const float* kj = k + j * kvd + (size_t)g * hd;
    const float s = fw_ab_score(qv, kj, nk, scale, cap, &slope);
    const float p = expf(s - lse);
    const float dp = fw_ab_dot(dv, v + j * kvd + (size_t)g * hd, nk);
    const float ds = p * (dp - dd) * slope * scale;
#pragma unroll
    for (int kk = 0; kk < FW_AB_MAXK; kk++)
      if (kk < nk) dqa[kk] = fmaf(ds, kj[lane + 32 * kk], dqa[kk]);
  }
  float* dqi = dq + i * qd + (size_t)h * hd;
#pragma unroll
  for (int kk = 0; kk < FW_AB_MAXK; kk++)
    if (kk < nk) dqi[lane + 32 * kk] = dqa[kk];
  if (lane == 0) {
    stats[((size_t)i * n_heads + h) * 2] = lse;
    stats[((size_t)i * n_heads + h) * 2 + 1] = dd;
  }
}

// Grid (off + t, n_kv), 32 threads; after `fw_attention_backward_q` (its stats).
extern "C" __global__ void fw_attention_backward_kv(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ dout, const float* __restrict__ stats, int t, int off, int n_heads,
    int n_kv, int hd, float scale, int window, float cap, float* __restrict__ dk,
    float* __restrict__ dvo) {
  const int j = blockIdx.x, g = blockIdx.y, lane = threadIdx.x;
  const int group = n_heads / n_kv, nk = hd / 32;
  const size_t qd = (size_t)n_heads * hd, kvd = (size_t)n_kv * hd;
  const float* kj = k + j * kvd + (size_t)g * hd;
  const float* vj = v + j * kvd + (size_t)g * hd;
  float dka[FW_AB_MAXK], dva[FW_AB_MAXK], qv[FW_AB_MAXK], dv[FW_AB_MAXK];
#pragma unroll
  for (int kk = 0; kk < FW_AB_MAXK; kk++) {
    dka[kk] = 0.0f;
    dva[kk] = 0.0f;
  }
  // The queries that see key j: from the one at its position on, to the window's last.
  const int i0 = max(0, j - off);
  const int i1 = window > 0 ? min(t - 1, j - off + window - 1) : t - 1;
  for (int hh = 0; hh < group; hh++) {
    const int h = g * group + hh;
    for (int i = i0; i <= i1; i++) {
      const float* qi = q + i * qd + (size_t)h * hd;
      const float* di = dout + i * qd + (size_t)h * hd;
#pragma unroll
      for (int kk = 0; kk < FW_AB_MAXK; kk++) {
        qv[kk] = kk < nk ? qi[lane + 32 * kk] : 0.0f;
        dv[kk] = kk < nk ? di[lane + 32 * kk] : 0.0f;
      }
      float slope;
      const float s = fw_ab_score(qv, kj, nk, scale, cap, &slope);
      const float* st = stats + ((size_t)i * n_heads + h) * 2;
      const float p = expf(s - st[0]);
      const float dp = fw_ab_dot(dv, vj, nk);
      const float ds = p * (dp - st[1]) * slope * scale;
#pragma unroll
      for (int kk = 0; kk < FW_AB_MAXK; kk++) {
        dka[kk] = fmaf(ds, qv[kk], dka[kk]);
        dva[kk] = fmaf(p, dv[kk], dva[kk]);
      }
    }
  }
#pragma unroll
  for (int kk = 0; kk < FW_AB_MAXK; kk++)
    if (kk < nk) {
      dk[j * kvd + (size_t)g * hd + lane + 32 * kk] = dka[kk];
      dvo[j * kvd + (size_t)g * hd + lane + 32 * kk] = dva[kk];
    }
}
