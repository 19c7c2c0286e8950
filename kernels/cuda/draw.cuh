// Drawing each sequence's next token on the GPU, so that a decode step returns a few words a row
// (the token, its log-prob, the top alternatives) instead of the whole row of logits: 33 MB a
// step at batch 64 with a 128k vocabulary, and the host's sampling of it.
//
// One block per drawn row (`fw_draw`), the steps of the engine's sampler (`engine::sampler`) for
// a draw from the whole distribution:
//   1. scale the logits by 1/T (the host sends 1 when greedy or T = 1, and x·1 = x);
//   2. log-softmax as `reference::log_softmax` computes it: the max, Σ exp(x - max) in f64,
//      lse = max + (f32) ln Σ, x - lse. Each thread sums its strided values, thread 0 adds the
//      threads' sums in order (`fw_draw_sum`): the f64 sum is rounded to f32 once, so lse is the
//      reference's (the CPU's SIMD kernels are within 1e-5 of it) but where the two f64 sums round to different f32 values (a sum's rounding error,
//      ~1e-16 relative, against f32's 6e-8);
//   3. greedy: the argmax of the log-probs (the first of equals); otherwise the inverse CDF at
//      the host's u (`reference::inverse_cdf`): thread t sums exp(lp) over its contiguous chunk
//      (f64), thread 0 turns the chunk sums into their running sums (`fw_draw_scan`), and each
//      thread finds the first index in its chunk where the running sum passes u·Σ
//      (`fw_draw_find`); the first of those is the token. Where rounding left none (u near 1),
//      the last token of positive probability, where u → 1 lands (the argmax if none). The
//      sums are grouped by chunk where the CPU's run in one line, so the token is the CPU's but
//      where u·Σ falls within rounding (~1e-16) of a boundary between two tokens;
//   4. the k best (token, log-prob), best first by `total_cmp` then index (`reference::top_indices`):
//      k passes, each the best after the one before under that total order (a unique answer, so
//      any order of reduction gives it);
//   5. with a top-k (≤ FW_DRAW_CAND; top-p and min-p with it), the draw is among those
//      candidates, found by the same passes: one thread runs `reference::truncated_pick`'s steps
//      over them in order (`fw_draw_truncated`), the sums in the reference's own order, so the
//      token is the reference's but where the device's f64 exp rounds differently from the host's
//      at a boundary;
//   6. a nucleus (top-p or min-p with no top-k: the sampler's cut of the whole sorted row) is
//      drawn among the row's FW_DRAW_CAND best the same way, the shares of top-p taken of the
//      row's Σ exp(lp) (by chunks, as step 3's: the reference sums it in sorted order, so a cut
//      can differ only where a running share is within rounding of top-p), where the cut falls
//      among those candidates (`fw_draw_pick`); where it reaches past them (a flat distribution)
//      the token is FW_DRAW_HOST and the host draws from the row's log-probs, left in place.
// The helpers are written once for the device and the host twin (`twin.cu draw`), which
// `kernels/tests/cuda_twin.rs` checks against `reference` on every machine. Written here: no crate
// draws on CUDA from Rust with the CPU sampler's rule.
#pragma once

#define FW_DRAW_THREADS 512
// The most alternatives a row reports (OpenAI's top_logprobs ≤ 20), and the largest top-k drawn
// here (llama.cpp's clients send 40 by default).
#define FW_DRAW_TOP 20
#define FW_DRAW_CAND 128
// A spec: row, 1/T's bits, u's low and high words, greedy, k, top-k (0: none), top-p's and
// min-p's bits. A result: token, its log-prob's bits, the mass kept (f64: low, high word; 1 when
// nothing is cut), then FW_DRAW_TOP ids and FW_DRAW_TOP log-probs' bits.
#define FW_DRAW_SPEC_WORDS 9
// The token of a nucleus whose cut falls past the candidates: the host draws it (`Gpu::draw`).
#define FW_DRAW_HOST 0xFFFFFFFFu
#define FW_DRAWN_WORDS (4 + 2 * FW_DRAW_TOP)
// A scored row's spec: row, 1/T's bits, token (`fw_score`).
#define FW_SCORE_SPEC_WORDS 3
// A normalized row's spec: row, 1/T's bits (`fw_normalize`).
#define FW_NORMALIZE_SPEC_WORDS 2

#ifdef __CUDA_ARCH__
#define FW_EXP(x) exp(x)
#define FW_LOG(x) log(x)
#else
#include <math.h>
#define FW_EXP(x) ::exp(x)
#define FW_LOG(x) ::log(x)
#endif

// Thread t's share of Σ exp(x - max) (f64): its values t, t + nt, ….
FW_HD double fw_draw_lse_part(const float* r, int vocab, int t, int nt, float mx) {
  double s = 0.0;
  for (int i = t; i < vocab; i += nt) s += FW_EXP((double)fw_sub(r[i], mx));
  return s;
}

// Σ of the threads' shares, in order.
FW_HD double fw_draw_sum(const double* part, int nt) {
  double s = 0.0;
  for (int j = 0; j < nt; j++) s += part[j];
  return s;
}

// The log-sum-exp as the reference rounds it: max + (f32) ln Σ.
FW_HD float fw_draw_lse(float mx, double sum) { return fw_add(mx, (float)FW_LOG(sum)); }

// Thread t's contiguous chunk [lo, hi) of the row.
FW_HD void fw_draw_chunk(int vocab, int nt, int t, int* lo, int* hi) {
  const int c = (vocab + nt - 1) / nt;
  const long a = (long)t * c, b = a + c;
  *lo = a < vocab ? (int)a : vocab;
  *hi = b < vocab ? (int)b : vocab;
}

// Σ exp(lp) over [lo, hi), in order (f64).
FW_HD double fw_draw_mass(const float* lp, int lo, int hi) {
  double s = 0.0;
  for (int i = lo; i < hi; i++) s += FW_EXP((double)lp[i]);
  return s;
}

// The chunks' sums turned into the running sum before each chunk, in order; returns the total.
FW_HD double fw_draw_scan(double* part, int nt) {
  double acc = 0.0;
  for (int j = 0; j < nt; j++) {
    const double m = part[j];
    part[j] = acc;
    acc += m;
  }
  return acc;
}

// The first index in [lo, hi) where the running sum from `before` passes `target`; -1 if none.
FW_HD int fw_draw_find(const float* lp, int lo, int hi, double before, double target) {
  double acc = before;
  for (int i = lo; i < hi; i++) {
    acc += FW_EXP((double)lp[i]);
    if (acc > target) return i;
  }
  return -1;
}

// a / b rounded once (IEEE), as the host divides.
FW_HD double fw_ddiv(double a, double b) {
#ifdef __CUDA_ARCH__
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}

// `reference::truncated_pick`: over n candidates' probabilities in order (p[j] = exp(lp[j]) in
// f64) and the `total` the shares are of, top-p's and min-p's prefix, then the first kept
// candidate whose running sum passes u·kept: its position, and the mass kept. `whole`: the
// candidates are every token the cut chooses among (a top-k's, or a row of at most n tokens);
// otherwise (a nucleus of a longer row: the n best of it) a cut that reaches past the n
// candidates is not known here, and where neither cut is known within them the pick is `at` -1.
struct FwPick {
  int at;
  double kept;
};
FW_HD FwPick fw_draw_pick(const double* p, int n, double total, float top_p, float min_p, double u,
                          bool whole) {
  int keep = n;
  bool known = whole;
  if (top_p < 1.0f) {
    double acc = 0.0;
    for (int j = 0; j < n; j++) {
      acc += fw_ddiv(p[j], total);
      if (acc >= (double)top_p) {
        keep = j + 1;
        known = true;
        break;
      }
    }
  }
  if (min_p > 0.0f) {
    const double floor = p[0] * (double)min_p;
    int c = 0;
    while (c < n && p[c] >= floor) c++;
    // Every candidate at or above the floor: tokens past them may be too (unless whole).
    if (c < n || whole) {
      if (c < 1) c = 1;
      if (c < keep) keep = c;
      known = true;
    }
  }
  if (!known) return FwPick{-1, 0.0};
  double m = 0.0;
  for (int j = 0; j < keep; j++) m += p[j];
  const double target = u * m;
  double acc = 0.0;
  for (int j = 0; j < keep; j++) {
    acc += p[j];
    if (acc > target) return FwPick{j, m};
  }
  return FwPick{keep - 1, m};
}

// A top-k's draw: the total is its candidates' sum, in order (`reference::truncated_pick`).
FW_HD FwPick fw_draw_truncated(const double* p, int n, float top_p, float min_p, double u) {
  double total = 0.0;
  for (int j = 0; j < n; j++) total += p[j];
  return fw_draw_pick(p, n, total, top_p, min_p, u, true);
}

// Rust's f32::total_cmp as an integer order: -NaN < -inf < … < -0 < +0 < … < +inf < +NaN.
FW_HD int32_t fw_total_key(float v) {
  int32_t b;
  memcpy(&b, &v, 4);
  return b ^ (int32_t)((uint32_t)(b >> 31) >> 1);
}

// Whether (key a, index i) comes before (key b, index j): larger first, then the lower index.
// j < 0: nothing yet, everything comes before it.
FW_HD bool fw_draw_before(int32_t a, int i, int32_t b, int j) {
  return j < 0 || a > b || (a == b && i < j);
}

// The argmax's order: a larger value (`>`: NaN never), then the lower index; j < 0: nothing yet.
FW_HD bool fw_argmax_before(float a, int i, float b, int j) {
  return (j < 0 && a == a) || (j >= 0 && (a > b || (a == b && i < j)));
}

// The kernel, in kernels.cu's build only (it takes that file's block reductions; the twin
// compiles the helpers above).
#if defined(__CUDA_ARCH__) && defined(FW_ROW_THREADS)
// The best (value, index) of the block by `before` (a strict total order on distinct indices:
// the answer is unique, whatever the order of reduction). Every thread gets it.
template <typename K, typename B>
__device__ void fw_draw_best(K* key, int* at, B before) {
  __shared__ K bk[FW_DRAW_THREADS / 32];
  __shared__ int bi[FW_DRAW_THREADS / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const K ok = __shfl_xor_sync(0xffffffffu, *key, o);
    const int oi = __shfl_xor_sync(0xffffffffu, *at, o);
    if (oi >= 0 && before(ok, oi, *key, *at)) {
      *key = ok;
      *at = oi;
    }
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();
  if (lane == 0) {
    bk[warp] = *key;
    bi[warp] = *at;
  }
  __syncthreads();
  for (int w = 0; w < FW_DRAW_THREADS / 32; w++)
    if (bi[w] >= 0 && before(bk[w], bi[w], *key, *at)) {
      *key = bk[w];
      *at = bi[w];
    }
}

// Steps 1 and 2 of a row: r scaled by `inv` (1/T) and left as its log-probs, by `fw_draw` and
// `fw_score` alike (so a scored token's log-prob is a drawn one's, bit for bit). `part`:
// FW_DRAW_THREADS doubles and `lse_s` a float of shared memory.
__device__ __forceinline__ void fw_draw_normalize(float* r, int vocab, float inv, double* part,
                                                  float* lse_s) {
  const int t = threadIdx.x, nt = FW_DRAW_THREADS;
  float mx = -INFINITY;
  for (int i = t; i < vocab; i += nt) {
    const float v = fw_mul(r[i], inv);
    r[i] = v;
    mx = fmaxf(mx, v);
  }
  mx = fw_block_max(mx);
  part[t] = fw_draw_lse_part(r, vocab, t, nt, mx);
  __syncthreads();
  if (t == 0) *lse_s = fw_draw_lse(mx, fw_draw_sum(part, nt));
  __syncthreads();
  const float lse = *lse_s;
  for (int i = t; i < vocab; i += nt) r[i] = fw_sub(r[i], lse);
  __syncthreads();
}

// Grid (scored rows), FW_DRAW_THREADS threads: the log-prob of a given token (the training
// forward's, `Gpu::score`). x: the step's logits, `vocab` a row; spec FW_SCORE_SPEC_WORDS words a
// scored row (row, 1/T's bits, token); out[b]: the log-prob's bits. The row is left as its
// log-probs.
extern "C" __global__ void __launch_bounds__(FW_DRAW_THREADS, 1)
    fw_score(float* __restrict__ x, int vocab, const uint32_t* __restrict__ spec,
             uint32_t* __restrict__ out) {
  __shared__ double part[FW_DRAW_THREADS];
  __shared__ float lse_s;
  const uint32_t* s = spec + (size_t)blockIdx.x * FW_SCORE_SPEC_WORDS;
  float* r = x + (size_t)s[0] * vocab;
  fw_draw_normalize(r, vocab, __uint_as_float(s[1]), part, &lse_s);
  if (threadIdx.x == 0) out[blockIdx.x] = __float_as_uint(r[s[2]]);
}

// Grid (rows), FW_DRAW_THREADS threads: the log-sum-exp a row's log-softmax at a temperature
// subtracts (`Gpu::normalize`), for the host to sample a row the draw does not cover with the
// draw's log-probs: log-prob i = fw_sub(fw_mul(logit i, 1/T), lse), each rounded once on the host
// too. x: the step's logits, `vocab` a row; spec FW_NORMALIZE_SPEC_WORDS words a row (row, 1/T's
// bits); out[b]: lse's bits. The row is left as its log-probs.
extern "C" __global__ void __launch_bounds__(FW_DRAW_THREADS, 1)
    fw_normalize(float* __restrict__ x, int vocab, const uint32_t* __restrict__ spec,
                 uint32_t* __restrict__ out) {
  __shared__ double part[FW_DRAW_THREADS];
  __shared__ float lse_s;
  const uint32_t* s = spec + (size_t)blockIdx.x * FW_NORMALIZE_SPEC_WORDS;
  fw_draw_normalize(x + (size_t)s[0] * vocab, vocab, __uint_as_float(s[1]), part, &lse_s);
  if (threadIdx.x == 0) out[blockIdx.x] = __float_as_uint(lse_s);
}

// Grid (drawn rows), FW_DRAW_THREADS threads (a block an SM is enough: one a row; with the
// default minimum, ptxas gave sm_80 32 registers and spills). x: the step's logits, `vocab` a
// row; spec and out: FW_DRAW_SPEC_WORDS and FW_DRAWN_WORDS words a drawn row. The row's logits
// are left as its log-probs.
extern "C" __global__ void __launch_bounds__(FW_DRAW_THREADS, 1)
    fw_draw(float* __restrict__ x, int vocab, const uint32_t* __restrict__ spec,
            uint32_t* __restrict__ out) {
  __shared__ double part[FW_DRAW_THREADS];
  __shared__ float lse_s;
  __shared__ double total_s;
  __shared__ int32_t prev_k;
  __shared__ int prev_i;
  __shared__ int cand_i[FW_DRAW_CAND];
  __shared__ float cand_v[FW_DRAW_CAND];
  __shared__ double cand_p[FW_DRAW_CAND];
  const uint32_t* s = spec + (size_t)blockIdx.x * FW_DRAW_SPEC_WORDS;
  uint32_t* o = out + (size_t)blockIdx.x * FW_DRAWN_WORDS;
  float* r = x + (size_t)s[0] * vocab;
  const float inv = __uint_as_float(s[1]);
  const double u = __hiloint2double((int)s[3], (int)s[2]);
  const bool greedy = s[4] != 0;
  const int k = min(min((int)s[5], FW_DRAW_TOP), vocab);
  const float top_p = __uint_as_float(s[7]), min_p = __uint_as_float(s[8]);
  // A nucleus: top-p or min-p with no top-k, drawn among the row's FW_DRAW_CAND best where its
  // cut falls among them (else left to the host: `Gpu::draw`).
  const bool nucleus = !greedy && s[6] == 0 && (top_p < 1.0f || min_p > 0.0f);
  // Candidates of a top-k draw or a nucleus (0: the whole distribution).
  const int nc = greedy ? 0 : min(min(nucleus ? FW_DRAW_CAND : (int)s[6], FW_DRAW_CAND), vocab);
  const int t = threadIdx.x, nt = FW_DRAW_THREADS;

  fw_draw_normalize(r, vocab, inv, part, &lse_s);

  // The argmax: the greedy token, and the draw's token where rounding leaves none.
  float bv = -INFINITY;
  int bi = -1;
  for (int i = t; i < vocab; i += nt)
    if (fw_argmax_before(r[i], i, bv, bi)) {
      bv = r[i];
      bi = i;
    }
  fw_draw_best(&bv, &bi, [](float a, int i, float b, int j) { return fw_argmax_before(a, i, b, j); });
  int token = bi < 0 ? 0 : bi;
  if (!greedy && (nc == 0 || nucleus)) {
    // Σ exp(lp) by chunks (a nucleus's shares are of it).
    int lo, hi;
    fw_draw_chunk(vocab, nt, t, &lo, &hi);
    part[t] = fw_draw_mass(r, lo, hi);
    __syncthreads();
    if (t == 0) total_s = fw_draw_scan(part, nt);
    __syncthreads();
  }
  if (!greedy && nc == 0) {
    int lo, hi;
    fw_draw_chunk(vocab, nt, t, &lo, &hi);
    const int f = fw_draw_find(r, lo, hi, part[t], u * total_s);
    // The first found: as an argmax of -index (no key: every found index is a candidate).
    int32_t key = 0;
    int at = f;
    fw_draw_best(&key, &at, [](int32_t, int i, int32_t, int j) { return j < 0 || i < j; });
    if (at < 0) {
      // The last token of positive probability (uniform across the block: `at` is everyone's).
      for (int i = t; i < vocab; i += nt)
        if (r[i] > -INFINITY) at = i;
      fw_draw_best(&key, &at, [](int32_t, int i, int32_t, int j) { return j < 0 || i > j; });
    }
    if (at >= 0) token = at;
  }
  // The k best after the one before, pass by pass (as many as the alternatives and the
  // candidates need).
  if (t == 0) prev_i = -1;
  for (int j = 0; j < max(k, nc); j++) {
    __syncthreads();
    const int32_t pk = prev_k;
    const int pi = prev_i;
    int32_t ck = 0;
    int ci = -1;
    for (int i = t; i < vocab; i += nt) {
      const int32_t key = fw_total_key(r[i]);
      if ((pi < 0 || fw_draw_before(pk, pi, key, i)) && fw_draw_before(key, i, ck, ci)) {
        ck = key;
        ci = i;
      }
    }
    fw_draw_best(&ck, &ci, [](int32_t a, int i, int32_t b, int j) { return fw_draw_before(a, i, b, j); });
    if (t == 0) {
      prev_k = ck;
      prev_i = ci;
      if (j < FW_DRAW_CAND) {
        cand_i[j] = ci;
        cand_v[j] = r[ci];
      }
      if (j < k) {
        o[4 + j] = (uint32_t)ci;
        o[4 + FW_DRAW_TOP + j] = __float_as_uint(r[ci]);
      }
    }
  }
  __syncthreads();
  if (t < nc) cand_p[t] = FW_EXP((double)cand_v[t]);
  __syncthreads();
  if (t == 0) {
    double kept = 1.0;
    if (nc > 0) {
      // A nucleus of a row of at most FW_DRAW_CAND tokens: its candidates are the whole row, in
      // the reference's order, and so is its total.
      const bool whole = !nucleus || nc == vocab;
      const FwPick p = whole ? fw_draw_truncated(cand_p, nc, top_p, min_p, u)
                             : fw_draw_pick(cand_p, nc, total_s, top_p, min_p, u, false);
      // Undecided (the cut past the candidates): FW_DRAW_HOST for the token.
      token = p.at < 0 ? -1 : cand_i[p.at];
      kept = p.kept;
    }
    o[0] = (uint32_t)token;
    o[1] = token < 0 ? 0u : __float_as_uint(r[token]);
    o[2] = (uint32_t)__double2loint(kept);
    o[3] = (uint32_t)__double2hiint(kept);
  }
}
#endif
