// fp8 e4m3fn decode on the CPU, shared by every CPU kernel. A 256-entry table built at compile time:
// exact for every code (subnormals included), NaN for 0x7F / 0xFF like torch.
#pragma once
#include <array>
#include <cstdint>
#include <limits>

#include "fp8_e4m3.h"

namespace lowbit::cpu {

constexpr std::array<float, 256> make_fp8_e4m3_table() {
  std::array<float, 256> t{};
  for (int i = 0; i < 256; i++) t[i] = fp8_e4m3_value(uint8_t(i));
  return t;
}

inline constexpr std::array<float, 256> kFp8E4m3Table = make_fp8_e4m3_table();

inline float fp8_e4m3_to_float(uint8_t b) { return kFp8E4m3Table[b]; }

}  // namespace lowbit::cpu
