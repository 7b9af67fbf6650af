#include "cpu/isa.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>

namespace lowbit::cpu {
namespace {

Isa detect() {
#if LOWBIT_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return __builtin_cpu_supports("avxvnni") ? Isa::AvxVnni : Isa::Avx2;
#endif
  return Isa::Portable;
}

const Isa kDetected = detect();
std::atomic<int> g_cap{int(Isa::AvxVnni)};

}  // namespace

Isa isa() { return Isa(std::min(int(kDetected), g_cap.load(std::memory_order_relaxed))); }

Isa set_isa_cap(Isa cap) { return Isa(g_cap.exchange(int(cap))); }

const char* isa_name(Isa i) {
  switch (i) {
    case Isa::AvxVnni: return "avxvnni";
    case Isa::Avx2: return "avx2";
    default: return "portable";
  }
}

Isa isa_from_name(const std::string& name) {
  if (name == "portable") return Isa::Portable;
  if (name == "avx2") return Isa::Avx2;
  if (name == "avxvnni" || name == "best") return Isa::AvxVnni;
  TORCH_CHECK(false, "cpu isa must be 'portable', 'avx2', 'avxvnni' or 'best', got '", name, "'");
}

}  // namespace lowbit::cpu
