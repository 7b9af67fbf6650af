#include "metal/plan_int8_mm.h"

#include <ATen/ops/empty.h>

#include "metal/plans.h"

namespace lowbit::metal {
namespace {

// Up to this many x rows the GEMV reads each weight chunk once per 4 x rows and wins on bandwidth; above
// it the tiled GEMM's 32 x 64 tiles amortize weight reads over 32 rows (PyTorch's int8 MPS GEMV stops at
// M < 12, MLX switches at M ~ 6..33; 8 = two x-slices of the GEMV).
constexpr int64_t kInt8GemvMaxM = 8;
// the _k16 kernels load int4 (16 bytes) from xq and wq rows
constexpr int64_t kVectorLoadBytes = 16;

// The kernels of each class (plans.h KernelVariant: newer-GPU variants go before the portable line). The first
// line is test-only: no GPU reports kTestOnlyDevice and no kernel int8_gemm_probe_* exists, so only a test under
// emulator.device_caps reaches it. On M5 the GEMM class runs Metal 4's int8 x int8 -> int32 matmul2d
// (metal/int8_gemm_apple10.metal) on its own 64 x 64 tiles.
constexpr TileGeometry kGemmHalfTile{kInt8GemmBM, kInt8GemmBN, kInt8GemmThreads, true};
constexpr TileGeometry kGemmMppTile{kInt8MppBM, kInt8MppBN, kInt8MppThreads, false};
constexpr KernelVariant<Int8MmKernel> kInt8MmKernels[] = {
    {Int8MmKernel::GemmHalf, "int8_gemm_probe", kTestOnlyDevice, kGemmHalfTile},
    {Int8MmKernel::GemmHalf, "int8_gemm_mpp", kTensorOpsDevice, kGemmMppTile},
    {Int8MmKernel::Gemv, "int8_gemv", kPortableDevice},
    {Int8MmKernel::GemmHalf, "int8_gemm", kPortableDevice, kGemmHalfTile},
};

}  // namespace

Int8MmKernel choose_int8_mm_kernel(int64_t M, int64_t /*N*/, int64_t /*K*/) {
  return M <= kInt8GemvMaxM ? Int8MmKernel::Gemv : Int8MmKernel::GemmHalf;
}

const char* int8_mm_kernel_base(int64_t M, int64_t N, int64_t K, const DeviceCaps& device) {
  return pick_kernel(kInt8MmKernels, choose_int8_mm_kernel(M, N, K), device);
}

at::Tensor plan_int8_mm(Target t, const at::Tensor& xq, const at::Tensor& x_scale, const at::Tensor& wq,
                        const at::Tensor& w_scale, const std::optional<at::Tensor>& bias,
                        std::optional<at::ScalarType> out_dtype) {
  const Int8MmArgs a = check_int8_mm(xq, x_scale, wq, w_scale, bias, out_dtype);
  at::Tensor out = at::empty({a.M, a.N}, a.xq.options().dtype(a.out_dtype));
  if (out.numel() == 0) return out.view(a.out_shape);
  if (a.K == 0) {
    // An empty sum, through the kernels' epilogue (a NaN scale still gives NaN): the kernels would take xq and wq
    // as nil buffers, which Metal's validation layer rejects.
    at::Tensor v = a.x_scale.view({a.M, 1}).mul(a.w_scale.view({1, -1})).mul(0.0);
    out.copy_(a.bias ? v.add(a.bias->to(at::kFloat)) : v);
    return out.view(a.out_shape);
  }

  Int8MmParams p{};
  p.M = checked_u32("M", a.M);
  p.N = checked_u32("N", a.N);
  p.K = checked_u32("K", a.K);
  p.w_per_channel = a.w_layout.kind == ScaleKind::Channel ? 1 : 0;
  p.has_bias = a.bias.has_value() ? 1 : 0;
  p.bias_dtype = a.bias ? kernel_dtype_code(a.bias->scalar_type()) : kDtypeFloat;

  const Int8MmKernel kind = choose_int8_mm_kernel(a.M, a.N, a.K);
  const KernelVariant<Int8MmKernel>& v = pick_variant(kInt8MmKernels, kind, t, a.out_dtype);
  const bool k16 = v.tile.vector_variants && vector_access_ok(kVectorLoadBytes, a.K, {a.xq, a.wq});
  Dispatch d(kernel_name(v.base, a.out_dtype, k16 ? "k16" : nullptr));
  // without a bias the kernel never reads buffer 4; w_scale stands in so that every index is bound
  d.buffer("xq", a.xq).buffer("x_scale", a.x_scale).buffer("wq", a.wq).buffer("w_scale", a.w_scale);
  d.buffer("bias", a.bias.has_value() ? *a.bias : a.w_scale);
  d.buffer("out", out, Access::Write).value("params", p);
  if (kind == Int8MmKernel::Gemv) {
    d.grid({checked_u32("grid x", ceil_div(a.M, kInt8GemvXRows)),
            checked_u32("grid y", ceil_div(a.N, kInt8GemvSimdgroups * kInt8GemvRows)), 1},
           {kInt8GemvSimdgroups * 32, 1, 1});
  } else {
    grid_over_tiles(d, v.tile, a.M, a.N);
  }
  t.run(d);
  return out.view(a.out_shape);
}

}  // namespace lowbit::metal
