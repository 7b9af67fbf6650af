// int8_quantize: per-row symmetric absmax quantization, scale = absmax / 127, q = rint(x / scale) clamped
// to [-127, 127]; an all-zero row gives q = 0 and scale = 0; a row holding NaN or +-inf gives q = 0 and
// scale NaN (the bits of the CPU's quiet NaN, 0x7FC00000).
//
// One threadgroup per row, threads_per_threadgroup a multiple of 32 (the plan picks 32..256 from K).
// Thread t handles elements t, t + T, t + 2T, ... (consecutive lanes read consecutive elements, so every
// load instruction is coalesced, for any K and any row alignment). absmax: simd_max per simdgroup, the
// partials through threadgroup memory, then every simdgroup reduces the partials itself (no second barrier).
// The row is then read a second time to quantize; it was just read, so that pass is served by the cache.
//
// The absmax is a max of |x|'s bits: for non-negative floats the unsigned order is the numeric order and
// every NaN lies above +inf, so one integer max also finds non-finite rows. Integer tests, unlike isnan / isinf,
// survive fast math, which may assume that floats are finite.
//
// Divisions use precise::divide: Metal's default fast math computes x / y with a reciprocal, which is not
// correctly rounded and would move q by one near .5 ties relative to the fp32 reference (and the CPU).
#include <metal_stdlib>
#include "params.h"
#include "instantiate.h"
using namespace metal;

constant constexpr uint kQuantizeMaxSimdgroups = 32;  // 1024 threads
constant constexpr uint kAbsMask = 0x7FFFFFFFu;
constant constexpr uint kInfBits = 0x7F800000u;
constant constexpr uint kNonFiniteScaleBits = 0x7FC00000u;

template <typename T>
kernel void int8_quantize(
    device const T* x [[buffer(0)]],
    device char* q [[buffer(1)]],
    device float* scale [[buffer(2)]],
    constant Int8QuantizeParams& p [[buffer(3)]],
    uint row [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint nthreads [[threads_per_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint nsg [[simdgroups_per_threadgroup]]) {
  threadgroup uint partial[kQuantizeMaxSimdgroups];
  device const T* xr = x + ulong(row) * p.K;
  uint amax = 0;
  for (uint k = tid; k < p.K; k += nthreads) {
    amax = max(amax, as_type<uint>(float(xr[k])) & kAbsMask);
  }
  amax = simd_max(amax);
  if (lane == 0) {
    partial[sg] = amax;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  amax = simd_max(lane < nsg ? partial[lane] : 0u);
  const bool finite = amax < kInfBits;
  const float s = finite ? precise::divide(as_type<float>(amax), 127.0f) : as_type<float>(kNonFiniteScaleBits);
  if (tid == 0) {
    scale[row] = s;
  }
  device char* qr = q + ulong(row) * p.K;
  for (uint k = tid; k < p.K; k += nthreads) {
    const float r = finite && s > 0.0f ? rint(precise::divide(float(xr[k]), s)) : 0.0f;
    qr[k] = char(clamp(r, -127.0f, 127.0f));
  }
}

LOWBIT_KERNEL(int8_quantize, int8_quantize, float)
LOWBIT_KERNEL(int8_quantize, int8_quantize, half)
LOWBIT_KERNEL(int8_quantize, int8_quantize, bfloat)
