// The fp8 GEMM body on Apple M5's tensor units (Metal 4 matmul2d, MSL 4.0), shared by fp8_mm's prefill kernel
// (fp8_gemm_apple10.metal) and fp8_grouped_mm's (fp8_grouped_mm_apple10.metal); fp8_gemm.h is its portable twin
// and this file keeps its numerics: fp8 weights decode exactly into T (half or bfloat: every e4m3 value is exact
// in both), activations stay in their own dtype, products are exact in fp32 and summed in fp32
// (matmul2d half x half -> float, bfloat x bfloat -> float from OS 26.1, relaxed_precision = false).
//
// One threadgroup of 4 simdgroups computes a BM x kFp8MppBN output tile. Per K segment (at most kFp8MppBK, never
// crossing a K block of block scales) the weight rows are decoded into threadgroup memory (as llama.cpp's and
// MLX's quantized tensor-op kernels do: the fp8 formats the tensor units take are not e4m3fn with its NaN
// codes); the activations are read as a tensor straight from device memory whose extents end at the segment
// and at the tile's last row, so the op reads zeros past them (never 0 * inf from a neighbour's activations).
// Each segment's products accumulate in a cooperative tensor `part`; at the end of a K block part * scale is
// added to `acc` (block scales multiply the block's partial sums, design.md); per-tensor and per-channel scales
// multiply once in the epilogue. The epilogue reads both through the cooperative tensor's own index API.
#pragma once
#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
#include "bias.h"
#include "fp8.h"
#include "scale.h"
using namespace metal;
using namespace mpp::tensor_ops;

// Decode weight rows n0 .. n0 + kFp8MppBN, K range k0 .. k0 + len, into ws [kFp8MppBN][kFp8MppBK] (row = output
// column n), zeros past N and past the segment. Consecutive threads read consecutive bytes of a row.
template <typename T>
inline void mpp_stage_weight(threadgroup T* ws, device const uchar* w, uint n0, uint N, uint K, uint k0, uint len,
                             uint tid) {
  for (uint e = tid; e < kFp8MppBN * kFp8MppBK; e += kFp8MppThreads) {
    const uint r = e / kFp8MppBK, kk = e % kFp8MppBK;
    ws[e] = n0 + r < N && kk < len ? T(fp8_e4m3_to_float(w[ulong(n0 + r) * K + k0 + kk])) : T(0.0f);
  }
}

// out[r, n0 + c] for tile rows r < rows and columns n0 + c < N; x and out point at the tile's first row (row
// strides K and N). ws: threadgroup memory of kFp8MppBN * kFp8MppBK elements. Every thread of the threadgroup
// (kFp8MppThreads) must call this: it has barriers and tensor-op collectives.
template <typename T, uint BM>
inline void fp8_gemm_mpp_tile(device T* x, uint rows, device const uchar* w, device const float* scale,
                              constant ScaleParams& sp, BiasRef bias, device T* out, uint n0, uint N, uint K,
                              threadgroup T* ws, uint tid) {
  constexpr auto desc = matmul2d_descriptor(int(BM), int(kFp8MppBN), int(kFp8MppBK), false, true, false,
                                            matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<desc, execution_simdgroups<kFp8MppThreads / 32>> op;
  auto wt = tensor<threadgroup T, dextents<int32_t, 2>, tensor_inline>(
      ws, dextents<int32_t, 2>(int(kFp8MppBK), int(kFp8MppBN)));
  using XTensor = tensor<device T, dextents<int32_t, 2>, tensor_inline>;
  auto part = op.template get_destination_cooperative_tensor<XTensor, decltype(wt), float>();
  auto acc = op.template get_destination_cooperative_tensor<XTensor, decltype(wt), float>();
  for (uint16_t i = 0; i < acc.get_capacity(); ++i) {
    if (acc.is_valid_element(i)) {
      part[i] = 0.0f;
      acc[i] = 0.0f;
    }
  }
  const bool block = sp.kind == kScalePerBlock;
  for (uint k0 = 0; k0 < K;) {
    uint k1 = min(k0 + kFp8MppBK, K);
    if (block) {
      k1 = uint(min(ulong(k1), ulong(k0 - k0 % sp.bk) + sp.bk));  // stay inside one K block
    }
    mpp_stage_weight<T>(ws, w, n0, N, K, k0, k1 - k0, tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    XTensor xt(x + k0, dextents<int32_t, 2>(int(k1 - k0), int(rows)), array<int, 2>{1, int(K)});
    op.run(xt, wt, part);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the next segment overwrites ws
    if (k1 == K || (block && k1 % sp.bk == 0)) {       // end of a K block: fold its partial sums into acc
      for (uint16_t i = 0; i < acc.get_capacity(); ++i) {
        if (!acc.is_valid_element(i)) {
          continue;
        }
        const uint n = n0 + uint(acc.get_multidimensional_index(i)[0]);
        acc[i] += part[i] * (block && n < N ? weight_scale(sp, scale, n, k0) : 1.0f);
        part[i] = 0.0f;
      }
    }
    k0 = k1;
  }
  for (uint16_t i = 0; i < acc.get_capacity(); ++i) {
    if (!acc.is_valid_element(i)) {
      continue;
    }
    const auto idx = acc.get_multidimensional_index(i);
    const uint r = uint(idx[1]), n = n0 + uint(idx[0]);
    if (r < rows && n < N) {
      const float v = block ? acc[i] : acc[i] * weight_scale(sp, scale, n, 0);
      out[ulong(r) * N + n] = T(add_bias(bias, v, n));
    }
  }
}
