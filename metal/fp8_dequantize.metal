// fp8_dequantize: the dense weight dec(w) * scale in T. One thread per 4 consecutive K elements of a row:
// with p.vec4 one 32-bit weight load (32 lanes read a whole 128-byte line) and 4 adjacent stores; the
// other cases (K % 4 != 0, or a weight not 4-byte aligned in its buffer) go element by element.
#include <metal_stdlib>
#include "fp8.h"
#include "scale.h"
#include "instantiate.h"
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
  device const float* srow = scale_row(p.scale, scale, n);
  if (p.vec4 != 0) {  // K % 4 == 0: the 4 elements are in range
    const float4 v = fp8x4_to_float4(*(device const uchar4*)(w + row + k0));
    for (uint j = 0; j < 4; j++) {  // block scales may change inside the 4 (bk % 4 != 0)
      out[row + k0 + j] = T(v[j] * row_scale(p.scale, srow, k0 + j));
    }
    return;
  }
  const uint k_end = min(k0 + 4, p.K);
  for (uint k = k0; k < k_end; k++) {
    out[row + k] = T(fp8_e4m3_to_float(w[row + k]) * row_scale(p.scale, srow, k));
  }
}

LOWBIT_KERNEL(fp8_dequantize, fp8_dequantize, float)
LOWBIT_KERNEL(fp8_dequantize, fp8_dequantize, half)
LOWBIT_KERNEL(fp8_dequantize, fp8_dequantize, bfloat)
