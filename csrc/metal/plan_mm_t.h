// The plan code shared by the transposed products (plan_fp8_mm_t.cpp, plan_int8_weight_mm_t.cpp,
// plan_fp8_grouped_mm_t.cpp): one chooser, the vector-load flags, the dense launch. Kernels: metal/mm_t.h.
#pragma once
#include "metal/plans.h"

namespace lowbit::metal {

// M == 1: the GEMV reads every weight byte once per threadgroup column range. Up to kMmTGemvRows (8) rows
// the multi-row GEMV still decodes each weight once for all rows; past that the 32 x 32 tiled GEMM reuses
// each staged weight tile for 32 rows (the same switch points as fp8_mm's forward kernels).
enum class MmTKernel { Gemv, GemvRows, Gemm };
MmTKernel choose_mm_t_kernel(int64_t M);

// "<op>_gemv_<dtype>", "<op>_gemv_rows_<dtype>", "<op>_gemm_<dtype>"
std::string mm_t_kernel_name(const char* op, MmTKernel k, at::ScalarType dtype);

// MmTFlags for g [rows, N] and the weight codes (rows of K bytes), through vector_access_ok
uint32_t mm_t_flags(const at::Tensor& g, int64_t N, const at::Tensor& w_bits, int64_t K);

// out[M, K] = g[M, N] @ (dec(w) * scale) for M, N, K > 0, through the kernels of metal/mm_t.metal
void run_mm_t(Target t, const char* op, const at::Tensor& g, const at::Tensor& w_bits, const at::Tensor& scale,
              const ScaleParams& sp, const at::Tensor& out, int64_t M, int64_t N, int64_t K);

// The result of a transposed product with an empty size: no rows or columns, or an empty sum (N == 0).
// Returns true when `out` is already complete.
bool mm_t_empty(const at::Tensor& out, int64_t N);

}  // namespace lowbit::metal
