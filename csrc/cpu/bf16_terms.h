// Activations as sums of bf16 terms, for the GEMMs that run on bf16 hardware (AMX): bf16 values are one term;
// half values two (11 significant bits: the bf16 rounding and the exact remainder, which has at most 4); float
// values three (the remainder's remainder) -- to within about 2^-24 relative, the error of fp32 accumulation.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/bit_cast.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

namespace lowbit::cpu {

template <typename T>
constexpr int kBf16Terms = std::is_same_v<T, c10::BFloat16> ? 1 : std::is_same_v<T, c10::Half> ? 2 : 3;

// f as `count` bf16 terms, largest first (each the rounding of what the earlier ones left).
inline void split_float_bf16(float f, int count, uint16_t* terms) {
  for (int t = 0; t < count; t++) {
    c10::BFloat16 h(f);  // round to nearest even
    if (std::isinf(float(h)) && std::isfinite(f))  // within half a bf16 ulp of FLT_MAX: truncate instead
      h = c10::BFloat16(uint16_t(c10::bit_cast<uint32_t>(f) >> 16), c10::BFloat16::from_bits());
    terms[t] = h.x;
    f = std::isfinite(float(h)) ? f - float(h) : 0.f;  // inf / NaN: the first term alone, as in fp32
  }
}

template <typename T>
inline void split_bf16(T v, uint16_t* terms) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) terms[0] = v.x;  // the bits as they are
  else split_float_bf16(float(v), kBf16Terms<T>, terms);
}

}  // namespace lowbit::cpu
