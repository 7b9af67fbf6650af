// Plan code shared by the grouped ops: fp8_grouped_mm (plan_fp8_grouped_mm.cpp, where it lives), its transposed
// product fp8_grouped_mm_t (plan_fp8_grouped_mm_t.cpp) and the 4-bit ones (plan_w4_grouped_mm.cpp,
// plan_w4_grouped_mm_t.cpp).
#pragma once
#include "metal/plans.h"

namespace lowbit::metal {

// The sizes and scale layout of a grouped call; flags: the op's own (Fp8Flags or MmTFlags)
Fp8GroupedMmParams grouped_params(const Fp8GroupedMmArgs& a, uint32_t flags);

// Runs fp8_grouped_tiles: the table of the groups' rows and of the 32-row tiles that exist
// (metal/fp8_grouped_mm.metal), laid out on the device, since the plan cannot read offsets on mps without a sync.
// Every grouped kernel, decode and prefill, reads its rows from it: one rule for malformed offsets.
at::Tensor run_grouped_tiles(Target t, const GroupRows& rows);

// Binds a grouped kernel's group buffers, the tile table (run first here) and expert_ids, and sizes its grid:
// `threads` per threadgroup over grid_x columns and y = one slot per group plus one for the rows in no group
// (decode), or the tiles that can exist (prefill: ceil(T / 32) + G + 1).
void bind_group_rows(Target t, Dispatch& d, const GroupRows& rows);
void grouped_grid(Dispatch& d, const GroupRows& rows, bool decode, int64_t grid_x, uint32_t threads);

// The fp8 grouped kernels' whole launch: x (or grad_out), weight, scale, the group buffers, out, params.
void run_grouped(Target t, const std::string& kernel, const char* x_name, const Fp8GroupedMmArgs& a,
                 const Fp8GroupedMmParams& p, const at::Tensor& out, bool decode, int64_t grid_x, uint32_t threads);

}  // namespace lowbit::metal
