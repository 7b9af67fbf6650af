// The plan code shared by the 4-bit ops (plan_w4_mm.cpp, plan_w4_dequantize.cpp, plan_w4_mm_t.cpp and the grouped
// plan_w4_grouped_mm.cpp, plan_w4_grouped_mm_t.cpp): kernel names, the params struct, the weight's buffers.
// Kernels: metal/w4*.
#pragma once
#include "metal/plans.h"

namespace lowbit::metal {

// "f32", "f16", "bf16", "e4m3", "e8m0" and "none", "zp", "bias": the parts of a w4 kernel's name for its scale
// encoding and offset kind (the list of variants is csrc/metal/w4_instances.py, which writes the instantiations)
const char* w4_scale_variant(W4Scale s);
const char* w4_offset_variant(W4Offset o);

// <base>_<dtype>_<scale>_<offset> for weight w, e.g. "w4_gemv_bfloat_e4m3_none" for nvfp4 and bf16 activations
std::string w4_kernel_name(const char* base, at::ScalarType dtype, const W4Weight& w);

// The params of weight w for a product with M rows (0 for w4_dequantize): sizes, the format's value table, the
// code-load flags; `flags` adds the op's own (kW4XVec, kW4HasBias, ...).
W4Params w4_params(const W4Weight& w, int64_t M, uint32_t flags);

// Whether every code value of w's format times every finite scale of its encoding is exact in dtype, and normal
// there where not zero (tensor units may flush subnormals): the M5 GEMM then stages decoded weights instead of
// folding group scales (kW4MppScaled, metal/w4_gemm_mpp.h). True for nvfp4 (E2M1 x E4M3) with bf16 and fp16;
// only E4M3 scales without offsets are tried.
bool w4_scaled_exact(const W4Weight& w, at::ScalarType dtype);
// The params flag of that choice for a kernel line with these needs: kW4MppScaled for a tensor-op kernel where
// w4_scaled_exact, else 0 (the portable kernels decode every weight in fp32).
uint32_t w4_mpp_flags(const DeviceCaps& kernel_needs, const W4Weight& w, at::ScalarType dtype);

// Binds the weight's four buffers in kernel order: codes, scale, offset, global_scale. An absent offset or global
// scale binds the scale in its place (never read: the params say it is absent), so no buffer is ever unbound.
void bind_w4_weight(Dispatch& d, const W4Weight& w);

// The params of a grouped product (T rows, G groups, E experts; `flags` as for w4_params)
W4GroupedParams w4_grouped_params(const W4GroupedMmArgs& a, uint32_t flags);

// Launches a 4-bit grouped kernel <kernel_base>_<dtype>_<scale>_<offset>: x (or grad_out), the weight's buffers,
// the group buffers (offsets for decode, else the tile table), out, params; grid as plan_grouped.h's
// grouped_grid.
void run_w4_grouped(Target t, const char* kernel_base, const char* x_name, const W4GroupedMmArgs& a,
                    const W4GroupedParams& p, const at::Tensor& out, bool decode, int64_t grid_x, uint32_t threads);

}  // namespace lowbit::metal
