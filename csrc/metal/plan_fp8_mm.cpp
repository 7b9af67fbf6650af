// fp8_mm on Metal: validate, pick the kernel for M, size the grid.
#include "metal/plans.h"

#include <ATen/ops/empty.h>

namespace lowbit::metal {
namespace {

// ---- kernel choice: one chooser, named thresholds ----
// M == 1 (batch-1 decode) is bandwidth-bound: fp8_gemv reads every weight byte once and keeps everything in
// registers.
constexpr int64_t kGemvMaxM = 1;
// Up to kFp8GemvRows (8) rows, fp8_gemv_rows still reads and decodes each weight chunk once and dots it
// against every row (staged once per threadgroup), so it keeps the GEMV's memory traffic while doing M times
// the math. Past 8 rows it would need a second pass (decoding the weights again), and a 32-row GEMM tile is
// already more than a quarter full: switch to the tiled GEMM. (Peers switch in the same region: MLX at M ~ 6..33 depending on
// chip and size, PyTorch's int8 MPS kernel at 12.)
constexpr int64_t kGemvRowsMaxM = kFp8GemvRows;

enum class Fp8MmKernel { Gemv, GemvRows, Gemm };

Fp8MmKernel choose_fp8_mm_kernel(int64_t M) {
  if (M <= kGemvMaxM) return Fp8MmKernel::Gemv;
  if (M <= kGemvRowsMaxM) return Fp8MmKernel::GemvRows;
  return Fp8MmKernel::Gemm;
}

// The kernels of each class (plans.h KernelVariant: newer-GPU variants go before the portable line).
constexpr KernelVariant<Fp8MmKernel> kFp8MmKernels[] = {
    {Fp8MmKernel::Gemv, "fp8_gemv", kPortableDevice},
    {Fp8MmKernel::GemvRows, "fp8_gemv_rows", kPortableDevice},
    {Fp8MmKernel::Gemm, "fp8_gemm", kPortableDevice},
};

}  // namespace

std::string fp8_mm_kernel_name(int64_t M, at::ScalarType dtype, const DeviceCaps& device) {
  return kernel_name(pick_kernel(kFp8MmKernels, choose_fp8_mm_kernel(M), device), dtype);
}

at::Tensor plan_fp8_mm(Target t, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias, at::OptionalIntArrayRef block_size) {
  const Fp8MmArgs a = check_fp8_mm(x, weight, scale, bias, block_size);
  const int64_t M = a.M, N = a.w.N, K = a.w.K;
  at::Tensor out = at::empty({M, N}, a.x.options());
  if (out.numel() == 0) return out.view(a.out_shape);
  if (K == 0) {  // an empty sum: bias (or zero) in every row
    if (a.bias) out.copy_(a.bias->expand({M, N}));
    else out.zero_();
    return out.view(a.out_shape);
  }
  Fp8MmParams p{};
  p.M = checked_u32("M", M);
  p.N = checked_u32("N", N);
  p.K = checked_u32("K", K);
  p.flags = (vector_access_ok(kFp8VecLoadBytes, K, {a.x, a.w.bits}) ? kFp8VecLoads : 0u) | (a.bias ? kFp8HasBias : 0u);
  p.bias_dtype = a.bias ? kernel_dtype_code(a.bias->scalar_type()) : kDtypeFloat;
  p.scale = scale_params(a.w.layout);

  const Fp8MmKernel k = choose_fp8_mm_kernel(M);
  Dispatch d(fp8_mm_kernel_name(M, a.x.scalar_type(), t.caps));
  d.buffer("x", a.x).buffer("weight", a.w.bits).buffer("scale", a.w.scale);
  // without a bias the kernel never reads [[buffer(3)]]; bind the scale there so it is never unbound
  d.buffer(a.bias ? "bias" : "bias (none: scale bound, unread)", a.bias ? *a.bias : a.w.scale);
  d.buffer("out", out, Access::Write).value("params", p);
  switch (k) {
    case Fp8MmKernel::Gemv:
      d.grid({checked_u32("grid x", ceil_div(N, kFp8GemvSimdgroups * kFp8GemvColsM1)), 1, 1},
             {kFp8GemvSimdgroups * 32, 1, 1});
      break;
    case Fp8MmKernel::GemvRows:
      d.grid({checked_u32("grid x", ceil_div(N, kFp8GemvRowsSimdgroups * kFp8GemvColsRows)),
              checked_u32("grid y", ceil_div(M, kFp8GemvRows)), 1},
             {kFp8GemvRowsSimdgroups * 32, 1, 1});
      break;
    case Fp8MmKernel::Gemm:
      d.grid({checked_u32("grid x", ceil_div(N, kFp8GemmTile)), checked_u32("grid y", ceil_div(M, kFp8GemmTile)), 1},
             {kFp8GemmThreads, 1, 1});
      break;
  }
  t.run(d);
  return out.view(a.out_shape);
}

}  // namespace lowbit::metal
