// The host twin of common.cuh's helpers: the same source as the GPU's, compiled for the CPU, so
// that `kernels/tests/cuda_twin.rs` compares them with the CPU kernels on machines with no GPU.
//
//   fw_twin dequant TYPE ROWS COLS ROW_BYTES   stdin: the rows' bytes; stdout: ROWS·COLS f32, by
//                                              `fw_unit_fast`, checked equal to `fw_unit` with
//                                              the rows at every byte alignment (exit 3 if not)
//   fw_twin kv BLOCK_SIZE KV_DIM POSITIONS     stdin: the block table (u32); stdout: per position,
//                                              its V offset, then each dim's K index (u64 each)
//   fw_twin first_key POS WINDOW               stdout: the first position seen, in text
//   fw_twin int8 TYPE ROWS COLS ROW_BYTES N    stdin: the rows' bytes, then N·COLS f32; stdout:
//                                              N·ROWS f32, the int8 product by int8.cuh's
//                                              quantizer, threads' shares (a token at a time)
//                                              and tree, checked equal to the shares taken 8
//                                              tokens at a time, as the batch kernel does (exit
//                                              3 if not)
//   fw_twin draw VOCAB K M TOPK TOPP MINP      stdin: 1/T (f32), VOCAB f32 logits, M uniforms
//                                              (f64; < 0: greedy); stdout: the row's log-probs
//                                              (f32), then per uniform the token (u32; a nucleus
//                                              left to the host: FW_DRAW_HOST), the mass kept
//                                              (f64) and the K best (u32 each), by draw.cuh's
//                                              helpers in fw_draw's order (TOPK 0 with TOPP < 1
//                                              or MINP > 0: a nucleus)
//   fw_twin attention BS HEADS KV_HEADS HEAD_DIM WINDOW SOFTCAP N TABLE BLOCKS SCALE
//                                              stdin: the block tables (TABLE u32), per token
//                                              where its table starts and its position (i32
//                                              each), q (N·HEADS·HEAD_DIM f32), the K and V
//                                              caches (f32, BLOCKS·BS·KV_HEADS·HEAD_DIM each);
//                                              stdout: the chunks kernel's output by
//                                              attention.cuh's helpers, its lanes walked one
//                                              after another
#include <stdio.h>
#include <stdlib.h>
#include <vector>

#include "common.cuh"
#include "units.cuh"
#include "int8.cuh"
#include "draw.cuh"
#include "attention.cuh"

static std::vector<unsigned char> read_all() {
  std::vector<unsigned char> v;
  unsigned char buf[65536];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, stdin)) > 0) v.insert(v.end(), buf, buf + n);
  return v;
}

// The lanes layout's (row, tokens) values (kernels.cu's fw_matmul_i8_lanes_body), its 16 threads
// one after another: each lane's share chunk by chunk (the row's bytes from the chunk's first
// block on, as its stage holds them), the min added, then the shuffles' sums (lane L adds lane
// L + k's value, its own past the 16th, for k = 8, 4, 2, 1).
template <int TY, int NT>
static void int8_lanes(const unsigned char* row, int nb, const int8_t* xq, const float* xd,
                       const int* xs, int xb, int nt, float* out) {
  float a[16][NT] = {}, m[16][NT] = {};
  for (int b0 = 0; b0 < nb; b0 += FW_I8_CHUNK)
    for (int L = 0; L < 16; L++)
      fw_i8_lane<TY, NT>(row + fw_i8_offset<TY>(b0), b0, nb, L, xq, xd, xs, xb, nt, a[L], m[L]);
  for (int t = 0; t < nt; t++) {
    float v[16];
    for (int L = 0; L < 16; L++) v[L] = fw_i8_has_min(TY) ? fw_add(a[L][t], m[L][t]) : a[L][t];
    for (int k = 8; k >= 1; k /= 2)
      for (int L = 0; L < 16; L++) v[L] = fw_add(v[L], v[L + k < 16 ? L + k : L]);
    out[t] = v[0];
  }
}

// y (n, rows) by the GPU's int8 arithmetic; false if a token's value differs between NT = 1 and
// NT = 8 or between the quads and lanes layouts.
template <int TY>
static bool int8_product(const unsigned char* w, int rows, int cols, long row_bytes, const float* x,
                         int n, float* y) {
  const int xb = fw_q8_blocks(cols), nb = cols / 32;
  // The device's layout: codes 16-byte aligned, a pair's missing block zeros.
  std::vector<int8_t> xq((size_t)n * xb * 32 + 16, 0);
  std::vector<float> xd((size_t)n * xb, 0.0f);
  std::vector<int> xs((size_t)n * xb, 0);
  for (int t = 0; t < n; t++)
    for (int b = 0; b < nb; b++) {
      const size_t k = (size_t)t * xb + b;
      xd[k] = fw_q8_block(x + (size_t)t * cols + 32 * b, &xq[k * 32], &xs[k]);
    }
  for (int r = 0; r < rows; r++) {
    const unsigned char* row = w + (size_t)r * row_bytes;
    for (int t0 = 0; t0 < n; t0 += 8) {
      const int nt = n - t0 < 8 ? n - t0 : 8;
      const size_t x0 = (size_t)t0 * xb;
      float tile[4][8][4];
      for (int k = 0; k < 4; k++)
        fw_i8_thread<TY, 8>(row, nb, k & 1, k >> 1, &xq[x0 * 32], &xd[x0], &xs[x0], xb, nt, tile[k]);
      float lane8[8];
      int8_lanes<TY, 8>(row, nb, &xq[x0 * 32], &xd[x0], &xs[x0], xb, nt, lane8);
      for (int t = 0; t < nt; t++) {
        const size_t xt = (size_t)(t0 + t) * xb;
        float s[4][4], sb[4][4];
        for (int k = 0; k < 4; k++) {
          float one[1][4];
          fw_i8_thread<TY, 1>(row, nb, k & 1, k >> 1, &xq[xt * 32], &xd[xt], &xs[xt], xb, 1, one);
          memcpy(s[k], one[0], sizeof s[k]);
          memcpy(sb[k], tile[k][t], sizeof sb[k]);
        }
        const float one = fw_i8_tree(s), batch = fw_i8_tree(sb);
        float lane1;
        int8_lanes<TY, 1>(row, nb, &xq[xt * 32], &xd[xt], &xs[xt], xb, 1, &lane1);
        for (float other : {batch, lane1, lane8[t]}) {
          if (memcmp(&one, &other, 4) != 0 && !(one != one && other != other)) {
            fprintf(stderr, "type %d row %d token %d: alone %g; in a batch %g; lanes alone %g, in a batch %g\n",
                    TY, r, t0 + t, one, batch, lane1, lane8[t]);
            return false;
          }
        }
        y[(size_t)(t0 + t) * rows + r] = one;
      }
    }
  }
  return true;
}

// fw_draw's steps, its threads one after another.
static void draw(std::vector<float>& r, float inv, const std::vector<double>& us, int k, int tk,
                 float top_p, float min_p, std::vector<uint32_t>& out) {
  const int vocab = (int)r.size(), nt = FW_DRAW_THREADS;
  float mx = -INFINITY;
  for (float& v : r) {
    v = fw_mul(v, inv);
    mx = fmaxf(mx, v);
  }
  std::vector<double> part(nt);
  for (int t = 0; t < nt; t++) part[t] = fw_draw_lse_part(r.data(), vocab, t, nt, mx);
  const float lse = fw_draw_lse(mx, fw_draw_sum(part.data(), nt));
  for (float& v : r) v = fw_sub(v, lse);
  float bv = -INFINITY;
  int bi = -1;
  for (int i = 0; i < vocab; i++)
    if (fw_argmax_before(r[i], i, bv, bi)) {
      bv = r[i];
      bi = i;
    }
  std::vector<uint32_t> cand_ids;
  std::vector<float> cand;
  // A nucleus (no top-k, a top-p or min-p) takes the FW_DRAW_CAND best as candidates.
  const bool nucleus = tk == 0 && (top_p < 1.0f || min_p > 0.0f);
  const int ck = nucleus ? FW_DRAW_CAND : tk;
  const int nc = ck < FW_DRAW_CAND ? (ck < vocab ? ck : vocab) : (FW_DRAW_CAND < vocab ? FW_DRAW_CAND : vocab);
  int32_t pk = 0;
  int pi = -1;
  for (int j = 0; j < (k > nc ? k : nc) && j < vocab; j++) {
    int32_t ck = 0;
    int ci = -1;
    for (int i = 0; i < vocab; i++) {
      const int32_t key = fw_total_key(r[i]);
      if ((pi < 0 || fw_draw_before(pk, pi, key, i)) && fw_draw_before(key, i, ck, ci)) {
        ck = key;
        ci = i;
      }
    }
    cand_ids.push_back((uint32_t)ci);
    cand.push_back(r[ci]);
    pk = ci < 0 ? pk : ck;
    pi = ci;
  }
  const std::vector<uint32_t> top(cand_ids.begin(), cand_ids.begin() + (k < vocab ? k : vocab));
  for (double u : us) {
    int token = bi < 0 ? 0 : bi;
    double kept = 1.0;
    if (u >= 0.0 && nc > 0) token = -1;  // drawn among the candidates below
    if (u >= 0.0 && nc == 0) {
      for (int t = 0; t < nt; t++) {
        int lo, hi;
        fw_draw_chunk(vocab, nt, t, &lo, &hi);
        part[t] = fw_draw_mass(r.data(), lo, hi);
      }
      const double total = fw_draw_scan(part.data(), nt);
      int found = -1;
      for (int t = 0; t < nt && found < 0; t++) {
        int lo, hi;
        fw_draw_chunk(vocab, nt, t, &lo, &hi);
        found = fw_draw_find(r.data(), lo, hi, part[t], u * total);
      }
      for (int i = vocab - 1; i >= 0 && found < 0; i--)
        if (r[i] > -INFINITY) found = i;
      if (found >= 0) token = found;
    }
    if (token < 0) {
      std::vector<double> probs(nc);
      for (int j = 0; j < nc; j++) probs[j] = FW_EXP((double)cand[j]);
      FwPick p;
      if (nucleus && nc < vocab) {
        // The row's Σ exp(lp) by the kernel's chunks.
        for (int t = 0; t < nt; t++) {
          int lo, hi;
          fw_draw_chunk(vocab, nt, t, &lo, &hi);
          part[t] = fw_draw_mass(r.data(), lo, hi);
        }
        const double total = fw_draw_scan(part.data(), nt);
        p = fw_draw_pick(probs.data(), nc, total, top_p, min_p, u, false);
      } else {
        p = fw_draw_truncated(probs.data(), nc, top_p, min_p, u);
      }
      token = p.at < 0 ? (int)FW_DRAW_HOST : (int)cand_ids[p.at];
      kept = p.kept;
    }
    out.push_back((uint32_t)token);
    uint64_t kb;
    memcpy(&kb, &kept, 8);
    out.push_back((uint32_t)kb);
    out.push_back((uint32_t)(kb >> 32));
    out.insert(out.end(), top.begin(), top.end());
  }
}

// The device's butterflies over a warp's 32 values (fw_warp_sum, fw_warp_max): lane l adds (or
// takes the max of) lane l ^ o's value, o = 16, 8, 4, 2, 1; every lane ends with lane 0's.
static float warp_reduce(const float* v, bool max) {
  float a[32], b[32];
  memcpy(a, v, sizeof a);
  for (int o = 16; o > 0; o >>= 1) {
    for (int l = 0; l < 32; l++) b[l] = max ? fmaxf(a[l], a[l ^ o]) : a[l] + a[l ^ o];
    memcpy(a, b, sizeof a);
  }
  return a[0];
}

// fw_att_chunk's steps, its lanes one after another: the partial (m, l, acc[head_dim]) over
// positions c0 .. c1 - 1.
static void att_chunk(const float* qs, const uint32_t* bt, const float* kc, const float* vc, int c0,
                      int c1, int kv_col, int hd, int bs, int kv_dim, float softcap, float* m_out,
                      float* l_out, float* acc) {
  float m = -INFINITY, l = 0.0f;
  for (int d = 0; d < hd; d++) acc[d] = 0.0f;
  for (int p0 = c0; p0 < c1; p0 += FW_ATT_TILE) {
    float sc[32], pr[32];
    for (int i = 0; i < 32; i++)
      sc[i] = p0 + i < c1 ? fw_att_score(qs, kc, bt, p0 + i, kv_col, hd, bs, kv_dim, softcap) : -INFINITY;
    const float m_new = fmaxf(m, warp_reduce(sc, true));
    for (int i = 0; i < 32; i++) pr[i] = p0 + i < c1 ? FW_EXPF(sc[i] - m_new) : 0.0f;
    const float keep = fw_att_keep(m, m_new);
    l = fmaf(l, keep, warp_reduce(pr, false));
    for (int d = 0; d < hd; d++) acc[d] = fw_mul(acc[d], keep);
    const int last = c1 - p0 < FW_ATT_TILE ? c1 - p0 : FW_ATT_TILE;
    for (int i = 0; i < last; i++) {
      const int p = p0 + i;
      const float* vr = vc + ((size_t)bt[p / bs] * bs + p % bs) * kv_dim + kv_col;
      for (int d = 0; d < hd; d++) acc[d] = fmaf(pr[i], fw_load(vr + d), acc[d]);
    }
    m = m_new;
  }
  *m_out = m;
  *l_out = l;
}

// fw_attention_chunks_body for one (token, head): the chunks' partials, merged in order.
static void att_query(const float* qh, float scale, const uint32_t* bt, int pos, int window,
                      const float* kc, const float* vc, int kv_col, int hd, int bs, int kv_dim,
                      float softcap, float* out) {
  float qs[FW_ATT_MAX_DIM];
  for (int d = 0; d < hd; d++) qs[d] = qh[d] * scale;
  const int lo = fw_first_key(pos, window);
  int len, count;
  fw_att_chunks(pos - lo + 1, &len, &count);
  float M = 0.0f, L = 0.0f;
  std::vector<float> A(hd), part(hd + 2);
  for (int s = 0; s < count; s++) {
    const int c0 = lo + s * len, c1 = c0 + len < pos + 1 ? c0 + len : pos + 1;
    float* ps = part.data();
    att_chunk(qs, bt, kc, vc, c0, c1, kv_col, hd, bs, kv_dim, softcap, ps, ps + 1, ps + 2);
    if (s == 0) {
      M = ps[0];
      L = ps[1];
      for (int d = 0; d < hd; d++) A[d] = ps[2 + d];
    } else {
      float ca, cb;
      fw_att_merge(&M, &L, ps[0], ps[1], &ca, &cb);
      for (int d = 0; d < hd; d++) A[d] = fw_att_mix(A[d], ca, ps[2 + d], cb);
    }
  }
  for (int d = 0; d < hd; d++) out[d] = A[d] / L;
}

int main(int argc, char** argv) {
  if (argc >= 12 && !strcmp(argv[1], "attention")) {
    const int bs = atoi(argv[2]), heads = atoi(argv[3]), kv_heads = atoi(argv[4]), hd = atoi(argv[5]);
    const int window = atoi(argv[6]), n = atoi(argv[8]), n_table = atoi(argv[9]), blocks = atoi(argv[10]);
    const float softcap = (float)atof(argv[7]), scale = (float)atof(argv[11]);
    const int kv_dim = kv_heads * hd;
    const size_t cache = (size_t)blocks * bs * kv_dim, nq = (size_t)n * heads * hd;
    std::vector<unsigned char> in = read_all();
    if (hd < 1 || hd > FW_ATT_MAX_DIM || heads % kv_heads ||
        in.size() != (size_t)n_table * 4 + (size_t)n * 8 + nq * 4 + cache * 8)
      return 2;
    const unsigned char* at = in.data();
    std::vector<uint32_t> table(n_table);
    std::vector<int32_t> table_at(n), pos(n);
    std::vector<float> q(nq), kc(cache), vc(cache), out(nq);
    memcpy(table.data(), at, table.size() * 4), at += table.size() * 4;
    memcpy(table_at.data(), at, (size_t)n * 4), at += (size_t)n * 4;
    memcpy(pos.data(), at, (size_t)n * 4), at += (size_t)n * 4;
    memcpy(q.data(), at, nq * 4), at += nq * 4;
    memcpy(kc.data(), at, cache * 4), at += cache * 4;
    memcpy(vc.data(), at, cache * 4);
    for (int t = 0; t < n; t++)
      for (int h = 0; h < heads; h++) {
        const size_t o = ((size_t)t * heads + h) * hd;
        att_query(&q[o], scale, &table[table_at[t]], pos[t], window, kc.data(), vc.data(),
                  (h / (heads / kv_heads)) * hd, hd, bs, kv_dim, softcap, &out[o]);
      }
    fwrite(out.data(), 4, nq, stdout);
    return 0;
  }
  if (argc >= 8 && !strcmp(argv[1], "draw")) {
    const int vocab = atoi(argv[2]), k = atoi(argv[3]), m = atoi(argv[4]), tk = atoi(argv[5]);
    const float top_p = (float)atof(argv[6]), min_p = (float)atof(argv[7]);
    std::vector<unsigned char> in = read_all();
    if (vocab < 1 || in.size() != 4 + (size_t)vocab * 4 + (size_t)m * 8) return 2;
    float inv;
    memcpy(&inv, in.data(), 4);
    std::vector<float> r(vocab);
    memcpy(r.data(), in.data() + 4, (size_t)vocab * 4);
    std::vector<double> us(m);
    memcpy(us.data(), in.data() + 4 + (size_t)vocab * 4, (size_t)m * 8);
    std::vector<uint32_t> out;
    draw(r, inv, us, k, tk, top_p, min_p, out);
    fwrite(r.data(), 4, r.size(), stdout);
    fwrite(out.data(), 4, out.size(), stdout);
    return 0;
  }
  if (argc >= 7 && !strcmp(argv[1], "int8")) {
    const int ty = atoi(argv[2]), rows = atoi(argv[3]), cols = atoi(argv[4]), n = atoi(argv[6]);
    const long row_bytes = atol(argv[5]);
    std::vector<unsigned char> in = read_all();
    const size_t wb = (size_t)rows * row_bytes;
    if (in.size() != wb + (size_t)n * cols * 4 || cols % 32) return 2;
    std::vector<unsigned char> w(in.begin(), in.begin() + wb);
    w.resize(wb + 16);  // fw_words reads up to a word past a unit, as the device's padding allows
    std::vector<float> x((size_t)n * cols), y((size_t)n * rows);
    memcpy(x.data(), in.data() + wb, x.size() * 4);
    bool ok;
    switch (ty) {
      case FW_Q4_0: ok = int8_product<FW_Q4_0>(w.data(), rows, cols, row_bytes, x.data(), n, y.data()); break;
      case FW_Q4_1: ok = int8_product<FW_Q4_1>(w.data(), rows, cols, row_bytes, x.data(), n, y.data()); break;
      case FW_Q8_0: ok = int8_product<FW_Q8_0>(w.data(), rows, cols, row_bytes, x.data(), n, y.data()); break;
      case FW_Q4K: ok = int8_product<FW_Q4K>(w.data(), rows, cols, row_bytes, x.data(), n, y.data()); break;
      case FW_Q6K: ok = int8_product<FW_Q6K>(w.data(), rows, cols, row_bytes, x.data(), n, y.data()); break;
      case FW_Q3K: ok = int8_product<FW_Q3K>(w.data(), rows, cols, row_bytes, x.data(), n, y.data()); break;
      case FW_Q5K: ok = int8_product<FW_Q5K>(w.data(), rows, cols, row_bytes, x.data(), n, y.data()); break;
      case FW_IQ4NL: ok = int8_product<FW_IQ4NL>(w.data(), rows, cols, row_bytes, x.data(), n, y.data()); break;
      case FW_IQ4XS: ok = int8_product<FW_IQ4XS>(w.data(), rows, cols, row_bytes, x.data(), n, y.data()); break;
      default: return 2;
    }
    if (!ok) return 3;
    fwrite(y.data(), 4, y.size(), stdout);
    return 0;
  }
  if (argc >= 6 && !strcmp(argv[1], "dequant")) {
    const int ty = atoi(argv[2]), rows = atoi(argv[3]), cols = atoi(argv[4]);
    const long row_bytes = atol(argv[5]);
    std::vector<unsigned char> in = read_all();
    if ((long)in.size() != rows * row_bytes || cols % 32) return 2;
    std::vector<float> out((size_t)rows * cols);
    std::vector<unsigned char> shifted(in.size() + 16);
    for (int shift = 0; shift < 4; shift++) {
      memcpy(shifted.data() + shift, in.data(), in.size());
      for (int r = 0; r < rows; r++)
        for (int u = 0; u < cols / 32; u++) {
          const unsigned char* row = shifted.data() + shift + (size_t)r * row_bytes;
          float slow[32];
          float* fast = out.data() + (size_t)r * cols + 32 * u;
          fw_unit_any(ty, row, u, slow);
          fw_unit_fast_any(ty, row, u, fast);
          for (int j = 0; j < 32; j++) {
            uint32_t a, b;
            memcpy(&a, &slow[j], 4);
            memcpy(&b, &fast[j], 4);
            const bool nan = slow[j] != slow[j];
            if (a != b && !(nan && fast[j] != fast[j])) {
              fprintf(stderr, "type %d row %d unit %d value %d shift %d: fw_unit %g, fw_unit_fast %g\n",
                      ty, r, u, j, shift, slow[j], fast[j]);
              return 3;
            }
          }
        }
    }
    fwrite(out.data(), 4, out.size(), stdout);
    return 0;
  }
  if (argc >= 5 && !strcmp(argv[1], "kv")) {
    const int bs = atoi(argv[2]), kv_dim = atoi(argv[3]), positions = atoi(argv[4]);
    std::vector<unsigned char> in = read_all();
    std::vector<uint32_t> table(in.size() / 4);
    memcpy(table.data(), in.data(), table.size() * 4);
    if ((long)table.size() * bs < positions) return 2;
    std::vector<uint64_t> out;
    for (int p = 0; p < positions; p++) {
      out.push_back(fw_v_offset(table.data(), p, bs, kv_dim));
      for (int c = 0; c < kv_dim; c++) out.push_back(fw_k_index(table.data(), p, c, bs, kv_dim));
    }
    fwrite(out.data(), 8, out.size(), stdout);
    return 0;
  }
  if (argc >= 4 && !strcmp(argv[1], "first_key")) {
    printf("%d\n", fw_first_key(atoi(argv[2]), atoi(argv[3])));
    return 0;
  }
  fprintf(stderr, "usage: fw_twin dequant|kv|first_key|int8|draw|attention ...\n");
  return 1;
}
