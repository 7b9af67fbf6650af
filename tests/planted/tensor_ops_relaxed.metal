// Must not compile (tests/test_emulator_tensor_ops.py): relaxed_precision = true is refused in our kernels.
#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;
using namespace mpp::tensor_ops;

kernel void mm_relaxed(device half* a [[buffer(0)]], device half* b [[buffer(1)]]) {
  auto A = tensor<device half, dextents<int32_t, 2>, tensor_inline>(a, dextents<int32_t, 2>(16, 64));
  auto B = tensor<device half, dextents<int32_t, 2>, tensor_inline>(b, dextents<int32_t, 2>(16, 64));
  constexpr auto desc = matmul2d_descriptor(64, 64, 16, false, true, true);
  matmul2d<desc, execution_simdgroups<4>> op;
  auto c = op.get_destination_cooperative_tensor<decltype(A), decltype(B), float>();
  op.run(A, B, c);
}
