// fp8_mm on the CPU: validation (checks.h), then the shared product (fp8_matmul.h).
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "checks.h"
#include "cpu/dispatch.h"
#include "cpu/fp8_matmul.h"

namespace lowbit::cpu {
namespace {

at::Tensor fp8_mm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                  const std::optional<at::Tensor>& bias, at::OptionalIntArrayRef block_size) {
  const Fp8MmArgs a = check_fp8_mm(x, weight, scale, bias, block_size);
  at::Tensor out = at::empty({a.M, a.w.N}, a.x.options());
  const at::Tensor bias_f32 = bias_as_float(a.bias);
  const Fp8Operand op{a.w.bits.data_ptr<uint8_t>(), a.w.scale.data_ptr<float>(), a.w.layout, a.w.N, a.w.K,
                      bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr};
  LOWBIT_DISPATCH_FLOAT_TYPES(a.x.scalar_type(), "fp8_mm", [&] {
    fp8_matmul<scalar_t>(a.x.data_ptr<scalar_t>(), a.M, op, out.data_ptr<scalar_t>(), a.w.N);
  });
  return shaped(out, a.out_shape);
}

}  // namespace
}  // namespace lowbit::cpu

TORCH_LIBRARY_IMPL(lowbit, CPU, m) {
  m.impl("fp8_mm", &lowbit::cpu::fp8_mm);
}
