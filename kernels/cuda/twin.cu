// The host twin of common.cuh's helpers: the same source as the GPU's, compiled for the CPU, so
// that `kernels/tests/cuda_twin.rs` compares them with the CPU kernels on machines with no GPU.
//
//   fw_twin dequant TYPE ROWS COLS ROW_BYTES   stdin: the rows' bytes; stdout: ROWS·COLS f32, by
//                                              `fw_unit_fast`, checked equal to `fw_unit` with
//                                              the rows at every byte alignment (exit 3 if not)
//   fw_twin kv BLOCK_SIZE KV_DIM POSITIONS     stdin: the block table (u32); stdout: per position,
//                                              its V offset, then each dim's K index (u64 each)
//   fw_twin first_key POS WINDOW               stdout: the first position seen, in text
#include <stdio.h>
#include <stdlib.h>
#include <vector>

#include "common.cuh"
#include "units.cuh"

static std::vector<unsigned char> read_all() {
  std::vector<unsigned char> v;
  unsigned char buf[65536];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, stdin)) > 0) v.insert(v.end(), buf, buf + n);
  return v;
}

int main(int argc, char** argv) {
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
  fprintf(stderr, "usage: fw_twin dequant|kv|first_key ...\n");
  return 1;
}
