// The 4-bit weight x float activation products on the CPU (w4_mm, w4_mm_t) and the weight's decode
// (w4_dequantize), shared by the three ops. Formats: csrc/w4_formats.h.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

#include "checks.h"

namespace lowbit::cpu {

// One [N, K] 4-bit weight as the kernels read it.
struct W4Operand {
  const uint8_t* codes = nullptr;  // [N, ceil(K/2)]
  const void* scale = nullptr;     // [N, G] in scale_enc
  W4Scale scale_enc = W4Scale::F32;
  const void* offset = nullptr;    // [N, G]: int8 zero points or biases in scale_enc; null for none
  W4Offset offset_kind = W4Offset::None;
  const float* values = nullptr;   // the format's 16 code values
  int64_t N = 0, K = 0, group = 1, G = 0;
  float global = 1.f;              // the per-tensor multiplier (1 where the format has none)
  const float* bias = nullptr;     // fp32 [N] (w4_mm only)
};

// The operand of expert e of a checked weight (e = 0 when ungrouped). Reads global_scale on the host.
W4Operand w4_operand(const W4Weight& w, int64_t e = 0, const float* bias = nullptr);

// dst[(n - n0) * ldd + k] = w[n, k] for n in [n0, n1), k < K: the format's decode in fp32, without the global scale.
void w4_decode_rows(const W4Operand& op, int64_t n0, int64_t n1, float* dst, int64_t ldd);

// out[m * ldo + n] = global * sum_k x[m, k] * w[n, k] (+ bias[n]), rounded once to T.
template <typename T>
void w4_matmul(const T* x, int64_t M, const W4Operand& op, T* out, int64_t ldo);

// out[m * ldo + k] = global * sum_n g[m, n] * w[n, k], rounded once to T (the transposed product).
template <typename T>
void w4_matmul_t(const T* g, int64_t M, const W4Operand& op, T* out, int64_t ldo);

}  // namespace lowbit::cpu
