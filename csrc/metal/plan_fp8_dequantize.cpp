#include "metal/plans.h"

#include <ATen/ops/empty.h>

namespace lowbit::metal {
namespace {

// The kernels (plans.h KernelVariant: newer-GPU variants go before the portable line); the plan sizes the
// threadgroups to the pipeline (no geometry)
constexpr KernelVariant<AnyShape> kFp8DequantizeKernels[] = {
    {AnyShape::All, "fp8_dequantize", kPortableDevice},
};

}  // namespace

at::Tensor plan_fp8_dequantize(Target t, const at::Tensor& weight, const at::Tensor& scale,
                               at::OptionalIntArrayRef block_size, at::ScalarType dtype) {
  const Fp8Weight w = check_fp8_dequantize(weight, scale, block_size, dtype);
  at::Tensor out = at::empty({w.N, w.K}, weight.options().dtype(dtype));
  if (out.numel() == 0) return out;
  Fp8DequantizeParams p{};
  p.N = checked_u32("N", w.N);
  p.K = checked_u32("K", w.K);
  p.vec4 = vector_access_ok(4, w.K, {w.bits});  // uchar4 weight loads
  p.scale = scale_params(w.layout);
  // one thread per 4 bytes of a row; 64 x 4 threads per threadgroup (fewer rows where the pipeline takes fewer)
  const uint32_t groups_k = checked_u32("K / 4", ceil_div(w.K, 4));
  Dispatch d(kernel_name(pick_kernel(kFp8DequantizeKernels, AnyShape::All, t.caps), dtype));
  d.buffer("weight", w.bits).buffer("scale", w.scale).buffer("out", out, Access::Write).value("params", p);
  const uint32_t rows = t.rows_that_fit(d.kernel, 64, 4);
  d.grid({uint32_t(ceil_div(groups_k, 64)), uint32_t(ceil_div(w.N, rows)), 1}, {64, rows, 1});
  t.run(d);
  return out;
}

}  // namespace lowbit::metal
