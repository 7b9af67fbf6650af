// int8_mm for small M (the decode case): a GEMV-style kernel with exact int32 accumulation.
//
// Geometry (params.h): a threadgroup of kInt8GemvSimdgroups (2) simdgroups; simdgroup s owns kInt8GemvRows (2)
// consecutive weight rows (output columns), so a threadgroup owns 4 rows (N = 1024 is 256 threadgroups, enough
// to fill a 40-core GPU several times over); it also owns up to kInt8GemvXRows (4) rows of x. Grid x:
// ceil(M / 4), grid y: ceil(N / 4); x-slices of the same weight rows are neighbours in dispatch order, so a
// weight row read for one slice is still in cache for the next.
// K advances 512 bytes per step. Each step the x chunk (4 rows x 512 bytes) is staged once per threadgroup in
// threadgroup memory; then lane l of every simdgroup reads bytes [16 l, 16 l + 16) of the step from each of
// its weight rows: consecutive lanes read consecutive 16-byte chunks of one row (512 contiguous bytes per load
// instruction, every 128-byte line fully used), and each weight chunk is reused for all x rows.
// Products are widened to int and summed in int32 (exact while K <= 2^31 / 2^14, checked by the plan);
// one simd_sum per (row, x row), then lane kInt8GemvXRows * r + m writes out[m, r] through the fp32 epilogue.
#include <metal_stdlib>
#include "int8.h"
#include "instantiate.h"
using namespace metal;

constant constexpr uint kGemvThreads = kInt8GemvSimdgroups * 32;
constant constexpr uint kGemvChunks = kInt8GemvStepK / 16;  // 16-byte chunks of a step: one per lane

template <typename T, bool Aligned>
kernel void int8_gemv(
    device const uchar* xq [[buffer(0)]],
    device const float* x_scale [[buffer(1)]],
    device const uchar* wq [[buffer(2)]],
    device const float* w_scale [[buffer(3)]],
    device const uchar* bias [[buffer(4)]],
    device T* out [[buffer(5)]],
    constant Int8MmParams& p [[buffer(6)]],
    uint2 tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup int4 xs[kInt8GemvXRows * kGemvChunks];
  const uint m0 = tg.x * kInt8GemvXRows;
  const uint mc = min(kInt8GemvXRows, p.M - m0);
  const uint n0 = (tg.y * kInt8GemvSimdgroups + sg) * kInt8GemvRows;

  int acc[kInt8GemvRows][kInt8GemvXRows];
  for (uint r = 0; r < kInt8GemvRows; r++) {
    for (uint m = 0; m < kInt8GemvXRows; m++) {
      acc[r][m] = 0;
    }
  }
  for (uint kb = 0; kb < p.K; kb += kInt8GemvStepK) {
    for (uint i = tid; i < mc * kGemvChunks; i += kGemvThreads) {
      const uint m = i / kGemvChunks;
      xs[i] = load_i8x16<Aligned>(xq + ulong(m0 + m) * p.K, kb + (i % kGemvChunks) * 16, p.K);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    int4 xv[kInt8GemvXRows];
    for (uint m = 0; m < kInt8GemvXRows; m++) {
      xv[m] = m < mc ? xs[m * kGemvChunks + lane] : int4(0);
    }
    const uint k0 = kb + lane * 16;
    for (uint r = 0; r < kInt8GemvRows; r++) {
      const uint n = n0 + r;
      if (n < p.N) {  // uniform across the simdgroup
        const int4 wv = load_i8x16<Aligned>(wq + ulong(n) * p.K, k0, p.K);
        for (uint m = 0; m < kInt8GemvXRows; m++) {
          if (m < mc) {  // uniform across the threadgroup
            acc[r][m] += dot_i8x16(xv[m], wv);
          }
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  int mine = 0;
  for (uint r = 0; r < kInt8GemvRows; r++) {
    for (uint m = 0; m < kInt8GemvXRows; m++) {
      const int s = simd_sum(acc[r][m]);
      if (lane == r * kInt8GemvXRows + m) {
        mine = s;
      }
    }
  }
  const uint r = lane / kInt8GemvXRows;
  const uint m = lane % kInt8GemvXRows;
  const uint n = n0 + r;
  if (r < kInt8GemvRows && n < p.N && m < mc) {
    out[ulong(m0 + m) * p.N + n] = int8_dequant<T>(float(mine), x_scale[m0 + m], w_scale, bias, p, n);
  }
}

LOWBIT_KERNEL(int8_gemv, int8_gemv, float, false)
LOWBIT_KERNEL(int8_gemv, int8_gemv, half, false)
LOWBIT_KERNEL(int8_gemv, int8_gemv, bfloat, false)
LOWBIT_KERNEL_VARIANT(int8_gemv, k16, int8_gemv, float, true)
LOWBIT_KERNEL_VARIANT(int8_gemv, k16, int8_gemv, half, true)
LOWBIT_KERNEL_VARIANT(int8_gemv, k16, int8_gemv, bfloat, true)
