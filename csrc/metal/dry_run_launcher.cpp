#include "metal/dry_run_launcher.h"

#include <torch/library.h>

#include <mutex>

#include "metal/emu_launcher.h"
#include "metal/planned_ops.h"

namespace lowbit::metal {
namespace {

std::mutex g_mu;
std::vector<RecordedDispatch> g_records;

}  // namespace

DeviceCaps DryRunLauncher::caps() const { return emulator_device_caps(); }

void DryRunLauncher::run(const Dispatch& d) {
  RecordedDispatch r;
  r.kernel = d.kernel;
  r.threadgroups = d.threadgroups;
  r.threads = d.threads;
  for (size_t b : d.threadgroup_memory) r.threadgroup_memory += b;
  for (const Arg& a : d.args) {
    if (a.is_value()) {
      r.binding.push_back(~int(r.values.size()));
      r.values.emplace_back(a.name, std::string(a.bytes.begin(), a.bytes.end()));
      continue;
    }
    r.binding.push_back(int(r.buffers.size()));
    r.buffers.push_back(RecordedBuffer{a.name, a.tensor.sizes().vec(), std::string(c10::toString(a.tensor.scalar_type())),
                                       a.tensor.storage_offset(), int64_t(a.tensor.numel() * a.tensor.element_size()),
                                       a.access});
  }
  std::lock_guard<std::mutex> g(g_mu);
  g_records.push_back(std::move(r));
}

std::vector<RecordedDispatch> take_dry_run_records() {
  std::lock_guard<std::mutex> g(g_mu);
  std::vector<RecordedDispatch> out;
  out.swap(g_records);
  return out;
}

}  // namespace lowbit::metal

// ---- torch.ops.lowbit_dryrun.*: the Metal plans on meta tensors, recording instead of running ----
TORCH_LIBRARY_IMPL(lowbit_dryrun, Meta, m) {
  lowbit::metal::PlannedOps<lowbit::metal::DryRunLauncher, /*HostVisible=*/false>::register_all(m);
}
