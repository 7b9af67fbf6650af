// The AVX2 fp8 decode of the x86 kernel sets (fp8_simd.h says why this order and why it is exact).
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "cpu/arch/x86/target.h"
#include "cpu/fp8_simd.h"

namespace lowbit::cpu {

namespace avx2 {

// 32 codes -> 4 vectors in kChunkOrder. nan_acc: byte-wise max of (code | 0x80), 0xFF somewhere <=> a NaN code.
LOWBIT_TARGET_AVX2 inline void decode_chunk(const uint8_t* code, __m256 out[4], __m256i& nan_acc) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(code));
  nan_acc = _mm256_max_epu8(nan_acc, _mm256_or_si256(b, _mm256_set1_epi8(char(0x80))));
  // each 16-bit lane gets one code in its high byte; an arithmetic shift by one then puts sign|exp|mant of the
  // code at bits 15|13..10|9..7 of a half, and the mask clears the copy of the sign at bit 14
  const __m256i mask = _mm256_set1_epi16(short(0xBF80));
  const __m256i even = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(b, 8), 1), mask);
  const __m256i odd = _mm256_and_si256(_mm256_srai_epi16(b, 1), mask);
  out[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(even));
  out[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(even, 1));
  out[2] = _mm256_cvtph_ps(_mm256_castsi256_si128(odd));
  out[3] = _mm256_cvtph_ps(_mm256_extracti128_si256(odd, 1));
}

LOWBIT_TARGET_AVX2 inline bool has_nan_code(__m256i nan_acc) {
  return _mm256_movemask_epi8(_mm256_cmpeq_epi8(nan_acc, _mm256_set1_epi8(char(0xFF)))) != 0;
}

LOWBIT_TARGET_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace avx2

}  // namespace lowbit::cpu
