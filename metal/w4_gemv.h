// The 4-bit GEMV body (decode of metal/w4.h), shared by w4_mm's GEMV kernels (w4_gemv.metal) and the grouped
// decode kernel (w4_grouped_mm.metal). A call computes kW4GemvCols output columns for up to MR activation rows
// in one simdgroup. Per step lane l reads the 16 code bytes (32 codes) at byte 16 l + 512 s of each of its rows:
// one load instruction of the 32 lanes covers 512 contiguous bytes of a row, four whole 128-byte lines. Codes are
// decoded 8 at a time (one 32-bit word) into fp32 and dotted against the activations; sums stay in fp32
// registers, one simd_sum per output at the end, which the global scale multiplies before the bias is added. No
// threadgroup memory and no barrier.
#pragma once
#include <metal_stdlib>
#include "w4.h"
using namespace metal;

constant constexpr uint kW4GemvStepBytes = 32 * kW4GemvLaneBytes;

// The lane's 16 code bytes at b0 of a row of rb bytes, zeros past the row. Vec: the row starts 16-byte aligned.
inline uint4 w4_load_lane_codes(device const uchar* row, uint b0, uint rb, uint flags) {
  if ((flags & kW4CodesVec) != 0 && b0 + kW4GemvLaneBytes <= rb) {
    return *(device const uint4*)(row + b0);
  }
  const bool word = (flags & kW4CodesWord) != 0;
  return uint4(w4_load_word(row, b0, rb, word), w4_load_word(row, b0 + 4, rb, word),
               w4_load_word(row, b0 + 8, rb, word), w4_load_word(row, b0 + 12, rb, word));
}

// out[m0 + m, n0 + r] for m < nrows (<= MR), r < kW4GemvCols, n0 + r < N; x and out point at row m0.
template <typename T, typename S, typename O, uint MR>
inline void w4_gemv_body(device const T* x, uint nrows, device const uchar* codes, device const uchar* scale,
                         device const uchar* offset, constant W4Params& p, float gmul, BiasRef bias, device T* out,
                         uint n0, uint lane) {
  constexpr uint R = kW4GemvCols;
  const uint K = p.K, rb = (K + 1) / 2;
  const bool x_vec = (p.flags & kW4XVec) != 0;
  bool live[R];
  device const uchar* rows[R];
  for (uint r = 0; r < R; r++) {
    live[r] = n0 + r < p.N;
    rows[r] = codes + ulong(live[r] ? n0 + r : 0) * rb;
  }
  float acc[MR][R];
  for (uint m = 0; m < MR; m++) {
    for (uint r = 0; r < R; r++) {
      acc[m][r] = 0.0f;
    }
  }
  for (uint b0 = lane * kW4GemvLaneBytes; b0 < rb; b0 += kW4GemvStepBytes) {
    uint4 cw[R];
    for (uint r = 0; r < R; r++) {
      cw[r] = live[r] ? w4_load_lane_codes(rows[r], b0, rb, p.flags) : uint4(0);
    }
    for (uint q = 0; q < 4; q++) {
      const uint k0 = 2 * b0 + 8 * q;
      if (k0 >= K) {
        break;
      }
      const uint len = min(8u, K - k0);
      float4 wlo[R], whi[R];
      for (uint r = 0; r < R; r++) {
        wlo[r] = float4(0.0f);
        whi[r] = float4(0.0f);
        if (live[r]) {
          w4_decode8<S, O>(p, cw[r][q], scale, offset, ulong(n0 + r) * p.G, k0, len, wlo[r], whi[r]);
        }
      }
      for (uint m = 0; m < MR; m++) {
        if (m < nrows) {
          float4 xlo, xhi;
          w4_load_x8<T>(x + ulong(m) * K + k0, len, x_vec, xlo, xhi);
          for (uint r = 0; r < R; r++) {
            acc[m][r] += dot(xlo, wlo[r]) + dot(xhi, whi[r]);
          }
        }
      }
    }
  }
  for (uint m = 0; m < MR; m++) {
    if (m >= nrows) {
      break;
    }
    for (uint r = 0; r < R; r++) {
      const float sum = simd_sum(acc[m][r]);
      const uint n = n0 + r;
      if (lane == (m * R + r) % 32 && n < p.N) {  // spread the stores over the lanes
        out[ulong(m) * p.N + n] = T(add_bias(bias, sum * gmul, n));
      }
    }
  }
}
