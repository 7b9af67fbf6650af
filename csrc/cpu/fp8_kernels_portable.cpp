// Portable inner loops of the fp8 products (see fp8_kernels.h): table decode and plain loops that compilers
// vectorize for the baseline of any CPU. Correct everywhere, including aarch64; the AVX2 path is the fast one.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstring>

#include "cpu/fp8_kernels.h"
#include "cpu/fp8.h"
#include "cpu/fp8_simd.h"

namespace lowbit::cpu {
namespace {

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

template <typename T>
void dequantize_as(const uint8_t* code, int64_t n, float scale, T* out) {
  for (int64_t k = 0; k < n; k++) out[k] = T(fp8_e4m3_to_float(code[k]) * scale);
}

}  // namespace

void dequantize_run_portable(const uint8_t* code, int64_t n, float scale, void* out, DequantOut kind) {
  switch (kind) {
    case DequantOut::F32: return dequantize_as(code, n, scale, static_cast<float*>(out));
    case DequantOut::BF16: return dequantize_as(code, n, scale, static_cast<c10::BFloat16*>(out));
    case DequantOut::F16: return dequantize_as(code, n, scale, static_cast<c10::Half*>(out));
  }
}

const Fp8Kernels& fp8_kernels_portable() {
  static const Fp8Kernels k{&gemv_tile, nullptr, &decode_rows, nullptr, &dequantize_run_portable};
  return k;
}

}  // namespace lowbit::cpu
