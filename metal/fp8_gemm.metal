// fp8_mm for larger M: the tiled simdgroup-matrix GEMM of fp8_gemm.h.
// Grid (ceil(N / 32), ceil(M / 32)) threadgroups of kFp8GemmThreads = 128 threads; threadgroup memory: the
// 32 x 36 activation tile (T) and the 32 x 40 decoded weight tile (half), at most 7 KB.
#include <metal_stdlib>
#include "fp8_gemm.h"
#include "instantiate.h"
using namespace metal;

template <typename T>
kernel void fp8_gemm(
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
  threadgroup T xs[kFp8GemmTile * kGemmXStride];
  threadgroup half ws[kFp8GemmTile * kGemmWStride];
  const uint m0 = tgid.y * kFp8GemmTile;
  const uint n0 = tgid.x * kFp8GemmTile;
  fp8_gemm_tile<T>(x + ulong(m0) * p.K, min(kFp8GemmTile, p.M - m0), w, scale, p.scale, fp8_mm_bias(p, bias),
                   out + ulong(m0) * p.N, n0, p.N, p.K, (p.flags & kFp8VecLoads) != 0, xs, ws, tid, sg, lane);
}

LOWBIT_KERNEL(fp8_gemm, fp8_gemm, float)
LOWBIT_KERNEL(fp8_gemm, fp8_gemm, half)
LOWBIT_KERNEL(fp8_gemm, fp8_gemm, bfloat)
