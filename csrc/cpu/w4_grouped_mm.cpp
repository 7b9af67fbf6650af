// w4_grouped_mm and w4_grouped_mm_t on the CPU: each group's rows through the dense 4-bit products
// (w4_matmul.h) of its expert; rows of expert -1 and rows in no group are zero.
// w4_grouped_mm's small groups (the decode case: a token's few experts, a few rows each) are scheduled together,
// as fp8_grouped_mm's: their rows packed once, then (group, column range) items in one parallel loop taken by
// whichever thread is free (parallel.h), so that the chosen experts' weights stream on every thread at once
// instead of one short parallel region per group. Groups of w4_gemm_min_rows rows or more run the GEMM one by one.
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <vector>

#include "checks.h"
#include "cpu/arch/kernel_set.h"
#include "cpu/dispatch.h"
#include "cpu/parallel.h"
#include "cpu/w4_matmul.h"
#include "cpu/workspace.h"

namespace lowbit::cpu {
namespace {

// Items per thread of the small groups' loop. A thread's items start cold (its tiles prefetch ahead within an item,
// not into the item it takes next), and a decode's experts are short: 16 a thread made items of 24-48 KB at 16
// threads (Qwen3-30B-A3B's experts); 4 make them 96-192 KB, a few percent of an item waiting, and still leave a
// thread's share to the others when it lags.
constexpr int64_t kItemsPerThread = 4;

struct SmallGroup {
  int64_t expert, r0, r1, packed_row;  // packed_row: first row of this group in the packed activations
};

// The small groups' products: rows [r0, r1) of x [T, K] times expert `expert` into out [T, N].
template <typename T>
void small_groups(const W4GroupedMmArgs& a, const std::vector<SmallGroup>& groups, int64_t rows, const T* x, T* out) {
  const int64_t K = a.w.K, N = a.w.N;
  const W4Kernels& kern = kernel_set().w4;
  std::vector<W4Operand> ops;
  for (const SmallGroup& g : groups) ops.push_back(w4_operand(a.w, g.expert));  // reads global scales once
  const W4GemvActivations acts = w4_gemv_activations<T>(kern, ops[0]);
  const int64_t ld = acts.row_bytes();
  uint8_t* packed = scratch<uint8_t>(Slot::Activations, size_t(rows * ld));
  for (const SmallGroup& g : groups) w4_pack_rows(acts, x + g.r0 * K, g.r1 - g.r0, packed + g.packed_row * ld);
  const int64_t cols = std::min(N, stream_chunk(N * int64_t(groups.size()), kMaxTileRows, 16, kItemsPerThread));
  const int64_t per_group = ceil_div(N, cols);
  parallel_chunks(int64_t(groups.size()) * per_group, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++) {
      const SmallGroup& g = groups[i / per_group];
      const int64_t n0 = (i % per_group) * cols, n1 = std::min(N, n0 + cols);
      w4_gemv_rows(kern, acts, packed + g.packed_row * ld, g.r1 - g.r0, ops[i / per_group], n0, n1, out + g.r0 * N, N);
    }
  });
  release_scratch_above_cap(Slot::Activations);
}

// out [T, width] = zeros, then each live group's rows of x through product(expert, r0, rows, out).
template <typename F>
at::Tensor for_each_group(const W4GroupedMmArgs& a, int64_t width, const F& product) {
  at::Tensor out = at::zeros({a.T, width}, a.x.options());
  const int32_t* off = a.offsets.data_ptr<int32_t>();
  const int32_t* ids = a.expert_ids.data_ptr<int32_t>();
  for (int64_t g = 0; g < a.G; g++) {
    const int64_t r0 = off[g], rows = off[g + 1] - off[g];
    if (ids[g] < 0 || rows == 0 || width == 0) continue;
    product(int64_t(ids[g]), r0, rows, out);
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
  std::vector<SmallGroup> small;
  int64_t small_rows = 0;
  int64_t gemm_rows = -1;  // the same for every expert (the route depends on the format): from the first live one
  at::Tensor out = for_each_group(a, N, [&](int64_t e, int64_t r0, int64_t rows, at::Tensor& out) {
    if (gemm_rows < 0)
      LOWBIT_DISPATCH_FLOAT_TYPES(a.x.scalar_type(), "w4_grouped_mm",
                                  [&] { gemm_rows = w4_gemm_min_rows<scalar_t>(w4_operand(a.w, e)); });
    if (rows < gemm_rows && K > 0) {  // after the big groups (w4_matmul reuses the activation scratch)
      small.push_back({e, r0, r0 + rows, small_rows});
      small_rows += rows;
      return;
    }
    LOWBIT_DISPATCH_FLOAT_TYPES(a.x.scalar_type(), "w4_grouped_mm", [&] {
      w4_matmul<scalar_t>(a.x.data_ptr<scalar_t>() + r0 * K, rows, w4_operand(a.w, e),
                          out.data_ptr<scalar_t>() + r0 * N, N);
    });
  });
  if (!small.empty())
    LOWBIT_DISPATCH_FLOAT_TYPES(a.x.scalar_type(), "w4_grouped_mm", [&] {
      small_groups<scalar_t>(a, small, small_rows, a.x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>());
    });
  return out;
}

at::Tensor w4_grouped_mm_t(const at::Tensor& grad_out, const at::Tensor& codes, const at::Tensor& scale,
                           c10::string_view format, int64_t group_size, c10::SymInt K, const at::Tensor& offsets,
                           const std::optional<at::Tensor>& expert_ids, const std::optional<at::Tensor>& offset,
                           const std::optional<at::Tensor>& global_scale) {
  const W4GroupedMmArgs a = check_w4_grouped_mm("w4_grouped_mm_t", true, grad_out, codes, scale, std::string(format),
                                                group_size, K.expect_int(), offsets, expert_ids, offset, global_scale,
                                                true);
  const int64_t k = a.w.K, N = a.w.N;
  return for_each_group(a, k, [&](int64_t e, int64_t r0, int64_t rows, at::Tensor& out) {
    if (N == 0) return;
    const W4Operand op = w4_operand(a.w, e);
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
