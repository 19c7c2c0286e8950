// Attention cut into chunks of positions (`fw_attention_chunks_<kv>`, FLYWHEEL_CUDA_ATTENTION=
// chunks): "flash-decoding". The rows kernel (kernels.cu) gives a (token, head) one block of 4
// warps, so a decode step at batch 1 runs n_heads blocks (32 on a 1B model's 132-SM card) and
// each walks every position it sees: at long contexts the card is mostly idle. Here a query's
// positions are cut into at most FW_ATT_SPLITS chunks, each a whole number of 32-position tiles,
// by the query's own count of positions (`fw_att_chunks`), and each chunk's (max, Σ, Σ p·V) is
// computed by one warp the same way wherever it runs. The chunks are then merged in order, each
// into the running result (`fw_att_mix`):
//   - split: a warp a chunk (blocks of FW_ATT_CW warps); each writes its partial to the scratch,
//     and the warp that finishes last (a counter per (token, head), reset by it) merges them all
//     in order;
//   - fold: a block a (token, head), its warps taking the chunks in turn, the partials in shared
//     memory, merged in order by the first warp.
// The same partials merged in the same order give the same bits, so a query's result does not
// depend on which the host launched (the host splits small batches, where blocks are few, and
// folds large ones: `cuda::paged`), nor on its batch. The helpers are written once for the
// device and for the host twin (`twin.cu attention`), which `kernels/tests/cuda_twin.rs` checks
// against `reference::attention` on every machine.
#pragma once

// The most chunks a query's positions are cut into (the split launch's grid.z).
#define FW_ATT_SPLITS 32
// Positions of a tile: one a lane.
#define FW_ATT_TILE 32
// The largest head held in registers (8 values a lane).
#define FW_ATT_MAX_DIM 256
// Warps a block of the chunks kernel (`ATT_CHUNK_WARPS` in cuda/attention.rs); FW_ATT_SPLITS is a
// multiple of it.
#define FW_ATT_CW 4

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
// The kernel is compiled for heads of up to 32·PL values (PL = 2, 4, 8: head dims ≤ 64, ≤ 128,
// ≤ 256), each lane holding PL of a row's values: registers for what the head has, not for 256
// (the V loop's loads in flight took 8 a position, and sm_90 spilled).

// Token t's query in the cache: its block table, the positions it sees (lo ..= pos) and their
// chunks (`fw_att_chunks`), chunk s being positions c0(s) .. c1(s) - 1.
struct FwAttSpan {
  const uint32_t* bt;
  int pos, lo, len, count;
  __device__ int c0(int s) const { return lo + s * len; }
  __device__ int c1(int s) const { return min(c0(s) + len, pos + 1); }
};
__device__ __forceinline__ FwAttSpan fw_att_span(const FwTokens& toks, int t, int window) {
  FwAttSpan a;
  a.bt = toks.block_tables + toks.table_at[t];
  a.pos = toks.pos[t];
  a.lo = fw_first_key(a.pos, window);
  fw_att_chunks(a.pos - a.lo + 1, &a.len, &a.count);
  return a;
}

// The warp's partial over positions c0 .. c1 - 1 of the query (all seen by it): tiles of 32, lane
// i scoring position p0 + i; an online softmax (m, l) and acc[j] = Σ p·V[lane + 32 j] under m.
template <int PL, typename E>
__device__ __forceinline__ void fw_att_chunk(const float* qs, const uint32_t* bt, const E* kc,
                                             const E* vc, int c0, int c1, int kv_col,
                                             int head_dim, int block_size, int kv_dim,
                                             float softcap, float* m_out, float* l_out,
                                             float* acc) {
  const int lane = threadIdx.x % FW_WARP;
  float m = -INFINITY, l = 0.0f;
#pragma unroll
  for (int j = 0; j < PL; j++) acc[j] = 0.0f;
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
    for (int j = 0; j < PL; j++) acc[j] = fw_mul(acc[j], keep);
    // Lane i's V row (looked up in parallel), taken by shuffle below.
    const int pl = in ? p : c1 - 1;
    const int my_slot = (int)bt[pl / block_size] * block_size + pl % block_size;
    const int last = min(FW_ATT_TILE, c1 - p0);
#pragma unroll 8
    for (int i = 0; i < last; i++) {
      const float w = __shfl_sync(0xffffffffu, pr, i);
      const E* vr = vc + (size_t)__shfl_sync(0xffffffffu, my_slot, i) * kv_dim + kv_col;
#pragma unroll
      for (int j = 0; j < PL; j++) {
        const int d = lane + FW_WARP * j;
        if (d < head_dim) acc[j] = fmaf(w, fw_load(vr + d), acc[j]);
      }
    }
    m = m_new;
  }
  *m_out = m;
  *l_out = l;
}

// A chunk's partial written for the merge: m and l, then acc's head_dim values.
template <int PL>
__device__ __forceinline__ void fw_att_put(float* p, float m, float l, const float* acc,
                                           int head_dim) {
  const int lane = threadIdx.x % FW_WARP;
  if (lane == 0) {
    p[0] = m;
    p[1] = l;
  }
#pragma unroll
  for (int j = 0; j < PL; j++) {
    const int d = lane + FW_WARP * j;
    if (d < head_dim) p[2 + d] = acc[j];
  }
}

// The query's output from its `count` partials (`stride` floats apart from `part`), merged in
// order by one warp: the first as it is, each next by fw_att_merge. L2: read past L1 (the
// partials of a split launch were written by other SMs).
template <int PL, bool L2>
__device__ __forceinline__ void fw_att_finish(const float* part, size_t stride, int count,
                                              int head_dim, float* out) {
  const int lane = threadIdx.x % FW_WARP;
  float M = 0.0f, L = 0.0f, A[PL];
  for (int s = 0; s < count; s++) {
    const float* ps = part + s * stride;
    const float m = L2 ? __ldcg(ps) : ps[0], l = L2 ? __ldcg(ps + 1) : ps[1];
    float acc[PL];
#pragma unroll
    for (int j = 0; j < PL; j++) {
      const int d = lane + FW_WARP * j;
      acc[j] = d < head_dim ? (L2 ? __ldcg(ps + 2 + d) : ps[2 + d]) : 0.0f;
    }
    if (s == 0) {
      M = m;
      L = l;
#pragma unroll
      for (int j = 0; j < PL; j++) A[j] = acc[j];
    } else {
      float ca, cb;
      fw_att_merge(&M, &L, m, l, &ca, &cb);
#pragma unroll
      for (int j = 0; j < PL; j++) A[j] = fw_att_mix(A[j], ca, acc[j], cb);
    }
  }
#pragma unroll
  for (int j = 0; j < PL; j++) {
    const int d = lane + FW_WARP * j;
    if (d < head_dim) out[d] = A[j] / L;
  }
}

// Grid (n, n_heads, split ? FW_ATT_SPLITS / FW_ATT_CW : 1), FW_ATT_CW warps a block; warp g of the
// query (z · FW_ATT_CW + w) computes chunks g, g + G, … (G: the query's warps), each partial the
// same wherever it is computed:
//   - fold (a block a query): the partials into shared memory (dynamic: FW_ATT_SPLITS ·
//     (head_dim + 2) floats), then warp 0 merges them in order;
//   - split (FW_ATT_SPLITS warps a query, a chunk each): the partials into `part` (FW_ATT_SPLITS
//     of head_dim + 2 floats a (token, head)), and the warp that finishes last (`counters`, one a
//     (token, head), zero between launches: it resets its own) merges them in order. A query of
//     one chunk writes its output at once (the merge of one partial is the partial: the same).
template <int PL, typename E>
__device__ __forceinline__ void fw_attention_chunks_body(
    const float* __restrict__ q, float* __restrict__ out, FwTokens toks, const E* __restrict__ kc,
    const E* __restrict__ vc, int n_heads, int n_kv_heads, int head_dim, int block_size,
    float scale, int window, float softcap, float* part, unsigned* counters, int split) {
  __shared__ float qs[FW_ATT_MAX_DIM];
  extern __shared__ float fold_part[];
  const int t = blockIdx.x, h = blockIdx.y;
  const int lane = threadIdx.x % FW_WARP, warp = threadIdx.x / FW_WARP;
  const int kv_col = (h / (n_heads / n_kv_heads)) * head_dim;
  const int kv_dim = n_kv_heads * head_dim;
  const FwAttSpan sp = fw_att_span(toks, t, window);
  const uint32_t* bt = sp.bt;
  const int count = sp.count;
  if (split && (int)blockIdx.z * FW_ATT_CW >= count) return;  // the whole block: no chunk here
  const float* qh = q + ((size_t)t * n_heads + h) * head_dim;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) qs[d] = qh[d] * scale;
  __syncthreads();
  const size_t th = (size_t)t * n_heads + h, stride = (size_t)head_dim + 2;
  float* oh = out + th * head_dim;
  if (!split) {
    for (int s = warp; s < count; s += FW_ATT_CW) {
      const int c0 = sp.c0(s), c1 = sp.c1(s);
      float m, l, acc[PL];
      fw_att_chunk<PL>(qs, bt, kc, vc, c0, c1, kv_col, head_dim, block_size, kv_dim, softcap, &m, &l, acc);
      fw_att_put<PL>(fold_part + s * stride, m, l, acc, head_dim);
    }
    __syncthreads();
    if (warp == 0) fw_att_finish<PL, false>(fold_part, stride, count, head_dim, oh);
    return;
  }
  const int s = (int)blockIdx.z * FW_ATT_CW + warp;
  if (s >= count) return;  // the whole warp
  const int c0 = sp.c0(s), c1 = sp.c1(s);
  float m, l, acc[PL];
  fw_att_chunk<PL>(qs, bt, kc, vc, c0, c1, kv_col, head_dim, block_size, kv_dim, softcap, &m, &l, acc);
  if (count == 1) {
#pragma unroll
    for (int j = 0; j < PL; j++) {
      const int d = lane + FW_WARP * j;
      if (d < head_dim) oh[d] = acc[j] / l;
    }
    return;
  }
  float* mine = part + th * FW_ATT_SPLITS * stride;
  fw_att_put<PL>(mine + s * stride, m, l, acc, head_dim);
  // Each lane's writes visible to the whole device before the count says they are there.
  __threadfence();
  __syncwarp();
  int last = 0;
  if (lane == 0) last = atomicAdd(&counters[th], 1u) == (unsigned)(count - 1);
  if (!__shfl_sync(0xffffffffu, last, 0)) return;
  __threadfence();
  fw_att_finish<PL, true>(mine, stride, count, head_dim, oh);
  if (lane == 0) counters[th] = 0;
}

// GQA groups (`FLYWHEEL_CUDA_ATTENTION=groups`: its split launches, `ChunkLaunch::Groups`): the
// query heads of one KV head, up to GP at a time, share one warp's pass over a chunk: each key's
// and value's elements loaded once for them, where a warp a head loads them once a head (4 times
// on a 1B model's 32 heads over 8). Each head's steps are fw_att_chunk's, the same operations on
// the same operands in the same order, so its partial has the same bits, and so has its result:
// the kernels test checks groups = fold = split. Heads past the group's (gn ≤ GP) run on zeros
// and are not written.
template <int PL, int GP, typename E>
__device__ __forceinline__ void fw_att_chunk_group(const float (*qs)[FW_ATT_MAX_DIM],
                                                   const uint32_t* bt, const E* kc, const E* vc,
                                                   int c0, int c1, int kv_col, int head_dim,
                                                   int block_size, int kv_dim, float softcap,
                                                   float* m_out, float* l_out, float (*acc)[PL]) {
  const int lane = threadIdx.x % FW_WARP;
  float m[GP], l[GP];
#pragma unroll
  for (int g = 0; g < GP; g++) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
#pragma unroll
    for (int j = 0; j < PL; j++) acc[g][j] = 0.0f;
  }
  for (int p0 = c0; p0 < c1; p0 += FW_ATT_TILE) {
    const int p = p0 + lane;
    const bool in = p < c1;
    // fw_att_score for each head, the key's elements loaded once.
    float dot[GP];
#pragma unroll
    for (int g = 0; g < GP; g++) dot[g] = 0.0f;
    if (in) {
      const size_t k0 = fw_k_index(bt, p, kv_col, block_size, kv_dim);
#pragma unroll 4
      for (int d = 0; d < head_dim; d++) {
        const float kd = fw_load(kc + k0 + (size_t)d * block_size);
#pragma unroll
        for (int g = 0; g < GP; g++) dot[g] = fmaf(qs[g][d], kd, dot[g]);
      }
    }
    float pr[GP];
#pragma unroll
    for (int g = 0; g < GP; g++) {
      const float sc = in ? (softcap > 0.0f ? softcap * FW_TANHF(dot[g] / softcap) : dot[g]) : -INFINITY;
      const float m_new = fmaxf(m[g], fw_warp_max(sc));
      pr[g] = in ? FW_EXPF(sc - m_new) : 0.0f;
      const float keep = fw_att_keep(m[g], m_new);
      l[g] = fmaf(l[g], keep, fw_warp_sum(pr[g]));
#pragma unroll
      for (int j = 0; j < PL; j++) acc[g][j] = fw_mul(acc[g][j], keep);
      m[g] = m_new;
    }
    const int pl = in ? p : c1 - 1;
    const int my_slot = (int)bt[pl / block_size] * block_size + pl % block_size;
    const int last = min(FW_ATT_TILE, c1 - p0);
#pragma unroll 4
    for (int i = 0; i < last; i++) {
      float w[GP];
#pragma unroll
      for (int g = 0; g < GP; g++) w[g] = __shfl_sync(0xffffffffu, pr[g], i);
      const E* vr = vc + (size_t)__shfl_sync(0xffffffffu, my_slot, i) * kv_dim + kv_col;
#pragma unroll
      for (int j = 0; j < PL; j++) {
        const int d = lane + FW_WARP * j;
        if (d < head_dim) {
          const float vd = fw_load(vr + d);
#pragma unroll
          for (int g = 0; g < GP; g++) acc[g][j] = fmaf(w[g], vd, acc[g][j]);
        }
      }
    }
  }
#pragma unroll
  for (int g = 0; g < GP; g++) {
    m_out[g] = m[g];
    l_out[g] = l[g];
  }
}

// Split launches by groups: grid (n, n_kv_heads · ceil(G / GP), FW_ATT_SPLITS / FW_ATT_CW), G =
// n_heads / n_kv_heads; block (t, y, z) takes query heads h0 .. h0 + gn of KV head y / ceil(G /
// GP), warp w chunk z · FW_ATT_CW + w of each. The partials go where the split launch puts them
// (per (token, head)); the group's counter is its first head's, and the warp that finishes last
// merges each of the group's heads in order (fw_att_finish, as the split launch does).
template <int PL, int GP, typename E>
__device__ __forceinline__ void fw_attention_groups_body(
    const float* __restrict__ q, float* __restrict__ out, FwTokens toks, const E* __restrict__ kc,
    const E* __restrict__ vc, int n_heads, int n_kv_heads, int head_dim, int block_size,
    float scale, int window, float softcap, float* part, unsigned* counters) {
  __shared__ float qs[GP][FW_ATT_MAX_DIM];
  const int t = blockIdx.x;
  const int lane = threadIdx.x % FW_WARP, warp = threadIdx.x / FW_WARP;
  const int G = n_heads / n_kv_heads, subs = (G + GP - 1) / GP;
  const int kvh = (int)blockIdx.y / subs, sub = (int)blockIdx.y % subs;
  const int h0 = kvh * G + sub * GP, gn = min(GP, G - sub * GP);
  const int kv_col = kvh * head_dim;
  const int kv_dim = n_kv_heads * head_dim;
  const FwAttSpan sp = fw_att_span(toks, t, window);
  const uint32_t* bt = sp.bt;
  const int count = sp.count;
  if ((int)blockIdx.z * FW_ATT_CW >= count) return;  // the whole block: no chunk here
  const size_t th0 = (size_t)t * n_heads + h0, stride = (size_t)head_dim + 2;
  for (int i = threadIdx.x; i < GP * head_dim; i += blockDim.x) {
    const int g = i / head_dim, d = i % head_dim;
    qs[g][d] = g < gn ? q[(th0 + g) * head_dim + d] * scale : 0.0f;
  }
  __syncthreads();
  const int s = (int)blockIdx.z * FW_ATT_CW + warp;
  if (s >= count) return;  // the whole warp
  const int c0 = sp.c0(s), c1 = sp.c1(s);
  float m[GP], l[GP], acc[GP][PL];
  fw_att_chunk_group<PL, GP>(qs, bt, kc, vc, c0, c1, kv_col, head_dim, block_size, kv_dim, softcap,
                             m, l, acc);
  if (count == 1) {
#pragma unroll
    for (int g = 0; g < GP; g++) {
      if (g >= gn) break;
#pragma unroll
      for (int j = 0; j < PL; j++) {
        const int d = lane + FW_WARP * j;
        if (d < head_dim) out[(th0 + g) * head_dim + d] = acc[g][j] / l[g];
      }
    }
    return;
  }
#pragma unroll
  for (int g = 0; g < GP; g++)
    if (g < gn) fw_att_put<PL>(part + ((th0 + g) * FW_ATT_SPLITS + s) * stride, m[g], l[g], acc[g], head_dim);
  // Each lane's writes visible to the whole device before the count says they are there.
  __threadfence();
  __syncwarp();
  int last = 0;
  if (lane == 0) last = atomicAdd(&counters[th0], 1u) == (unsigned)(count - 1);
  if (!__shfl_sync(0xffffffffu, last, 0)) return;
  __threadfence();
  for (int g = 0; g < gn; g++)
    fw_att_finish<PL, true>(part + (th0 + g) * FW_ATT_SPLITS * stride, stride, count, head_dim,
                            out + (th0 + g) * head_dim);
  if (lane == 0) counters[th0] = 0;
}

// fw_attention_chunks_<kv>_<DIM> for heads of up to DIM values. BLOCKS: the blocks an SM the
// registers are held to (the most at which sm_90's ptxas spilled nothing: 6, 5 and 4; sm_80 needs
// fewer registers).
#define FW_ATT_CHUNKS(NAME, E, DIM, PL, BLOCKS)                                                   \
  extern "C" __global__ void __launch_bounds__(FW_ATT_CW * FW_WARP, BLOCKS)                      \
      fw_attention_chunks_##NAME##_##DIM(const float* q, float* out, FwTokens toks, const E* kc,  \
                                        const E* vc, int n_heads, int n_kv_heads, int head_dim,   \
                                        int block_size, float scale, int window, float softcap,   \
                                        float* part, unsigned* counters, int split) {             \
    fw_attention_chunks_body<PL, E>(q, out, toks, kc, vc, n_heads, n_kv_heads, head_dim,          \
                                    block_size, scale, window, softcap, part, counters, split);   \
  }

FW_ATT_CHUNKS(f32, float, 64, 2, 6)
FW_ATT_CHUNKS(f32, float, 128, 4, 5)
FW_ATT_CHUNKS(f32, float, 256, 8, 4)
FW_ATT_CHUNKS(f16, uint16_t, 64, 2, 6)
FW_ATT_CHUNKS(f16, uint16_t, 128, 4, 5)
FW_ATT_CHUNKS(f16, uint16_t, 256, 8, 4)

// fw_attention_groups_<kv>_<DIM>: GP heads a warp (4 up to 128 values a head, 2 for 256:
// `att_group_heads` in cuda/attention.rs). Held to 5 blocks an SM: with no minimum ptxas spilled
// a few bytes of some (3 to 6 spilled none).
#define FW_ATT_GROUPS(NAME, E, DIM, PL, GP)                                                       \
  extern "C" __global__ void __launch_bounds__(FW_ATT_CW * FW_WARP, 5)                           \
      fw_attention_groups_##NAME##_##DIM(const float* q, float* out, FwTokens toks, const E* kc,  \
                                        const E* vc, int n_heads, int n_kv_heads, int head_dim,   \
                                        int block_size, float scale, int window, float softcap,   \
                                        float* part, unsigned* counters) {                        \
    fw_attention_groups_body<PL, GP, E>(q, out, toks, kc, vc, n_heads, n_kv_heads, head_dim,      \
                                        block_size, scale, window, softcap, part, counters);      \
  }

FW_ATT_GROUPS(f32, float, 64, 2, 4)
FW_ATT_GROUPS(f32, float, 128, 4, 4)
FW_ATT_GROUPS(f32, float, 256, 8, 2)
FW_ATT_GROUPS(f16, uint16_t, 64, 2, 4)
FW_ATT_GROUPS(f16, uint16_t, 128, 4, 4)
FW_ATT_GROUPS(f16, uint16_t, 256, 8, 2)
#endif
