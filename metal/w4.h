// 4-bit weights (W4A16): the decode every w4 kernel shares. A weight is rows of ceil(K/2) bytes, two codes per
// byte along K (the even k in the low nibble), one scale per group of p.group consecutive k, an optional offset
// per group and an optional global scale (csrc/w4_formats.h). w[n, k] is computed in fp32 exactly as the format
// defines it: v * s, (v - zp) * s or v * s + b, v = value[code].
//
// The format reaches a kernel as data and as two template parameters: its 16-entry value table
// (W4Params::values), its scale encoding (S: the width and decode of the scale loads) and its offset kind (O).
// Kernels are instantiated for every S x O (csrc/metal/w4_instances.py), so a new format is a table line.
#pragma once
#include <metal_stdlib>
#include "bias.h"
#include "fp8.h"
#include "params.h"
using namespace metal;

// ---- scale encodings (lowbit::W4Scale): scale i of a buffer bound as bytes; elements are naturally aligned ----
// bytes(n): the size of n scales (a grouped kernel's step from one expert's scales to the next)
struct W4ScaleF32 {
  static float load(device const uchar* s, ulong i) { return ((device const float*)s)[i]; }
  static ulong bytes(ulong n) { return 4 * n; }
};
struct W4ScaleF16 {
  static float load(device const uchar* s, ulong i) { return float(((device const half*)s)[i]); }
  static ulong bytes(ulong n) { return 2 * n; }
};
struct W4ScaleBF16 {
  static float load(device const uchar* s, ulong i) { return float(((device const bfloat*)s)[i]); }
  static ulong bytes(ulong n) { return 2 * n; }
};
struct W4ScaleE4M3 {
  static float load(device const uchar* s, ulong i) { return fp8_e4m3_to_float(s[i]); }
  static ulong bytes(ulong n) { return n; }
};
// 2^(b - 127); 0xFF is NaN; b == 0 is 2^-127, an fp32 subnormal
struct W4ScaleE8M0 {
  static ulong bytes(ulong n) { return n; }
  static float load(device const uchar* s, ulong i) {
    const uint b = s[i];
    return b == 0xFFu ? as_type<float>(kFp8QuietNaN) : as_type<float>(b == 0u ? 0x00400000u : b << 23);
  }
};

// ---- offset kinds (lowbit::W4Offset): a group's terms and each format's own arithmetic, in fp32 ----
// A group: its scale s and its offset o (the zero point or the additive bias; unused without one).
struct W4Group {
  float s, o;
};

// bytes<S>(n): the size of n offsets (as W4Scale*::bytes)
struct W4OffsetNone {
  template <typename S>
  static float offset(device const uchar*, ulong) { return 0.0f; }
  template <typename S>
  static ulong bytes(ulong) { return 0; }
  static float apply(float v, W4Group g) { return v * g.s; }
  // the tensor-op GEMM (w4_gemm_mpp.h): what it stages for a code of value v (the weight before its group's scale,
  // exact in half and bfloat) and whether the group's sum of x times the offset joins the scaled sum
  static float unscaled(float v, float) { return v; }
  static bool adds_x_sums() { return false; }
};
struct W4OffsetZeroPoint {  // int8 zero points
  template <typename S>
  static float offset(device const uchar* o, ulong i) { return float(((device const char*)o)[i]); }
  template <typename S>
  static ulong bytes(ulong n) { return n; }
  static float apply(float v, W4Group g) { return (v - g.o) * g.s; }
  static float unscaled(float v, float zp) { return v - zp; }  // an integer of at most 8 bits: exact
  static bool adds_x_sums() { return false; }
};
struct W4OffsetBias {  // additive biases in the scale's encoding (MLX affine)
  template <typename S>
  static float offset(device const uchar* o, ulong i) { return S::load(o, i); }
  template <typename S>
  static ulong bytes(ulong n) { return S::bytes(n); }
  static float apply(float v, W4Group g) { return v * g.s + g.o; }
  static float unscaled(float v, float) { return v; }
  static bool adds_x_sums() { return true; }
};

template <typename S, typename O>
inline W4Group w4_group(device const uchar* scale, device const uchar* offset, ulong i) {
  return W4Group{S::load(scale, i), O::template offset<S>(offset, i)};
}

inline uint w4_group_of(constant W4Params& p, uint k) {
  return p.group_shift != kW4NoShift ? k >> p.group_shift : k / p.group;
}

// Bytes [b0, b0 + 4) of a row of rb bytes as one little-endian word, zeros past the row. Word: the row starts
// 4-byte aligned (kW4CodesWord; b0 is a multiple of 4 at every call).
inline uint w4_load_word(device const uchar* row, uint b0, uint rb, bool word) {
  if (word && b0 + 4 <= rb) {
    return *(device const uint*)(row + b0);
  }
  uint v = 0;
  for (uint j = 0; j < 4; j++) {
    if (b0 + j < rb) {
      v |= uint(row[b0 + j]) << (8 * j);
    }
  }
  return v;
}

// The 8 weights w[n, k0 .. k0 + 8) of the codes in `word` (k0 a multiple of 8, k0 < K), zeros past len = min(8,
// K - k0) so that nothing past K reaches a sum (not even a NaN scale times a zero activation). srow = n * G. With
// a group size that is a multiple of 8 the 8 codes share one group: one scale (and offset) load.
template <typename S, typename O>
inline void w4_decode8(constant W4Params& p, uint word, device const uchar* scale, device const uchar* offset,
                       ulong srow, uint k0, uint len, thread float4& lo, thread float4& hi) {
  const bool one_group = p.group % 8 == 0;
  W4Group g = w4_group<S, O>(scale, offset, srow + w4_group_of(p, k0));
  float w[8];
  for (uint j = 0; j < 8; j++) {
    w[j] = 0.0f;
    if (j < len) {
      if (!one_group && j > 0 && (k0 + j) % p.group == 0) {
        g = w4_group<S, O>(scale, offset, srow + w4_group_of(p, k0 + j));
      }
      w[j] = O::apply(p.values[(word >> (4 * j)) & 0xFu], g);
    }
  }
  lo = float4(w[0], w[1], w[2], w[3]);
  hi = float4(w[4], w[5], w[6], w[7]);
}

// Eight activations x[0 .. 8) as floats (exact for every T), zeros past len. Aligned: x is 16-byte aligned.
template <typename T>
inline void w4_load_x8(device const T* x, uint len, bool aligned, thread float4& lo, thread float4& hi) {
  if (aligned && len == 8) {
    const vec<T, 4> a = *(device const vec<T, 4>*)x;
    const vec<T, 4> b = *(device const vec<T, 4>*)(x + 4);
    lo = float4(a);
    hi = float4(b);
    return;
  }
  float v[8];
  for (uint j = 0; j < 8; j++) {
    v[j] = j < len ? float(x[j]) : 0.0f;
  }
  lo = float4(v[0], v[1], v[2], v[3]);
  hi = float4(v[4], v[5], v[6], v[7]);
}

inline float w4_global_scale(constant W4Params& p, device const float* global_scale) {
  return (p.flags & kW4HasGlobalScale) != 0 ? global_scale[0] : 1.0f;
}

inline BiasRef w4_mm_bias(constant W4Params& p, device const uchar* bias) {
  return BiasRef{bias, p.bias_dtype, (p.flags & kW4HasBias) != 0};
}
