// fp8_mm for few activation rows: the register-resident GEMV body of fp8_gemv.h.
//   fp8_gemv_*       M == 1: MR = 1 row, kFp8GemvColsM1 = 4 output columns per simdgroup
//   fp8_gemv_rows_*  small M: kFp8GemvRows = 8 rows per pass (grid y), kFp8GemvColsRows = 2 columns per
//                    simdgroup; each weight chunk is decoded once and used for all rows of the pass
// Threadgroup: kFp8GemvSimdgroups = 2 simdgroups (64 threads); grid x = ceil(N / (2 * R)).
#include <metal_stdlib>
#include "fp8_gemv.h"
using namespace metal;

template <typename T, uint MR, uint R>
kernel void fp8_gemv(
    device const T* x [[buffer(0)]],
    device const uchar* w [[buffer(1)]],
    device const float* scale [[buffer(2)]],
    device const float* bias [[buffer(3)]],
    device T* out [[buffer(4)]],
    constant Fp8MmParams& p [[buffer(5)]],
    uint2 tgid [[threadgroup_position_in_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  const uint n0 = (tgid.x * kFp8GemvSimdgroups + sg) * R;
  const uint m0 = tgid.y * MR;
  if (n0 >= p.N || m0 >= p.M) {
    return;  // the whole simdgroup; the kernel has no barrier
  }
  fp8_gemv_rows<T, MR, R>(x + ulong(m0) * p.K, min(MR, p.M - m0), w, scale, p.scale, bias,
                          (p.flags & kFp8HasBias) != 0, out + ulong(m0) * p.N, n0, p.N, p.K,
                          (p.flags & kFp8VecLoads) != 0, lane);
}

template [[host_name("fp8_gemv_float")]] [[kernel]] decltype(fp8_gemv<float, 1, kFp8GemvColsM1>) fp8_gemv<float, 1, kFp8GemvColsM1>;
template [[host_name("fp8_gemv_half")]] [[kernel]] decltype(fp8_gemv<half, 1, kFp8GemvColsM1>) fp8_gemv<half, 1, kFp8GemvColsM1>;
template [[host_name("fp8_gemv_bfloat")]] [[kernel]] decltype(fp8_gemv<bfloat, 1, kFp8GemvColsM1>) fp8_gemv<bfloat, 1, kFp8GemvColsM1>;
template [[host_name("fp8_gemv_rows_float")]] [[kernel]] decltype(fp8_gemv<float, kFp8GemvRows, kFp8GemvColsRows>) fp8_gemv<float, kFp8GemvRows, kFp8GemvColsRows>;
template [[host_name("fp8_gemv_rows_half")]] [[kernel]] decltype(fp8_gemv<half, kFp8GemvRows, kFp8GemvColsRows>) fp8_gemv<half, kFp8GemvRows, kFp8GemvColsRows>;
template [[host_name("fp8_gemv_rows_bfloat")]] [[kernel]] decltype(fp8_gemv<bfloat, kFp8GemvRows, kFp8GemvColsRows>) fp8_gemv<bfloat, kFp8GemvRows, kFp8GemvColsRows>;
