// w4_dequantize on the CPU: the dense [N, K] weight in fp32, rounded once to dtype.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "checks.h"
#include "cpu/dispatch.h"
#include "cpu/w4_matmul.h"

namespace lowbit::cpu {
namespace {

at::Tensor w4_dequantize(const at::Tensor& codes, const at::Tensor& scale, c10::string_view format,
                         int64_t group_size, c10::SymInt K, const std::optional<at::Tensor>& offset,
                         const std::optional<at::Tensor>& global_scale, at::ScalarType dtype) {
  const W4Weight w = check_w4_dequantize(codes, scale, std::string(format), group_size, K.expect_int(), offset,
                                         global_scale, dtype);
  at::Tensor out = at::empty({w.N, w.K}, codes.options().dtype(dtype));
  const W4Operand op = w4_operand(w);
  LOWBIT_DISPATCH_FLOAT_TYPES(dtype, "w4_dequantize", [&] { w4_dequantize_to<scalar_t>(op, out.data_ptr<scalar_t>()); });
  return out;
}

}  // namespace
}  // namespace lowbit::cpu

TORCH_LIBRARY_IMPL(lowbit, CPU, m) {
  m.impl("w4_dequantize", &lowbit::cpu::w4_dequantize);
}
