// Horizontal sums of a GEMV tile's accumulators, shared by the AVX-512 tiles.
#pragma once
#include <immintrin.h>

#include "cpu/arch/x86/target.h"

namespace lowbit::cpu {

// out[r] = the sum of v[r]'s 16 lanes, r < NR. Four rows are reduced together (two interleaving adds, then the
// 128-bit quarters: 11 instructions and one 128-bit store against four separate reductions of about eight
// dependent ones each): at batch 1 with short rows (K = 768: six 128-code steps) the separate reductions and the
// scalar stores their results wait on were a sixth of a tile's time.
template <int NR>
LOWBIT_TARGET_AVX512 inline __attribute__((always_inline)) void store_row_sums(const __m512 (&v)[NR], float* out) {
  int r = 0;
  for (; r + 4 <= NR; r += 4) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(v[r], v[r + 1]), _mm512_unpackhi_ps(v[r], v[r + 1]));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(v[r + 2], v[r + 3]), _mm512_unpackhi_ps(v[r + 2], v[r + 3]));
    // per 128-bit quarter: its share of rows r .. r + 3
    const __m512 q = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(q),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(q), 1)));
    _mm_storeu_ps(out + r, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  }
  for (; r < NR; r++) out[r] = _mm512_reduce_add_ps(v[r]);
}

}  // namespace lowbit::cpu
