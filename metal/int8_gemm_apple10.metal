// int8_mm for larger M on Apple M5 (MTLGPUFamilyApple10, MSL 4.0): Metal 4's tensor units through Metal
// Performance Primitives' matmul2d, int8 x int8 -> int32 (Apple's type table, MPPTensorOpsMatMul2d.h in the
// macOS 26.2 SDK: "int8_t int8_t int32_t"). The int32 sum is exact (the op's K <= 131071 keeps |sum| < 2^31) and
// is rounded to fp32 once, in the same epilogue as the portable kernel (int8.h int8_dequant): the two kernels
// give the same bits.
//
// Threadgroup: 4 simdgroups compute a 64 x 64 output tile (the seed's shape; MLX's quantized NAX kernels use the
// same 64 x 64 tile of 4 simdgroups). Both operands are read as tensors straight from device memory: x [M, K]
// has extents (K, M), the weight [N, K] has extents (K, N) and is the transposed right operand (Apple's header:
// "K = A.extents().extent(0) or B.extents().extent(0) for NT"). K advances kInt8MppBK per run in
// multiply_accumulate mode onto a zeroed cooperative destination; slices keep the whole tensors' bounds, so
// rows past M / N and K past its end read as 0 (Apple: run "will do edge checking ... against extents of
// original tensor"). The epilogue reads the destination through the cooperative tensor's own index API
// (is_valid_element, get_multidimensional_index: x = column, y = row), never an assumed lane layout: that
// layout is implementation-defined.
// Grid: (ceil(N / 64), ceil(M / 64)), walked in Morton order (tile_order.h).
#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
#include "int8.h"
#include "tile_order.h"
#include "instantiate.h"
using namespace metal;
using namespace mpp::tensor_ops;

#if !defined(__HAVE_TENSOR__)
#error "int8_gemm_apple10.metal needs MSL 4.0 with tensors (macOS 26 SDK): it is built only into lowbit_apple10"
#endif

template <typename T>
kernel void int8_gemm_mpp(
    device char* xq [[buffer(0)]],
    device const float* x_scale [[buffer(1)]],
    device char* wq [[buffer(2)]],
    device const float* w_scale [[buffer(3)]],
    device const uchar* bias [[buffer(4)]],
    device T* out [[buffer(5)]],
    constant Int8MmParams& p [[buffer(6)]],
    uint2 tg [[threadgroup_position_in_grid]],
    uint2 tgs [[threadgroups_per_grid]]) {
  const uint2 tile = morton_tile(tg.y * tgs.x + tg.x, tgs.x, tgs.y);
  const uint n0 = tile.x * kInt8MppBN;
  const uint m0 = tile.y * kInt8MppBM;

  auto x = tensor<device char, dextents<int32_t, 2>, tensor_inline>(xq, dextents<int32_t, 2>(int(p.K), int(p.M)));
  auto w = tensor<device char, dextents<int32_t, 2>, tensor_inline>(wq, dextents<int32_t, 2>(int(p.K), int(p.N)));
  constexpr auto desc = matmul2d_descriptor(int(kInt8MppBM), int(kInt8MppBN), int(kInt8MppBK), false, true, false,
                                            matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<desc, execution_simdgroups<kInt8MppThreads / 32>> op;

  auto acc = op.template get_destination_cooperative_tensor<decltype(x.slice(0, 0)), decltype(w.slice(0, 0)), int>();
  for (uint16_t i = 0; i < acc.get_capacity(); ++i) {
    if (acc.is_valid_element(i)) {
      acc[i] = 0;
    }
  }
  for (uint k = 0; k < p.K; k += kInt8MppBK) {
    auto x_tile = x.slice(int(k), int(m0));
    auto w_tile = w.slice(int(k), int(n0));
    op.run(x_tile, w_tile, acc);
  }

  for (uint16_t i = 0; i < acc.get_capacity(); ++i) {
    if (!acc.is_valid_element(i)) {
      continue;
    }
    const auto idx = acc.get_multidimensional_index(i);
    const uint m = m0 + uint(idx[1]);
    const uint n = n0 + uint(idx[0]);
    if (m < p.M && n < p.N) {
      out[ulong(m) * p.N + n] = int8_dequant<T>(float(acc[i]), x_scale[m], w_scale, bias, p, n);
    }
  }
}

LOWBIT_KERNEL(int8_gemm_mpp, int8_gemm_mpp, float)
LOWBIT_KERNEL(int8_gemm_mpp, int8_gemm_mpp, half)
LOWBIT_KERNEL(int8_gemm_mpp, int8_gemm_mpp, bfloat)
