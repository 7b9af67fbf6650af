// Target attributes of the Arm kernel sets: NEON (Advanced SIMD) is in every aarch64 CPU and the baseline of the
// build; the dot-product and int8 matrix-multiply levels are compiled for their extension and only called on a
// CPU that reports it (kernel_sets.cpp).
#pragma once

#define LOWBIT_TARGET_NEON
// sdot / udot: four byte products summed into each int32 lane (Armv8.2 dotprod; Apple M1 and later, Graviton 2+)
#define LOWBIT_TARGET_DOTPROD __attribute__((target("arch=armv8.2-a+dotprod")))
// usdot / smmla: unsigned x signed byte dot products and 2x8x2 matrix tiles (Armv8.6 i8mm; M2+, Graviton 3+)
#define LOWBIT_TARGET_I8MM __attribute__((target("arch=armv8.2-a+dotprod+i8mm")))
// bfdot / bfmmla: bf16 pair dot products into fp32 lanes (Armv8.6 FEAT_BF16; M2+, Graviton 3+, Grace). The bf16
// set also runs the i8mm set's loops, so its attribute names every extension below it.
#define LOWBIT_TARGET_BF16 __attribute__((target("arch=armv8.2-a+dotprod+i8mm+bf16")))
