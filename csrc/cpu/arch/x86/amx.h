// The avx512amx set's own AMX tile kernels (amx.cpp).
#pragma once
#include <cstdint>

#include "cpu/arch/kernel_set.h"

namespace lowbit::cpu {

// Whether the process may run tile instructions: the CPU has AMX and (Linux) the OS granted the tile data state,
// which it hands out on request only (asked here once; torch's oneDNN asks the same, and a second grant is a no-op).
bool amx_tiles_granted();

// kernel_set.h's Bf16GemmFn on AMX tiles (only where amx_tiles_granted()) where K and the segment length are
// multiples of 32 (a tile's depth); other shapes run the avx512 set's bf16 GEMM, which has the same contract.
void amx_bf16_gemm(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb,
                   float* C, int64_t ldc, bool add, const Bf16Segments* segs);

}  // namespace lowbit::cpu
