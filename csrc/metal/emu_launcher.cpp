#include "metal/emu_launcher.h"

#include <dlfcn.h>
#include <torch/library.h>

#include <atomic>
#include <map>
#include <mutex>

#include "metal/planned_ops.h"

namespace lowbit::metal {
namespace {

// The C API of csrc/emu/runtime.cpp
using RunFn = int (*)(const char*, int, void**, const size_t*, const int*, const size_t*, const unsigned*,
                      const unsigned*, const size_t*, int, char*, size_t);
using SetReverseFn = void (*)(int);
using HasKernelFn = int (*)(const char*);
using SetArgInfoFn = void (*)(int, const char* const*, const int*);

struct EmuApi {
  RunFn run = nullptr;
  SetReverseFn set_reverse = nullptr;
  HasKernelFn has_kernel = nullptr;
  SetArgInfoFn set_arg_info = nullptr;  // only in the traffic build (_msl_trace): names its per-buffer counts
};
EmuApi g_api;
std::mutex g_api_mu;

const EmuApi& api() {
  std::lock_guard<std::mutex> g(g_api_mu);
  TORCH_CHECK(g_api.run != nullptr,
              "torch_lowbit: the Metal emulator is not built into this install (torch.ops.lowbit_emu needs "
              "torch_lowbit/_msl_emu*.so; it is built on non-macOS machines unless TORCH_LOWBIT_EMULATOR=0)");
  return g_api;
}

}  // namespace

void load_emulator(const std::string& path) {
  std::lock_guard<std::mutex> g(g_api_mu);
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  TORCH_CHECK(h != nullptr, "torch_lowbit: cannot load the Metal emulator ", path, ": ", dlerror());
  EmuApi a;
  a.run = reinterpret_cast<RunFn>(dlsym(h, "msl_emu_run"));
  a.set_reverse = reinterpret_cast<SetReverseFn>(dlsym(h, "msl_emu_set_reverse"));
  a.has_kernel = reinterpret_cast<HasKernelFn>(dlsym(h, "msl_emu_has_kernel"));
  a.set_arg_info = reinterpret_cast<SetArgInfoFn>(dlsym(h, "msl_emu_set_arg_info"));
  TORCH_CHECK(a.run && a.set_reverse && a.has_kernel, "torch_lowbit: ", path, " lacks the emulator's C API");
  g_api = a;
}

bool emulator_loaded() {
  std::lock_guard<std::mutex> g(g_api_mu);
  return g_api.run != nullptr;
}

void set_emulator_reverse(bool on) { api().set_reverse(on ? 1 : 0); }

namespace {
std::mutex g_caps_mu;
DeviceCaps g_caps;  // the portable floor
}  // namespace

void set_emulator_device_caps(uint32_t apple_family, uint32_t msl_version) {
  std::lock_guard<std::mutex> g(g_caps_mu);
  g_caps = DeviceCaps{apple_family, msl_version};
}

DeviceCaps emulator_device_caps() {
  std::lock_guard<std::mutex> g(g_caps_mu);
  return g_caps;
}

DeviceCaps EmuLauncher::caps() const { return emulator_device_caps(); }

namespace {
std::atomic<uint32_t> g_max_threads{uint32_t(kMaxThreadsPerThreadgroup)};
std::mutex g_kernel_limits_mu;
std::map<std::string, uint32_t> g_kernel_limits;  // pipelines given their own, lower limit (a test switch)
}  // namespace

void set_emulator_max_threads_per_threadgroup(uint32_t limit) {
  TORCH_CHECK(limit >= 32 && limit <= kMaxThreadsPerThreadgroup && limit % 32 == 0,
              "max_threads_per_threadgroup must be a multiple of 32 (the simdgroup width) from 32 to ",
              kMaxThreadsPerThreadgroup, ", got ", limit);
  g_max_threads = limit;
}

uint32_t emulator_max_threads_per_threadgroup() { return g_max_threads; }

void set_emulator_kernel_max_threads(const std::string& kernel, uint32_t limit) {
  TORCH_CHECK(limit == 0 || (limit >= 32 && limit <= kMaxThreadsPerThreadgroup && limit % 32 == 0),
              "max_threads_per_threadgroup of ", kernel, " must be a multiple of 32 (the simdgroup width) from 32 to ",
              kMaxThreadsPerThreadgroup, " (0: back to every pipeline's), got ", limit);
  std::lock_guard<std::mutex> g(g_kernel_limits_mu);
  if (limit == 0) g_kernel_limits.erase(kernel);
  else g_kernel_limits[kernel] = limit;
}

uint32_t EmuLauncher::max_threads_per_threadgroup(const std::string& kernel) {
  std::lock_guard<std::mutex> g(g_kernel_limits_mu);
  const auto it = g_kernel_limits.find(kernel);
  return it == g_kernel_limits.end() ? g_max_threads.load() : std::min(g_max_threads.load(), it->second);
}

void EmuLauncher::run(const Dispatch& d) {
  const EmuApi& e = api();
  TORCH_CHECK(e.has_kernel(d.kernel.c_str()), "metal emulator: no kernel named '", d.kernel,
              "' in metal/*.metal (is it instantiated with [[host_name]]?)");
  const int n = int(d.args.size());
  TORCH_CHECK(n <= 31, "metal emulator: ", d.kernel, " binds ", n, " buffers; Metal allows 31");
  std::vector<void*> ptrs(n);
  std::vector<size_t> sizes(n);
  std::vector<int> flags(n);
  std::vector<size_t> residues(n, 0);  // where mps binds each buffer: its storage offset in bytes
  for (int i = 0; i < n; i++) {
    const Arg& a = d.args[i];
    if (a.is_value()) {
      ptrs[i] = const_cast<uint8_t*>(a.bytes.data());
      sizes[i] = a.bytes.size();
      flags[i] = 4;
      continue;
    }
    TORCH_CHECK(a.tensor.device().is_cpu(), "metal emulator: ", d.kernel, " buffer ", a.name,
                " must be a CPU tensor, got ", a.tensor.device());
    const size_t nbytes = size_t(a.tensor.numel()) * a.tensor.element_size();
    // An empty tensor may have no storage: mps binds it as nil, and so does the emulator, whose runtime then
    // fails any kernel that takes that [[buffer(i)]] (as Metal's validation layer does). Plans return early.
    ptrs[i] = nbytes ? a.tensor.data_ptr() : nullptr;
    sizes[i] = nbytes;
    // 1: copy back after the run; 2: output only (starts poisoned with 0xFF, so unwritten elements show)
    flags[i] = a.access == Access::Read ? 0 : a.access == Access::Write ? 3 : 1;
    residues[i] = size_t(a.tensor.storage_offset() * a.tensor.element_size());
  }
  const unsigned grid[3] = {d.threadgroups.x, d.threadgroups.y, d.threadgroups.z};
  const unsigned tg[3] = {d.threads.x, d.threads.y, d.threads.z};
  if (uint64_t(grid[0]) * grid[1] * grid[2] == 0) return;
  if (e.set_arg_info) {
    std::vector<const char*> names(n);
    std::vector<int> kinds(n);  // 0 value, 1 read, 2 write, 3 read-write
    for (int i = 0; i < n; i++) {
      const Arg& a = d.args[i];
      names[i] = a.name;
      kinds[i] = a.is_value() ? 0 : a.access == Access::Read ? 1 : a.access == Access::Write ? 2 : 3;
    }
    e.set_arg_info(n, names.data(), kinds.data());
  }
  std::string err(16384, '\0');
  // the runtime checks Metal's launch limits again, for launches that bypass the plans (tests/emu_ctypes.py)
  const int nerr = e.run(d.kernel.c_str(), n, ptrs.data(), sizes.data(), flags.data(), residues.data(), grid, tg,
                         d.threadgroup_memory.data(), 0, err.data(), err.size());
  err.resize(strlen(err.c_str()));
  // Divergent simd ops are reported as warnings by the runtime; our kernels must not have any.
  TORCH_CHECK(nerr == 0 && err.find("warning:") == std::string::npos, "metal emulator: kernel '", d.kernel,
              "' failed on grid (", grid[0], ",", grid[1], ",", grid[2], ") x threadgroup (", tg[0], ",", tg[1], ",",
              tg[2], "):\n", err, "buffers: ", d.describe_buffers());
}

}  // namespace lowbit::metal

// ---- torch.ops.lowbit_emu.*: the Metal plans on CPU tensors, run by the emulator ----
TORCH_LIBRARY_IMPL(lowbit_emu, CPU, m) {
  lowbit::metal::PlannedOps<lowbit::metal::EmuLauncher, /*HostVisible=*/true>::register_all(m);
}

// ---- torch.ops.lowbit_emu_mps.*: the same, with the plans as the mps device runs them (HostVisible = false) ----
// Offsets and expert ids are not validated on the host, so tests reach the kernels' clamping of malformed values.
TORCH_LIBRARY_IMPL(lowbit_emu_mps, CPU, m) {
  lowbit::metal::PlannedOps<lowbit::metal::EmuLauncher, /*HostVisible=*/false>::register_all(m);
}
