// w4_dequantize on Metal: validate, one thread per 8 codes.
#include "metal/plan_w4.h"

#include <ATen/ops/empty.h>

namespace lowbit::metal {
namespace {

// The kernels (plans.h KernelVariant: newer-GPU variants go before the portable line); the plan sizes the
// threadgroups to the pipeline (no geometry)
constexpr KernelVariant<AnyShape> kW4DequantizeKernels[] = {
    {AnyShape::All, "w4_dequantize", kPortableDevice},
};

}  // namespace

at::Tensor plan_w4_dequantize(Target t, const at::Tensor& codes, const at::Tensor& scale, const std::string& format,
                              int64_t group_size, int64_t K, const std::optional<at::Tensor>& offset,
                              const std::optional<at::Tensor>& global_scale, at::ScalarType dtype) {
  const W4Weight w = check_w4_dequantize(codes, scale, format, group_size, K, offset, global_scale, dtype);
  at::Tensor out = at::empty({w.N, w.K}, codes.options().dtype(dtype));
  if (out.numel() == 0) return out;
  const W4Params p = w4_params(w, 0, 0u);
  Dispatch d(w4_kernel_name(pick_kernel(kW4DequantizeKernels, AnyShape::All, t.caps), dtype, w));
  bind_w4_weight(d, w);
  d.buffer("out", out, Access::Write).value("params", p);
  const uint32_t rows = t.rows_that_fit(d.kernel, kW4DequantizeThreadsX, kW4DequantizeThreadsY);
  d.grid({checked_u32("grid x", ceil_div(ceil_div(w.K, 8), kW4DequantizeThreadsX)),
          checked_u32("grid y", ceil_div(w.N, rows)), 1},
         {kW4DequantizeThreadsX, rows, 1});
  t.run(d);
  return out;
}

}  // namespace lowbit::metal
