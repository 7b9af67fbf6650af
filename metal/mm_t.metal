// fp8_mm_t and int8_weight_mm_t: out[M, K] = g[M, N] @ (dec(W[N, K]) * scale), the bodies of mm_t.h.
//   <op>_gemv_*       M == 1: grid (ceil(K / 128), 1)
//   <op>_gemv_rows_*  small M: kMmTGemvRows = 8 rows per pass, grid (ceil(K / 128), ceil(M / 8)); each decoded
//                     weight is used for every row of the pass
//     threadgroup: kMmTGemvSimdgroups = 8 simdgroups (256 threads), 4 KB of threadgroup memory
//   <op>_gemm_*       larger M: grid (ceil(K / 32), ceil(M / 32)), kFp8GemmThreads = 128 threads, 9 KB of
//                     threadgroup memory
// <op> is fp8_mm_t (e4m3 codes) or int8_weight_mm_t (int8 values, per-tensor or per-channel w_scale).
#include <metal_stdlib>
#include "mm_t.h"
#include "instantiate.h"
using namespace metal;

template <typename T, typename Code, uint MR>
kernel void mm_t_gemv(
    device const T* g [[buffer(0)]],
    device const uchar* w [[buffer(1)]],
    device const float* scale [[buffer(2)]],
    device T* out [[buffer(3)]],
    constant MmTParams& p [[buffer(4)]],
    uint2 tgid [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float4 red[kMmTGemvSimdgroups * 32];
  const uint m0 = tgid.y * MR;
  mm_t_gemv_rows<T, Code, MR>(g + ulong(m0) * p.N, min(MR, p.M - m0), w, scale, p.scale, out + ulong(m0) * p.K,
                              tgid.x * kMmTGemvCols, p.N, p.K, (p.flags & kMmTWeightVec) != 0, red, tid, sg, lane);
}

template <typename T, typename Code>
kernel void mm_t_gemm(
    device const T* g [[buffer(0)]],
    device const uchar* w [[buffer(1)]],
    device const float* scale [[buffer(2)]],
    device T* out [[buffer(3)]],
    constant MmTParams& p [[buffer(4)]],
    uint2 tgid [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  // alignas(16): float4 stores (mm_t.h): MSL promises a float array only 4-byte alignment
  alignas(16) threadgroup float gs[kFp8GemmTile * kGemmXStride];
  alignas(16) threadgroup float ws[kFp8GemmTile * kGemmXStride];
  const uint m0 = tgid.y * kFp8GemmTile;
  mm_t_gemm_tile<T, Code>(g + ulong(m0) * p.N, min(kFp8GemmTile, p.M - m0), w, scale, p.scale,
                          out + ulong(m0) * p.K, tgid.x * kFp8GemmTile, p.N, p.K, p.flags, gs, ws, tid, sg, lane);
}

LOWBIT_KERNEL(fp8_mm_t_gemv, mm_t_gemv, float, Fp8Code, 1)
LOWBIT_KERNEL(fp8_mm_t_gemv, mm_t_gemv, half, Fp8Code, 1)
LOWBIT_KERNEL(fp8_mm_t_gemv, mm_t_gemv, bfloat, Fp8Code, 1)
LOWBIT_KERNEL(fp8_mm_t_gemv_rows, mm_t_gemv, float, Fp8Code, kMmTGemvRows)
LOWBIT_KERNEL(fp8_mm_t_gemv_rows, mm_t_gemv, half, Fp8Code, kMmTGemvRows)
LOWBIT_KERNEL(fp8_mm_t_gemv_rows, mm_t_gemv, bfloat, Fp8Code, kMmTGemvRows)
LOWBIT_KERNEL(fp8_mm_t_gemm, mm_t_gemm, float, Fp8Code)
LOWBIT_KERNEL(fp8_mm_t_gemm, mm_t_gemm, half, Fp8Code)
LOWBIT_KERNEL(fp8_mm_t_gemm, mm_t_gemm, bfloat, Fp8Code)
LOWBIT_KERNEL(int8_weight_mm_t_gemv, mm_t_gemv, float, Int8Code, 1)
LOWBIT_KERNEL(int8_weight_mm_t_gemv, mm_t_gemv, half, Int8Code, 1)
LOWBIT_KERNEL(int8_weight_mm_t_gemv, mm_t_gemv, bfloat, Int8Code, 1)
LOWBIT_KERNEL(int8_weight_mm_t_gemv_rows, mm_t_gemv, float, Int8Code, kMmTGemvRows)
LOWBIT_KERNEL(int8_weight_mm_t_gemv_rows, mm_t_gemv, half, Int8Code, kMmTGemvRows)
LOWBIT_KERNEL(int8_weight_mm_t_gemv_rows, mm_t_gemv, bfloat, Int8Code, kMmTGemvRows)
LOWBIT_KERNEL(int8_weight_mm_t_gemm, mm_t_gemm, float, Int8Code)
LOWBIT_KERNEL(int8_weight_mm_t_gemm, mm_t_gemm, half, Int8Code)
LOWBIT_KERNEL(int8_weight_mm_t_gemm, mm_t_gemm, bfloat, Int8Code)
