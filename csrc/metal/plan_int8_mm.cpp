#include "metal/plan_int8_mm.h"

#include "metal/plans.h"

namespace lowbit::metal {
namespace {

// Up to this many x rows the GEMV reads each weight chunk once per 4 x rows and wins on bandwidth; above
// it the tiled GEMM's 32 x 64 tiles amortize weight reads over 32 rows (PyTorch's int8 MPS GEMV stops at
// M < 12, MLX switches at M ~ 6..33; 8 = two x-slices of the GEMV).
constexpr int64_t kInt8GemvMaxM = 8;
// Tile shapes: must match metal/int8_gemv.metal and metal/int8_gemm.metal.
constexpr int64_t kGemvRowsPerGroup = 64, kGemvXRows = 4, kGemvThreads = 256;
constexpr int64_t kGemmBM = 32, kGemmBN = 64, kGemmThreads = 128;
// the _k16 kernels load int4 (16 bytes) from xq and wq rows
constexpr int64_t kVectorLoadBytes = 16;

}  // namespace

Int8MmKernel choose_int8_mm_kernel(int64_t M, int64_t /*N*/, int64_t /*K*/) {
  return M <= kInt8GemvMaxM ? Int8MmKernel::Gemv : Int8MmKernel::GemmHalf;
}

const char* int8_mm_kernel_name(Int8MmKernel k) {
  switch (k) {
    case Int8MmKernel::Gemv: return "gemv";
    case Int8MmKernel::GemmHalf: return "gemm_half";
  }
  return "?";
}

at::Tensor plan_int8_mm(Target t, const at::Tensor& xq, const at::Tensor& x_scale, const at::Tensor& wq,
                        const at::Tensor& w_scale, const std::optional<at::Tensor>& bias,
                        std::optional<at::ScalarType> out_dtype) {
  const Int8MmArgs a = check_int8_mm(xq, x_scale, wq, w_scale, bias, out_dtype);
  at::Tensor out = at::empty({a.M, a.N}, a.xq.options().dtype(a.out_dtype));
  if (out.numel() == 0) return out.view(a.out_shape);

  Int8MmParams p{};
  p.M = checked_u32("M", a.M);
  p.N = checked_u32("N", a.N);
  p.K = checked_u32("K", a.K);
  p.w_per_channel = a.w_scale.numel() == a.N && a.N != 1 ? 1 : 0;
  p.has_bias = a.bias.has_value() ? 1 : 0;

  const Int8MmKernel kind = choose_int8_mm_kernel(a.M, a.N, a.K);
  std::string name = kind == Int8MmKernel::Gemv ? "int8_gemv_" : "int8_gemm_";
  name += kernel_dtype_suffix(a.out_dtype);
  if (vector_access_ok(kVectorLoadBytes, a.K, {a.xq, a.wq})) name += "_k16";
  Dispatch d(name);
  // without a bias the kernel never reads buffer 4; w_scale stands in so that every index is bound
  d.buffer("xq", a.xq).buffer("x_scale", a.x_scale).buffer("wq", a.wq).buffer("w_scale", a.w_scale);
  d.buffer("bias", a.bias.has_value() ? *a.bias : a.w_scale);
  d.buffer("out", out, Access::Write).value("params", p);
  if (kind == Int8MmKernel::Gemv) {
    d.grid({checked_u32("ceil(M / 4)", ceil_div(a.M, kGemvXRows)),
            checked_u32("ceil(N / 64)", ceil_div(a.N, kGemvRowsPerGroup)), 1},
           {uint32_t(kGemvThreads), 1, 1});
  } else {
    d.grid({checked_u32("ceil(N / 64)", ceil_div(a.N, kGemmBN)), checked_u32("ceil(M / 32)", ceil_div(a.M, kGemmBM)), 1},
           {uint32_t(kGemmThreads), 1, 1});
  }
  t.run(d);
  return out.view(a.out_shape);
}

}  // namespace lowbit::metal
