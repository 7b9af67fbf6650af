// The one table of this build's kernel sets and the one map from the CPU's features to the set that runs.
#include <algorithm>
#include <atomic>

#include "cpu/arch/kernel_set.h"

#if LOWBIT_X86
#include <cpuid.h>
#elif LOWBIT_ARM && defined(__APPLE__)
#include <sys/sysctl.h>
#elif LOWBIT_ARM && defined(__linux__)
#include <sys/auxv.h>
#endif

namespace lowbit::cpu {

// This architecture's sets after portable, in order of preference (each file under arch/<architecture>/ defines
// kernel_set_<name>()): a new level is one entry here.
#if LOWBIT_X86
#define LOWBIT_ARCH_KERNEL_SETS(X) X(avx2) X(avxvnni) X(avx512) X(avx512amx)
#elif LOWBIT_ARM
#define LOWBIT_ARCH_KERNEL_SETS(X) X(neon) X(dotprod) X(i8mm) X(bf16)
#else
#define LOWBIT_ARCH_KERNEL_SETS(X)
#endif

const KernelSet& kernel_set_portable();
#define LOWBIT_DECLARE_SET(name) const KernelSet& kernel_set_##name();
LOWBIT_ARCH_KERNEL_SETS(LOWBIT_DECLARE_SET)
#undef LOWBIT_DECLARE_SET

namespace {

#if LOWBIT_X86
// Bit `bit` of register `reg` (0 eax, 1 ebx, 2 ecx, 3 edx) of CPUID leaf `leaf`, subleaf `sub`: for the features
// that __builtin_cpu_supports does not name in every compiler the build takes (clang 16, of Apple clang 15's
// generation, refuses "f16c" and "avxvnni"). Both are VEX-encoded, usable where AVX2 is (whose check covers the
// OS's saving of the YMM state).
bool cpuid_bit(unsigned leaf, unsigned sub, int reg, int bit) {
  unsigned r[4] = {};
  if (!__get_cpuid_count(leaf, sub, &r[0], &r[1], &r[2], &r[3])) return false;
  return (r[reg] >> bit) & 1u;
}
#endif

uint64_t detect_features() {
  uint64_t f = 0;
#if LOWBIT_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2"), f16c = cpuid_bit(1, 0, 2, 29), avx_vnni = cpuid_bit(7, 1, 0, 4);
  if (avx2 && __builtin_cpu_supports("fma") && f16c) f |= kFeatAvx2;
  if (avx2 && avx_vnni) f |= kFeatAvxVnni;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi") &&
      __builtin_cpu_supports("avx512bf16"))
    f |= kFeatAvx512;
  // CPUID.(7,0):EDX bits 22 (AMX-BF16), 24 (AMX-TILE), 25 (AMX-INT8): read as a property of the core (no set runs
  // tile instructions itself; torch's oneDNN asks the OS for the tile state)
  if (cpuid_bit(7, 0, 3, 22) && cpuid_bit(7, 0, 3, 24) && cpuid_bit(7, 0, 3, 25)) f |= kFeatAmx;
#elif LOWBIT_ARM && defined(__APPLE__)
  const auto has = [](const char* name) {
    int v = 0;
    size_t size = sizeof(v);
    return sysctlbyname(name, &v, &size, nullptr, 0) == 0 && v != 0;
  };
  if (has("hw.optional.arm.FEAT_DotProd")) f |= kFeatDotprod;
  if (has("hw.optional.arm.FEAT_I8MM")) f |= kFeatI8mm;
  if (has("hw.optional.arm.FEAT_BF16")) f |= kFeatBf16;
#elif LOWBIT_ARM && defined(__linux__)
  // the bits of <asm/hwcap.h>, spelled out: older C libraries' headers lack HWCAP2_I8MM / HWCAP2_BF16
  constexpr unsigned long kHwcapAsimdDp = 1ul << 20, kHwcap2I8mm = 1ul << 13, kHwcap2Bf16 = 1ul << 14;
  if (getauxval(AT_HWCAP) & kHwcapAsimdDp) f |= kFeatDotprod;
  if (getauxval(AT_HWCAP2) & kHwcap2I8mm) f |= kFeatI8mm;
  if (getauxval(AT_HWCAP2) & kHwcap2Bf16) f |= kFeatBf16;
#endif
  return f;
}

const std::vector<const KernelSet*>& all_sets() {
  static const std::vector<const KernelSet*> sets = {
      &kernel_set_portable(),
#define LOWBIT_LIST_SET(name) &kernel_set_##name(),
      LOWBIT_ARCH_KERNEL_SETS(LOWBIT_LIST_SET)
#undef LOWBIT_LIST_SET
  };
  return sets;
}

// The index of the set that runs under cap c (kernel_set(); c = the number of sets: no cap). Portable runs
// everywhere.
int set_under_cap(int c) {
  const auto& sets = all_sets();
  if (c < int(sets.size()) && cpu_supports(*sets[size_t(c)])) return c;
  for (int i = std::min(c, int(sets.size())) - 1; i > 0; i--)
    if (cpu_supports(*sets[size_t(i)]) && cpu_prefers(*sets[size_t(i)])) return i;
  return 0;
}

// best[c]: set_under_cap(c) for every cap c, the last entry for none
std::vector<int> best_under_each_cap() {
  std::vector<int> best;
  for (int c = 0; c <= int(all_sets().size()); c++) best.push_back(set_under_cap(c));
  return best;
}

std::atomic<int> g_cap{-1};  // index into all_sets(); -1: no cap

int cap_index() {
  const int c = g_cap.load(std::memory_order_relaxed);
  return c < 0 ? int(all_sets().size()) : c;
}

}  // namespace

uint64_t cpu_features() {
  static const uint64_t features = detect_features();
  return features;
}

const std::vector<const KernelSet*>& kernel_sets() { return all_sets(); }

const KernelSet& kernel_set() {
  static const std::vector<int> best = best_under_each_cap();
  return *all_sets()[size_t(best[size_t(cap_index())])];
}

const char* cap_kernel_set(const std::string& name) {
  const auto& sets = all_sets();
  int c = -1;
  if (name != "best") {
    const auto it = std::find_if(sets.begin(), sets.end(), [&](const KernelSet* s) { return name == s->name; });
    if (it == sets.end()) return nullptr;
    c = int(it - sets.begin());
  }
  const int previous = g_cap.exchange(c);
  return previous < 0 ? "best" : sets[size_t(previous)]->name;
}

}  // namespace lowbit::cpu
