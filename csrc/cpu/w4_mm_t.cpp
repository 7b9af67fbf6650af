// w4_mm_t on the CPU: grad_out [..., N] @ w [N, K] -> [..., K], read from the 4-bit weight (w4_matmul.h).
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "checks.h"
#include "cpu/dispatch.h"
#include "cpu/w4_matmul.h"

namespace lowbit::cpu {
namespace {

at::Tensor w4_mm_t(const at::Tensor& grad_out, const at::Tensor& codes, const at::Tensor& scale,
                   c10::string_view format, int64_t group_size, c10::SymInt K, const std::optional<at::Tensor>& offset,
                   const std::optional<at::Tensor>& global_scale) {
  const W4MmArgs a = check_w4_mm_t(grad_out, codes, scale, std::string(format), group_size, K.expect_int(), offset,
                                   global_scale);
  // N == 0: an empty sum, zeros
  at::Tensor out = a.w.N == 0 ? at::zeros({a.M, a.w.K}, a.x.options()) : at::empty({a.M, a.w.K}, a.x.options());
  const W4Operand op = w4_operand(a.w);
  if (a.w.N > 0)
    LOWBIT_DISPATCH_FLOAT_TYPES(a.x.scalar_type(), "w4_mm_t", [&] {
      w4_matmul_t<scalar_t>(a.x.data_ptr<scalar_t>(), a.M, op, out.data_ptr<scalar_t>(), a.w.K);
    });
  return shaped(out, a.out_shape);
}

}  // namespace
}  // namespace lowbit::cpu

TORCH_LIBRARY_IMPL(lowbit, CPU, m) {
  m.impl("w4_mm_t", &lowbit::cpu::w4_mm_t);
}
