// A copy of metal/fp8_dequantize.metal with a planted bug, loaded in place of the real kernels by
// tests/test_emulator.py to check the emulator launcher's error path through torch.ops.lowbit_emu.
// BUG (wrong tail bound): each thread converts 4 elements without clamping to K, so the last thread of a row
// reads past the row -- past the weight buffer on the last row -- whenever K % 4 != 0.
#include <metal_stdlib>
#include "fp8.h"
#include "scale.h"
using namespace metal;

template <typename T>
kernel void fp8_dequantize(
    device const uchar* w [[buffer(0)]],
    device const float* scale [[buffer(1)]],
    device T* out [[buffer(2)]],
    constant Fp8DequantizeParams& p [[buffer(3)]],
    uint2 gid [[thread_position_in_grid]]) {
  const uint n = gid.y;
  const uint k0 = gid.x * 4;
  if (n >= p.N || k0 >= p.K) {
    return;
  }
  const ulong row = ulong(n) * p.K;
  for (uint k = k0; k < k0 + 4; k++) {
    const float v = fp8_e4m3_to_float(w[row + k]) * weight_scale(p.scale, scale, n, k);
    if (k < p.K) out[row + k] = T(v);
  }
}

// Drops the last element of every row: the output keeps its poison there.
template <typename T>
kernel void fp8_dequantize_skip_last(
    device const uchar* w [[buffer(0)]],
    device const float* scale [[buffer(1)]],
    device T* out [[buffer(2)]],
    constant Fp8DequantizeParams& p [[buffer(3)]],
    uint2 gid [[thread_position_in_grid]]) {
  const uint n = gid.y;
  const uint k0 = gid.x * 4;
  if (n >= p.N || k0 >= p.K) {
    return;
  }
  const ulong row = ulong(n) * p.K;
  for (uint k = k0; k < min(k0 + 4, p.K - 1); k++) {
    out[row + k] = T(fp8_e4m3_to_float(w[row + k]) * weight_scale(p.scale, scale, n, k));
  }
}

template [[host_name("fp8_dequantize_float")]] [[kernel]] decltype(fp8_dequantize<float>) fp8_dequantize<float>;
template [[host_name("fp8_dequantize_half")]] [[kernel]] decltype(fp8_dequantize_skip_last<half>) fp8_dequantize_skip_last<half>;
