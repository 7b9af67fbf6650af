// The Python module torch_lowbit._C: op schemas and kernels register themselves at load time (static
// registrars); this file only adds the few host functions Python calls directly.
#include <torch/extension.h>

#include "autograd.h"

#include "cpu/arch/kernel_set.h"
#include "cpu/brgemm.h"
#include "cpu/fp8_matmul.h"
#include "cpu/int8_mm.h"
#include "cpu/read_bandwidth.h"
#include "cpu/transposed_matmul.h"
#include "cpu/workspace.h"
#include "metal/dry_run_launcher.h"
#include "metal/emu_launcher.h"
#include "metal/library_loading.h"
#include "metal/mps_info.h"
#include "metal/plan_int8_mm.h"
#include "metal/plan_w4.h"
#include "metal/plans.h"

namespace {

// The dry-run records as Python dicts (torch_lowbit.emulator.dry_run).
py::list dry_run_take() {
  using lowbit::metal::Access;
  py::list out;
  for (const auto& r : lowbit::metal::take_dry_run_records()) {
    py::dict d;
    d["kernel"] = r.kernel;
    d["grid"] = py::make_tuple(r.threadgroups.x, r.threadgroups.y, r.threadgroups.z);
    d["threads"] = py::make_tuple(r.threads.x, r.threads.y, r.threads.z);
    d["threadgroup_memory"] = r.threadgroup_memory;
    py::dict buffers, values;
    py::list order;
    for (const auto& b : r.buffers) {
      py::dict e;
      e["shape"] = py::tuple(py::cast(b.shape));
      e["dtype"] = b.dtype;
      e["storage_offset"] = b.storage_offset;
      e["nbytes"] = b.nbytes;
      e["access"] = b.access == Access::Read ? "read" : b.access == Access::Write ? "write" : "read_write";
      buffers[py::str(b.name)] = e;
    }
    for (const auto& [name, bytes] : r.values) values[py::str(name)] = py::bytes(bytes);
    for (int i : r.binding) order.append(i >= 0 ? r.buffers[i].name : r.values[~i].first);
    d["buffers"] = buffers;
    d["values"] = values;
    d["binding"] = order;
    out.append(d);
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("_load_emulator", &lowbit::metal::load_emulator, "load torch_lowbit/_msl_emu*.so (the MSL emulator)");
  m.def("_register_autograd", &lowbit::register_autograd, py::arg("ns"), py::arg("name"), py::arg("impl"),
        "route ns::name's Autograd key through the C++ kernel of csrc/autograd.h; impl(*args) runs when a gradient "
        "is needed");
  m.def("_emulator_loaded", &lowbit::metal::emulator_loaded);
  m.def(
      "_mps_info",
      []() -> py::object {
        auto provider = lowbit::metal::mps_info_provider();
        if (provider == nullptr) return py::none();  // built without the mps launcher (not macOS)
        const lowbit::metal::MpsInfo info = provider();
        py::dict d;
        d["gpu"] = info.gpu;
        d["apple_family"] = info.caps.apple_family;
        d["msl_version"] = info.caps.msl_version;
        d["libraries"] = info.libraries;
        py::dict pipelines;
        for (const auto& [name, limit] : info.pipelines) pipelines[py::str(name)] = limit;
        d["pipelines"] = pipelines;
        return d;
      },
      "the mps launcher's GPU, its Apple family, the MSL version, how each Metal library was loaded and each "
      "kernel's pipeline limit on threads per threadgroup (loads them all); None when built without the mps launcher");
  m.def("_emu_set_reverse", &lowbit::metal::set_emulator_reverse,
        "run the threads of every emulated threadgroup in reverse order (a test switch)");
  m.def(
      "_emu_set_device_caps",
      [](uint32_t apple_family, uint32_t msl_version) {
        lowbit::metal::set_emulator_device_caps(apple_family, msl_version);
      },
      "the device capabilities (Apple GPU family, MSL version x 100) the emulator reports to the plans (a test switch)");
  m.def(
      "_emu_device_caps",
      [] {
        const lowbit::metal::DeviceCaps c = lowbit::metal::emulator_device_caps();
        return std::make_tuple(c.apple_family, c.msl_version);
      },
      "(apple_family, msl_version) the emulator reports now");
  m.def("_emu_set_max_threads_per_threadgroup", &lowbit::metal::set_emulator_max_threads_per_threadgroup,
        "every pipeline's maxTotalThreadsPerThreadgroup as the emulator reports and enforces it (a test switch)");
  m.def("_emu_max_threads_per_threadgroup", &lowbit::metal::emulator_max_threads_per_threadgroup);
  m.def("_emu_set_kernel_max_threads", &lowbit::metal::set_emulator_kernel_max_threads,
        "one pipeline's maxTotalThreadsPerThreadgroup as the emulator reports and enforces it (0: the global one)");
  m.def(
      "_metal_int8_mm_kernel",
      [](int64_t M, int64_t N, int64_t K) {
        return std::string(
            lowbit::metal::int8_mm_kernel_base(M, N, K, lowbit::metal::emulator_device_caps()));
      },
      "the host_name base of the int8_mm kernel the plan runs for an [M, K] x [N, K]^T product on the emulator's "
      "device (for tests)");
  m.def(
      "_metal_fp8_mm_kernel",
      [](int64_t M, at::ScalarType dtype) {
        return lowbit::metal::fp8_mm_kernel_name(M, dtype, lowbit::metal::emulator_device_caps());
      },
      "the Metal kernel fp8_mm runs for (M, x dtype) on the emulator's device");
  m.def(
      "_metal_w4_scaled_exact",
      [](const at::Tensor& codes, const at::Tensor& scale, const std::string& format, int64_t group_size, int64_t K,
         at::ScalarType dtype) {
        return lowbit::metal::w4_scaled_exact(
            lowbit::check_w4_weight("w4_mm", codes, scale, format, group_size, K, std::nullopt, std::nullopt, false),
            dtype);
      },
      "whether w4_mm's M5 GEMM stages this weight's decoded values (every value times every scale exact in dtype)");
  m.def(
      "_metal_fp8_grouped_mm_kernel",
      [](int64_t T, int64_t G, at::ScalarType dtype) {
        return lowbit::metal::fp8_grouped_mm_kernel_name(T, G, dtype, lowbit::metal::emulator_device_caps());
      },
      "the Metal kernel fp8_grouped_mm runs for (T rows, G groups, x dtype) on the emulator's device");
  m.def(
      "_metal_library_loading_check",
      [](bool metallib_exists, const std::string& metallib_error, const std::string& source_error) {
        // the mps launcher's library loading with stand-in loaders: an empty error string loads
        const lowbit::metal::MetalLibrary lib{"lowbit", 301, 7, 14, ""};
        auto stand_in = [](const std::string& e) {
          return [e](std::string& error) { return (error = e).empty(); };
        };
        return lowbit::metal::load_library(lib, "/x/lowbit.metallib", metallib_exists, stand_in(metallib_error),
                                           stand_in(source_error));
      },
      "the mps launcher's choice between a metallib and the embedded source, with stand-in loaders (tests)");
  m.def("_dry_run_take", &dry_run_take, "the dispatches torch.ops.lowbit_dryrun recorded since the last call");
  m.def(
      "_metal_check_launch_limits",
      [](const std::string& kernel, std::vector<uint32_t> grid, std::vector<uint32_t> threads, size_t tg_bytes,
         size_t value_bytes) {
        lowbit::metal::Dispatch d(kernel);
        d.grid({grid.at(0), grid.at(1), grid.at(2)}, {threads.at(0), threads.at(1), threads.at(2)});
        d.shared_memory(0, tg_bytes);
        d.args.push_back(lowbit::metal::Arg{"params", at::Tensor(), std::vector<uint8_t>(value_bytes), {}});
        lowbit::metal::check_launch_limits(d);
      },
      "the plans' launch-limit check on a dispatch of these sizes (raises like a plan would; for tests)");
  m.def(
      "_cpu_set_isa",
      [](const std::string& name) {
        const char* previous = lowbit::cpu::cap_kernel_set(name);
        if (!previous) {
          std::string names;
          for (const auto* s : lowbit::cpu::kernel_sets()) names += std::string("'") + s->name + "', ";
          TORCH_CHECK(false, "cpu isa must be one of ", names, "or 'best' (the kernel sets of this build), got '",
                      name, "'");
        }
        return std::string(previous);
      },
      "cap the CPU kernel sets at the one named (one of _cpu_kernel_sets(), or 'best'); returns the previous cap");
  m.def("_cpu_isa", [] { return std::string(lowbit::cpu::kernel_set().name); },
        "the kernel set the CPU kernels use now");
  m.def(
      "_cpu_kernel_sets",
      [] {
        std::vector<std::pair<std::string, bool>> sets;
        for (const auto* s : lowbit::cpu::kernel_sets()) sets.emplace_back(s->name, lowbit::cpu::cpu_supports(*s));
        return sets;
      },
      "the CPU kernel sets of this build as (name, whether this CPU supports it), in order of preference");
  m.def("_cpu_transposed_gemm_min_rows", &lowbit::cpu::transposed_gemm_min_rows,
        "rows of grad_out from which the transposed products run their GEMM regime");
  m.def("_cpu_transposed_panels_bf16", &lowbit::cpu::transposed_panels_bf16,
        "whether that regime multiplies bf16 grad_out by the bf16-dequantized weight now (AMX)");
  m.def("_cpu_amx_gemm", &lowbit::cpu::amx_gemm_available,
        "whether the GEMM regimes of fp8_mm and int8_mm run on oneDNN's AMX brgemm now");
  m.def("_cpu_bf16_panel_gemm", &lowbit::cpu::bf16_panel_gemm_available,
        "whether the GEMM regimes of fp8_mm and w4_mm multiply bf16 panels now (AMX, or the kernel set's bf16 GEMM)");
  m.def(
      "_cpu_poison_workspaces", [](bool on) { lowbit::cpu::g_poison_scratch = on; },
      "hand out the CPU kernels' scratch buffers filled with 0xFF and ending at an inaccessible page (a test switch)");
  m.def(
      "_cpu_scratch_read",
      [](int64_t n, int64_t offset) {
        return int(lowbit::cpu::scratch<uint8_t>(lowbit::cpu::Slot::Tile, size_t(n))[offset]);
      },
      "byte `offset` of a fresh n-byte scratch buffer, unchecked (tests of the scratch guard)");
  m.def("_cpu_scratch_high_water", &lowbit::cpu::scratch_high_water_and_reset,
        "the most bytes of CPU kernel scratch held at once (all threads) since the last call; restarts the count");
  m.def("_cpu_stream_read", &lowbit::cpu::stream_read, "read a tensor's bytes in parallel (bandwidth baseline)");
  m.def("_cpu_int8_pack_strips", &lowbit::cpu::int8_pack_strips, py::arg("xq"), py::arg("W"), py::arg("G"),
        py::arg("narrow_last"), "int8_mm's activation pack of xq [M, K]: (packed elements, row sums), for tests");
}
