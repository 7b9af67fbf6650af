// The portable 4-bit kernels (w4_kernels.h): per-group tables of the 16 decoded values, plain loops. Every set's
// fallback for group sizes its vector loops do not take, and the reference the harness checks them against.
#include <algorithm>

#include "cpu/arch/w4_kernels.h"

namespace lowbit::cpu {
namespace {

inline int code_at(const uint8_t* row, int64_t k) { return (row[k >> 1] >> ((k & 1) * 4)) & 0xF; }

// Calls fn(k, value) for codes k in [k0, k1) of row n, each decoded by its group's table.
template <typename F>
void for_each_decoded(const W4Operand& op, int64_t n, int64_t k0, int64_t k1, F&& fn) {
  const float* byte_table = w4_byte_scale_table(op.scale_enc);
  const uint8_t* row = op.codes + n * op.row_bytes();
  for (int64_t k = k0; k < k1;) {
    const int64_t g = k / op.group, end = std::min(k1, (g + 1) * op.group);
    const W4Group p = w4_group(op, byte_table, n, g);
    float table[16];
    for (int c = 0; c < 16; c++) table[c] = w4_decode_value(op.values[c], p);
    for (; k < end; k++) fn(k, table[code_at(row, k)]);
  }
}

void gemv_tile(int mr, int nr, const float* x, int64_t ldx, const W4Operand& op, int64_t n0, float* sums) {
  constexpr int kLanes = 8;  // independent partial sums
  for (int r = 0; r < nr; r++) {
    float acc[4][kLanes] = {};
    for_each_decoded(op, n0 + r, 0, op.K, [&](int64_t k, float w) {
      const int64_t p = w4_packed_pos(k);
      for (int m = 0; m < mr; m++) acc[m][k % kLanes] += x[m * ldx + p] * w;
    });
    for (int m = 0; m < mr; m++) {
      float s = 0.f;
      for (int l = 0; l < kLanes; l++) s += acc[m][l];
      sums[m * nr + r] = s;
    }
  }
}

void decode_rows(const W4Operand& op, int64_t n0, int64_t nrows, int64_t k0, int64_t n, float* dst, int64_t ldd) {
  const int64_t k1 = std::min(op.K, k0 + n);
  for (int64_t r = 0; r < nrows; r++) {
    float* d = dst + r * ldd;
    std::fill(d, d + w4_padded(n), 0.f);
    for_each_decoded(op, n0 + r, k0, k1, [&](int64_t k, float w) { d[w4_packed_pos(k - k0)] = w; });
  }
}

void dequantize_rows(const W4Operand& op, int64_t n0, int64_t nrows, float* dst, int64_t ldd) {
  for (int64_t r = 0; r < nrows; r++)
    for_each_decoded(op, n0 + r, 0, op.K, [&](int64_t k, float w) { dst[r * ldd + k] = w; });
}

void decode_rows_bf16(const W4Operand& op, int64_t n0, int64_t nrows, int64_t k0, int64_t n, int terms, uint16_t* dst,
                      int64_t ldd, int64_t term_stride) {
  const int64_t k1 = std::min(op.K, k0 + n), padded = (n + kW4Bf16Chunk - 1) / kW4Bf16Chunk * kW4Bf16Chunk;
  for (int64_t r = 0; r < nrows; r++) {
    for (int t = 0; t < terms; t++) std::fill(dst + t * term_stride + r * ldd, dst + t * term_stride + r * ldd + padded, 0);
    for_each_decoded(op, n0 + r, k0, k1, [&](int64_t k, float decoded) {
      const float w = decoded * op.global;
      const uint16_t hi = w4_bf16_round(w);
      dst[r * ldd + k - k0] = hi;
      if (terms > 1) dst[term_stride + r * ldd + k - k0] = w4_bf16_remainder(w, hi);
    });
  }
}

}  // namespace

const W4Kernels kW4KernelsPortable{&gemv_tile, &decode_rows, &dequantize_rows, nullptr, nullptr, &decode_rows_bf16};

}  // namespace lowbit::cpu
