// fp8_mm_t and fp8_grouped_mm_t on the CPU: the transposed products of fp8_mm's and fp8_grouped_mm's backward
// passes (grad_x = grad_out @ (dec(W) * scale)), through transposed_matmul.h.
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "checks.h"
#include "cpu/dispatch.h"
#include "cpu/transposed_matmul.h"

namespace lowbit::cpu {
namespace {

TransposedOperand fp8_operand(const Fp8Weight& w, int64_t e) {
  return TransposedOperand{w.expert_bits(e), WeightCode::Fp8, w.expert_scale(e), w.layout, w.N, w.K};
}

at::Tensor fp8_mm_t(const at::Tensor& grad_out, const at::Tensor& weight, const at::Tensor& scale,
                    at::OptionalIntArrayRef block_size) {
  const Fp8MmArgs a = check_fp8_mm_t(grad_out, weight, scale, block_size);
  at::Tensor out = at::zeros({a.M, a.w.K}, a.x.options());
  LOWBIT_DISPATCH_FLOAT_TYPES(a.x.scalar_type(), "fp8_mm_t", [&] {
    transposed_matmul<scalar_t>(a.x.data_ptr<scalar_t>(), a.M, fp8_operand(a.w, 0), out.data_ptr<scalar_t>(), a.w.K);
  });
  return shaped(out, a.out_shape);
}

// Groups one after the other, each parallel inside; rows of -1 groups and rows in no group stay zero.
at::Tensor fp8_grouped_mm_t(const at::Tensor& grad_out, const at::Tensor& weight, const at::Tensor& scale,
                            const at::Tensor& offsets, const std::optional<at::Tensor>& expert_ids,
                            at::OptionalIntArrayRef block_size) {
  const Fp8GroupedMmArgs a = check_fp8_grouped_mm_t(grad_out, weight, scale, offsets, expert_ids, block_size, true);
  const int64_t N = a.w.N, K = a.w.K;
  at::Tensor out = at::zeros({a.T, K}, a.x.options());
  const int32_t* off = a.offsets.data_ptr<int32_t>();
  const int32_t* ids = a.expert_ids.data_ptr<int32_t>();
  LOWBIT_DISPATCH_FLOAT_TYPES(a.x.scalar_type(), "fp8_grouped_mm_t", [&] {
    const scalar_t* g = a.x.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    for (int64_t grp = 0; grp < a.G; grp++) {
      const int64_t e = ids[grp], r0 = off[grp], r1 = off[grp + 1];
      if (e < 0 || r1 <= r0) continue;
      transposed_matmul<scalar_t>(g + r0 * N, r1 - r0, fp8_operand(a.w, e), o + r0 * K, K);
    }
  });
  return out;
}

}  // namespace
}  // namespace lowbit::cpu

TORCH_LIBRARY_IMPL(lowbit, CPU, m) {
  m.impl("fp8_mm_t", &lowbit::cpu::fp8_mm_t);
  m.impl("fp8_grouped_mm_t", &lowbit::cpu::fp8_grouped_mm_t);
}
