// w4_grouped_mm and w4_grouped_mm_t on the CPU: each group's rows through the dense 4-bit products
// (w4_matmul.h) of its expert; rows of expert -1 and rows in no group are zero.
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "checks.h"
#include "cpu/dispatch.h"
#include "cpu/w4_matmul.h"

namespace lowbit::cpu {
namespace {

// out [T, width] = zeros, then group g's rows of x [T, x_width] through product(rows, operand, out rows).
template <typename F>
at::Tensor for_each_group(const W4GroupedMmArgs& a, int64_t width, const F& product) {
  at::Tensor out = at::zeros({a.T, width}, a.x.options());
  const int32_t* off = a.offsets.data_ptr<int32_t>();
  const int32_t* ids = a.expert_ids.data_ptr<int32_t>();
  for (int64_t g = 0; g < a.G; g++) {
    const int64_t r0 = off[g], rows = off[g + 1] - off[g];
    if (ids[g] < 0 || rows == 0 || width == 0) continue;
    product(r0, rows, w4_operand(a.w, ids[g]), out);
  }
  return out;
}

at::Tensor w4_grouped_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                         c10::string_view format, int64_t group_size, const at::Tensor& offsets,
                         const std::optional<at::Tensor>& expert_ids, const std::optional<at::Tensor>& offset,
                         const std::optional<at::Tensor>& global_scale) {
  const W4GroupedMmArgs a = check_w4_grouped_mm("w4_grouped_mm", false, x, codes, scale, std::string(format),
                                                group_size, 0, offsets, expert_ids, offset, global_scale, true);
  const int64_t K = a.w.K, N = a.w.N;
  return for_each_group(a, N, [&](int64_t r0, int64_t rows, const W4Operand& op, at::Tensor& out) {
    LOWBIT_DISPATCH_FLOAT_TYPES(a.x.scalar_type(), "w4_grouped_mm", [&] {
      w4_matmul<scalar_t>(a.x.data_ptr<scalar_t>() + r0 * K, rows, op, out.data_ptr<scalar_t>() + r0 * N, N);
    });
  });
}

at::Tensor w4_grouped_mm_t(const at::Tensor& grad_out, const at::Tensor& codes, const at::Tensor& scale,
                           c10::string_view format, int64_t group_size, c10::SymInt K, const at::Tensor& offsets,
                           const std::optional<at::Tensor>& expert_ids, const std::optional<at::Tensor>& offset,
                           const std::optional<at::Tensor>& global_scale) {
  const W4GroupedMmArgs a = check_w4_grouped_mm("w4_grouped_mm_t", true, grad_out, codes, scale, std::string(format),
                                                group_size, K.expect_int(), offsets, expert_ids, offset, global_scale,
                                                true);
  const int64_t k = a.w.K, N = a.w.N;
  return for_each_group(a, k, [&](int64_t r0, int64_t rows, const W4Operand& op, at::Tensor& out) {
    if (N == 0) return;
    LOWBIT_DISPATCH_FLOAT_TYPES(a.x.scalar_type(), "w4_grouped_mm_t", [&] {
      w4_matmul_t<scalar_t>(a.x.data_ptr<scalar_t>() + r0 * N, rows, op, out.data_ptr<scalar_t>() + r0 * k, k);
    });
  });
}

}  // namespace
}  // namespace lowbit::cpu

TORCH_LIBRARY_IMPL(lowbit, CPU, m) {
  m.impl("w4_grouped_mm", &lowbit::cpu::w4_grouped_mm);
  m.impl("w4_grouped_mm_t", &lowbit::cpu::w4_grouped_mm_t);
}
