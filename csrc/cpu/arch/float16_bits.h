// float -> bf16 / half bits, rounded to nearest even as torch's c10::BFloat16 and c10::Half round (every NaN
// becomes 0x7FC0 in bf16; a NaN keeps its sign and becomes 0x7E00 in half): the kernel sets' scalar roundings,
// without c10 (arch/ builds without torch).
#pragma once
#include <cstdint>
#include <cstring>

namespace lowbit::cpu {

inline uint32_t float_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

inline uint16_t float_to_bf16_bits(float f) {
  const uint32_t b = float_bits(f);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return uint16_t((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

inline uint16_t float_to_half_bits(float f) {
  const uint32_t b = float_bits(f), a = b & 0x7FFFFFFFu;
  const uint16_t sign = uint16_t((b >> 16) & 0x8000u);
  if (a > 0x7F800000u) return sign | 0x7E00;  // NaN
  if (a >= 0x477FF000u) return sign | 0x7C00;  // 65520 and above round to infinity
  if (a >= 0x38800000u) {  // a normal half (2^-14 and above): rebias the exponent by 127 - 15, round off 13 bits
    const uint32_t m = a - 0x38000000u;
    return sign | uint16_t((m + 0xFFFu + ((m >> 13) & 1u)) >> 13);
  }
  if (a <= 0x33000000u) return sign;  // at most 2^-25: half of the smallest subnormal, a tie to even zero
  // a subnormal half: the value in units of 2^-24 is the 24-bit significand shifted right by 126 - exponent
  const uint32_t sig = (a & 0x7FFFFFu) | 0x800000u;
  const int shift = 126 - int(a >> 23);
  const uint32_t q = sig >> shift, rem = sig & ((1u << shift) - 1), half = 1u << (shift - 1);
  return sign | uint16_t(q + (rem > half || (rem == half && (q & 1u))));
}

}  // namespace lowbit::cpu
