// w4_mm_t on Metal (w4_mm's backward product): validate, then the tiled transposed GEMM for every M (the fp8
// transposed plan's kernels read one fp32 scale layout and whole-byte codes, so they do not take 4-bit weights).
#include "metal/plan_mm_t.h"
#include "metal/plan_w4.h"

#include <ATen/ops/empty.h>

namespace lowbit::metal {
namespace {

// The kernels (plans.h KernelVariant: newer-GPU variants go before the portable line)
constexpr KernelVariant<AnyShape> kW4MmTKernels[] = {
    {AnyShape::All, "w4_mm_t_gemm", kPortableDevice},
};

}  // namespace

at::Tensor plan_w4_mm_t(Target t, const at::Tensor& grad_out, const at::Tensor& codes, const at::Tensor& scale,
                        const std::string& format, int64_t group_size, int64_t K,
                        const std::optional<at::Tensor>& offset, const std::optional<at::Tensor>& global_scale) {
  const W4MmArgs a = check_w4_mm_t(grad_out, codes, scale, format, group_size, K, offset, global_scale);
  const int64_t M = a.M, N = a.w.N;
  at::Tensor out = at::empty({M, K}, a.x.options());
  if (mm_t_empty(out, N)) return out.view(a.out_shape);
  const W4Params p = w4_params(a.w, M, vector_access_ok(kW4XVecBytes, N, {a.x}) ? kW4XVec : 0u);
  Dispatch d(w4_kernel_name(pick_kernel(kW4MmTKernels, AnyShape::All, t.caps), a.x.scalar_type(), a.w));
  d.buffer("grad_out", a.x);
  bind_w4_weight(d, a.w);
  d.buffer("out", out, Access::Write).value("params", p);
  d.grid({checked_u32("grid x", ceil_div(K, kW4GemmTile)), checked_u32("grid y", ceil_div(M, kW4GemmTile)), 1},
         {kW4GemmThreads, 1, 1});
  t.run(d);
  return out.view(a.out_shape);
}

}  // namespace lowbit::metal
