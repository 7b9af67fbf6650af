// fp8_mm on Metal: validate, pick the kernel for M, size the grid.
#include "metal/plans.h"

#include <ATen/ops/empty.h>

namespace lowbit::metal {
namespace {

// The kernels of each class (plans.h KernelVariant: newer-GPU variants go before the portable line). On M5 the
// bf16 / fp16 GEMM runs Metal 4's matmul2d on 64 x 64 tiles (metal/fp8_gemm_apple10.metal).
// The GEMV lines carry only their threads (their plan sizes the grid from its own constants).
constexpr TileGeometry kGemmTile{kFp8GemmTile, kFp8GemmTile, kFp8GemmThreads, true};
constexpr KernelVariant<MmWidthClass> kFp8MmKernels[] = {
    {MmWidthClass::Gemv, "fp8_gemv", kPortableDevice, {0, 0, kFp8GemvSimdgroups * 32, true}},
    {MmWidthClass::GemvRows, "fp8_gemv_rows", kPortableDevice, {0, 0, kFp8GemvRowsSimdgroups * 32, true}},
    {MmWidthClass::Gemm16, "fp8_gemm_mpp", kTensorOpsDevice, {kFp8MppBM, kFp8MppBN, kFp8MppThreads, false}},
    {MmWidthClass::Gemm16, "fp8_gemm", kPortableDevice, kGemmTile},
    {MmWidthClass::Gemm32, "fp8_gemm", kPortableDevice, kGemmTile},
};

}  // namespace

std::string fp8_mm_kernel_name(int64_t M, at::ScalarType dtype, const DeviceCaps& device) {
  return kernel_name(pick_kernel(kFp8MmKernels, mm_width_class(M, kFp8GemvRows, dtype), device), dtype);
}

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

  const MmWidthClass k = mm_width_class(M, kFp8GemvRows, a.x.scalar_type());
  // the multi-row GEMV holds 8 rows in registers: where its pipeline takes fewer than its 256 threads, the
  // narrower GEMM (any M) runs; the one-row GEMV has nothing narrower
  const MmWidthClass narrower =
      k != MmWidthClass::GemvRows ? k : mm_width_class(kFp8GemvRows + 1, kFp8GemvRows, a.x.scalar_type());
  const KernelVariant<MmWidthClass>& v = pick_variant(kFp8MmKernels, k, narrower, t, a.x.scalar_type());
  Dispatch d(kernel_name(v.base, a.x.scalar_type()));
  d.buffer("x", a.x).buffer("weight", a.w.bits).buffer("scale", a.w.scale);
  // without a bias the kernel never reads [[buffer(3)]]; bind the scale there so it is never unbound
  d.buffer(a.bias ? "bias" : "bias (none: scale bound, unread)", a.bias ? *a.bias : a.w.scale);
  d.buffer("out", out, Access::Write).value("params", p);
  switch (v.cls) {
    case MmWidthClass::Gemv:
      d.grid({checked_u32("grid x", ceil_div(N, kFp8GemvSimdgroups * kFp8GemvColsM1)), 1, 1},
             {v.tile.threads, 1, 1});
      break;
    case MmWidthClass::GemvRows:
      d.grid({checked_u32("grid x", ceil_div(N, kFp8GemvRowsSimdgroups * kFp8GemvColsRows)),
              checked_u32("grid y", ceil_div(M, kFp8GemvRows)), 1},
             {v.tile.threads, 1, 1});
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
