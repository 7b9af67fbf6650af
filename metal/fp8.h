// fp8 e4m3fn -> float / half, shared by every kernel. MSL has no fp8 type before Metal 4.1.
//
// The 7 magnitude bits are moved into fp16 position (exponent field 4 -> 5 bits, mantissa 3 -> 10 bits):
// the fp16 value is then the e4m3 value times 2^-8 (bias 7 vs 15), so one multiply by 256 restores it.
// fp16 subnormals cover every e4m3 subnormal, so every finite code decodes exactly; a float32 route with
// a 2^120 factor could flush subnormals to zero under fast math. 0x7F / 0xFF are NaN, like torch.
#pragma once
#include <metal_stdlib>
using namespace metal;

constant constexpr uint kFp8QuietNaN = 0x7FC00000u;

inline half fp8_e4m3_to_half(uchar b) {
  // scalar ushort operands promote to int: cast the combined bits back before reinterpreting
  const ushort bits = ushort(((b & 0x80) << 8) | ((b & 0x7F) << 7));
  const half v = as_type<half>(bits) * half(256.0f);
  return (b & 0x7F) == 0x7F ? half(as_type<float>(kFp8QuietNaN)) : v;
}

inline float fp8_e4m3_to_float(uchar b) {
  return float(fp8_e4m3_to_half(b));
}

// Four codes at once (one 32-bit load).
inline float4 fp8x4_to_float4(uchar4 b) {
  const ushort4 s = ushort4(b);
  const ushort4 h = ((s & ushort(0x80)) << ushort(8)) | ((s & ushort(0x7F)) << ushort(7));
  float4 v = float4(as_type<half4>(h)) * 256.0f;
  const bool4 nan_code = (s & ushort(0x7F)) == ushort(0x7F);
  return select(v, float4(as_type<float>(kFp8QuietNaN)), nan_code);
}

// Four codes -> half4: exact (every e4m3 value is a half), for kernels that stage decoded weights as half.
inline half4 fp8x4_to_half4(uchar4 b) {
  const ushort4 s = ushort4(b);
  const ushort4 h = ((s & ushort(0x80)) << ushort(8)) | ((s & ushort(0x7F)) << ushort(7));
  const half4 v = as_type<half4>(h) * half(256.0f);
  const bool4 nan_code = (s & ushort(0x7F)) == ushort(0x7F);
  return select(v, half4(as_type<half>(ushort(0x7E00))), nan_code);  // fp16 quiet NaN
}

// A number format as a type: reads like a cast at every use (`float(w)`).
struct fp8_e4m3 {
  uchar bits;
  operator float() const { return fp8_e4m3_to_float(bits); }
  operator half() const { return fp8_e4m3_to_half(bits); }
};
