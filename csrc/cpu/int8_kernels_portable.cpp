// Portable inner loops of int8_mm (see int8_kernels.h): plain int32 loops, correct on any CPU.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpu/int8_kernels.h"

namespace lowbit::cpu {
namespace {

void gemv_tile(int mr, int nr, const int8_t* x, const int8_t* w, int64_t K, int32_t* acc) {
  for (int m = 0; m < mr; m++)
    for (int r = 0; r < nr; r++) {
      const int8_t* xr = x + m * K;
      const int8_t* wr = w + r * K;
      int32_t s = 0;
      for (int64_t k = 0; k < K; k++) s += int32_t(xr[k]) * int32_t(wr[k]);
      acc[m * nr + r] = s;
    }
}

constexpr int kPanelRows = 4;
constexpr int kStrip = 16;

void gemm_micro(const void* panel_, int64_t ldp, const void* xs_, int64_t len, int32_t* tile, bool accumulate) {
  const auto* panel = static_cast<const int16_t*>(panel_);
  const auto* xs = static_cast<const int16_t*>(xs_);
  int32_t c[kPanelRows][kStrip];
  for (int r = 0; r < kPanelRows; r++)
    for (int j = 0; j < kStrip; j++) c[r][j] = accumulate ? tile[r * kStrip + j] : 0;
  for (int r = 0; r < kPanelRows; r++) {
    const int16_t* row = panel + r * ldp;
    for (int64_t k = 0; k < len; k += 2) {
      const int32_t a0 = row[k], a1 = row[k + 1];
      const int16_t* xp = xs + k * kStrip;
      for (int j = 0; j < kStrip; j++) c[r][j] += a0 * xp[2 * j] + a1 * xp[2 * j + 1];
    }
  }
  std::memcpy(tile, c, sizeof(c));
}

}  // namespace

void quantize_with_scale(const float* x, int64_t K, float scale, int8_t* q) {
  for (int64_t k = 0; k < K; k++) {
    // fp32 division then round-half-even (the default rounding mode); a zero row stays zero
    const float r = scale > 0.f ? std::nearbyint(x[k] / scale) : 0.f;
    q[k] = int8_t(std::min(127.f, std::max(-127.f, r)));
  }
}

uint32_t absmax_bits(const float* x, int64_t K, uint32_t amax_bits) {
  for (int64_t k = 0; k < K; k++) amax_bits = std::max(amax_bits, abs_bits(x[k]));
  return amax_bits;
}

float row_scale(uint32_t amax_bits) {
  if (amax_bits >= kFloatInfBits) return kNonFiniteRowScale;
  float amax;
  std::memcpy(&amax, &amax_bits, sizeof(amax));
  return amax / 127.f;
}

float quantize_row_portable(const float* x, int64_t K, int8_t* q) {
  const float scale = row_scale(absmax_bits(x, K, 0));
  quantize_with_scale(x, K, scale, q);
  return scale;
}

const Int8Kernels& int8_kernels_portable() {
  static const Int8Kernels k{&gemv_tile, 2, kPanelRows, kStrip, &gemm_micro, &quantize_row_portable};
  return k;
}

}  // namespace lowbit::cpu
