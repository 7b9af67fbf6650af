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
  {
    if (!__builtin_cpu_supports("avxvnni")) return Isa::Avx2;
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
                        __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512bf16");
    return avx512 ? Isa::Avx512 : Isa::AvxVnni;
  }
#endif
  return Isa::Portable;
}

const Isa kDetected = detect();
std::atomic<int> g_cap{int(Isa::Avx512)};

}  // namespace

Isa isa() { return Isa(std::min(int(kDetected), g_cap.load(std::memory_order_relaxed))); }

Isa set_isa_cap(Isa cap) { return Isa(g_cap.exchange(int(cap))); }

const char* isa_name(Isa i) {
  switch (i) {
    case Isa::Avx512: return "avx512";
    case Isa::AvxVnni: return "avxvnni";
    case Isa::Avx2: return "avx2";
    default: return "portable";
  }
}

Isa isa_from_name(const std::string& name) {
  if (name == "portable") return Isa::Portable;
  if (name == "avx2") return Isa::Avx2;
  if (name == "avxvnni") return Isa::AvxVnni;
  if (name == "avx512" || name == "best") return Isa::Avx512;
  TORCH_CHECK(false, "cpu isa must be 'portable', 'avx2', 'avxvnni', 'avx512' or 'best', got '", name, "'");
}

}  // namespace lowbit::cpu
