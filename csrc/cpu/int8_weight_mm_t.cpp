// int8_weight_mm_t on the CPU: grad_out @ (wq * w_scale), the transposed product of Int8Linear's backward pass
// (straight through the activation quantization), through transposed_matmul.h.
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "checks.h"
#include "cpu/dispatch.h"
#include "cpu/transposed_matmul.h"

namespace lowbit::cpu {
namespace {

at::Tensor int8_weight_mm_t(const at::Tensor& grad_out, const at::Tensor& wq, const at::Tensor& w_scale) {
  const Int8WeightMmTArgs a = check_int8_weight_mm_t(grad_out, wq, w_scale);
  at::Tensor out = at::zeros({a.M, a.K}, a.grad_out.options());
  const TransposedOperand op{reinterpret_cast<const uint8_t*>(a.wq.data_ptr<int8_t>()), WeightCode::Int8,
                             a.w_scale.data_ptr<float>(), a.w_layout, a.N, a.K};
  LOWBIT_DISPATCH_FLOAT_TYPES(a.grad_out.scalar_type(), "int8_weight_mm_t", [&] {
    transposed_matmul<scalar_t>(a.grad_out.data_ptr<scalar_t>(), a.M, op, out.data_ptr<scalar_t>(), a.K);
  });
  return shaped(out, a.out_shape);
}

}  // namespace
}  // namespace lowbit::cpu

TORCH_LIBRARY_IMPL(lowbit, CPU, m) {
  m.impl("int8_weight_mm_t", &lowbit::cpu::int8_weight_mm_t);
}
