#include "cpu/isa.h"

#include <c10/util/Exception.h>

#include <atomic>

namespace lowbit::cpu {
namespace {

Isa detect() {
#if LOWBIT_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return Isa::Avx2;
#endif
  return Isa::Portable;
}

const Isa kDetected = detect();
std::atomic<int> g_cap{int(Isa::Avx2)};

}  // namespace

Isa isa() { return Isa(std::min(int(kDetected), g_cap.load(std::memory_order_relaxed))); }

Isa set_isa_cap(Isa cap) { return Isa(g_cap.exchange(int(cap))); }

const char* isa_name(Isa i) { return i == Isa::Avx2 ? "avx2" : "portable"; }

Isa isa_from_name(const std::string& name) {
  if (name == "portable") return Isa::Portable;
  if (name == "avx2" || name == "best") return Isa::Avx2;
  TORCH_CHECK(false, "cpu isa must be 'portable', 'avx2' or 'best', got '", name, "'");
}

}  // namespace lowbit::cpu
