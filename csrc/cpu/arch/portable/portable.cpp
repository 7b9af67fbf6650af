// The portable kernel set: plain loops that compilers vectorize for the baseline of any CPU. Correct everywhere;
// the reference the other sets are tested against (tests/cpu_harness), and the tails of their vector loops.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpu/arch/float16_bits.h"
#include "cpu/arch/kernel_set.h"
#include "cpu/fp8.h"
#include "cpu/fp8_simd.h"

namespace lowbit::cpu {
namespace {
namespace fp8 {

constexpr int kLanes = 8;  // independent partial sums per dot product, so the compiler can vectorize

void decode_range(const uint8_t* code, int64_t n, float* dst) {
  const int64_t full = n / kChunk * kChunk;
  for (int64_t k = 0; k < full; k += kChunk) decode_chunk_portable(code + k, dst + k);
  if (full < n) {
    uint8_t tmp[kChunk] = {};
    std::memcpy(tmp, code + full, size_t(n - full));
    decode_chunk_portable(tmp, dst + full);
  }
}

void gemv_tile(int mr, int nr, const float* x, int64_t ldx, const uint8_t* w, int64_t K, const float* const* bscale,
               const KSegments& seg, float* sums, bool* /*nan: NaN codes decode to NaN here*/) {
  float wdec[kChunk];
  for (int r = 0; r < nr; r++) {
    float tot[kMaxTileRows] = {};
    for (int64_t s = 0; s < seg.count; s++) {
      const int64_t k0 = seg.begin(s), n = seg.size(s);
      float acc[kMaxTileRows][kLanes] = {};
      for (int64_t k = 0; k < n; k += kChunk) {
        decode_range(w + r * K + k0 + k, std::min<int64_t>(kChunk, n - k), wdec);
        for (int m = 0; m < mr; m++) {
          const float* xp = x + m * ldx + s * seg.padded + k;
          for (int p = 0; p < kChunk; p++) acc[m][p % kLanes] += xp[p] * wdec[p];
        }
      }
      for (int m = 0; m < mr; m++) {
        float part = 0.f;
        for (int l = 0; l < kLanes; l++) part += acc[m][l];
        tot[m] += bscale ? bscale[r][s] * part : part;
      }
    }
    for (int m = 0; m < mr; m++) sums[m * nr + r] = tot[m];
  }
}

void decode_rows(const uint8_t* w, int64_t K, int64_t nrows, int64_t k0, int64_t n, float* dst, int64_t ldd,
                 bool* /*nan*/) {
  for (int64_t r = 0; r < nrows; r++) decode_range(w + r * K + k0, n, dst + r * ldd);
}

template <typename T, typename Round>
void dequantize_as(const uint8_t* code, int64_t n, float scale, T* out, Round round) {
  for (int64_t k = 0; k < n; k++) out[k] = round(fp8_e4m3_to_float(code[k]) * scale);
}

}  // namespace fp8

namespace int8 {

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

}  // namespace int8

// acc[m * lda + p] += c[m] * v[p] (the transposed products' row walk)
void axpy_rows(int64_t mr, const float* c, const float* v, int64_t n, float* acc, int64_t lda) {
  for (int64_t m = 0; m < mr; m++) {
    const float cm = c[m];
    float* a = acc + m * lda;
    for (int64_t p = 0; p < n; p++) a[p] += cm * v[p];
  }
}

uint64_t xor_words(const uint64_t* p, int64_t n) {
  uint64_t acc = 0;
  for (int64_t i = 0; i < n; i++) acc ^= p[i];
  return acc;
}

}  // namespace

void dequantize_run_portable(const uint8_t* code, int64_t n, float scale, void* out, DequantOut kind) {
  switch (kind) {
    case DequantOut::F32:
      return fp8::dequantize_as(code, n, scale, static_cast<float*>(out), [](float v) { return v; });
    case DequantOut::BF16: return fp8::dequantize_as(code, n, scale, static_cast<uint16_t*>(out), &float_to_bf16_bits);
    case DequantOut::F16: return fp8::dequantize_as(code, n, scale, static_cast<uint16_t*>(out), &float_to_half_bits);
  }
}

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

const KernelSet& kernel_set_portable() {
  static const KernelSet s{
      "portable",
      0,
      Fp8Kernels{&fp8::gemv_tile, nullptr, &fp8::decode_rows, nullptr, &dequantize_run_portable},
      Int8Kernels{&int8::gemv_tile, 2, int8::kPanelRows, int8::kStrip, &int8::gemm_micro, &quantize_row_portable},
      kW4KernelsPortable,
      &axpy_rows,
      &xor_words,
      false,
      nullptr,
  };
  return s;
}

}  // namespace lowbit::cpu
