// The Python module torch_lowbit._C: op schemas and kernels register themselves at load time (static
// registrars); this file only adds the few host functions Python calls directly.
#include <torch/extension.h>

#include "metal/emu_launcher.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("_load_emulator", &lowbit::metal::load_emulator, "load torch_lowbit/_msl_emu*.so (the MSL emulator)");
  m.def("_emulator_loaded", &lowbit::metal::emulator_loaded);
  m.def("_emu_set_reverse", &lowbit::metal::set_emulator_reverse,
        "run the threads of every emulated threadgroup in reverse order (a test switch)");
}
