// A bias read as it is (bf16 / fp16 / fp32, LowbitDtype in params.h) and widened in the epilogue, so no
// separate kernel widens it to fp32 on every call. The buffer is bound as bytes; elements are naturally aligned.
#pragma once
#include <metal_stdlib>
#include "params.h"
using namespace metal;

inline float load_bias(device const uchar* bias, uint dtype, uint n) {
  if (dtype == kDtypeHalf) return float(((device const half*)bias)[n]);
  if (dtype == kDtypeBfloat) return float(((device const bfloat*)bias)[n]);
  return ((device const float*)bias)[n];
}

// An optional bias of the output columns; without one, data is never read.
struct BiasRef {
  device const uchar* data;
  uint dtype;  // LowbitDtype
  bool present;
};

inline BiasRef no_bias() {
  return BiasRef{nullptr, kDtypeFloat, false};
}

inline float add_bias(thread const BiasRef& b, float v, uint n) {
  return b.present ? v + load_bias(b.data, b.dtype, n) : v;
}

inline BiasRef fp8_mm_bias(constant Fp8MmParams& p, device const uchar* bias) {
  return BiasRef{bias, p.bias_dtype, (p.flags & kFp8HasBias) != 0};
}
