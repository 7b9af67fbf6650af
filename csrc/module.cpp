// The Python module torch_lowbit._C: op schemas and kernels register themselves at load time (static
// registrars); this file only adds the few host functions Python calls directly.
#include <torch/extension.h>

#include "metal/emu_launcher.h"
#include "metal/plan_int8_mm.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("_load_emulator", &lowbit::metal::load_emulator, "load torch_lowbit/_msl_emu*.so (the MSL emulator)");
  m.def("_emulator_loaded", &lowbit::metal::emulator_loaded);
  m.def("_emu_set_reverse", &lowbit::metal::set_emulator_reverse,
        "run the threads of every emulated threadgroup in reverse order (a test switch)");
  m.def(
      "_metal_int8_mm_kernel",
      [](int64_t M, int64_t N, int64_t K) {
        return std::string(lowbit::metal::int8_mm_kernel_name(lowbit::metal::choose_int8_mm_kernel(M, N, K)));
      },
      "the int8_mm Metal kernel variant the plan picks for an [M, K] x [N, K]^T product (for tests)");
}
