// The Metal plans: one per op (plan_<op>.cpp). A plan validates (checks.h), allocates the output on the
// inputs' device, picks the kernel variant, computes the grid, and runs it through a Launcher. The same
// plan serves the mps device (MpsLauncher) and the emulator (EmuLauncher).
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <string>

#include "metal/launcher.h"

namespace lowbit::metal {

// Where a plan runs: the mps device validates tensor values (offsets, expert ids) in the kernel instead of
// on the host, to avoid a device sync per call.
struct Target {
  Launcher& launcher;
  bool host_visible;  // true for the emulator: plans may read small tensors on the host
  DeviceCaps caps{};  // the launcher's device (the portable floor unless the launcher says more)
};

}  // namespace lowbit::metal

#include "checks.h"
#include "../../metal/params.h"

namespace lowbit::metal {

// "float" / "half" / "bfloat": the suffix of a kernel's host_name for an activation or output dtype
const char* kernel_dtype_suffix(at::ScalarType t);

ScaleParams scale_params(const ScaleLayout& l);

uint32_t checked_u32(const char* what, int64_t v);  // sizes travel as 32-bit in params structs

// kFp8VecLoads: K % 16 == 0 and x and the weight bits start 16-byte aligned in their buffers
bool fp8_vec_loads_ok(const at::Tensor& x, const at::Tensor& bits, int64_t K);

// The kernel (host_name) each plan picks, exposed to Python (torch_lowbit._C) so tests pin the thresholds.
std::string fp8_mm_kernel_name(int64_t M, at::ScalarType dtype);
std::string fp8_grouped_mm_kernel_name(int64_t T, int64_t G, at::ScalarType dtype);

// ---- one function per op; each lives in plan_<op>.cpp ----
at::Tensor plan_fp8_mm(Target t, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias, at::OptionalIntArrayRef block_size);

at::Tensor plan_fp8_dequantize(Target t, const at::Tensor& weight, const at::Tensor& scale,
                               at::OptionalIntArrayRef block_size, at::ScalarType dtype);

at::Tensor plan_fp8_grouped_mm(Target t, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                               const at::Tensor& offsets, const std::optional<at::Tensor>& expert_ids,
                               at::OptionalIntArrayRef block_size);

std::tuple<at::Tensor, at::Tensor> plan_int8_quantize(Target t, const at::Tensor& x);

at::Tensor plan_int8_mm(Target t, const at::Tensor& xq, const at::Tensor& x_scale, const at::Tensor& wq,
                        const at::Tensor& w_scale, const std::optional<at::Tensor>& bias,
                        std::optional<at::ScalarType> out_dtype);

}  // namespace lowbit::metal
