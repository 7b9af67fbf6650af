// Target attributes of the x86 kernel sets: each set's loops are compiled for its level inside a baseline build
// and only called on a CPU with the set's features (kernel_sets.cpp).
#pragma once

// AVX2 for the integer and float lanes, FMA for the dot products, F16C for the fp8 -> half -> float decode
#define LOWBIT_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
// AVX-VNNI: byte dot products with int32 accumulation (vpdpbusd), on 256-bit vectors
#define LOWBIT_TARGET_AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))
// AVX-512 (F, BW, VL, VNNI, VBMI, BF16) on top of AVX2 -- not AVX-VNNI, which Zen 4 lacks: its byte dot products
// are AVX-512 VNNI's (EVEX) here, and no target below lets the compiler emit the VEX ones
#define LOWBIT_TARGET_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl")))
#define LOWBIT_TARGET_AVX512VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
// byte permutes (table decode) and bf16 dot products
#define LOWBIT_TARGET_AVX512BF16 \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx512bf16")))
