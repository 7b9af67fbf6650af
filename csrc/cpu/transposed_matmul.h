// The transposed product of the backward passes on the CPU, shared by fp8_mm_t, fp8_grouped_mm_t and
// int8_weight_mm_t: out[m, k] = sum_n g[m, n] * w(n, k) * scale(n, k), for a weight of N rows of K one-byte
// codes (fp8 e4m3 or int8) read row-major as stored, never as a dense copy.
//
// Regimes (chosen from M): few rows -> each thread owns a range of K and walks every weight row once, decoding
// it exactly to fp32 and adding it, times g[m, n], into fp32 accumulators that stay in L1 (the weight is read
// once, at memory bandwidth); more rows -> column panels of the weight dequantized (every scale applied, one
// rounding: to bf16 where the CPU has AMX and g is bf16, else fp32) into a bounded buffer and multiplied with g
// in torch's GEMM (oneDNN's AMX bf16 GEMM or MKL's fp32 GEMM), as the same layer on its dequantized weight would.
//
// Scales: in the row walk, per tensor times the result, per channel (along N, the reduced dimension) folded into
// g in fp32, per block times each block's fp32 partial sum over its rows; in the panels, times each code.
#pragma once
#include <cstdint>

#include "checks.h"

namespace lowbit::cpu {

enum class WeightCode : int { Fp8, Int8 };

struct TransposedOperand {
  const uint8_t* w = nullptr;  // [N, K] codes (int8 as its bytes)
  WeightCode code = WeightCode::Fp8;
  const float* scale = nullptr;  // [1] | [N] | [nb, kb] as `layout` says
  ScaleLayout layout;
  int64_t N = 0, K = 0;
};

// From this many rows of g the GEMM regime runs (below it the row walk); see transposed_matmul.cpp.
int64_t transposed_gemm_min_rows();
// Whether the GEMM regime dequantizes to bf16 panels for bf16 g now (else fp32): where torch's bf16 GEMM runs on
// bf16 hardware (AMX, AVX-512 BF16). Then out is the product of g and the bf16-dequantized weight (fp8_dequantize's
// bits), not the exact one.
bool transposed_panels_bf16();

// out[m * ldo + k] for m < M, k < K, rounded once to T; g is [M, N] contiguous.
template <typename T>
void transposed_matmul(const T* g, int64_t M, const TransposedOperand& op, T* out, int64_t ldo);

}  // namespace lowbit::cpu
