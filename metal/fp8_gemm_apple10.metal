// fp8_mm prefill on Apple M5 (MTLGPUFamilyApple10, MSL 4.0): the tensor-op body of fp8_gemm_mpp.h for bf16 and
// fp16 activations (fp32 activations stay on the portable fp8_gemm: the tensor units would round them).
// Grid (ceil(N / 64), ceil(M / 64)) threadgroups of 128 threads, walked in Morton order (tile_order.h);
// threadgroup memory: the 64 x 64 decoded weight tile (8 KB).
#include <metal_stdlib>
#include "fp8_gemm_mpp.h"
#include "tile_order.h"
#include "instantiate.h"
using namespace metal;

template <typename T>
kernel void fp8_gemm_mpp(
    device T* x [[buffer(0)]],
    device const uchar* w [[buffer(1)]],
    device const float* scale [[buffer(2)]],
    device const uchar* bias [[buffer(3)]],
    device T* out [[buffer(4)]],
    constant Fp8MmParams& p [[buffer(5)]],
    uint2 tg [[threadgroup_position_in_grid]],
    uint2 tgs [[threadgroups_per_grid]],
    uint tid [[thread_index_in_threadgroup]]) {
  threadgroup T ws[kFp8MppBN * kFp8MppBK];
  const uint2 tile = morton_tile(tg.y * tgs.x + tg.x, tgs.x, tgs.y);
  const uint m0 = tile.y * kFp8MppBM;
  const uint n0 = tile.x * kFp8MppBN;
  fp8_gemm_mpp_tile<T, kFp8MppBM>(x + ulong(m0) * p.K, min(kFp8MppBM, p.M - m0), w, scale, p.scale,
                                  fp8_mm_bias(p, bias), out + ulong(m0) * p.N, n0, p.N, p.K, ws, tid);
}

LOWBIT_KERNEL(fp8_gemm_mpp, fp8_gemm_mpp, half)
LOWBIT_KERNEL(fp8_gemm_mpp, fp8_gemm_mpp, bfloat)
