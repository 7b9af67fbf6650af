// Must not compile (tests/test_emulator_tensor_ops.py): bfloat operands need OS 26.1 in Apple's table, and this
// file targets 26.0 (the emulator's MSL_EMU_TENSOR_OS; the shipped kernels target 26.2).
#define MSL_EMU_TENSOR_OS 2600
#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;
using namespace mpp::tensor_ops;

kernel void mm_bfloat(device bfloat* a [[buffer(0)]], device bfloat* b [[buffer(1)]]) {
  auto A = tensor<device bfloat, dextents<int32_t, 2>, tensor_inline>(a, dextents<int32_t, 2>(16, 64));
  auto B = tensor<device bfloat, dextents<int32_t, 2>, tensor_inline>(b, dextents<int32_t, 2>(16, 64));
  constexpr auto desc = matmul2d_descriptor(64, 64, 16, false, true, false);
  matmul2d<desc, execution_simdgroups<4>> op;
  auto c = op.get_destination_cooperative_tensor<decltype(A), decltype(B), float>();
  op.run(A, B, c);
}
