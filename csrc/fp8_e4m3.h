// The value of an fp8 e4m3fn code: exact for every code (subnormals included), NaN for 0x7F / 0xFF like torch.
// One definition for the CPU kernels' decode table (cpu/fp8.h) and the 4-bit formats' e4m3 scales (w4_formats.h).
// Nothing here includes ATen or c10 (tests/cpu_harness builds without torch).
#pragma once
#include <cstdint>
#include <limits>

namespace lowbit {

constexpr float fp8_e4m3_value(uint8_t b) {
  const int e = (b >> 3) & 0xF, m = b & 7;
  if ((b & 0x7F) == 0x7F) return std::numeric_limits<float>::quiet_NaN();
  // subnormal: m * 2^-9; normal: (8 + m) * 2^(e - 10); scaling by powers of two is exact
  float v = e == 0 ? float(m) : float(8 + m);
  int p = e == 0 ? -9 : e - 10;
  for (; p < 0; p++) v *= 0.5f;
  for (; p > 0; p--) v *= 2.0f;
  return (b & 0x80) ? -v : v;
}

}  // namespace lowbit
