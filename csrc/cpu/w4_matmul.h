// The 4-bit weight x float activation products on the CPU (w4_mm, w4_mm_t) and the weight's decode
// (w4_dequantize), shared by the three ops; their inner loops are the kernel set's (cpu/arch/w4_kernels.h).
// Formats: csrc/w4_formats.h.
//
// w4_mm regimes (chosen from M): few rows -> GEMV tiles that stream the packed codes once, decode each chunk in
// registers for up to 4 activation rows (packed once per call, w4_kernels.h's order), weight rows split across
// threads; more rows -> where bf16_panel_gemm_available, bf16 panels through fp8_matmul's bf16 panel GEMM (one
// exact term, or hi + lo: w4_matmul.cpp says when and what it costs in accuracy); elsewhere, and for float x with a
// two-term weight, panels of weight rows decoded to fp32 (exact: the same bits as the per-element decode) window by
// window along K and multiplied with the packed activations in torch's fp32 GEMM, one panel per task.
// w4_mm_t: fp32 panels in torch's fp32 GEMM; for bf16 grad_out where transposed_panels_bf16, bf16-dequantized
// column panels in torch's bf16 GEMM.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

#include "checks.h"
#include "cpu/arch/w4_kernels.h"

namespace lowbit::cpu {

// The operand of expert e of a checked weight (e = 0 when ungrouped). Reads global_scale on the host.
W4Operand w4_operand(const W4Weight& w, int64_t e = 0, const float* bias = nullptr);

// From this many activation rows w4_mm runs the panel GEMM on AMX with two bf16 terms a weight, and w4_mm_t its
// GEMM regime (below it the GEMV tiles, which decode the weight again for every 4 rows).
constexpr int64_t kW4GemmMinRows = 8;
// The same for one term a weight on AMX (exact in bf16, or the integer codes with their group scales on the sums).
constexpr int64_t kW4AmxOneTermMinRows = 5;
// From how many rows of type T w4_mm runs its GEMM regime for op now (5 or 8 on AMX; more elsewhere).
template <typename T>
int64_t w4_gemm_min_rows(const W4Operand& op);

// How the GEMV tiles see the activations: fp32 in w4_kernels.h's packed order, or -- bf16 x, where the kernel set
// has a bf16 tile that takes the weight -- the bf16 values themselves in its bf16 order, followed, for weights with
// zero points or biases, by the row's sum over each group (W4Kernels::gemv_rows_bf16), and by the digit planes
// where the set reads them (W4Kernels::pack_plane_steps).
struct W4GemvActivations {
  bool bf16 = false;
  int64_t K = 0;
  int64_t group = 0, group_sums = 0;  // codes per group of the sums; fp32 sums per row (0: none)
  void (*pack_bf16_row)(const uint16_t*, int64_t, int64_t, int64_t, uint16_t*) = nullptr;  // the set's, if any
  void (*pack_plane_steps)(const uint16_t*, int64_t, int64_t, int64_t, W4PlaneStep*) = nullptr;  // planes, if any
  int64_t row_elems() const {
    if (!bf16) return w4_padded(K);
    return w4_plane_steps_at(K, group_sums) + (pack_plane_steps ? w4_plane_steps_bytes(K) / 2 : 0);
  }
  int64_t row_bytes() const { return row_elems() * (bf16 ? 2 : 4); }
};
template <typename T>
W4GemvActivations w4_gemv_activations(const W4Kernels& kern, const W4Operand& op);

// Pieces for callers that schedule many small products themselves (w4_grouped_mm's decode case): w4_pack_rows
// writes x [M, K] as M packed rows of acts.row_bytes(); w4_gemv_rows then computes output columns [n0, n1) of
// those rows (M < w4_gemm_min_rows) on the calling thread, global scale and bias applied.
template <typename T>
void w4_pack_rows(const W4GemvActivations& acts, const T* x, int64_t M, void* dst);
template <typename T>
void w4_gemv_rows(const W4Kernels& kern, const W4GemvActivations& acts, const void* xp, int64_t M, const W4Operand& op,
                  int64_t n0, int64_t n1, T* out, int64_t ldo);

// out[m * ldo + n] = global * sum_k x[m, k] * w[n, k] (+ bias[n]), rounded once to T.
template <typename T>
void w4_matmul(const T* x, int64_t M, const W4Operand& op, T* out, int64_t ldo);

// out[m * ldo + k] = global * sum_n g[m, n] * w[n, k], rounded once to T (the transposed product).
template <typename T>
void w4_matmul_t(const T* g, int64_t M, const W4Operand& op, T* out, int64_t ldo);

// out [N, K] = global * w, rounded once to T.
template <typename T>
void w4_dequantize_to(const W4Operand& op, T* out);

}  // namespace lowbit::cpu
