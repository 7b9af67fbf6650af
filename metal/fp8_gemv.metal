// fp8_mm for few activation rows: the GEMV bodies of fp8_gemv.h.
//   fp8_gemv_*       M == 1: kFp8GemvSimdgroups simdgroups of kFp8GemvColsM1 output columns each, activations
//                    straight from device memory; grid x = ceil(N / (kFp8GemvSimdgroups * kFp8GemvColsM1)).
//   fp8_gemv_rows_*  small M: kFp8GemvRows = 8 rows per pass (grid y), kFp8GemvRowsSimdgroups simdgroups of
//                    kFp8GemvColsRows columns each; each step of the pass's activation rows is staged once per
//                    threadgroup and each weight chunk is decoded once and used for all rows of the pass.
// A bias is read in its own dtype (Fp8MmParams::bias_dtype).
#include <metal_stdlib>
#include "fp8_gemv.h"
#include "instantiate.h"
using namespace metal;

template <typename T>
kernel void fp8_gemv(
    device const T* x [[buffer(0)]],
    device const uchar* w [[buffer(1)]],
    device const float* scale [[buffer(2)]],
    device const uchar* bias [[buffer(3)]],
    device T* out [[buffer(4)]],
    constant Fp8MmParams& p [[buffer(5)]],
    uint2 tgid [[threadgroup_position_in_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  const uint n0 = (tgid.x * kFp8GemvSimdgroups + sg) * kFp8GemvColsM1;
  const uint m0 = tgid.y;
  if (n0 >= p.N || m0 >= p.M) {
    return;  // the whole simdgroup; the kernel has no barrier
  }
  gemv_body<T, 1, kFp8GemvColsM1>(x + ulong(m0) * p.K, 1, w, scale, p.scale, fp8_mm_bias(p, bias),
                                  out + ulong(m0) * p.N, n0, p.N, p.K, (p.flags & kFp8VecLoads) != 0, lane);
}

template <typename T>
kernel void fp8_gemv_multirow(
    device const T* x [[buffer(0)]],
    device const uchar* w [[buffer(1)]],
    device const float* scale [[buffer(2)]],
    device const uchar* bias [[buffer(3)]],
    device T* out [[buffer(4)]],
    constant Fp8MmParams& p [[buffer(5)]],
    uint2 tgid [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup vec<T, 4> xs[kFp8GemvRows * kGemvStagedVecs];
  const uint n0 = (tgid.x * kFp8GemvRowsSimdgroups + sg) * kFp8GemvColsRows;
  const uint m0 = tgid.y * kFp8GemvRows;
  // no early return for simdgroups past N: they take part in staging (and read no weights)
  gemv_body_staged<T, kFp8GemvRows, kFp8GemvColsRows>(x + ulong(m0) * p.K, min(kFp8GemvRows, p.M - m0), xs, w, scale,
                                                      p.scale, fp8_mm_bias(p, bias), out + ulong(m0) * p.N, n0, p.N,
                                                      p.K, (p.flags & kFp8VecLoads) != 0, tid,
                                                      kFp8GemvRowsSimdgroups * 32, lane);
}

LOWBIT_KERNEL(fp8_gemv, fp8_gemv, float)
LOWBIT_KERNEL(fp8_gemv, fp8_gemv, half)
LOWBIT_KERNEL(fp8_gemv, fp8_gemv, bfloat)
LOWBIT_KERNEL(fp8_gemv_rows, fp8_gemv_multirow, float)
LOWBIT_KERNEL(fp8_gemv_rows, fp8_gemv_multirow, half)
LOWBIT_KERNEL(fp8_gemv_rows, fp8_gemv_multirow, bfloat)
