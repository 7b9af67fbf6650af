#include "metal/plan_mm_t.h"

namespace lowbit::metal {

MmTKernel choose_mm_t_kernel(int64_t M) {
  if (M <= 1) return MmTKernel::Gemv;
  if (M <= kMmTGemvRows) return MmTKernel::GemvRows;
  return MmTKernel::Gemm;
}

std::string mm_t_kernel_name(const char* op, MmTKernel k, at::ScalarType dtype) {
  const char* variant = k == MmTKernel::Gemv ? "_gemv_" : k == MmTKernel::GemvRows ? "_gemv_rows_" : "_gemm_";
  return std::string(op) + variant + kernel_dtype_suffix(dtype);
}

uint32_t mm_t_flags(const at::Tensor& g, int64_t N, const at::Tensor& w_bits, int64_t K) {
  return (vector_access_ok(kMmTWeightVecBytes, K, {w_bits}) ? kMmTWeightVec : 0u) |
         (vector_access_ok(kMmTGradVecBytes, N, {g}) ? kMmTGradVec : 0u);
}

bool mm_t_empty(const at::Tensor& out, int64_t N) {
  if (out.numel() == 0) return true;
  if (N == 0) {
    out.zero_();
    return true;
  }
  return false;
}

void run_mm_t(Target t, const char* op, const at::Tensor& g, const at::Tensor& w_bits, const at::Tensor& scale,
              const ScaleParams& sp, const at::Tensor& out, int64_t M, int64_t N, int64_t K) {
  MmTParams p{};
  p.M = checked_u32("M", M);
  p.N = checked_u32("N", N);
  p.K = checked_u32("K", K);
  p.flags = mm_t_flags(g, N, w_bits, K);
  p.scale = sp;
  MmTKernel k = choose_mm_t_kernel(M);
  // the GEMVs take 256 threads: where their pipeline takes fewer, the narrower GEMM (128 threads, any M) runs
  if (k != MmTKernel::Gemm && !t.fits(mm_t_kernel_name(op, k, g.scalar_type()), kMmTGemvSimdgroups * 32))
    k = MmTKernel::Gemm;
  Dispatch d(mm_t_kernel_name(op, k, g.scalar_type()));
  d.buffer("grad_out", g).buffer("weight", w_bits).buffer("scale", scale);
  d.buffer("out", out, Access::Write).value("params", p);
  if (k == MmTKernel::Gemm) {
    d.grid({checked_u32("grid x", ceil_div(K, kFp8GemmTile)), checked_u32("grid y", ceil_div(M, kFp8GemmTile)), 1},
           {kFp8GemmThreads, 1, 1});
  } else {
    const int64_t rows = k == MmTKernel::Gemv ? 1 : kMmTGemvRows;
    d.grid({checked_u32("grid x", ceil_div(K, kMmTGemvCols)), checked_u32("grid y", ceil_div(M, rows)), 1},
           {kMmTGemvSimdgroups * 32, 1, 1});
  }
  t.run(d);
}

}  // namespace lowbit::metal
