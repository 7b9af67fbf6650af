// The AVX-VNNI kernel set: the AVX2 set with the int8 GEMM micro-tile on byte dot products (vpdpbusd on 256 bits).
// The int8 GEMV tiles stay on vpmaddwd: at few rows int8_mm is bound by reading the weights, not by multiplies.
#include <immintrin.h>

#include <cstring>

#include "cpu/arch/kernel_set.h"
#include "cpu/arch/x86/target.h"

namespace lowbit::cpu {

const KernelSet& kernel_set_avx2();

namespace {

constexpr int kStrip = 16;  // activation rows per GEMM micro-tile: two vectors of 8 int32

// 6 x 16 register tile of byte quads: per 4 k, two vectors of activation quads (signed) and six broadcast
// weight quads (stored + 128, unsigned) feed 12 vpdpbusd, each 32 exact products summed into int32 lanes.
LOWBIT_TARGET_AVXVNNI void gemm_micro(const void* panel_, int64_t ldp, const void* xs_, int64_t len,
                                           int32_t* tile, bool accumulate) {
  static_assert(kStrip == 16, "the register tile below is 6 x 16");
  const auto* panel = static_cast<const uint8_t*>(panel_);
  const auto* xs = static_cast<const int8_t*>(xs_);
#define LOWBIT_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define LOWBIT_LOAD(P) _mm256_loadu_si256(reinterpret_cast<const __m256i*>(P))
#define LOWBIT_INIT(R)                                                                   \
  __m256i c##R##a = accumulate ? LOWBIT_LOAD(tile + R * 16) : _mm256_setzero_si256();     \
  __m256i c##R##b = accumulate ? LOWBIT_LOAD(tile + R * 16 + 8) : _mm256_setzero_si256(); \
  const uint8_t* p##R = panel + R * ldp;
#define LOWBIT_DOT(R)                                                                    \
  std::memcpy(&quad, p##R + k, sizeof(quad));                                            \
  a = _mm256_set1_epi32(quad);                                                           \
  c##R##a = _mm256_dpbusd_avx_epi32(c##R##a, a, b0);                                     \
  c##R##b = _mm256_dpbusd_avx_epi32(c##R##b, a, b1);
#define LOWBIT_STORE(R)                                                                  \
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(tile + R * 16), c##R##a);               \
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(tile + R * 16 + 8), c##R##b);
  LOWBIT_ROWS(LOWBIT_INIT)
  for (int64_t k = 0; k < len; k += 4) {
    const __m256i b0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(xs + k * 16));
    const __m256i b1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(xs + k * 16 + 32));
    int32_t quad;
    __m256i a;
    LOWBIT_ROWS(LOWBIT_DOT)
  }
  LOWBIT_ROWS(LOWBIT_STORE)
#undef LOWBIT_ROWS
#undef LOWBIT_LOAD
#undef LOWBIT_INIT
#undef LOWBIT_DOT
#undef LOWBIT_STORE
}

}  // namespace

const KernelSet& kernel_set_avxvnni() {
  const KernelSet& avx2 = kernel_set_avx2();
  static const KernelSet s{
      "avxvnni",
      kFeatAvx2 | kFeatAvxVnni,
      avx2.fp8,
      Int8Kernels{avx2.int8.gemv_tile, 4, 6, kStrip, &gemm_micro, avx2.int8.quantize_row},
      avx2.w4,
      avx2.axpy_rows,
      avx2.xor_words,
      false,
      nullptr,
  };
  return s;
}

}  // namespace lowbit::cpu
