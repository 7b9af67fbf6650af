// w4_mm on Metal: validate, pick the kernel for M, size the grid.
#include "metal/plan_w4.h"

#include <ATen/ops/empty.h>

namespace lowbit::metal {
namespace {

// The kernels of each class (plans.h KernelVariant: newer-GPU variants go before the portable line). On M5 the
// bf16 / fp16 GEMM runs Metal 4's matmul2d on 64 x 64 tiles (metal/w4_gemm_apple10.metal).
constexpr TileGeometry kGemmTile{kW4GemmTile, kW4GemmTile, kW4GemmThreads, false};
constexpr KernelVariant<MmWidthClass> kW4MmKernels[] = {
    {MmWidthClass::Gemv, "w4_gemv", kPortableDevice},
    {MmWidthClass::GemvRows, "w4_gemv_rows", kPortableDevice},
    {MmWidthClass::Gemm16, "w4_gemm_mpp", kTensorOpsDevice, {kFp8MppBM, kFp8MppBN, kFp8MppThreads, false}},
    {MmWidthClass::Gemm16, "w4_gemm", kPortableDevice, kGemmTile},
    {MmWidthClass::Gemm32, "w4_gemm", kPortableDevice, kGemmTile},
};

}  // namespace

at::Tensor plan_w4_mm(Target t, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                      const std::string& format, int64_t group_size, const std::optional<at::Tensor>& offset,
                      const std::optional<at::Tensor>& global_scale, const std::optional<at::Tensor>& bias) {
  const W4MmArgs a = check_w4_mm(x, codes, scale, format, group_size, offset, global_scale, bias);
  const int64_t M = a.M, N = a.w.N, K = a.w.K;
  at::Tensor out = at::empty({M, N}, a.x.options());
  if (empty_product(out, a.bias, K)) return out.view(a.out_shape);
  const at::ScalarType dtype = a.x.scalar_type();
  const KernelVariant<MmWidthClass>& v = pick_variant(kW4MmKernels, mm_width_class(M, kW4GemvRows, dtype), t.caps);
  W4Params p = w4_params(a.w, M, (vector_access_ok(kW4XVecBytes, K, {a.x}) ? kW4XVec : 0u) |
                                     (a.bias ? kW4HasBias : 0u) | w4_mpp_flags(v.needs, a.w, dtype));
  if (a.bias) p.bias_dtype = kernel_dtype_code(a.bias->scalar_type());

  Dispatch d(w4_kernel_name(v.base, dtype, a.w));
  d.buffer("x", a.x);
  bind_w4_weight(d, a.w);
  // without a bias the kernel never reads [[buffer(5)]]; bind the codes there so it is never unbound
  d.buffer(a.bias ? "bias" : "bias (none: codes bound, unread)", a.bias ? *a.bias : a.w.codes);
  d.buffer("out", out, Access::Write).value("params", p);
  const uint32_t cols_per_group = kW4GemvSimdgroups * kW4GemvCols;
  switch (v.cls) {
    case MmWidthClass::Gemv:
    case MmWidthClass::GemvRows:
      d.grid({checked_u32("grid x", ceil_div(N, cols_per_group)),
              checked_u32("grid y", ceil_div(M, v.cls == MmWidthClass::Gemv ? 1 : kW4GemvRows)), 1},
             {kW4GemvSimdgroups * 32, 1, 1});
      break;
    case MmWidthClass::Gemm16:
    case MmWidthClass::Gemm32:
      grid_over_tiles(d, v.tile, M, N);
      break;
  }
  t.run(d);
  return out.view(a.out_shape);
}

}  // namespace lowbit::metal
