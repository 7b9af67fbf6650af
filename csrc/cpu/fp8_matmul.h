// The fp8 weight x float activation product shared by fp8_mm and fp8_grouped_mm on the CPU.
//
// Regimes (chosen by fp8_matmul from M): few rows -> GEMV-style tiles that decode each weight chunk once for
// all rows, weight rows split across threads; more rows -> a GEMM that decodes a panel of weight rows once and
// multiplies it with all activation rows in an optimized GEMM: bf16 panels and x as 1-3 bf16 terms in oneDNN's
// AMX brgemm where amx_gemm_available() (brgemm.h) or in the kernel set's bf16 GEMM (AVX-512 BF16), fp32 panels
// and torch's fp32 GEMM otherwise. No dequantized
// copy of the weight exists; scratch memory is per-thread and reused across calls (workspace.h).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

#include "checks.h"
#include "cpu/arch/kernel_set.h"

namespace lowbit::cpu {

// One [N, K] fp8 weight (one expert) with its fp32 scales in `layout`, and an optional fp32 bias [N].
struct Fp8Operand {
  const uint8_t* w = nullptr;
  const float* scale = nullptr;
  ScaleLayout layout;
  int64_t N = 0, K = 0;
  const float* bias = nullptr;
};

// A weight as the bf16 panel GEMM (bf16_panel_gemm) reads it: fp8 and 4-bit weights implement it, so that
// both run one engine. The GEMM multiplies decoded bf16 panels with x as 1-3 exact bf16 terms (bf16_terms.h);
// a weight whose decode is not exact in one bf16 word gives two (hi + lo), each multiplied with x's first term
// and the first with every term of x (lo x lo, at most 2^-16 of a product, is left out).
struct PanelWeight {
  int64_t N = 0, K = 0;
  int terms = 1;  // bf16 words per decoded weight: 1 or 2
  // positions of a chunk of kBf16Chunk: position p holds code order[p] of the chunk (pairs of consecutive codes)
  const uint8_t* order = nullptr;
  bool block = false;  // block scales along K (segments of block_k codes), block_scale_row's
  int64_t block_k = 0;
  // out = (sum * unscale) * mul[n] (+ add[n] where has_add)
  float unscale = 1.f;
  bool has_add = false;

  virtual ~PanelWeight() = default;
  // Rows [r0, r0 + nr), codes [k0, k0 + n) of each: term t of the code at position p (relative to k0, chunk by
  // chunk in `order`) at dst[t * term_stride + r * ld + p], zero padded up to a whole chunk.
  virtual void decode(int64_t r0, int64_t nr, int64_t k0, int64_t n, uint16_t* dst, int64_t ld,
                      int64_t term_stride) const = 0;
  // Columns [n0, n0 + nr)'s multipliers and addends.
  virtual void columns(int64_t n0, int64_t nr, float* mul, float* add) const = 0;
  // block: row n's scales, one per segment
  virtual const float* block_scale_row(int64_t) const { return nullptr; }
  // block: every row's offsets, [N][segments] fp32, each added times the segment's sum of x (null: none) -- a
  // weight w = q * scale + offset multiplies as scale * sum(q x) + offset * sum(x)
  virtual const float* block_offsets() const { return nullptr; }
};

// Whether bf16_panel_gemm can run now: AMX (amx_gemm_available()), or the kernel set has a bf16 GEMM.
bool bf16_panel_gemm_available();

// out[m * ldo + n] for the rows of x [M, K] through the bf16 panel GEMM (where bf16_panel_gemm_available()).
template <typename T>
void bf16_panel_gemm(const T* x, int64_t M, const PanelWeight& w, T* out, int64_t ldo);

// Below this many activation rows the GEMV-style tiles are used (they re-decode the weight for every group of
// 4 rows, so their cost grows with M; the panel GEMM's does not). Not tuned yet: a first guess.
constexpr int64_t kGemmMinRows = 8;
// The same on AMX: there the GEMM (bf16 x, K = 4096, N = 14336: 6.5 ms from 5 rows to 16, weights in L3) beats
// the tiles from 5 rows (4.6 ms at 4 rows, 7.9 ms at 6: a second group of rows decodes the weights again).
constexpr int64_t kAmxGemmMinRows = 5;
// The same for the kernel set's bf16 GEMM (bf16 panels without AMX): its fixed cost -- the whole weight decoded to
// bf16 panels -- is larger against the tiles' (bf16 x, K = 4096, N = 14336 on 2 Zen 5 cores: equal at 16-20 rows;
// 3.2 against 6.6 ms at 8).
constexpr int64_t kBf16GemmMinRows = 16;

// How the GEMV tiles see the activations: fp32 in chunks of 32 codes, or -- bf16 x, where the kernels have a
// bf16 dot product -- the bf16 values themselves in chunks of 64.
struct GemvActivations {
  bool bf16 = false;
  KSegments seg;
  int64_t row_bytes() const { return seg.packed_size() * (bf16 ? 2 : 4); }
};
template <typename T>
GemvActivations gemv_activations(const Fp8Kernels& kern, const ScaleLayout& layout, int64_t K);

// The number of activation rows from which fp8_matmul runs its GEMM regime now (kAmxGemmMinRows on AMX,
// kBf16GemmMinRows on the set's bf16 GEMM, else kGemmMinRows): fewer rows run the GEMV tiles.
int64_t gemm_min_rows();

// out[m * ldo + n] = sum_k x[m, k] * dec(w[n, k]) * scale(n, k) (+ bias[n]), rounded once to T; x is [M, K].
template <typename T>
void fp8_matmul(const T* x, int64_t M, const Fp8Operand& op, T* out, int64_t ldo);

// Pieces for callers that schedule many small products themselves (fp8_grouped_mm's decode case):
// pack_rows writes x [M, K] as M packed rows of acts.row_bytes(); gemv_rows then computes output columns
// [n0, n1) of those rows on the calling thread.
template <typename T>
void pack_rows(const GemvActivations& acts, const T* x, int64_t M, void* dst);
template <typename T>
void gemv_rows(const Fp8Kernels& kern, const GemvActivations& acts, const void* xp, int64_t M, const Fp8Operand& op,
               int64_t n0, int64_t n1, T* out, int64_t ldo);

}  // namespace lowbit::cpu
