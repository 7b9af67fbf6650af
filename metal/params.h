// Parameter structs passed by value (`constant P& p [[buffer(i)]]`), shared by the .metal kernels and the
// host plans (csrc/metal/plan_*.cpp), so both sides agree on the layout. 32-bit fields only.
#pragma once
#ifdef __METAL_VERSION__
#include <metal_stdlib>
#define LOWBIT_PARAMS_NAMESPACE_BEGIN
#define LOWBIT_PARAMS_NAMESPACE_END
#else
#include <cstdint>
#define LOWBIT_PARAMS_NAMESPACE_BEGIN namespace lowbit::metal { using uint = uint32_t;
#define LOWBIT_PARAMS_NAMESPACE_END }
#endif

LOWBIT_PARAMS_NAMESPACE_BEGIN

// How an fp8 weight's fp32 scale applies (lowbit::ScaleKind): 0 per tensor (scale[0]), 1 per output
// channel (scale[n]), 2 per [bn, bk] block (scale[(n / bn) * kb + k / bk]).
struct ScaleParams {
  uint kind;
  uint bn, bk;  // block size (kind 2)
  uint kb;      // blocks along K = ceil(K / bk) (kind 2)
};

struct Fp8DequantizeParams {
  uint N, K;
  ScaleParams scale;
};

// ---- int8 ----
struct Int8QuantizeParams {
  uint M, K;
};

struct Int8MmParams {
  uint M, N, K;
  uint w_per_channel;  // 1: w_scale[n]; 0: w_scale[0] for every column
  uint has_bias;       // 0: the bias buffer is a placeholder and is never read
};

LOWBIT_PARAMS_NAMESPACE_END
