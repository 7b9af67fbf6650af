// The emulator launcher: runs Dispatches in the MSL emulator (the _msl_emu library) on CPU tensors.
#pragma once
#include <string>

#include "metal/launcher.h"

namespace lowbit::metal {

class EmuLauncher final : public Launcher {
 public:
  void run(const Dispatch& d) override;
};

// Called once from Python with the path of torch_lowbit/_msl_emu*.so.
void load_emulator(const std::string& path);
bool emulator_loaded();
// Test switch: run the threads of every threadgroup in reverse order.
void set_emulator_reverse(bool on);

}  // namespace lowbit::metal
