// int8 helpers shared by the int8 kernels: 16-byte chunk loads of an int8 row, exact integer dot products,
// widening to half for the simdgroup-matrix GEMM, and the fp32 dequant epilogue.
#pragma once
#include <metal_stdlib>
#include "bias.h"
#include "params.h"
using namespace metal;

// Sixteen int8 values packed four per int component (little-endian): the unit every int8 kernel loads.
// `row` points at a row's first byte, k0 is a multiple of 16; values at k >= K read as 0.
// Aligned (K % 16 == 0, so every row starts on a 16-byte boundary): one 16-byte load, and a chunk is
// either wholly inside the row or wholly past its end. Otherwise rows start anywhere, so a vector load
// would be misaligned: guarded byte loads assembled into words. Bytes are read unsigned and reinterpreted
// later, so nothing depends on the signedness of `char`.
template <bool Aligned>
inline int4 load_i8x16(device const uchar* row, uint k0, uint K) {
  if (Aligned) {
    return k0 < K ? *((device const int4*)(row + k0)) : int4(0);
  }
  uint4 v = uint4(0);
  for (uint c = 0; c < 4; c++) {
    uint word = 0;
    for (uint b = 0; b < 4; b++) {
      const uint k = k0 + c * 4 + b;
      word |= k < K ? uint(row[k]) << (8 * b) : 0u;
    }
    v[c] = word;
  }
  return as_type<int4>(v);
}

// The four int8 values of one packed word, widened to int (exact).
inline int4 unpack_i8x4(int word) {
  return int4(as_type<char4>(word));
}

// sum_i a[i] * b[i] over 16 packed int8 pairs, exactly: |each product| <= 2^14, |sum| <= 2^18.
inline int dot_i8x16(int4 a, int4 b) {
  int s = 0;
  for (uint c = 0; c < 4; c++) {
    const int4 p = unpack_i8x4(a[c]) * unpack_i8x4(b[c]);
    s += (p.x + p.y) + (p.z + p.w);
  }
  return s;
}

// 16 packed int8 values -> 16 halves in threadgroup memory (int8 is exact in half). dst is 8-byte aligned.
inline void store_i8x16_as_half(threadgroup half* dst, int4 v) {
  for (uint c = 0; c < 4; c++) {
    *((threadgroup half4*)(dst + 4 * c)) = half4(as_type<char4>(v[c]));
  }
}

// out[m, n] = acc * x_scale[m] * w_scale[n] (+ bias[n]), formed in fp32 in this order (like the CPU kernel)
// and rounded once to T.
// The bias is read in its own dtype (p.bias_dtype).
template <typename T>
inline T int8_dequant(float acc, float xs, device const float* w_scale, device const uchar* bias,
                      constant Int8MmParams& p, uint n) {
  float v = acc * xs * w_scale[p.w_per_channel ? n : 0];
  if (p.has_bias != 0) {
    v += load_bias(bias, p.bias_dtype, n);
  }
  return T(v);
}
