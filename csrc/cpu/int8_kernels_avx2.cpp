// AVX2, AVX-VNNI and AVX512-VNNI inner loops of int8_mm (see int8_kernels.h). int8 x int8 is signed x signed, which the byte
// multiply-add (vpmaddubsw: unsigned x signed, saturating) cannot do exactly; values are sign-extended to
// int16 and multiplied with vpmaddwd, whose pair sums (at most 2 * 128 * 128) are exact in int32.
#include "cpu/int8_kernels.h"
#include "cpu/gemv_prefetch.h"

#if LOWBIT_X86
// GCC 12 warns about the undefined pass-through operand inside its own AVX-512 intrinsics headers
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace lowbit::cpu {
namespace {

constexpr int kStep = 16;  // int8 values per vector step (sign-extended to 16 int16)
constexpr int kStrip = 16;  // activation rows per GEMM micro-tile: two vectors of 8 int32

LOWBIT_TARGET_AVX2 inline __m256i widen(const int8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

LOWBIT_TARGET_AVX2 inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// acc[m][r] += the 16 products at x rows xp[m] and weight rows wp[r]
template <int MR, int NR>
LOWBIT_TARGET_AVX2 inline __attribute__((always_inline)) void gemv_step(__m256i (&acc)[MR][NR], const int8_t* const* xp,
                                                                        const int8_t* const* wp) {
  __m256i xv[MR];
  for (int m = 0; m < MR; m++) xv[m] = widen(xp[m]);
  for (int r = 0; r < NR; r++) {
    const __m256i wv = widen(wp[r]);
    for (int m = 0; m < MR; m++) acc[m][r] = _mm256_add_epi32(acc[m][r], _mm256_madd_epi16(xv[m], wv));
  }
}

template <int MR, int NR>
LOWBIT_TARGET_AVX2 void gemv_tile_t(const int8_t* x, const int8_t* w, int64_t K, int32_t* out) {
  __m256i acc[MR][NR];
  for (int m = 0; m < MR; m++)
    for (int r = 0; r < NR; r++) acc[m][r] = _mm256_setzero_si256();
  const int8_t* xp[MR];
  const int8_t* wp[NR];
  const int64_t full = K / kStep * kStep;
  for (int64_t k = 0; k < full; k += kStep) {
    for (int m = 0; m < MR; m++) xp[m] = x + m * K + k;
    for (int r = 0; r < NR; r++) wp[r] = w + r * K + k;
    gemv_step<MR, NR>(acc, xp, wp);
  }
  if (full < K) {  // the tail through zero-padded copies: never read past a row
    int8_t xt[MR][kStep] = {}, wt[NR][kStep] = {};
    for (int m = 0; m < MR; m++) {
      std::memcpy(xt[m], x + m * K + full, size_t(K - full));
      xp[m] = xt[m];
    }
    for (int r = 0; r < NR; r++) {
      std::memcpy(wt[r], w + r * K + full, size_t(K - full));
      wp[r] = wt[r];
    }
    gemv_step<MR, NR>(acc, xp, wp);
  }
  for (int m = 0; m < MR; m++)
    for (int r = 0; r < NR; r++) out[m * NR + r] = hsum_epi32(acc[m][r]);
}

using GemvFn = void (*)(const int8_t*, const int8_t*, int64_t, int32_t*);

// Runs the instantiation Tiles::get<MR, NR>() of a tile family for a run-time (mr, nr), from one table.
template <class Tiles>
void run_gemv_tile(int mr, int nr, const int8_t* x, const int8_t* w, int64_t K, int32_t* acc) {
  static const GemvFn table[kInt8TileRows][kInt8TileRows] = {
#define LOWBIT_ROW(M) \
  {Tiles::template get<M, 1>(), Tiles::template get<M, 2>(), Tiles::template get<M, 3>(), Tiles::template get<M, 4>()}
      LOWBIT_ROW(1), LOWBIT_ROW(2), LOWBIT_ROW(3), LOWBIT_ROW(4),
#undef LOWBIT_ROW
  };
  table[mr - 1][nr - 1](x, w, K, acc);
}

struct Avx2Tiles {
  template <int MR, int NR>
  static constexpr GemvFn get() { return &gemv_tile_t<MR, NR>; }
};

void gemv_tile(int mr, int nr, const int8_t* x, const int8_t* w, int64_t K, int32_t* acc) {
  run_gemv_tile<Avx2Tiles>(mr, nr, x, w, K, acc);
}

// 4 x 16 register tile: per pair of k, two vectors of activation pairs and four broadcast weight pairs feed
// 8 multiply-adds. Named accumulators, not an array, so that GCC keeps them in registers.
LOWBIT_TARGET_AVX2 void gemm_micro(const void* panel_, int64_t ldp, const void* xs_, int64_t len, int32_t* tile,
                                   bool accumulate) {
  static_assert(kStrip == 16, "the register tile below is 4 x 16");
  const auto* panel = static_cast<const int16_t*>(panel_);
  const auto* xs = static_cast<const int16_t*>(xs_);
#define LOWBIT_ROWS(X) X(0) X(1) X(2) X(3)
#define LOWBIT_LOAD(P) _mm256_loadu_si256(reinterpret_cast<const __m256i*>(P))
#define LOWBIT_INIT(R)                                                                   \
  __m256i c##R##a = accumulate ? LOWBIT_LOAD(tile + R * 16) : _mm256_setzero_si256();     \
  __m256i c##R##b = accumulate ? LOWBIT_LOAD(tile + R * 16 + 8) : _mm256_setzero_si256(); \
  const int16_t* p##R = panel + R * ldp;
#define LOWBIT_MADD(R)                                                                   \
  std::memcpy(&pair, p##R + k, sizeof(pair));                                            \
  a = _mm256_set1_epi32(pair);                                                           \
  c##R##a = _mm256_add_epi32(c##R##a, _mm256_madd_epi16(a, b0));                         \
  c##R##b = _mm256_add_epi32(c##R##b, _mm256_madd_epi16(a, b1));
#define LOWBIT_STORE(R)                                                                  \
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(tile + R * 16), c##R##a);               \
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(tile + R * 16 + 8), c##R##b);
  LOWBIT_ROWS(LOWBIT_INIT)
  for (int64_t k = 0; k < len; k += 2) {
    const __m256i b0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(xs + k * 16));
    const __m256i b1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(xs + k * 16 + 16));
    int32_t pair;
    __m256i a;
    LOWBIT_ROWS(LOWBIT_MADD)
  }
  LOWBIT_ROWS(LOWBIT_STORE)
#undef LOWBIT_ROWS
#undef LOWBIT_LOAD
#undef LOWBIT_INIT
#undef LOWBIT_MADD
#undef LOWBIT_STORE
}

// 6 x 16 register tile of byte quads: per 4 k, two vectors of activation quads (signed) and six broadcast
// weight quads (stored + 128, unsigned) feed 12 vpdpbusd, each 32 exact products summed into int32 lanes.
LOWBIT_TARGET_AVXVNNI void gemm_micro_vnni(const void* panel_, int64_t ldp, const void* xs_, int64_t len,
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

// int8_quantize of a row (int8_kernels.h): the portable loop's results bit for bit -- the absmax is an unsigned
// max of |x|'s bits (NaN and inf found as there), vdivps is the correctly rounded fp32 division and vroundps
// rounds half to even. Tails run the portable loop.
LOWBIT_TARGET_AVX2 inline __m256i quantize8(const float* x, __m256 scale) {
  const __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x), scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, _mm256_set1_ps(-127.f)), _mm256_set1_ps(127.f)));
}

LOWBIT_TARGET_AVX2 inline __m256i abs_bits8(const float* x) {
  return _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)), _mm256_set1_epi32(0x7FFFFFFF));
}

LOWBIT_TARGET_AVX2 float quantize_row(const float* x, int64_t K, int8_t* q) {
  const int64_t full = K / 32 * 32;
  __m256i m0 = _mm256_setzero_si256(), m1 = m0, m2 = m0, m3 = m0;
  for (int64_t k = 0; k < full; k += 32) {
    m0 = _mm256_max_epu32(abs_bits8(x + k), m0);
    m1 = _mm256_max_epu32(abs_bits8(x + k + 8), m1);
    m2 = _mm256_max_epu32(abs_bits8(x + k + 16), m2);
    m3 = _mm256_max_epu32(abs_bits8(x + k + 24), m3);
  }
  alignas(32) uint32_t lanes[8];
  const __m256i m = _mm256_max_epu32(_mm256_max_epu32(m0, m1), _mm256_max_epu32(m2, m3));
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), m);
  uint32_t amax = 0;
  for (uint32_t v : lanes) amax = std::max(amax, v);
  const float scale = row_scale(absmax_bits(x + full, K - full, amax));
  if (!(scale > 0.f)) {
    std::memset(q, 0, size_t(K));
    return scale;
  }
  const __m256 s = _mm256_set1_ps(scale);
  for (int64_t k = 0; k < full; k += 32) {
    // int32 -> int16 -> int8 packs work per 128-bit lane; the permute restores the order of the 32 values
    const __m256i w01 = _mm256_packs_epi32(quantize8(x + k, s), quantize8(x + k + 8, s));
    const __m256i w23 = _mm256_packs_epi32(quantize8(x + k + 16, s), quantize8(x + k + 24, s));
    const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), b);
  }
  quantize_with_scale(x + full, K - full, scale, q + full);
  return scale;
}

}  // namespace

const Int8Kernels& int8_kernels_avx2() {
  static const Int8Kernels k{&gemv_tile, 2, 4, kStrip, &gemm_micro, &quantize_row};
  return k;
}

// The GEMV tiles stay on vpmaddwd: at few rows int8_mm is bound by reading the weights, not by multiplies.
const Int8Kernels& int8_kernels_avxvnni() {
  static const Int8Kernels k{&gemv_tile, 4, 6, kStrip, &gemm_micro_vnni, &quantize_row};
  return k;
}

// The same 6-row tile on 512-bit vectors: 6 x 32 activation rows, 12 vpdpbusd of 64 products each per 4 k.
static LOWBIT_TARGET_AVX512VNNI void gemm_micro_avx512(const void* panel_, int64_t ldp, const void* xs_, int64_t len,
                                               int32_t* tile, bool accumulate) {
  const auto* panel = static_cast<const uint8_t*>(panel_);
  const auto* xs = static_cast<const int8_t*>(xs_);
#define LOWBIT_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define LOWBIT_INIT(R)                                                                          \
  __m512i c##R##a = accumulate ? _mm512_loadu_si512(tile + R * 32) : _mm512_setzero_si512();     \
  __m512i c##R##b = accumulate ? _mm512_loadu_si512(tile + R * 32 + 16) : _mm512_setzero_si512(); \
  const uint8_t* p##R = panel + R * ldp;
#define LOWBIT_DOT(R)                                    \
  std::memcpy(&quad, p##R + k, sizeof(quad));            \
  a = _mm512_set1_epi32(quad);                           \
  c##R##a = _mm512_dpbusd_epi32(c##R##a, a, b0);         \
  c##R##b = _mm512_dpbusd_epi32(c##R##b, a, b1);
#define LOWBIT_STORE(R)                                  \
  _mm512_storeu_si512(tile + R * 32, c##R##a);           \
  _mm512_storeu_si512(tile + R * 32 + 16, c##R##b);
  LOWBIT_ROWS(LOWBIT_INIT)
  for (int64_t k = 0; k < len; k += 4) {
    const __m512i b0 = _mm512_load_si512(xs + k * 32);
    const __m512i b1 = _mm512_load_si512(xs + k * 32 + 64);
    int32_t quad;
    __m512i a;
    LOWBIT_ROWS(LOWBIT_DOT)
  }
  LOWBIT_ROWS(LOWBIT_STORE)
#undef LOWBIT_ROWS
#undef LOWBIT_INIT
#undef LOWBIT_DOT
#undef LOWBIT_STORE
}

// GEMV tiles on 512-bit byte dot products. vpdpbusd multiplies unsigned by signed bytes: each weight vector is
// made unsigned by flipping its sign bit (w + 128) and x is the signed operand, so the sums hold 128 * sum_k x[m, k]
// too, which the same instruction counts (against ones) and the tile subtracts, modulo 2^32 (exact: the true sum
// fits). One load, one xor and one dot product per 64 weight bytes and x row leave the loop bound by memory;
// each weight row is its own stream of whole 4 KB pages (K = 4096), where the hardware prefetchers stop, so each
// stream is fetched ahead (gemv_prefetch.h), a line per row per step, with the outer-level hint: it streamed a few
// percent closer to the read bandwidth than the L1 hint at 2 and at 16 threads.
// acc[m][r] += the 64 products at k of x row m and weight row r (w + 128), xsum[m] += x's 64 values; bytes off
// `mask` load as 0 (weights then flip to 128, against x's zeros: no product)
template <int MR, int NR>
static LOWBIT_TARGET_AVX512VNNI inline __attribute__((always_inline)) void gemv_vnni_step(
    __m512i (&acc)[MR][NR], __m512i (&xsum)[MR], const int8_t* x, const int8_t* w, int64_t K, int64_t k, __mmask64 mask) {
  const __m512i flip = _mm512_set1_epi8(char(0x80)), ones = _mm512_set1_epi8(1);
  __m512i xv[MR];
  for (int m = 0; m < MR; m++) {
    xv[m] = _mm512_maskz_loadu_epi8(mask, x + m * K + k);
    xsum[m] = _mm512_dpbusd_epi32(xsum[m], ones, xv[m]);
  }
  for (int r = 0; r < NR; r++) {
    const __m512i wv = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, w + r * K + k), flip);
    for (int m = 0; m < MR; m++) acc[m][r] = _mm512_dpbusd_epi32(acc[m][r], wv, xv[m]);
  }
}

template <int MR, int NR>
static LOWBIT_TARGET_AVX512VNNI void gemv_tile_vnni_t(const int8_t* x, const int8_t* w, int64_t K, int32_t* out) {
  __m512i acc[MR][NR], xsum[MR];
  for (int m = 0; m < MR; m++) {
    xsum[m] = _mm512_setzero_si512();
    for (int r = 0; r < NR; r++) acc[m][r] = _mm512_setzero_si512();
  }
  const int64_t full = K / 64 * 64;
  for (int64_t k = 0; k < full; k += 64) {
    for (int r = 0; r < NR; r++) _mm_prefetch(gemv_prefetch_target(w, K, r, NR, k), _MM_HINT_T2);
    gemv_vnni_step<MR, NR>(acc, xsum, x, w, K, k, ~__mmask64(0));
  }
  if (full < K) gemv_vnni_step<MR, NR>(acc, xsum, x, w, K, full, (__mmask64(1) << (K - full)) - 1);
  for (int m = 0; m < MR; m++) {
    const uint32_t offset = 128u * uint32_t(_mm512_reduce_add_epi32(xsum[m]));
    for (int r = 0; r < NR; r++) out[m * NR + r] = int32_t(uint32_t(_mm512_reduce_add_epi32(acc[m][r])) - offset);
  }
}

struct Avx512VnniTiles {
  template <int MR, int NR>
  static constexpr GemvFn get() { return &gemv_tile_vnni_t<MR, NR>; }
};

static void gemv_tile_vnni(int mr, int nr, const int8_t* x, const int8_t* w, int64_t K, int32_t* acc) {
  run_gemv_tile<Avx512VnniTiles>(mr, nr, x, w, K, acc);
}

const Int8Kernels& int8_kernels_avx512() {
  static const Int8Kernels k{&gemv_tile_vnni, 4, 6, 32, &gemm_micro_avx512, &quantize_row};
  return k;
}

}  // namespace lowbit::cpu
#endif
