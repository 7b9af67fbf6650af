// The 4-bit weight formats (W4A16): one table, read by the argument checks, the CPU kernels and the Metal plans
// (which pass a format's value table to the kernels), so that a new 16-entry format (NF4, ...) is one line here.
//
// Every format stores two 4-bit codes per byte along K, the even k in the low nibble, rows of ceil(K/2) bytes,
// and one scale per group of `group_size` consecutive k of a row (the last group of a row may be partial):
//   w[n, k] = value[code] * scale[n, g]                       offset None
//   w[n, k] = (value[code] - zero_point[n, g]) * scale[n, g]  offset ZeroPoint (int8 zero points)
//   w[n, k] = value[code] * scale[n, g] + bias[n, g]          offset Bias (biases in the scale's dtype: MLX affine)
// each computed in fp32, and a format with a global scale multiplies the whole product by one fp32 number.
// Nothing here includes ATen or c10: the CPU kernel sets and tests/cpu_harness build without torch.
#pragma once
#include <cstdint>
#include <cstring>
#include <limits>

#include "fp8_e4m3.h"

namespace lowbit {

// How a group scale is stored.
enum class W4Scale : int32_t {
  F32 = 0,
  F16 = 1,
  BF16 = 2,
  E4M3 = 3,  // float8_e4m3fn (or its bits in uint8): NVFP4
  E8M0 = 4,  // 2^(b - 127), 0xFF is NaN (OCP microscaling, or torch.float8_e8m0fnu): MXFP4
};
// Bytes of one stored scale.
constexpr int64_t w4_scale_bytes(W4Scale s) {
  return s == W4Scale::F32 ? 4 : (s == W4Scale::F16 || s == W4Scale::BF16) ? 2 : 1;
}
constexpr uint32_t w4_scale_bit(W4Scale s) { return 1u << int32_t(s); }
constexpr uint32_t kW4FloatScales = w4_scale_bit(W4Scale::F32) | w4_scale_bit(W4Scale::F16) | w4_scale_bit(W4Scale::BF16);

enum class W4Offset : int32_t { None = 0, ZeroPoint = 1, Bias = 2 };

struct W4Format {
  const char* name;
  float values[16];     // value of each code
  uint32_t scales;      // W4Scale bits this format accepts
  W4Offset offset;      // the offset kind this format may carry (optional: a format with an offset runs without one)
  bool global_scale;    // whether it takes a per-tensor fp32 multiplier
  int32_t default_group;  // what its writers use (quantize_ configs start from it)
};

// E2M1 (OCP FP4): sign, 2 exponent bits, 1 mantissa bit; every value exact.
#define LOWBIT_E2M1_VALUES {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f}

inline constexpr W4Format kW4Formats[] = {
    // compressed-tensors nvfp4-pack-quantized, ModelOpt NVFP4: e4m3 scale per 16, fp32 global multiplier
    {"nvfp4", LOWBIT_E2M1_VALUES, w4_scale_bit(W4Scale::E4M3), W4Offset::None, true, 16},
    // OCP MXFP4 (gpt-oss, compressed-tensors mxfp4): e8m0 scale per 32
    {"mxfp4", LOWBIT_E2M1_VALUES, w4_scale_bit(W4Scale::E8M0), W4Offset::None, false, 32},
    // signed int4 (compressed-tensors pack-quantized stores code = q + 8): symmetric, or with int8 zero points
    {"int4", {-8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f, 0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f}, kW4FloatScales,
     W4Offset::ZeroPoint, false, 128},
    // unsigned int4 with an additive bias per group (MLX affine: w = q * scale + bias)
    {"uint4", {0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f, 10.f, 11.f, 12.f, 13.f, 14.f, 15.f}, kW4FloatScales,
     W4Offset::Bias, false, 64},
};
#undef LOWBIT_E2M1_VALUES

inline const W4Format* find_w4_format(const char* name) {
  for (const W4Format& f : kW4Formats)
    if (std::strcmp(f.name, name) == 0) return &f;
  return nullptr;
}

// One stored group scale as fp32 (exact for every encoding).
inline float w4_scale_to_float(W4Scale enc, const void* scales, int64_t i) {
  uint32_t bits = 0;
  switch (enc) {
    case W4Scale::F32: {
      float f;
      std::memcpy(&f, static_cast<const float*>(scales) + i, 4);
      return f;
    }
    case W4Scale::BF16:
      bits = uint32_t(static_cast<const uint16_t*>(scales)[i]) << 16;
      break;
    case W4Scale::F16: {
      const uint32_t h = static_cast<const uint16_t*>(scales)[i];
      const uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
      if (e == 0x1F) {
        bits = sign | 0x7F800000u | (m << 13);
      } else if (e != 0) {
        bits = sign | ((e + 112) << 23) | (m << 13);
      } else {  // zero or subnormal: m * 2^-24, exact in fp32
        float f = float(m) * (1.f / 16777216.f);
        return sign ? -f : f;
      }
      break;
    }
    case W4Scale::E4M3:
      return fp8_e4m3_value(static_cast<const uint8_t*>(scales)[i]);
    case W4Scale::E8M0: {
      const uint8_t b = static_cast<const uint8_t*>(scales)[i];
      if (b == 0xFF) return std::numeric_limits<float>::quiet_NaN();
      bits = b == 0 ? 0x00400000u : uint32_t(b) << 23;  // 2^-127 is an fp32 subnormal
      break;
    }
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

}  // namespace lowbit
