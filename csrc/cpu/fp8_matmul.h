// The fp8 weight x float activation product shared by fp8_mm and fp8_grouped_mm on the CPU.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>

#include "checks.h"

namespace lowbit::cpu {

// out[m, n] = sum_k x[m, k] * dec(w[n, k]) * scale(n, k) (+ bias[n]) for m < M, n < N; rows of out are ldo apart.
// w: [N, K] bits of one weight (one expert); scale: that weight's fp32 scales in `layout`; x: [M, K] in T.
template <typename T>
void fp8_matmul(const T* x, int64_t M, const uint8_t* w, const float* scale, const ScaleLayout& layout, int64_t N,
                int64_t K, const float* bias, T* out, int64_t ldo);

}  // namespace lowbit::cpu
