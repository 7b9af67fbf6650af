// w4_grouped_mm_t on Metal (w4_grouped_mm's backward product): validate, then as the dense w4_mm_t the tiled
// GEMM for every T, over fp8_grouped_tiles' table of the row tiles that exist (plan_grouped.h).
#include "metal/plan_grouped.h"
#include "metal/plan_w4.h"

#include <ATen/ops/empty.h>

namespace lowbit::metal {
namespace {

// The kernels (plans.h KernelVariant: newer-GPU variants go before the portable line)
constexpr KernelVariant<AnyShape> kW4GroupedMmTKernels[] = {
    {AnyShape::All, "w4_grouped_mm_t_gemm", kPortableDevice},
};

}  // namespace

at::Tensor plan_w4_grouped_mm_t(Target t, const at::Tensor& grad_out, const at::Tensor& codes,
                                const at::Tensor& scale, const std::string& format, int64_t group_size, int64_t K,
                                const at::Tensor& offsets, const std::optional<at::Tensor>& expert_ids,
                                const std::optional<at::Tensor>& offset,
                                const std::optional<at::Tensor>& global_scale) {
  const W4GroupedMmArgs a = check_w4_grouped_mm("w4_grouped_mm_t", /*transposed=*/true, grad_out, codes, scale,
                                                format, group_size, K, offsets, expert_ids, offset, global_scale,
                                                /*validate_values=*/t.host_visible);
  const int64_t T = a.T, N = a.w.N, G = a.G;
  at::Tensor out = at::empty({T, K}, a.x.options());
  if (out.numel() == 0) return out;
  if (N == 0 || G == 0) return out.zero_();  // empty sums, or every row in no group

  // as the dense w4_mm_t, the tiled GEMM for every T (over the tile table: only the row tiles that exist run)
  const W4GroupedParams p = w4_grouped_params(a, vector_access_ok(kW4XVecBytes, N, {a.x}) ? kW4XVec : 0u);
  run_w4_grouped(t, pick_kernel(kW4GroupedMmTKernels, AnyShape::All, t.caps), "grad_out", a, p, out, false,
                 ceil_div(K, kW4GemmTile), kW4GemmThreads);
  return out;
}

}  // namespace lowbit::metal
