// Scale lookup for fp8 weights, shared by every kernel (layouts: params.h ScaleParams).
#pragma once
#include <metal_stdlib>
#include "params.h"
using namespace metal;

constant constexpr uint kScalePerTensor = 0;
constant constexpr uint kScalePerChannel = 1;
constant constexpr uint kScalePerBlock = 2;

// The multiplier of weight element (n, k).
inline float weight_scale(constant ScaleParams& p, device const float* scale, uint n, uint k) {
  if (p.kind == kScalePerTensor) return scale[0];
  if (p.kind == kScalePerChannel) return scale[n];
  return scale[(n / p.bn) * p.kb + k / p.bk];
}
