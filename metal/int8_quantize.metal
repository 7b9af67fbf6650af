// int8_quantize: per-row symmetric absmax quantization, scale = absmax / 127, q = rint(x / scale) clamped
// to [-127, 127]; an all-zero row gives q = 0 and scale = 0.
//
// One threadgroup per row, threads_per_threadgroup a multiple of 32 (the plan picks 32..256 from K).
// Thread t handles elements t, t + T, t + 2T, ... (consecutive lanes read consecutive elements, so every
// load instruction is coalesced, for any K and any row alignment). absmax: simd_max per simdgroup, the
// partials through threadgroup memory, then every simdgroup reduces the partials itself (no second barrier).
// The row is then read a second time to quantize; it was just read, so that pass is served by the cache.
//
// Divisions use precise::divide: Metal's default fast math computes x / y with a reciprocal, which is not
// correctly rounded and would move q by one near .5 ties relative to the fp32 reference (and the CPU).
#include <metal_stdlib>
#include "params.h"
using namespace metal;

constant constexpr uint kQuantizeMaxSimdgroups = 32;  // 1024 threads

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
  threadgroup float partial[kQuantizeMaxSimdgroups];
  device const T* xr = x + ulong(row) * p.K;
  float amax = 0.0f;
  for (uint k = tid; k < p.K; k += nthreads) {
    amax = max(amax, fabs(float(xr[k])));
  }
  amax = simd_max(amax);
  if (lane == 0) {
    partial[sg] = amax;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  amax = simd_max(lane < nsg ? partial[lane] : 0.0f);
  const float s = precise::divide(amax, 127.0f);
  if (tid == 0) {
    scale[row] = s;
  }
  device char* qr = q + ulong(row) * p.K;
  for (uint k = tid; k < p.K; k += nthreads) {
    const float r = s > 0.0f ? rint(precise::divide(float(xr[k]), s)) : 0.0f;
    qr[k] = char(clamp(r, -127.0f, 127.0f));
  }
}

template [[host_name("int8_quantize_float")]] [[kernel]] decltype(int8_quantize<float>) int8_quantize<float>;
template [[host_name("int8_quantize_half")]] [[kernel]] decltype(int8_quantize<half>) int8_quantize<half>;
template [[host_name("int8_quantize_bfloat")]] [[kernel]] decltype(int8_quantize<bfloat>) int8_quantize<bfloat>;
