// The kernel choice of plan_int8_mm, exposed for tests (torch_lowbit._C._metal_int8_mm_kernel).
#pragma once
#include <cstdint>

namespace lowbit::metal {

enum class Int8MmKernel {
  Gemv,      // int8_gemv_*: small M, exact int32 accumulation (metal/int8_gemv.metal)
  GemmHalf,  // int8_gemm_*: tiled 8x8 simdgroup_matrix GEMM, int8 widened to half, fp32 accumulation
  // GemmMatmul2dInt: M5 / Metal 4 `matmul2d` int8 x int8 -> int32. Not written yet; it would be chosen
  // for M > kInt8GemvMaxM when the device supports it (MTLGPUFamilyApple10 / MSL 4), which the Target
  // would then have to carry.
};

Int8MmKernel choose_int8_mm_kernel(int64_t M, int64_t N, int64_t K);
const char* int8_mm_kernel_name(Int8MmKernel k);  // "gemv" / "gemm_half"

}  // namespace lowbit::metal
