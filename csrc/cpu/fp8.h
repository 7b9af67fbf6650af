// fp8 e4m3fn decode on the CPU, shared by every CPU kernel. A 256-entry table built at compile time:
// exact for every code (subnormals included), NaN for 0x7F / 0xFF like torch.
#pragma once
#include <array>
#include <cstdint>
#include <limits>

namespace lowbit::cpu {

constexpr float fp8_e4m3_value(uint8_t b) {
  const int e = (b >> 3) & 0xF, m = b & 7;
  if ((b & 0x7F) == 0x7F) return std::numeric_limits<float>::quiet_NaN();
  // subnormal: m * 2^-9; normal: (8 + m) * 2^(e - 10)
  float v = e == 0 ? float(m) : float(8 + m);
  int p = e == 0 ? -9 : e - 10;
  for (; p < 0; p++) v *= 0.5f;
  for (; p > 0; p--) v *= 2.0f;
  return (b & 0x80) ? -v : v;
}

constexpr std::array<float, 256> make_fp8_e4m3_table() {
  std::array<float, 256> t{};
  for (int i = 0; i < 256; i++) t[i] = fp8_e4m3_value(uint8_t(i));
  return t;
}

inline constexpr std::array<float, 256> kFp8E4m3Table = make_fp8_e4m3_table();

inline float fp8_e4m3_to_float(uint8_t b) { return kFp8E4m3Table[b]; }

}  // namespace lowbit::cpu
