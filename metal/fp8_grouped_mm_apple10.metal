// fp8_grouped_mm prefill on Apple M5 (MTLGPUFamilyApple10, MSL 4.0): the tensor-op body of fp8_gemm_mpp.h over
// the portable prefill's device-side tile table (fp8_grouped_tiles in fp8_grouped_mm.metal: 32-row tiles per
// segment, so a tile here is 32 rows x 64 columns), for bf16 and fp16 activations.
// Grid (ceil(N / 64), ceil(T / 32) + G + 1) threadgroups of 128 threads; threadgroup memory: the 64 x 64
// decoded weight tile. A group with expert id -1 zeroes its rows; tiles past the table return at once.
#include <metal_stdlib>
#include "fp8_gemm_mpp.h"
#include "fp8_grouped.h"
#include "instantiate.h"
using namespace metal;

template <typename T>
kernel void fp8_grouped_gemm_mpp(
    device T* x [[buffer(0)]],
    device const uchar* w [[buffer(1)]],
    device const float* scale [[buffer(2)]],
    device const uint* tiles [[buffer(3)]],
    device const int* expert_ids [[buffer(4)]],
    device T* out [[buffer(5)]],
    constant Fp8GroupedMmParams& p [[buffer(6)]],
    uint2 tgid [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]]) {
  threadgroup T ws[kFp8MppBN * kFp8MppBK];
  const GroupTile gt = group_tile(tiles, expert_ids, tgid.y, p);
  if (gt.rows == 0) {
    return;  // past the tiles that exist; the whole threadgroup
  }
  const uint n0 = tgid.x * kFp8MppBN, c1 = min(n0 + kFp8MppBN, p.N);
  if (gt.expert < 0) {
    zero_rows<T>(out, p.N, gt.m0, gt.m0 + gt.rows, n0, c1, tid, kFp8MppThreads);
    return;
  }
  device const uchar* we = w + ulong(gt.expert) * p.N * p.K;
  device const float* se = scale + ulong(gt.expert) * p.scale_stride;
  fp8_gemm_mpp_tile<T, kFp8GemmTile>(x + ulong(gt.m0) * p.K, gt.rows, we, se, p.scale, no_bias(),
                                     out + ulong(gt.m0) * p.N, n0, p.N, p.K, ws, tid);
}

LOWBIT_KERNEL(fp8_grouped_gemm_mpp, fp8_grouped_gemm_mpp, half)
LOWBIT_KERNEL(fp8_grouped_gemm_mpp, fp8_grouped_gemm_mpp, bfloat)
