// The kernel choice of plan_int8_mm, exposed for tests (torch_lowbit._C._metal_int8_mm_kernel).
#pragma once
#include <cstdint>

#include "metal/launcher.h"

namespace lowbit::metal {

// The shape classes of int8_mm; each has its kernels in plan_int8_mm.cpp's kInt8MmKernels.
enum class Int8MmKernel {
  Gemv,      // int8_gemv_*: small M, exact int32 accumulation (metal/int8_gemv.metal)
  GemmHalf,  // int8_gemm_*: tiled 8x8 simdgroup_matrix GEMM, int8 widened to half (metal/int8_gemm.metal)
};

Int8MmKernel choose_int8_mm_kernel(int64_t M, int64_t N, int64_t K);
// The host_name base of the kernel the plan runs for this shape on this device ("int8_gemv", "int8_gemm", ...)
const char* int8_mm_kernel_base(int64_t M, int64_t N, int64_t K, const DeviceCaps& device);

}  // namespace lowbit::metal
