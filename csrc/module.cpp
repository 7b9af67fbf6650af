// The Python module torch_lowbit._C: op schemas and kernels register themselves at load time (static
// registrars); this file only adds the few host functions Python calls directly.
#include <torch/extension.h>

#include "cpu/isa.h"
#include "cpu/read_bandwidth.h"
#include "metal/emu_launcher.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("_load_emulator", &lowbit::metal::load_emulator, "load torch_lowbit/_msl_emu*.so (the MSL emulator)");
  m.def("_emulator_loaded", &lowbit::metal::emulator_loaded);
  m.def("_emu_set_reverse", &lowbit::metal::set_emulator_reverse,
        "run the threads of every emulated threadgroup in reverse order (a test switch)");
  m.def(
      "_cpu_set_isa",
      [](const std::string& name) {
        using namespace lowbit::cpu;
        return std::string(isa_name(set_isa_cap(isa_from_name(name))));
      },
      "cap the instruction set of the CPU kernels ('portable', 'avx2', 'best'); returns the previous cap");
  m.def("_cpu_isa", [] { return std::string(lowbit::cpu::isa_name(lowbit::cpu::isa())); },
        "the instruction set the CPU kernels use now");
  m.def("_cpu_stream_read", &lowbit::cpu::stream_read, "read a tensor's bytes in parallel (bandwidth baseline)");
}
