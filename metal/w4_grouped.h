// The 4-bit grouped (MoE) kernels' shared pieces (w4_grouped_mm.metal, w4_grouped_mm_t.metal): one expert's slice
// of the stacked weight. Groups of rows, their clamping and the prefill tile table are fp8_grouped.h's.
#pragma once
#include <metal_stdlib>
#include "fp8_grouped.h"
#include "w4.h"
using namespace metal;

// Expert e's weight: its codes [N, ceil(K/2)], scales and offsets [N, G] and its global scale (1 without one).
struct W4Expert {
  device const uchar* codes;
  device const uchar* scale;
  device const uchar* offset;
  float gmul;
};

// e in [0, E): the kernels call it only for a clamped expert id (GroupSpan / GroupTile)
template <typename S, typename O>
inline W4Expert w4_expert(device const uchar* codes, device const uchar* scale, device const uchar* offset,
                          device const float* global_scale, constant W4Params& p, uint e) {
  const ulong groups = ulong(e) * p.N * p.G;  // scales (and offsets) before expert e
  W4Expert x;
  x.codes = codes + ulong(e) * p.N * ((p.K + 1) / 2);
  x.scale = scale + S::bytes(groups);
  x.offset = offset + O::template bytes<S>(groups);
  x.gmul = (p.flags & kW4HasGlobalScale) != 0 ? global_scale[e] : 1.0f;
  return x;
}
