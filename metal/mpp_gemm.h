// The low-bit GEMM body on Apple M5's tensor units (Metal 4 matmul2d, MSL 4.0), shared by the fp8 prefill kernels
// (fp8_gemm_mpp.h) and the 4-bit one (w4_gemm_mpp.h), which differ only in their weight: a policy type W that
// decodes weight rows into threadgroup memory and says how partial sums become outputs.
//
// One threadgroup of kFp8MppThreads (4 simdgroups) computes a BM x kFp8MppBN output tile. K is cut into segments
// of at most kFp8MppBK that end where W's scales change (W::segment_end); per segment W stages the weight rows
// decoded into T (exact: each W decodes only what T holds exactly), and the activations are read as a tensor
// straight from device memory whose extents end at the segment and at the tile's last row, so the op reads zeros
// past them (never 0 * inf from a neighbour's activations). Each segment's products accumulate in a cooperative
// tensor `part`; where W's scales end (W::folds_after) part goes through W::fold into `acc`, and the epilogue
// writes W::finish(acc) plus the bias. Both read elements through the cooperative tensor's own index API (no
// lane layout assumed). Products are exact in fp32 and summed in fp32 (half x half -> float, bfloat x bfloat ->
// float from OS 26.1, relaxed_precision = false).
//
// W provides:
//   uint segment_end(uint k0, uint K)          the end of the segment that starts at k0 (<= k0 + kFp8MppBK, <= K)
//   bool folds_after(uint k1, uint K)          whether the partial sums are folded after a segment ending at k1
//   void stage(threadgroup T* ws, device const T* x, uint rows, uint n0, uint k0, uint k1, uint tid)
//                                              ws[r * kFp8MppBK + kk] = weight[n0 + r, k0 + kk], zeros past N and
//                                              k1; x / rows: the tile's activations (for sums of them)
//   float fold(float part, uint r, uint n, uint k0)   what a segment's partial sum at (r, n) adds to acc (k0: the
//                                              start of the segment folded last)
//   float finish(float acc, uint n)            the output before its bias
#pragma once
#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
#include "bias.h"
#include "params.h"
using namespace metal;
using namespace mpp::tensor_ops;

// out[r, n0 + c] for tile rows r < rows and columns n0 + c < N; x and out point at the tile's first row (row
// strides K and N). ws: threadgroup memory of kFp8MppBN * kFp8MppBK elements. Every thread of the threadgroup
// (kFp8MppThreads) must call this: it has barriers and tensor-op collectives.
template <typename T, uint BM, typename W>
inline void mpp_gemm_tile(device T* x, uint rows, thread const W& w, BiasRef bias, device T* out, uint n0, uint N,
                          uint K, threadgroup T* ws, uint tid) {
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
  for (uint k0 = 0; k0 < K;) {
    const uint k1 = w.segment_end(k0, K);
    w.stage(ws, x, rows, n0, k0, k1, tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    XTensor xt(x + k0, dextents<int32_t, 2>(int(k1 - k0), int(rows)), array<int, 2>{1, int(K)});
    op.run(xt, wt, part);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the next segment overwrites ws
    if (w.folds_after(k1, K)) {
      for (uint16_t i = 0; i < acc.get_capacity(); ++i) {
        if (!acc.is_valid_element(i)) {
          continue;
        }
        const auto idx = acc.get_multidimensional_index(i);
        acc[i] += w.fold(part[i], uint(idx[1]), n0 + uint(idx[0]), k0);
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
      out[ulong(r) * N + n] = T(add_bias(bias, w.finish(acc[i], n), n));
    }
  }
}
