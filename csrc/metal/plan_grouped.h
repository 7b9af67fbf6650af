// Plan code shared by the grouped ops, fp8_grouped_mm (plan_fp8_grouped_mm.cpp, where it lives) and its
// transposed product fp8_grouped_mm_t (plan_fp8_grouped_mm_t.cpp).
#pragma once
#include "metal/plans.h"

namespace lowbit::metal {

// The sizes and scale layout of a grouped call; flags: the op's own (Fp8Flags or MmTFlags)
Fp8GroupedMmParams grouped_params(const Fp8GroupedMmArgs& a, uint32_t flags);

// Runs fp8_grouped_tiles: the table of the 32-row tiles that exist (metal/fp8_grouped_mm.metal), laid out on
// the device, since the plan cannot read offsets on mps without a sync. Returns the table for the prefill kernel.
at::Tensor run_grouped_tiles(Target t, const at::Tensor& offsets, const Fp8GroupedMmParams& p);

// Binds a grouped kernel's buffers -- x (or grad_out), weight, scale, offsets (decode) or the tile table
// (prefill), expert_ids, out, params -- and launches it with `threads` per threadgroup over grid_x columns and
// y = one slot per group plus one for the rows in no group (decode), or the tiles that can exist (prefill).
void run_grouped(Target t, const std::string& kernel, const char* x_name, const Fp8GroupedMmArgs& a,
                 const Fp8GroupedMmParams& p, const at::Tensor& out, bool decode, int64_t grid_x, uint32_t threads);

}  // namespace lowbit::metal
