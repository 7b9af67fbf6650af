// Scale lookup for fp8 weights, shared by every kernel (layouts: params.h ScaleParams).
// Kernels that walk a row find the row's scales once (scale_row) and index them per K block (row_scale), so
// the hot loop holds no division by bn; a power-of-two bk (128 in every checkpoint format) is a shift.
#pragma once
#include <metal_stdlib>
#include "params.h"
using namespace metal;

constant constexpr uint kScalePerTensor = 0;
constant constexpr uint kScalePerChannel = 1;
constant constexpr uint kScalePerBlock = 2;

// The K block holding column k (kind 2).
inline uint scale_block_k(constant ScaleParams& p, uint k) {
  return p.bk_shift != kScaleBkNoShift ? k >> p.bk_shift : k / p.bk;
}

// The scales every column of weight row n shares: scale itself (per tensor), its element (per channel), or
// its row of K blocks. Only address arithmetic: nothing is read, so n may be past N.
inline device const float* scale_row(constant ScaleParams& p, device const float* scale, uint n) {
  if (p.kind == kScalePerTensor) return scale;
  if (p.kind == kScalePerChannel) return scale + n;
  return scale + ulong(n / p.bn) * p.kb;
}

// The multiplier of column k of the row whose scale_row is `row`.
inline float row_scale(constant ScaleParams& p, device const float* row, uint k) {
  return p.kind == kScalePerBlock ? row[scale_block_k(p, k)] : row[0];
}

// The multiplier of weight element (n, k).
inline float weight_scale(constant ScaleParams& p, device const float* scale, uint n, uint k) {
  return row_scale(p, scale_row(p, scale, n), k);
}
