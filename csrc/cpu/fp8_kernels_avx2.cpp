// AVX2 + FMA + F16C inner loops of the fp8 products (see fp8_kernels.h). Compiled with a target attribute,
// called only when the CPU has those features (isa.cpp).
#include "cpu/fp8_kernels.h"

#if LOWBIT_X86
#include <cstring>
#include <limits>

#include "cpu/fp8_simd.h"
#include "cpu/gemv_prefetch.h"

namespace lowbit::cpu {
namespace {

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
        for (int r = 0; r < NR; r++) _mm_prefetch(gemv_prefetch_target(w, K, r, NR, k0 + k), _MM_HINT_T1);
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

}  // namespace

const Fp8Kernels& fp8_kernels_avx2() {
  static const Fp8Kernels k{&gemv_tile, nullptr, &decode_rows, nullptr, &dequantize_run};
  return k;
}

}  // namespace lowbit::cpu
#endif
