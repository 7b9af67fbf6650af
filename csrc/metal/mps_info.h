// What the mps launcher found on this Mac, for bug reports (`python -m torch_lowbit.env`, through
// torch_lowbit._C._mps_info). mps_launcher.mm installs the provider when it is built (macOS); elsewhere it
// stays null and _mps_info returns None.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "metal/launcher.h"

namespace lowbit::metal {

struct MpsInfo {
  std::string gpu;                     // MTLDevice.name
  DeviceCaps caps;                     // what plans see (Target::caps)
  std::vector<std::string> libraries;  // per library: "lowbit: metallib <path>" / "...: source (MSL 3.1)" / "...: not loaded (...)"
  // every kernel of the loaded libraries and its pipeline's maxTotalThreadsPerThreadgroup (Launcher)
  std::vector<std::pair<std::string, uint32_t>> pipelines;
};

using MpsInfoProvider = MpsInfo (*)();

inline MpsInfoProvider& mps_info_provider() {
  static MpsInfoProvider provider = nullptr;
  return provider;
}

}  // namespace lowbit::metal
