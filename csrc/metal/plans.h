// The Metal plans: one per op (plan_<op>.cpp). A plan validates (checks.h), allocates the output on the
// inputs' device, picks the kernel variant, computes the grid, and runs it through a Launcher. The same
// plan serves the mps device (MpsLauncher) and the emulator (EmuLauncher).
#pragma once
#include <ATen/core/Tensor.h>

#include <algorithm>
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

  // Every plan launches through here: Metal's launch limits are checked (check_launch_limits, and the kernel's
  // own pipeline limit on threads per threadgroup) before any launcher sees the dispatch, so the mps device and
  // the emulator refuse the same launches.
  void run(const Dispatch& d) const;
  // Does `kernel`'s pipeline take `threads` per threadgroup? Plans pick a narrower variant, or fewer threads,
  // where it does not (its maxTotalThreadsPerThreadgroup can be below Metal's 1024).
  bool fits(const std::string& kernel, uint64_t threads) const {
    return threads <= launcher.max_threads_per_threadgroup(kernel);
  }
  // For a kernel indexed by thread_position_in_grid alone: how many of `rows` rows of `width` threads its
  // threadgroups take (at least one; Target::run refuses a row wider than the pipeline allows).
  uint32_t rows_that_fit(const std::string& kernel, uint32_t width, uint32_t rows) const {
    return std::max<uint32_t>(1, std::min<uint32_t>(rows, launcher.max_threads_per_threadgroup(kernel) / width));
  }
};

// Metal's limits (metal/limits.h) on one dispatch: threads per threadgroup, threadgroup memory, setBytes
// sizes, 32-bit thread positions per grid dimension. Errors name the kernel and the limit.
void check_launch_limits(const Dispatch& d);

}  // namespace lowbit::metal

#include "checks.h"
#include "../../metal/params.h"

namespace lowbit::metal {

// "float" / "half" / "bfloat": the suffix of a kernel's host_name for an activation or output dtype
const char* kernel_dtype_suffix(at::ScalarType t);

// ---- kernel names and variants: one scheme for every plan ----
// The host_name of a kernel instantiation as metal/*.metal spell it: <base>_<dtype>[_<variant>], e.g.
// kernel_name("int8_gemv", kBFloat16, "k16") == "int8_gemv_bfloat_k16".
std::string kernel_name(const char* base, at::ScalarType dtype, const char* variant = nullptr);

// One line of an op's kernel table: the kernel (host_name base) that computes one of the op's shape classes,
// the least device it runs on, and its tile geometry where lines of one class differ in it. The op's thresholds
// pick the class; pick_variant then takes the class's first line the device runs. So a kernel for newer GPUs is
// one line, listed before the portable kernel of its class, plus its .metal file and a test under
// emulator.device_caps.
struct TileGeometry {
  uint32_t bm = 0, bn = 0;     // output rows (activations) and columns (weight rows) per threadgroup
  uint32_t threads = 0;        // threads per threadgroup
  bool vector_variants = true;  // the kernel has _k16-style aligned-load variants (the portable kernels)
};
template <class Class>
struct KernelVariant {
  Class cls;
  const char* base;
  DeviceCaps needs;
  TileGeometry tile{};
};

// The shape class of an op that runs one kernel for every shape (the dequantize and quantize ops, the 4-bit
// transposed products): its table has one line per device generation.
enum class AnyShape { All };

inline constexpr DeviceCaps kPortableDevice{};  // every Apple GPU from M1 (Apple7, MSL 3.1)
// Apple M5 (MTLGPUFamilyApple10) with MSL 4.0: Metal 4 tensor ops (mpp::tensor_ops::matmul2d). The mps launcher
// reports MSL 4.0 only where it loaded the lowbit_apple10 library (csrc/metal/metallib.py: macOS 26.2 and up).
inline constexpr DeviceCaps kTensorOpsDevice{10, 400};
// No Apple GPU reports this; the emulator's device_caps switch can, so that tests pin that plans run what the
// device's capabilities select (see kInt8MmKernels).
inline constexpr DeviceCaps kTestOnlyDevice{1000, 9900};

// TORCH_LOWBIT_NO_MPP=1 keeps every plan off the tensor-op (MSL 4.0) kernels, on the mps device and in the
// emulator alike (read at each choice, so a test can flip it).
bool tensor_ops_disabled();

// Whether a kernel line with these needs runs on the tensor units (an MSL 4.0 kernel)
inline bool uses_tensor_ops(const DeviceCaps& needs) { return needs.msl_version >= kTensorOpsDevice.msl_version; }
inline bool runs_on(const DeviceCaps& device, const DeviceCaps& needs) {
  if (uses_tensor_ops(needs) && tensor_ops_disabled()) return false;
  return device.apple_family >= needs.apple_family && device.msl_version >= needs.msl_version;
}

template <class Class, size_t N>
const KernelVariant<Class>& pick_variant(const KernelVariant<Class> (&table)[N], Class cls, const DeviceCaps& device) {
  for (const KernelVariant<Class>& v : table)
    if (v.cls == cls && runs_on(device, v.needs)) return v;
  TORCH_CHECK(false, "torch_lowbit metal: no kernel for shape class ", int(cls), " on Apple GPU family ",
              device.apple_family, " with MSL ", device.msl_version);
}
// As pick_variant, for a launch on t: a line whose pipeline takes fewer threads per threadgroup than its geometry
// needs (maxTotalThreadsPerThreadgroup of a register-heavy kernel) is passed over for the class's next line, as a
// device that lacks its capabilities would be. Lines without a geometry (tile.threads 0) size their threadgroups
// in their plan. Where no line fits, the last that runs is returned and Target::run refuses it naming the limit.
template <class Class, size_t N>
const KernelVariant<Class>& pick_variant(const KernelVariant<Class> (&table)[N], Class cls, const Target& t,
                                         at::ScalarType dtype) {
  const KernelVariant<Class>* last = nullptr;
  for (const KernelVariant<Class>& v : table) {
    if (v.cls != cls || !runs_on(t.caps, v.needs)) continue;
    if (v.tile.threads == 0 || t.fits(kernel_name(v.base, dtype), v.tile.threads)) return v;
    last = &v;
  }
  return last ? *last : pick_variant(table, cls, t.caps);
}
// As above, for a class whose kernels hold more threads than any other (a multi-row GEMV holds its rows in
// registers): where its line's pipeline takes fewer threads than its geometry needs, `narrower`'s line runs (a
// class that computes any shape in fewer threads, such as the tiled GEMM).
template <class Class, size_t N>
const KernelVariant<Class>& pick_variant(const KernelVariant<Class> (&table)[N], Class cls, Class narrower,
                                         const Target& t, at::ScalarType dtype) {
  const KernelVariant<Class>& v = pick_variant(table, cls, t, dtype);
  if (cls == narrower || v.tile.threads == 0 || t.fits(kernel_name(v.base, dtype), v.tile.threads)) return v;
  return pick_variant(table, narrower, t, dtype);
}
template <class Class, size_t N>
const char* pick_kernel(const KernelVariant<Class> (&table)[N], Class cls, const DeviceCaps& device) {
  return pick_variant(table, cls, device).base;
}

// LowbitDtype (params.h) of a buffer a kernel reads in its own dtype: bf16 / fp16 / fp32
uint32_t kernel_dtype_code(at::ScalarType t);

ScaleParams scale_params(const ScaleLayout& l);

uint32_t checked_u32(const char* what, int64_t v);  // sizes travel as 32-bit in params structs

// A tiled kernel's grid: one threadgroup of tile.threads threads per tile.bm x tile.bn block of a rows x cols
// output (grid x over the columns, y over the rows).
void grid_over_tiles(Dispatch& d, const TileGeometry& tile, int64_t rows, int64_t cols);

// May a kernel use `bytes`-byte vector loads / stores on every one of `buffers`, whose rows hold row_elems
// elements each? MSL needs a vector access aligned to its size, and mps binds a tensor at
// storage_offset * element_size bytes into its MTLBuffer: so each buffer's byte offset and its row pitch
// (row_elems * element_size) must be multiples of `bytes`. The one rule for every plan's vector variants.
bool vector_access_ok(int64_t bytes, int64_t row_elems, std::initializer_list<at::Tensor> buffers);

// The three regimes of a weight-only matmul (fp8_mm, w4_mm) by activation rows M. M == 1 (batch-1 decode) is
// bandwidth-bound: a GEMV reads every weight byte once and keeps everything in registers. Up to gemv_rows rows a
// multi-row GEMV still reads and decodes each weight chunk once and dots it against every row, keeping the GEMV's
// memory traffic while doing M times the math; past that it would decode the weights again per pass, and a 32-row
// GEMM tile is already more than a quarter full, so the tiled GEMM takes over. (Peers switch in the same region:
// MLX at M ~ 6..33 depending on chip and size, PyTorch's int8 MPS kernel at 12.)
enum class MmKernel { Gemv, GemvRows, Gemm };
inline MmKernel choose_mm_kernel(int64_t M, int64_t gemv_rows) {
  if (M <= 1) return MmKernel::Gemv;
  if (M <= gemv_rows) return MmKernel::GemvRows;
  return MmKernel::Gemm;
}
// The same regimes with the GEMM split by activation width, for ops with an M5 tensor-op GEMM: fp32 activations
// never go through the tensor units (they would be rounded to half or bfloat: design.md).
enum class MmWidthClass { Gemv, GemvRows, Gemm16, Gemm32 };
inline MmWidthClass mm_width_class(int64_t M, int64_t gemv_rows, at::ScalarType dtype) {
  switch (choose_mm_kernel(M, gemv_rows)) {
    case MmKernel::Gemv: return MmWidthClass::Gemv;
    case MmKernel::GemvRows: return MmWidthClass::GemvRows;
    case MmKernel::Gemm: break;
  }
  return dtype == at::kFloat ? MmWidthClass::Gemm32 : MmWidthClass::Gemm16;
}

// The [M, N] product's result where it is empty or K == 0 (an empty sum: the bias, or zero, in every row); false
// where the kernels must run.
bool empty_product(at::Tensor& out, const std::optional<at::Tensor>& bias, int64_t K);

// The kernel (host_name) each plan picks, exposed to Python (torch_lowbit._C) so tests pin the thresholds.
std::string fp8_mm_kernel_name(int64_t M, at::ScalarType dtype, const DeviceCaps& device);
std::string fp8_grouped_mm_kernel_name(int64_t T, int64_t G, at::ScalarType dtype,
                                       const DeviceCaps& device = kPortableDevice);

// ---- one function per op; each lives in plan_<op>.cpp ----
at::Tensor plan_fp8_mm(Target t, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias, at::OptionalIntArrayRef block_size);

at::Tensor plan_fp8_dequantize(Target t, const at::Tensor& weight, const at::Tensor& scale,
                               at::OptionalIntArrayRef block_size, at::ScalarType dtype);

at::Tensor plan_fp8_grouped_mm(Target t, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                               const at::Tensor& offsets, const std::optional<at::Tensor>& expert_ids,
                               at::OptionalIntArrayRef block_size);

std::tuple<at::Tensor, at::Tensor> plan_int8_quantize(Target t, const at::Tensor& x);

// The transposed products of the backward passes (shared plan code: plan_mm_t.h)
at::Tensor plan_fp8_mm_t(Target t, const at::Tensor& grad_out, const at::Tensor& weight, const at::Tensor& scale,
                         at::OptionalIntArrayRef block_size);

at::Tensor plan_fp8_grouped_mm_t(Target t, const at::Tensor& grad_out, const at::Tensor& weight,
                                 const at::Tensor& scale, const at::Tensor& offsets,
                                 const std::optional<at::Tensor>& expert_ids, at::OptionalIntArrayRef block_size);

at::Tensor plan_int8_weight_mm_t(Target t, const at::Tensor& grad_out, const at::Tensor& wq, const at::Tensor& w_scale);

// 4-bit weights (csrc/w4_formats.h; shared plan code: plan_w4.h)
at::Tensor plan_w4_mm(Target t, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                      const std::string& format, int64_t group_size, const std::optional<at::Tensor>& offset,
                      const std::optional<at::Tensor>& global_scale, const std::optional<at::Tensor>& bias);

at::Tensor plan_w4_dequantize(Target t, const at::Tensor& codes, const at::Tensor& scale, const std::string& format,
                              int64_t group_size, int64_t K, const std::optional<at::Tensor>& offset,
                              const std::optional<at::Tensor>& global_scale, at::ScalarType dtype);

at::Tensor plan_w4_mm_t(Target t, const at::Tensor& grad_out, const at::Tensor& codes, const at::Tensor& scale,
                        const std::string& format, int64_t group_size, int64_t K,
                        const std::optional<at::Tensor>& offset, const std::optional<at::Tensor>& global_scale);

// grouped (MoE): codes [E, N, ceil(K/2)], scale / offset [E, N, G], global_scale [E]
at::Tensor plan_w4_grouped_mm(Target t, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                              const std::string& format, int64_t group_size, const at::Tensor& offsets,
                              const std::optional<at::Tensor>& expert_ids, const std::optional<at::Tensor>& offset,
                              const std::optional<at::Tensor>& global_scale);

at::Tensor plan_w4_grouped_mm_t(Target t, const at::Tensor& grad_out, const at::Tensor& codes,
                                const at::Tensor& scale, const std::string& format, int64_t group_size, int64_t K,
                                const at::Tensor& offsets, const std::optional<at::Tensor>& expert_ids,
                                const std::optional<at::Tensor>& offset,
                                const std::optional<at::Tensor>& global_scale);

at::Tensor plan_int8_mm(Target t, const at::Tensor& xq, const at::Tensor& x_scale, const at::Tensor& wq,
                        const at::Tensor& w_scale, const std::optional<at::Tensor>& bias,
                        std::optional<at::ScalarType> out_dtype);

}  // namespace lowbit::metal
