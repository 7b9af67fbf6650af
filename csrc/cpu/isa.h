// Which instruction set the CPU kernels use, chosen at run time. The extension is compiled for the baseline
// of its platform (no -mavx2), so one build runs on every x86-64 and aarch64 CPU; the AVX2 kernels are
// separate functions compiled with a target attribute and only called when the CPU reports the features.
#pragma once
#include <cstdint>
#include <string>

#if defined(__x86_64__) || defined(_M_X64)
#define LOWBIT_X86 1
// AVX2 for the integer and float lanes, FMA for the dot products, F16C for the fp8 -> half -> float decode
#define LOWBIT_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
// AVX-VNNI: byte dot products with int32 accumulation (vpdpbusd), on 256-bit vectors
#define LOWBIT_TARGET_AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))
// AVX-512 (F, BW, VL, VNNI, VBMI, BF16) on top of the above
#define LOWBIT_TARGET_AVX512 __attribute__((target("avx2,fma,f16c,avxvnni,avx512f,avx512bw,avx512vl")))
#define LOWBIT_TARGET_AVX512VNNI \
  __attribute__((target("avx2,fma,f16c,avxvnni,avx512f,avx512bw,avx512vl,avx512vnni")))
// byte permutes (table decode) and bf16 dot products
#define LOWBIT_TARGET_AVX512BF16 \
  __attribute__((target("avx2,fma,f16c,avxvnni,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx512bf16")))
#else
#define LOWBIT_X86 0
#endif

namespace lowbit::cpu {

// Ordered: each level implies the ones below it (a CPU with AVX-512 but without AVX-VNNI stays at Avx2).
enum class Isa : int { Portable = 0, Avx2 = 1, AvxVnni = 2, Avx512 = 3 };

// The best level this CPU supports, lowered by set_isa_cap (a test switch).
Isa isa();
// Lower (or restore, with the highest level) the level the kernels may use; returns the previous cap.
Isa set_isa_cap(Isa cap);
const char* isa_name(Isa i);
Isa isa_from_name(const std::string& name);  // "portable" | "avx2" | "avxvnni" | "avx512" | "best"

}  // namespace lowbit::cpu
