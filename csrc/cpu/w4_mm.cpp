// w4_mm on the CPU: validation (checks.h), then the shared product (w4_matmul.h).
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "checks.h"
#include "cpu/dispatch.h"
#include "cpu/w4_matmul.h"

namespace lowbit::cpu {
namespace {

at::Tensor w4_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, c10::string_view format,
                 int64_t group_size, const std::optional<at::Tensor>& offset,
                 const std::optional<at::Tensor>& global_scale, const std::optional<at::Tensor>& bias) {
  const W4MmArgs a = check_w4_mm(x, codes, scale, std::string(format), group_size, offset, global_scale, bias);
  at::Tensor out = at::empty({a.M, a.w.N}, a.x.options());
  const at::Tensor bias_f32 = bias_as_float(a.bias);
  const W4Operand op = w4_operand(a.w, 0, bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr);
  LOWBIT_DISPATCH_FLOAT_TYPES(a.x.scalar_type(), "w4_mm", [&] {
    w4_matmul<scalar_t>(a.x.data_ptr<scalar_t>(), a.M, op, out.data_ptr<scalar_t>(), a.w.N);
  });
  return shaped(out, a.out_shape);
}

}  // namespace
}  // namespace lowbit::cpu

TORCH_LIBRARY_IMPL(lowbit, CPU, m) {
  m.impl("w4_mm", &lowbit::cpu::w4_mm);
}
