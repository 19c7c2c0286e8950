// Attention cut into chunks of positions (`fw_attention_chunks_<kv>`, FLYWHEEL_CUDA_ATTENTION=
// chunks): "flash-decoding". The rows kernel (kernels.cu) gives a (token, head) one block of 4
// warps, so a decode step at batch 1 runs n_heads blocks (32 on a 1B model's 132-SM card) and
// each walks every position it sees: at long contexts the card is mostly idle. Here a query's
// positions are cut into at most FW_ATT_SPLITS chunks, each a whole number of 32-position tiles,
// by the query's own count of positions (`fw_att_chunks`), and each chunk's (max, Σ, Σ p·V) is
// computed by one warp the same way wherever it runs. The chunks are then merged in order, each
// into the running result (`fw_att_mix`):
//   - split: one block (a warp) a chunk; each writes its partial to the scratch, and the block
//     that finishes last (a counter per (token, head), reset by it) merges them all in order;
//   - fold: one block a (token, head) computes its chunks one after another and merges each as
//     it comes.
// The same partials merged in the same order give the same bits, so a query's result does not
// depend on which the host launched (the host splits small batches, where blocks are few, and
// folds large ones: `cuda::paged`), nor on its batch. The helpers are written once for the
// device and for the host twin (`twin.cu attention`), which `kernels/tests/cuda_twin.rs` checks
// against `reference::attention` on every machine.
#pragma once

// The most chunks a query's positions are cut into (the split launch's grid.z).
#define FW_ATT_SPLITS 16
// Positions of a tile: one a lane.
#define FW_ATT_TILE 32
// The largest head held in registers (8 values a lane).
#define FW_ATT_MAX_DIM 256

#ifdef __CUDA_ARCH__
#define FW_EXPF(x) expf(x)
#define FW_TANHF(x) tanhf(x)
#else
#include <math.h>
#define FW_EXPF(x) ::expf(x)
#define FW_TANHF(x) ::tanhf(x)
#endif

FW_HD float fw_load(const float* p) { return *p; }
FW_HD float fw_load(const uint16_t* p) { return fw_f16(*p); }

// A query seeing n_pos ≥ 1 positions: chunks of *len positions (a multiple of FW_ATT_TILE, the
// fewest tiles that leave at most FW_ATT_SPLITS chunks), *count of them.
FW_HD void fw_att_chunks(int n_pos, int* len, int* count) {
  const int span = FW_ATT_TILE * FW_ATT_SPLITS;
  const int tiles = (n_pos + span - 1) / span;
  *len = FW_ATT_TILE * (tiles < 1 ? 1 : tiles);
  *count = (n_pos + *len - 1) / *len;
}

// The scaled query (qs) against the key at position p: Σ qs[d]·k[d] in order of d (fmaf), then
// softcap·tanh(s / softcap) where softcap > 0 (Gemma 2).
template <typename E>
FW_HD float fw_att_score(const float* qs, const E* kc, const uint32_t* bt, int p, int kv_col,
                         int head_dim, int block_size, int kv_dim, float softcap) {
  const size_t k0 = fw_k_index(bt, p, kv_col, block_size, kv_dim);
  float dot = 0.0f;
#pragma unroll 8
  for (int d = 0; d < head_dim; d++) dot = fmaf(qs[d], fw_load(kc + k0 + (size_t)d * block_size), dot);
  return softcap > 0.0f ? softcap * FW_TANHF(dot / softcap) : dot;
}

// What a sum kept under max m keeps under the larger max m_new: exp(m - m_new), 0 for nothing
// yet (m = -inf).
FW_HD float fw_att_keep(float m, float m_new) { return m == -INFINITY ? 0.0f : FW_EXPF(m - m_new); }

// a·ca + b·cb, each product and the sum rounded once (no FMA: the same bits in every context).
FW_HD float fw_att_mix(float a, float ca, float b, float cb) {
  return fw_add(fw_mul(a, ca), fw_mul(b, cb));
}

// One partial (m, l, acc) merged into the running one (M, L, A): the larger max, each side's
// sums kept under it. The caller merges a's values with the factors this returns in *ca, *cb.
FW_HD void fw_att_merge(float* M, float* L, float m, float l, float* ca, float* cb) {
  const float mn = fmaxf(*M, m);
  *ca = fw_att_keep(*M, mn);
  *cb = fw_att_keep(m, mn);
  *L = fw_att_mix(*L, *ca, l, *cb);
  *M = mn;
}

// The kernel, in kernels.cu's build only (FwTokens and the warp reductions are that file's; the
// twin compiles the helpers above and walks the lanes itself).
#if defined(__CUDA_ARCH__) && defined(FW_ROW_THREADS)
#define FW_ATT_PER_LANE (FW_ATT_MAX_DIM / FW_WARP)

// The warp's partial over positions c0 .. c1 - 1 of the query (all seen by it): tiles of 32, lane
// i scoring position p0 + i; an online softmax (m, l) and acc[j] = Σ p·V[lane + 32 j] under m.
template <typename E>
__device__ __forceinline__ void fw_att_chunk(const float* qs, const uint32_t* bt, const E* kc,
                                             const E* vc, int c0, int c1, int kv_col,
                                             int head_dim, int block_size, int kv_dim,
                                             float softcap, float* m_out, float* l_out,
                                             float* acc) {
  const int lane = threadIdx.x % FW_WARP;
  float m = -INFINITY, l = 0.0f;
#pragma unroll
  for (int j = 0; j < FW_ATT_PER_LANE; j++) acc[j] = 0.0f;
  for (int p0 = c0; p0 < c1; p0 += FW_ATT_TILE) {
    const int p = p0 + lane;
    const bool in = p < c1;
    const float sc =
        in ? fw_att_score(qs, kc, bt, p, kv_col, head_dim, block_size, kv_dim, softcap) : -INFINITY;
    const float m_new = fmaxf(m, fw_warp_max(sc));
    const float pr = in ? FW_EXPF(sc - m_new) : 0.0f;
    const float keep = fw_att_keep(m, m_new);
    l = fmaf(l, keep, fw_warp_sum(pr));
#pragma unroll
    for (int j = 0; j < FW_ATT_PER_LANE; j++) acc[j] = fw_mul(acc[j], keep);
    // Lane i's V row (looked up in parallel), taken by shuffle below.
    const int pl = in ? p : c1 - 1;
    const int my_slot = (int)bt[pl / block_size] * block_size + pl % block_size;
    const int last = min(FW_ATT_TILE, c1 - p0);
#pragma unroll 8
    for (int i = 0; i < last; i++) {
      const float w = __shfl_sync(0xffffffffu, pr, i);
      const E* vr = vc + (size_t)__shfl_sync(0xffffffffu, my_slot, i) * kv_dim + kv_col;
#pragma unroll
      for (int j = 0; j < FW_ATT_PER_LANE; j++) {
        const int d = lane + FW_WARP * j;
        if (d < head_dim) acc[j] = fmaf(w, fw_load(vr + d), acc[j]);
      }
    }
    m = m_new;
  }
  *m_out = m;
  *l_out = l;
}

// Grid (n, n_heads, split ? FW_ATT_SPLITS : 1), one warp a block. part: FW_ATT_SPLITS partials of
// head_dim + 2 floats (m, l, acc) for each (token, head) of a split launch; counters: one a
// (token, head), zero between launches.
template <typename E>
__device__ __forceinline__ void fw_attention_chunks_body(
    const float* __restrict__ q, float* __restrict__ out, FwTokens toks, const E* __restrict__ kc,
    const E* __restrict__ vc, int n_heads, int n_kv_heads, int head_dim, int block_size,
    float scale, int window, float softcap, float* part, unsigned* counters, int split) {
  __shared__ float qs[FW_ATT_MAX_DIM];
  const int t = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
  const int kv_col = (h / (n_heads / n_kv_heads)) * head_dim;
  const int kv_dim = n_kv_heads * head_dim;
  const uint32_t* bt = toks.block_tables + toks.table_at[t];
  const int pos = toks.pos[t];
  const int lo = fw_first_key(pos, window);
  int len, count;
  fw_att_chunks(pos - lo + 1, &len, &count);
  const int z = split ? (int)blockIdx.z : 0;
  if (z >= count) return;
  const float* qh = q + ((size_t)t * n_heads + h) * head_dim;
  for (int d = lane; d < head_dim; d += FW_WARP) qs[d] = qh[d] * scale;
  __syncwarp();
  float* oh = out + ((size_t)t * n_heads + h) * head_dim;
  float M, L, A[FW_ATT_PER_LANE];
  if (!split || count == 1) {
    // Fold: the chunks in order, each merged as it comes.
    for (int s = 0; s < count; s++) {
      const int c0 = lo + s * len, c1 = min(c0 + len, pos + 1);
      float m, l, acc[FW_ATT_PER_LANE];
      fw_att_chunk(qs, bt, kc, vc, c0, c1, kv_col, head_dim, block_size, kv_dim, softcap, &m, &l, acc);
      if (s == 0) {
        M = m;
        L = l;
#pragma unroll
        for (int j = 0; j < FW_ATT_PER_LANE; j++) A[j] = acc[j];
      } else {
        float ca, cb;
        fw_att_merge(&M, &L, m, l, &ca, &cb);
#pragma unroll
        for (int j = 0; j < FW_ATT_PER_LANE; j++) A[j] = fw_att_mix(A[j], ca, acc[j], cb);
      }
    }
  } else {
    // Split: chunk z here, its partial to the scratch; the last of the query's blocks to finish
    // merges every partial in order.
    const size_t th = (size_t)t * n_heads + h, stride = (size_t)head_dim + 2;
    float* mine = part + (th * FW_ATT_SPLITS + z) * stride;
    {
      const int c0 = lo + z * len, c1 = min(c0 + len, pos + 1);
      float m, l, acc[FW_ATT_PER_LANE];
      fw_att_chunk(qs, bt, kc, vc, c0, c1, kv_col, head_dim, block_size, kv_dim, softcap, &m, &l, acc);
      if (lane == 0) {
        mine[0] = m;
        mine[1] = l;
      }
#pragma unroll
      for (int j = 0; j < FW_ATT_PER_LANE; j++) {
        const int d = lane + FW_WARP * j;
        if (d < head_dim) mine[2 + d] = acc[j];
      }
    }
    // Each lane's writes visible to the whole device before the count says they are there.
    __threadfence();
    __syncwarp();
    int last = 0;
    if (lane == 0) last = atomicAdd(&counters[th], 1u) == (unsigned)(count - 1);
    if (!__shfl_sync(0xffffffffu, last, 0)) return;
    __threadfence();
    // Read past L1 (another SM wrote these; this one may hold an earlier launch's lines).
    for (int s = 0; s < count; s++) {
      const float* ps = part + (th * FW_ATT_SPLITS + s) * stride;
      const float m = __ldcg(ps), l = __ldcg(ps + 1);
      float acc[FW_ATT_PER_LANE];
#pragma unroll
      for (int j = 0; j < FW_ATT_PER_LANE; j++) {
        const int d = lane + FW_WARP * j;
        acc[j] = d < head_dim ? __ldcg(ps + 2 + d) : 0.0f;
      }
      if (s == 0) {
        M = m;
        L = l;
#pragma unroll
        for (int j = 0; j < FW_ATT_PER_LANE; j++) A[j] = acc[j];
      } else {
        float ca, cb;
        fw_att_merge(&M, &L, m, l, &ca, &cb);
#pragma unroll
        for (int j = 0; j < FW_ATT_PER_LANE; j++) A[j] = fw_att_mix(A[j], ca, acc[j], cb);
      }
    }
    if (lane == 0) counters[th] = 0;
  }
#pragma unroll
  for (int j = 0; j < FW_ATT_PER_LANE; j++) {
    const int d = lane + FW_WARP * j;
    if (d < head_dim) oh[d] = A[j] / L;
  }
}

#define FW_ATT_CHUNKS(NAME, E)                                                                   \
  extern "C" __global__ void __launch_bounds__(FW_WARP) fw_attention_chunks_##NAME(             \
      const float* q, float* out, FwTokens toks, const E* kc, const E* vc, int n_heads,           \
      int n_kv_heads, int head_dim, int block_size, float scale, int window, float softcap,       \
      float* part, unsigned* counters, int split) {                                               \
    fw_attention_chunks_body<E>(q, out, toks, kc, vc, n_heads, n_kv_heads, head_dim, block_size,  \
                                scale, window, softcap, part, counters, split);                   \
  }

FW_ATT_CHUNKS(f32, float)
FW_ATT_CHUNKS(f16, uint16_t)
#endif
