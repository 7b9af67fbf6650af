// fp8_grouped_mm on the CPU: the dense fp8 product per group; rows outside live groups are zero.
#include <torch/library.h>

#include "checks.h"
#include "cpu/dispatch.h"
#include "cpu/fp8_matmul.h"

namespace lowbit::cpu {
namespace {

at::Tensor fp8_grouped_mm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                          const at::Tensor& offsets, const std::optional<at::Tensor>& expert_ids,
                          at::OptionalIntArrayRef block_size) {
  const Fp8GroupedMmArgs a = check_fp8_grouped_mm(x, weight, scale, offsets, expert_ids, block_size, true);
  const int64_t N = a.w.N, K = a.w.K;
  at::Tensor out = at::zeros({a.T, N}, a.x.options());
  const int32_t* off = a.offsets.data_ptr<int32_t>();
  const int32_t* ids = a.expert_ids.data_ptr<int32_t>();
  const int64_t scale_per_expert = a.w.scale.numel() / std::max<int64_t>(a.w.E, 1);
  LOWBIT_DISPATCH_FLOAT_TYPES(a.x.scalar_type(), "fp8_grouped_mm", [&] {
    const scalar_t* xp = a.x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    for (int64_t g = 0; g < a.G; g++) {
      const int64_t e = ids[g], r0 = off[g], r1 = off[g + 1];
      if (e < 0 || r1 <= r0) continue;
      fp8_matmul<scalar_t>(xp + r0 * K, r1 - r0, a.w.bits.data_ptr<uint8_t>() + e * N * K,
                           a.w.scale.data_ptr<float>() + e * scale_per_expert, a.w.layout, N, K, nullptr, op + r0 * N, N);
    }
  });
  return out;
}

}  // namespace
}  // namespace lowbit::cpu

TORCH_LIBRARY_IMPL(lowbit, CPU, m) {
  m.impl("fp8_grouped_mm", &lowbit::cpu::fp8_grouped_mm);
}
