// The Python module torch_lowbit._C: op schemas and kernels register themselves at load time (static
// registrars); this file only adds the few host functions Python calls directly.
#include <torch/extension.h>

#include "metal/emu_launcher.h"
#include "metal/plans.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("_load_emulator", &lowbit::metal::load_emulator, "load torch_lowbit/_msl_emu*.so (the MSL emulator)");
  m.def("_emulator_loaded", &lowbit::metal::emulator_loaded);
  m.def("_emu_set_reverse", &lowbit::metal::set_emulator_reverse,
        "run the threads of every emulated threadgroup in reverse order (a test switch)");
  m.def("_metal_fp8_mm_kernel", &lowbit::metal::fp8_mm_kernel_name, "the Metal kernel fp8_mm runs for (M, x dtype)");
  m.def("_metal_fp8_grouped_mm_kernel", &lowbit::metal::fp8_grouped_mm_kernel_name,
        "the Metal kernel fp8_grouped_mm runs for (T rows, G groups, x dtype)");
}
