// fp8_mm on Metal: validate, pick the kernel for M, size the grid.
#include "metal/plans.h"

#include <ATen/ops/empty.h>

namespace lowbit::metal {
namespace {

// The kernels of each class (plans.h KernelVariant: newer-GPU variants go before the portable line).
constexpr KernelVariant<MmKernel> kFp8MmKernels[] = {
    {MmKernel::Gemv, "fp8_gemv", kPortableDevice},
    {MmKernel::GemvRows, "fp8_gemv_rows", kPortableDevice},
    {MmKernel::Gemm, "fp8_gemm", kPortableDevice},
};

}  // namespace

std::string fp8_mm_kernel_name(int64_t M, at::ScalarType dtype, const DeviceCaps& device) {
  return kernel_name(pick_kernel(kFp8MmKernels, choose_mm_kernel(M, kFp8GemvRows), device), dtype);
}

namespace {
uint32_t fp8_mm_threads(MmKernel k) {
  return k == MmKernel::Gemv ? kFp8GemvSimdgroups * 32 : k == MmKernel::GemvRows ? kFp8GemvRowsSimdgroups * 32
                                                                                 : kFp8GemmThreads;
}
}  // namespace

at::Tensor plan_fp8_mm(Target t, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias, at::OptionalIntArrayRef block_size) {
  const Fp8MmArgs a = check_fp8_mm(x, weight, scale, bias, block_size);
  const int64_t M = a.M, N = a.w.N, K = a.w.K;
  at::Tensor out = at::empty({M, N}, a.x.options());
  if (empty_product(out, a.bias, K)) return out.view(a.out_shape);
  Fp8MmParams p{};
  p.M = checked_u32("M", M);
  p.N = checked_u32("N", N);
  p.K = checked_u32("K", K);
  p.flags = (vector_access_ok(kFp8VecLoadBytes, K, {a.x, a.w.bits}) ? kFp8VecLoads : 0u) | (a.bias ? kFp8HasBias : 0u);
  p.bias_dtype = a.bias ? kernel_dtype_code(a.bias->scalar_type()) : kDtypeFloat;
  p.scale = scale_params(a.w.layout);

  MmKernel k = choose_mm_kernel(M, kFp8GemvRows);
  // the multi-row GEMV holds 8 rows in registers: where its pipeline takes fewer than its 256 threads, the
  // narrower GEMM (128 threads, any M) runs
  if (k == MmKernel::GemvRows &&
      !t.fits(kernel_name(pick_kernel(kFp8MmKernels, k, t.caps), a.x.scalar_type()), fp8_mm_threads(k)))
    k = MmKernel::Gemm;
  Dispatch d(kernel_name(pick_kernel(kFp8MmKernels, k, t.caps), a.x.scalar_type()));
  d.buffer("x", a.x).buffer("weight", a.w.bits).buffer("scale", a.w.scale);
  // without a bias the kernel never reads [[buffer(3)]]; bind the scale there so it is never unbound
  d.buffer(a.bias ? "bias" : "bias (none: scale bound, unread)", a.bias ? *a.bias : a.w.scale);
  d.buffer("out", out, Access::Write).value("params", p);
  switch (k) {
    case MmKernel::Gemv:
      d.grid({checked_u32("grid x", ceil_div(N, kFp8GemvSimdgroups * kFp8GemvColsM1)), 1, 1},
             {fp8_mm_threads(k), 1, 1});
      break;
    case MmKernel::GemvRows:
      d.grid({checked_u32("grid x", ceil_div(N, kFp8GemvRowsSimdgroups * kFp8GemvColsRows)),
              checked_u32("grid y", ceil_div(M, kFp8GemvRows)), 1},
             {fp8_mm_threads(k), 1, 1});
      break;
    case MmKernel::Gemm:
      d.grid({checked_u32("grid x", ceil_div(N, kFp8GemmTile)), checked_u32("grid y", ceil_div(M, kFp8GemmTile)), 1},
             {fp8_mm_threads(k), 1, 1});
      break;
  }
  t.run(d);
  return out.view(a.out_shape);
}

}  // namespace lowbit::metal
