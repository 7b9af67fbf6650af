// The AVX2 kernel set (AVX2 + FMA + F16C): fp8 GEMV tiles and decodes, int8 products on vpmaddwd, int8_quantize,
// the transposed products' row loop and the streaming read. Compiled with target attributes, called only on a CPU
// with those features (kernel_sets.cpp). The AVX-VNNI and AVX-512 sets reuse the loops they do not replace.
#include <algorithm>
#include <cstring>
#include <limits>

#include "cpu/arch/kernel_set.h"
#include "cpu/arch/x86/fp8_avx2.h"
#include "cpu/arch/x86/target.h"
#include "cpu/gemv_prefetch.h"

namespace lowbit::cpu {

extern const W4Kernels kW4KernelsAvx2;  // w4_avx2.cpp
namespace {
namespace fp8 {

// The last, partial chunk of a segment: staged through a zero-padded copy (never read past a weight row).
LOWBIT_TARGET_AVX2 inline void decode_tail(const uint8_t* code, int64_t n, __m256 out[4], __m256i& nan_acc) {
  alignas(32) uint8_t tmp[kChunk] = {};
  std::memcpy(tmp, code, size_t(n));
  avx2::decode_chunk(tmp, out, nan_acc);
}

// acc[m][r] += the chunk at packed position p of activation row m times decoded weight chunk d of row r
template <int MR, int NR>
LOWBIT_TARGET_AVX2 inline __attribute__((always_inline)) void fma_rows(__m256 (&acc)[MR][NR], int r, const __m256 d[4],
                                                                       const float* xs, int64_t ldx, int64_t p) {
  for (int m = 0; m < MR; m++) {
    const float* xp = xs + m * ldx + p;
    __m256 a = acc[m][r];
    a = _mm256_fmadd_ps(_mm256_load_ps(xp), d[0], a);
    a = _mm256_fmadd_ps(_mm256_load_ps(xp + 8), d[1], a);
    a = _mm256_fmadd_ps(_mm256_load_ps(xp + 16), d[2], a);
    a = _mm256_fmadd_ps(_mm256_load_ps(xp + 24), d[3], a);
    acc[m][r] = a;
  }
}

// x rows stay in L1 (a packed row of K floats), weight bytes stream from memory once per tile; every decoded
// chunk feeds all MR activation rows.
template <int MR, int NR, bool kBlock>
LOWBIT_TARGET_AVX2 void gemv_tile_t(const float* x, int64_t ldx, const uint8_t* w, int64_t K,
                                    const float* const* bscale, const KSegments& seg, float* sums, bool* nan) {
  const GemvPrefetch prefetch(w, K, NR);
  __m256 tot[MR][NR];
  for (int m = 0; m < MR; m++)
    for (int r = 0; r < NR; r++) tot[m][r] = _mm256_setzero_ps();
  // NaN codes tracked for the whole tile in one register (one per row spills at 16 vector registers); the rare
  // tile that holds one finds its rows afterwards
  __m256i nan_acc = _mm256_setzero_si256();
  for (int64_t s = 0; s < seg.count; s++) {
    const int64_t k0 = seg.begin(s), n = seg.size(s), full = n / kChunk * kChunk;
    const float* xs = x + s * seg.padded;
    __m256 acc[MR][NR];
    for (int m = 0; m < MR; m++)
      for (int r = 0; r < NR; r++) acc[m][r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < full; k += kChunk) {
      // Each weight row is its own stream, and a row of K = 4096 codes is one 4 KB page, where the hardware
      // prefetchers stop: fetch ahead along each stream (gemv_prefetch.h).
      if ((k & 63) == 0)
        for (int r = 0; r < NR; r++) _mm_prefetch(prefetch(r, k0 + k), _MM_HINT_T1);
      for (int r = 0; r < NR; r++) {
        __m256 d[4];
        avx2::decode_chunk(w + r * K + k0 + k, d, nan_acc);
        fma_rows<MR, NR>(acc, r, d, xs, ldx, k);
      }
    }
    if (full < n) {
      for (int r = 0; r < NR; r++) {
        __m256 d[4];
        decode_tail(w + r * K + k0 + full, n - full, d, nan_acc);
        fma_rows<MR, NR>(acc, r, d, xs, ldx, full);
      }
    }
    for (int m = 0; m < MR; m++)
      for (int r = 0; r < NR; r++) {
        if (!kBlock) tot[m][r] = acc[m][r];
        else if (s == 0) tot[m][r] = _mm256_mul_ps(_mm256_set1_ps(bscale[r][s]), acc[m][r]);
        else tot[m][r] = _mm256_fmadd_ps(_mm256_set1_ps(bscale[r][s]), acc[m][r], tot[m][r]);
      }
  }
  for (int m = 0; m < MR; m++)
    for (int r = 0; r < NR; r++) sums[m * NR + r] = avx2::hsum(tot[m][r]);
  if (avx2::has_nan_code(nan_acc))
    for (int r = 0; r < NR; r++) nan[r] = nan[r] || has_nan_code(w + r * K, K);
}

struct FloatTiles {  // this file's tile family, for pick_gemv_tile
  template <int MR, int NR, bool kBlock>
  static constexpr Fp8GemvTileFn get() { return &gemv_tile_t<MR, NR, kBlock>; }
};

void gemv_tile(int mr, int nr, const float* x, int64_t ldx, const uint8_t* w, int64_t K, const float* const* bscale,
               const KSegments& seg, float* sums, bool* nan) {
  pick_gemv_tile<Fp8GemvTileFn, FloatTiles>(bscale != nullptr, mr, nr)(x, ldx, w, K, bscale, seg, sums, nan);
}

LOWBIT_TARGET_AVX2 void decode_rows(const uint8_t* w, int64_t K, int64_t nrows, int64_t k0, int64_t n, float* dst,
                                    int64_t ldd, bool* nan) {
  const int64_t full = n / kChunk * kChunk;
  for (int64_t r = 0; r < nrows; r++) {
    const uint8_t* src = w + r * K + k0;
    float* d = dst + r * ldd;
    __m256i nan_acc = _mm256_setzero_si256();
    __m256 v[4];
    for (int64_t k = 0; k < full; k += kChunk) {
      avx2::decode_chunk(src + k, v, nan_acc);
      for (int q = 0; q < 4; q++) _mm256_storeu_ps(d + k + 8 * q, v[q]);
    }
    if (full < n) {
      decode_tail(src + full, n - full, v, nan_acc);
      for (int q = 0; q < 4; q++) _mm256_storeu_ps(d + full + 8 * q, v[q]);
    }
    nan[r] = nan[r] || avx2::has_nan_code(nan_acc);
  }
}

// 8 values to bf16, rounded to nearest even like c10::BFloat16 (every NaN becomes 0x7FC0), in the low 16 bits
// of each 32-bit lane
LOWBIT_TARGET_AVX2 inline __m256i to_bf16_lanes(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}

// fp8_dequantize, 16 codes a step: the half-bits decode in natural order (a zero-extended byte per 16-bit lane),
// dec = decoded * 256 exactly, one rounding of dec * scale, NaN codes (which decode to 480 / 256) made NaN.
LOWBIT_TARGET_AVX2 void dequantize_run(const uint8_t* code, int64_t n, float scale, void* out, DequantOut kind) {
  const int64_t full = n / 16 * 16;
  const __m256 s = _mm256_set1_ps(scale), unscale = _mm256_set1_ps(kDecodeUnscale);
  const __m256 nan_decoded = _mm256_set1_ps(480.f / kDecodeUnscale), sign = _mm256_set1_ps(-0.f);
  const __m256 qnan = _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN());
  for (int64_t k = 0; k < full; k += 16) {
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(code + k)));
    const __m256i h = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(w, 8), 1), _mm256_set1_epi16(short(0xBF80)));
    __m256 v[2] = {_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))};
    for (int i = 0; i < 2; i++) {
      const __m256 is_nan = _mm256_cmp_ps(_mm256_andnot_ps(sign, v[i]), nan_decoded, _CMP_EQ_OQ);
      v[i] = _mm256_blendv_ps(_mm256_mul_ps(_mm256_mul_ps(v[i], unscale), s), qnan, is_nan);
    }
    switch (kind) {
      case DequantOut::F32:
        _mm256_storeu_ps(static_cast<float*>(out) + k, v[0]);
        _mm256_storeu_ps(static_cast<float*>(out) + k + 8, v[1]);
        break;
      case DequantOut::BF16: {  // packus works per 128-bit lane: the permute puts the 16 words back in order
        const __m256i p = _mm256_packus_epi32(to_bf16_lanes(v[0]), to_bf16_lanes(v[1]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + k),
                            _mm256_permute4x64_epi64(p, 0xD8));
        break;
      }
      case DequantOut::F16:  // vcvtps2ph rounds to nearest even and keeps NaN sign and top payload, like c10::Half
        _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + k),
                         _mm256_cvtps_ph(v[0], _MM_FROUND_TO_NEAREST_INT));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + k + 8),
                         _mm256_cvtps_ph(v[1], _MM_FROUND_TO_NEAREST_INT));
        break;
    }
  }
  dequantize_run_portable(code + full, n - full, scale, static_cast<uint8_t*>(out) + full * element_size(kind), kind);
}

}  // namespace fp8

// int8 x int8 is signed x signed, which the byte multiply-add (vpmaddubsw: unsigned x signed, saturating) cannot
// do exactly; values are sign-extended to int16 and multiplied with vpmaddwd, whose pair sums (at most
// 2 * 128 * 128) are exact in int32.
namespace int8 {

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
    int8_tile_rows_at(x, w, K, k, xp, wp);
    gemv_step<MR, NR>(acc, xp, wp);
  }
  if (full < K) {
    int8_t xt[MR][kStep], wt[NR][kStep];
    int8_tile_rows_padded(x, w, K, full, xt, wt, xp, wp);
    gemv_step<MR, NR>(acc, xp, wp);
  }
  for (int m = 0; m < MR; m++)
    for (int r = 0; r < NR; r++) out[m * NR + r] = hsum_epi32(acc[m][r]);
}

struct Avx2Tiles {
  template <int MR, int NR>
  static constexpr Int8GemvTileFn get() { return &gemv_tile_t<MR, NR>; }
};

void gemv_tile(int mr, int nr, const int8_t* x, const int8_t* w, int64_t K, int32_t* acc) {
  run_int8_gemv_tile<Avx2Tiles>(mr, nr, x, w, K, acc);
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

}  // namespace int8

LOWBIT_TARGET_AVX2 void axpy_rows(int64_t mr, const float* c, const float* v, int64_t n, float* acc, int64_t lda) {
  const int64_t full = n / 32 * 32;
  for (int64_t m = 0; m < mr; m++) {
    const __m256 cm = _mm256_set1_ps(c[m]);
    float* a = acc + m * lda;
    for (int64_t p = 0; p < full; p += 32)
      for (int q = 0; q < 32; q += 8)
        _mm256_storeu_ps(a + p + q, _mm256_fmadd_ps(cm, _mm256_loadu_ps(v + p + q), _mm256_loadu_ps(a + p + q)));
    for (int64_t p = full; p < n; p++) a[p] += c[m] * v[p];
  }
}

LOWBIT_TARGET_AVX2 uint64_t xor_words(const uint64_t* p, int64_t n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const auto* v = reinterpret_cast<const __m256i*>(p + i);
    a0 = _mm256_xor_si256(a0, _mm256_loadu_si256(v));
    a1 = _mm256_xor_si256(a1, _mm256_loadu_si256(v + 1));
    a2 = _mm256_xor_si256(a2, _mm256_loadu_si256(v + 2));
    a3 = _mm256_xor_si256(a3, _mm256_loadu_si256(v + 3));
  }
  alignas(32) uint64_t t[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(t), _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3)));
  uint64_t r = t[0] ^ t[1] ^ t[2] ^ t[3];
  for (; i < n; i++) r ^= p[i];
  return r;
}

}  // namespace

const KernelSet& kernel_set_avx2() {
  static const KernelSet s{
      "avx2",
      kFeatAvx2,
      Fp8Kernels{&fp8::gemv_tile, nullptr, &fp8::decode_rows, nullptr, &fp8::dequantize_run},
      Int8Kernels{&int8::gemv_tile, 2, 4, int8::kStrip, &int8::gemm_micro, &int8::quantize_row},
      kW4KernelsAvx2,
      &axpy_rows,
      &xor_words,
      false,
      nullptr,
  };
  return s;
}

}  // namespace lowbit::cpu
