// fp8_grouped_mm on the CPU: the dense fp8 product per group; rows outside live groups are zero.
// Groups big enough for the GEMM run one after the other, each parallel inside. Small groups (the decode case:
// many groups of one row) are scheduled together: their rows are packed once and (group, column range) work
// items run in one parallel loop, taken by whichever thread is free (parallel.h), so a handful of 1-row groups
// still keeps every thread streaming weights.
#include <ATen/Parallel.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <vector>

#include "checks.h"
#include "cpu/dispatch.h"
#include "cpu/fp8_matmul.h"
#include "cpu/parallel.h"
#include "cpu/workspace.h"

namespace lowbit::cpu {
namespace {

constexpr int64_t kColumnsPerItem = 256;  // weight rows per work item of the small-group loop

struct Group {
  int64_t expert, r0, r1, packed_row;  // packed_row: first row of this group in the packed activations
};

at::Tensor fp8_grouped_mm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                          const at::Tensor& offsets, const std::optional<at::Tensor>& expert_ids,
                          at::OptionalIntArrayRef block_size) {
  const Fp8GroupedMmArgs a = check_fp8_grouped_mm(x, weight, scale, offsets, expert_ids, block_size, true);
  const int64_t N = a.w.N, K = a.w.K;
  at::Tensor out = at::zeros({a.T, N}, a.x.options());
  if (N == 0) return out;
  const int32_t* off = a.offsets.data_ptr<int32_t>();
  const int32_t* ids = a.expert_ids.data_ptr<int32_t>();
  auto operand = [&](int64_t e) {
    return Fp8Operand{a.w.expert_bits(e), a.w.expert_scale(e), a.w.layout, N, K, nullptr};
  };
  std::vector<Group> small;
  int64_t small_rows = 0;
  LOWBIT_DISPATCH_FLOAT_TYPES(a.x.scalar_type(), "fp8_grouped_mm", [&] {
    const scalar_t* xp = a.x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t gemm_rows = gemm_min_rows();
    for (int64_t g = 0; g < a.G; g++) {
      const int64_t e = ids[g], r0 = off[g], r1 = off[g + 1];
      if (e < 0 || r1 <= r0) continue;
      if (r1 - r0 >= gemm_rows || K == 0) {
        fp8_matmul<scalar_t>(xp + r0 * K, r1 - r0, operand(e), op + r0 * N, N);
      } else {
        small.push_back({e, r0, r1, small_rows});
        small_rows += r1 - r0;
      }
    }
    if (small.empty()) return;
    // after the big groups: fp8_matmul reuses the same activation scratch
    const Fp8Kernels& kern = kernel_set().fp8;
    const GemvActivations acts = gemv_activations<scalar_t>(kern, a.w.layout, K);
    const int64_t ld = acts.row_bytes();
    uint8_t* packed = scratch<uint8_t>(Slot::Activations, size_t(small_rows * ld));
    for (const Group& g : small) pack_rows(acts, xp + g.r0 * K, g.r1 - g.r0, packed + g.packed_row * ld);
    const int64_t per_group = ceil_div(N, kColumnsPerItem);
    parallel_chunks(int64_t(small.size()) * per_group, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; i++) {
        const Group& g = small[i / per_group];
        const int64_t n0 = (i % per_group) * kColumnsPerItem, n1 = std::min(N, n0 + kColumnsPerItem);
        gemv_rows(kern, acts, packed + g.packed_row * ld, g.r1 - g.r0, operand(g.expert), n0, n1, op + g.r0 * N, N);
      }
    });
    release_scratch_above_cap(Slot::Activations);
  });
  return out;
}

}  // namespace
}  // namespace lowbit::cpu

TORCH_LIBRARY_IMPL(lowbit, CPU, m) {
  m.impl("fp8_grouped_mm", &lowbit::cpu::fp8_grouped_mm);
}
