// fp8_mm_t on Metal (fp8_mm's backward product): validate, then the shared transposed-product plan.
#include "metal/plan_mm_t.h"

#include <ATen/ops/empty.h>

namespace lowbit::metal {
namespace {

// The kernels of each class (plans.h KernelVariant: newer-GPU variants go before the portable line)
constexpr KernelVariant<MmTKernel> kFp8MmTKernels[] = {
    {MmTKernel::Gemv, "fp8_mm_t_gemv", kPortableDevice, kMmTGemvGeometry},
    {MmTKernel::GemvRows, "fp8_mm_t_gemv_rows", kPortableDevice, kMmTGemvRowsGeometry},
    {MmTKernel::Gemm, "fp8_mm_t_gemm", kPortableDevice, kMmTGemmGeometry},
};

}  // namespace

at::Tensor plan_fp8_mm_t(Target t, const at::Tensor& grad_out, const at::Tensor& weight, const at::Tensor& scale,
                         at::OptionalIntArrayRef block_size) {
  const Fp8MmArgs a = check_fp8_mm_t(grad_out, weight, scale, block_size);
  const int64_t M = a.M, N = a.w.N, K = a.w.K;
  at::Tensor out = at::empty({M, K}, a.x.options());
  if (!mm_t_empty(out, N))
    run_mm_t(t, pick_mm_t_variant(kFp8MmTKernels, t, M, a.x.scalar_type()), a.x, a.w.bits, a.w.scale,
             scale_params(a.w.layout), out, M, N, K);
  return out.view(a.out_shape);
}

}  // namespace lowbit::metal
