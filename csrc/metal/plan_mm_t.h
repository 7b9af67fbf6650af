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

// The geometry of metal/mm_t.h's kernels (out [M, K]: bm rows of grad_out, bn columns of out per threadgroup),
// for the lines of each transposed op's table (KernelVariant<MmTKernel>, in the op's plan file). The kernels take
// MmTFlags for their aligned loads rather than vector variants.
inline constexpr TileGeometry kMmTGemvGeometry{1, kMmTGemvCols, kMmTGemvSimdgroups * 32, false};
inline constexpr TileGeometry kMmTGemvRowsGeometry{kMmTGemvRows, kMmTGemvCols, kMmTGemvSimdgroups * 32, false};
inline constexpr TileGeometry kMmTGemmGeometry{kFp8GemmTile, kFp8GemmTile, kFp8GemmThreads, false};

// The line of `kernels` a transposed product with M rows of grad_out runs on t: choose_mm_t_kernel's class, or the
// tiled GEMM (128 threads, any M) where the GEMVs' pipeline takes fewer than their 256 threads.
template <size_t N>
const KernelVariant<MmTKernel>& pick_mm_t_variant(const KernelVariant<MmTKernel> (&kernels)[N], const Target& t,
                                                  int64_t M, at::ScalarType dtype) {
  return pick_variant(kernels, choose_mm_t_kernel(M), MmTKernel::Gemm, t, dtype);
}

// MmTFlags for g [rows, N] and the weight codes (rows of K bytes), through vector_access_ok
uint32_t mm_t_flags(const at::Tensor& g, int64_t N, const at::Tensor& w_bits, int64_t K);

// out[M, K] = g[M, N] @ (dec(w) * scale) for M, N, K > 0, through kernel v (pick_mm_t_variant) of metal/mm_t.metal
void run_mm_t(Target t, const KernelVariant<MmTKernel>& v, const at::Tensor& g, const at::Tensor& w_bits,
              const at::Tensor& scale, const ScaleParams& sp, const at::Tensor& out, int64_t M, int64_t N, int64_t K);

// The result of a transposed product with an empty size: no rows or columns, or an empty sum (N == 0).
// Returns true when `out` is already complete.
bool mm_t_empty(const at::Tensor& out, int64_t N);

}  // namespace lowbit::metal
