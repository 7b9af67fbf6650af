// The avx512amx set's own AMX tile kernels (amx.cpp).
#pragma once
#include <cstdint>

#include "cpu/arch/kernel_set.h"

namespace lowbit::cpu {

// kernel_set.h's Bf16GemmFn on AMX tiles where the OS grants them and K and the segment length are multiples of
// 32 (a tile's depth); otherwise the avx512 set's bf16 GEMM, which has the same contract.
void amx_bf16_gemm(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb,
                   float* C, int64_t ldc, bool add, const Bf16Segments* segs);

}  // namespace lowbit::cpu
