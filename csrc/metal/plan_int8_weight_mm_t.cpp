// int8_weight_mm_t on Metal (Int8Linear's backward product, grad_out @ (wq * w_scale)): validate, then the
// shared transposed-product plan with int8 weight codes.
#include "metal/plan_mm_t.h"

#include <ATen/ops/empty.h>

namespace lowbit::metal {
namespace {

// The kernels of each class (plans.h KernelVariant: newer-GPU variants go before the portable line)
constexpr KernelVariant<MmTKernel> kInt8WeightMmTKernels[] = {
    {MmTKernel::Gemv, "int8_weight_mm_t_gemv", kPortableDevice, kMmTGemvGeometry},
    {MmTKernel::GemvRows, "int8_weight_mm_t_gemv_rows", kPortableDevice, kMmTGemvRowsGeometry},
    {MmTKernel::Gemm, "int8_weight_mm_t_gemm", kPortableDevice, kMmTGemmGeometry},
};

}  // namespace

at::Tensor plan_int8_weight_mm_t(Target t, const at::Tensor& grad_out, const at::Tensor& wq, const at::Tensor& w_scale) {
  const Int8WeightMmTArgs a = check_int8_weight_mm_t(grad_out, wq, w_scale);
  at::Tensor out = at::empty({a.M, a.K}, a.grad_out.options());
  if (!mm_t_empty(out, a.N)) {
    run_mm_t(t, pick_mm_t_variant(kInt8WeightMmTKernels, t, a.M, a.grad_out.scalar_type()), a.grad_out, a.wq,
             a.w_scale, scale_params(a.w_layout), out, a.M, a.N, a.K);
  }
  return out.view(a.out_shape);
}

}  // namespace lowbit::metal
