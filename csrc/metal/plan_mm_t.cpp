#include "metal/plan_mm_t.h"

namespace lowbit::metal {

MmTKernel choose_mm_t_kernel(int64_t M) {
  if (M <= 1) return MmTKernel::Gemv;
  if (M <= kMmTGemvRows) return MmTKernel::GemvRows;
  return MmTKernel::Gemm;
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

void run_mm_t(Target t, const KernelVariant<MmTKernel>& v, const at::Tensor& g, const at::Tensor& w_bits,
              const at::Tensor& scale, const ScaleParams& sp, const at::Tensor& out, int64_t M, int64_t N, int64_t K) {
  MmTParams p{};
  p.M = checked_u32("M", M);
  p.N = checked_u32("N", N);
  p.K = checked_u32("K", K);
  p.flags = mm_t_flags(g, N, w_bits, K);
  p.scale = sp;
  Dispatch d(kernel_name(v.base, g.scalar_type()));
  d.buffer("grad_out", g).buffer("weight", w_bits).buffer("scale", scale);
  d.buffer("out", out, Access::Write).value("params", p);
  grid_over_tiles(d, v.tile, M, K);
  t.run(d);
}

}  // namespace lowbit::metal
