// One 64 x 64 tile of C = A B^T (A [M, K], B [N, K] half, straight from device memory) into a cooperative float
// destination, K in runs of 32 (multiply_accumulate), stored through the index API. Two kernel files instantiate
// it (tensor_ops_coop_a.metal, tensor_ops_coop_b.metal): the same matmul2d type in two translation units, as the
// fp8 and 4-bit M5 GEMMs are (tests/test_emulator_tensor_ops.py).
#pragma once
#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;
using namespace mpp::tensor_ops;

inline void mm_half_coop(device half* a, device half* b, device float* out, constant uint4& p) {
  const int M = int(p.x), N = int(p.y), K = int(p.z);
  constexpr auto desc = matmul2d_descriptor(64, 64, 32, false, true, false,
                                            matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<desc, execution_simdgroups<4>> op;
  using Operand = tensor<device half, dextents<int32_t, 2>, tensor_inline>;
  auto c = op.template get_destination_cooperative_tensor<Operand, Operand, float>();
  for (uint16_t i = 0; i < c.get_capacity(); ++i) {
    if (c.is_valid_element(i)) {
      c[i] = 0.0f;
    }
  }
  for (int k = 0; k < K; k += 32) {
    const int len = min(32, K - k);
    Operand A(a + k, dextents<int32_t, 2>(len, M), array<int, 2>{1, K});
    Operand B(b + k, dextents<int32_t, 2>(len, N), array<int, 2>{1, K});
    op.run(A, B, c);
  }
  for (uint16_t i = 0; i < c.get_capacity(); ++i) {
    if (!c.is_valid_element(i)) {
      continue;
    }
    const auto idx = c.get_multidimensional_index(i);
    if (idx[1] < M && idx[0] < N) {
      out[idx[1] * N + idx[0]] = c[i];
    }
  }
}
