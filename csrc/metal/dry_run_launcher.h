// The dry-run launcher: records every Dispatch a plan makes instead of running it, so tests can check the
// plans' grids at real model sizes (torch.ops.lowbit_dryrun.<op> on meta tensors, which hold no memory;
// torch_lowbit.emulator.dry_run() from Python). It runs the plans as on mps: offsets and ids unread.
#pragma once
#include <string>
#include <vector>

#include "metal/launcher.h"

namespace lowbit::metal {

struct RecordedBuffer {
  std::string name;
  std::vector<int64_t> shape;
  std::string dtype;
  int64_t storage_offset = 0;  // elements
  int64_t nbytes = 0;
  Access access = Access::Read;
};

struct RecordedDispatch {
  std::string kernel;
  Size3 threadgroups, threads;
  size_t threadgroup_memory = 0;                              // bytes, all [[threadgroup(i)]] together
  std::vector<RecordedBuffer> buffers;                        // tensor arguments, in [[buffer(i)]] order
  std::vector<std::pair<std::string, std::string>> values;    // value arguments: name, raw bytes
  std::vector<int> binding;                                   // [[buffer(i)]] -> index into buffers (>= 0) or ~index into values
};

class DryRunLauncher final : public Launcher {
 public:
  void run(const Dispatch& d) override;
  // the device of emulator.device_caps (the portable floor unless a test sets another): plans at real sizes on M5
  DeviceCaps caps() const override;
};

// The dispatches recorded since the last call, oldest first.
std::vector<RecordedDispatch> take_dry_run_records();

}  // namespace lowbit::metal
