// The emulator launcher: runs Dispatches in the MSL emulator (the _msl_emu library) on CPU tensors.
#pragma once
#include <string>

#include "metal/launcher.h"

namespace lowbit::metal {

class EmuLauncher final : public Launcher {
 public:
  void run(const Dispatch& d) override;
  DeviceCaps caps() const override;  // the portable floor unless a test set others (set_emulator_device_caps)
  uint32_t max_threads_per_threadgroup(const std::string& kernel) override;  // set_emulator_max_threads...
};

// Called once from Python with the path of torch_lowbit/_msl_emu*.so.
void load_emulator(const std::string& path);
bool emulator_loaded();
// Test switch: run the threads of every threadgroup in reverse order.
void set_emulator_reverse(bool on);
// Test switch: the device capabilities the emulator reports to the plans (kernel variants for newer GPUs).
void set_emulator_device_caps(uint32_t apple_family, uint32_t msl_version);
DeviceCaps emulator_device_caps();
// Test switch: every pipeline's maxTotalThreadsPerThreadgroup as the emulator reports it to the plans (and
// enforces), Metal's 1024 by default; lower, it runs the plans' narrower variants as a register-heavy pipeline
// on a real GPU would.
void set_emulator_max_threads_per_threadgroup(uint32_t limit);
uint32_t emulator_max_threads_per_threadgroup();
// Test switch: one pipeline's own limit (a full kernel name, e.g. int8_gemm_mpp_bfloat; 0 removes it), as a
// register-heavy kernel's may be lower than its neighbours'.
void set_emulator_kernel_max_threads(const std::string& kernel, uint32_t limit);

}  // namespace lowbit::metal
