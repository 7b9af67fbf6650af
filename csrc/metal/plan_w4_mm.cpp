// w4_mm on Metal: validate, pick the kernel for M, size the grid.
#include "metal/plan_w4.h"

#include <ATen/ops/empty.h>

namespace lowbit::metal {
namespace {

// The kernels of each class (plans.h KernelVariant: newer-GPU variants go before the portable line).
constexpr KernelVariant<MmKernel> kW4MmKernels[] = {
    {MmKernel::Gemv, "w4_gemv", kPortableDevice},
    {MmKernel::GemvRows, "w4_gemv_rows", kPortableDevice},
    {MmKernel::Gemm, "w4_gemm", kPortableDevice},
};

}  // namespace

at::Tensor plan_w4_mm(Target t, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                      const std::string& format, int64_t group_size, const std::optional<at::Tensor>& offset,
                      const std::optional<at::Tensor>& global_scale, const std::optional<at::Tensor>& bias) {
  const W4MmArgs a = check_w4_mm(x, codes, scale, format, group_size, offset, global_scale, bias);
  const int64_t M = a.M, N = a.w.N, K = a.w.K;
  at::Tensor out = at::empty({M, N}, a.x.options());
  if (empty_product(out, a.bias, K)) return out.view(a.out_shape);
  W4Params p = w4_params(a.w, M, (vector_access_ok(kW4XVecBytes, K, {a.x}) ? kW4XVec : 0u) |
                                     (a.bias ? kW4HasBias : 0u));
  if (a.bias) p.bias_dtype = kernel_dtype_code(a.bias->scalar_type());

  const MmKernel k = choose_mm_kernel(M, kW4GemvRows);
  Dispatch d(w4_kernel_name(pick_kernel(kW4MmKernels, k, t.caps), a.x.scalar_type(), a.w));
  d.buffer("x", a.x);
  bind_w4_weight(d, a.w);
  // without a bias the kernel never reads [[buffer(5)]]; bind the codes there so it is never unbound
  d.buffer(a.bias ? "bias" : "bias (none: codes bound, unread)", a.bias ? *a.bias : a.w.codes);
  d.buffer("out", out, Access::Write).value("params", p);
  const uint32_t cols_per_group = kW4GemvSimdgroups * kW4GemvCols;
  switch (k) {
    case MmKernel::Gemv:
    case MmKernel::GemvRows:
      d.grid({checked_u32("grid x", ceil_div(N, cols_per_group)),
              checked_u32("grid y", ceil_div(M, k == MmKernel::Gemv ? 1 : kW4GemvRows)), 1},
             {kW4GemvSimdgroups * 32, 1, 1});
      break;
    case MmKernel::Gemm:
      d.grid({checked_u32("grid x", ceil_div(N, kW4GemmTile)), checked_u32("grid y", ceil_div(M, kW4GemmTile)), 1},
             {kW4GemmThreads, 1, 1});
      break;
  }
  t.run(d);
  return out.view(a.out_shape);
}

}  // namespace lowbit::metal
