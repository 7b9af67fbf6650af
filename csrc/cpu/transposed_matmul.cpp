#include "cpu/transposed_matmul.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <type_traits>

#include "cpu/bf16_terms.h"
#include "cpu/brgemm.h"
#include "cpu/fp8_kernels.h"
#include "cpu/fp8_simd.h"
#include "cpu/workspace.h"

#if LOWBIT_X86
#include <immintrin.h>
#endif

namespace lowbit::cpu {
namespace {

// Row walk: below this many rows of g (its accumulators, M x kWalkMaxCols floats, stay in L1 / L2). The panel
// GEMM decodes each weight element once for all rows too, but pays a GEMM's packing per panel: a first guess.
constexpr int64_t kGemmMinRows = 8;
// Columns of out per work item of the row walk: K split so that each thread gets a few items, each row segment
// read at least kWalkMinCols bytes at a time (whole cache lines, a prefetcher-friendly stream).
constexpr int64_t kWalkMinCols = 256;
constexpr int64_t kWalkMaxCols = 2048;
// Panel GEMM: columns of out per work item (its fp32 accumulators are M x kPanelCols) and weight rows decoded per
// GEMM call (a kPanelRows x kPanelCols panel: 128 KB in bf16, 256 KB in fp32, kept in L2).
constexpr int64_t kPanelCols = 256;
constexpr int64_t kPanelRows = 256;

// Codes [0, n) of one weight row, decoded exactly (unscaled): fp8 through the fp8 kernels' dequantize_run with
// scale 1 (NaN codes give NaN), int8 by conversion (every int8 is exact in bf16 and fp32).
struct RowDecoder {
  const Fp8Kernels& fp8;
  WeightCode code;
  void operator()(const uint8_t* c, int64_t n, float* dst) const {
    if (code == WeightCode::Fp8) return fp8.dequantize_run(c, n, 1.f, dst, DequantOut::F32);
    const auto* q = reinterpret_cast<const int8_t*>(c);
    for (int64_t k = 0; k < n; k++) dst[k] = float(q[k]);
  }
  void operator()(const uint8_t* c, int64_t n, c10::BFloat16* dst) const {
    if (code == WeightCode::Fp8) return fp8.dequantize_run(c, n, 1.f, dst, DequantOut::BF16);
    const auto* q = reinterpret_cast<const int8_t*>(c);
    for (int64_t k = 0; k < n; k++) dst[k] = c10::BFloat16(float(q[k]));
  }
};

// acc[m * lda + p] += c[m] * v[p] for m < mr, p < n.
void axpy_rows_portable(int64_t mr, const float* c, const float* v, int64_t n, float* acc, int64_t lda) {
  for (int64_t m = 0; m < mr; m++) {
    const float cm = c[m];
    float* a = acc + m * lda;
    for (int64_t p = 0; p < n; p++) a[p] += cm * v[p];
  }
}

#if LOWBIT_X86
LOWBIT_TARGET_AVX2 void axpy_rows_avx2(int64_t mr, const float* c, const float* v, int64_t n, float* acc,
                                       int64_t lda) {
  const int64_t full = n / 32 * 32;
  for (int64_t m = 0; m < mr; m++) {
    const __m256 cm = _mm256_set1_ps(c[m]);
    float* a = acc + m * lda;
    for (int64_t p = 0; p < full; p += 32)
      for (int q = 0; q < 32; q += 8)
        _mm256_storeu_ps(a + p + q, _mm256_fmadd_ps(cm, _mm256_loadu_ps(v + p + q), _mm256_loadu_ps(a + p + q)));
    for (int64_t p = full; p < n; p++) a[p] += c[m] * v[p];
  }
}
#endif

using AxpyRowsFn = void (*)(int64_t, const float*, const float*, int64_t, float*, int64_t);
AxpyRowsFn axpy_rows() {
#if LOWBIT_X86
  if (isa() >= Isa::Avx2) return &axpy_rows_avx2;
#endif
  return &axpy_rows_portable;
}

inline float channel_scale(const TransposedOperand& op, int64_t n) {
  return op.layout.kind == ScaleKind::Channel ? op.scale[n] : 1.f;
}
inline float tensor_scale(const TransposedOperand& op) {
  return op.layout.kind == ScaleKind::Tensor ? op.scale[0] : 1.f;
}
// Rows sharing one scale along N: a block row of blocks, or (tensor / channel) all of them.
inline int64_t rows_per_scale(const TransposedOperand& op) {
  return op.layout.kind == ScaleKind::Block ? op.layout.bn : std::max<int64_t>(op.N, 1);
}

// For each K block overlapping columns [k0, k0 + kw): f(first column, end column, block index).
template <typename F>
void for_k_blocks(const TransposedOperand& op, int64_t k0, int64_t kw, F&& f) {
  for (int64_t k = k0; k < k0 + kw;) {
    const int64_t b = k / op.layout.bk, end = std::min(k0 + kw, (b + 1) * op.layout.bk);
    f(k, end, b);
    k = end;
  }
}

template <typename T>
void write_out(const float* acc, int64_t lda, int64_t M, int64_t k0, int64_t kw, float s, T* out, int64_t ldo) {
  for (int64_t m = 0; m < M; m++)
    for (int64_t j = 0; j < kw; j++) out[m * ldo + k0 + j] = T(acc[m * lda + j] * s);
}

template <typename T>
void row_walk(const RowDecoder& decode, const T* g, int64_t M, const TransposedOperand& op, T* out, int64_t ldo) {
  const int64_t N = op.N, K = op.K, group = rows_per_scale(op);
  const bool block = op.layout.kind == ScaleKind::Block;
  const int64_t per_thread = ceil_div(K, 4 * int64_t(at::get_num_threads()));
  const int64_t kc = std::clamp(ceil_div(per_thread, 64) * 64, kWalkMinCols, kWalkMaxCols);
  const AxpyRowsFn axpy = axpy_rows();
  at::parallel_for(0, ceil_div(K, kc), 1, [&](int64_t i0, int64_t i1) {
    float* acc = scratch<float>(Slot::Tile, size_t((block ? 2 : 1) * M * kc));
    float* part = acc + M * kc;  // one block row's sums (block scales)
    float* row = scratch<float>(Slot::Panel, size_t(kc));
    float coef[kGemmMinRows];
    for (int64_t i = i0; i < i1; i++) {
      const int64_t k0 = i * kc, kw = std::min(kc, K - k0);
      std::fill(acc, acc + M * kc, 0.f);
      for (int64_t n0 = 0; n0 < N; n0 += group) {
        const int64_t n1 = std::min(N, n0 + group);
        float* sums = block ? part : acc;
        if (block) std::fill(part, part + M * kc, 0.f);
        for (int64_t n = n0; n < n1; n++) {
          decode(op.w + n * K + k0, kw, row);
          for (int64_t m = 0; m < M; m++) coef[m] = float(g[m * N + n]) * channel_scale(op, n);
          axpy(M, coef, row, kw, sums, kc);
        }
        if (block)
          for_k_blocks(op, k0, kw, [&](int64_t ka, int64_t kb, int64_t b) {
            const float s = op.scale[(n0 / op.layout.bn) * op.layout.kb + b];
            for (int64_t m = 0; m < M; m++)
              for (int64_t j = ka - k0; j < kb - k0; j++) acc[m * kc + j] += s * part[m * kc + j];
          });
      }
      write_out(acc, kc, M, k0, kw, tensor_scale(op), out, ldo);
    }
  });
}

// fp32 panels (CPUs without AMX): g with channel scales folded in, times decoded weight panels in torch's fp32
// GEMM (MKL), accumulating into fp32 [M, kPanelCols] tiles; a block scale is the GEMM's alpha for its block.
template <typename T>
void panel_gemm_f32(const RowDecoder& decode, const T* g, int64_t M, const TransposedOperand& op, T* out,
                    int64_t ldo) {
  const int64_t N = op.N, K = op.K, group = rows_per_scale(op);
  const bool block = op.layout.kind == ScaleKind::Block;
  float* G = scratch<float>(Slot::Activations, size_t(M * N));
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m++)
      for (int64_t n = 0; n < N; n++) G[m * N + n] = float(g[m * N + n]) * channel_scale(op, n);
  });
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::parallel_for(0, ceil_div(K, kPanelCols), 1, [&](int64_t i0, int64_t i1) {
    float* acc = scratch<float>(Slot::Tile, size_t(M * kPanelCols));
    float* panel = scratch<float>(Slot::Panel, size_t(kPanelRows * kPanelCols));
    for (int64_t i = i0; i < i1; i++) {
      const int64_t k0 = i * kPanelCols, kw = std::min(kPanelCols, K - k0);
      std::fill(acc, acc + M * kPanelCols, 0.f);
      for (int64_t nb = 0; nb < N; nb += group)
        for (int64_t n0 = nb; n0 < std::min(N, nb + group); n0 += kPanelRows) {
          const int64_t rows = std::min({kPanelRows, N - n0, nb + group - n0});
          for (int64_t r = 0; r < rows; r++) decode(op.w + (n0 + r) * K + k0, kw, panel + r * kPanelCols);
          const at::Tensor A = at::from_blob(G + n0, {M, rows}, {N, 1}, f32);
          auto product = [&](int64_t ka, int64_t kb, float alpha) {
            at::Tensor C = at::from_blob(acc + (ka - k0), {M, kb - ka}, {kPanelCols, 1}, f32);
            C.addmm_(A, at::from_blob(panel + (ka - k0), {rows, kb - ka}, {kPanelCols, 1}, f32), 1.f, alpha);
          };
          if (!block) product(k0, k0 + kw, 1.f);
          else
            for_k_blocks(op, k0, kw, [&](int64_t ka, int64_t kb, int64_t b) {
              product(ka, kb, op.scale[(nb / op.layout.bn) * op.layout.kb + b]);
            });
        }
      write_out(acc, kPanelCols, M, k0, kw, tensor_scale(op), out, ldo);
    }
  });
}

// AMX blocking of the bf16 panels (see fp8_matmul.cpp's): rows of g and columns of out per brgemm call, and
// weight rows (the reduced dimension) per decoded panel.
constexpr int64_t kAmxRows = 64;
constexpr int64_t kAmxCols = 64;
constexpr int64_t kAmxDepth = 512;
constexpr int64_t kAmxPad = 32;  // each scale group of weight rows padded to whole steps of the brgemm's depth

// bf16 panels on AMX: g (channel scales folded in) as bf16 terms is the brgemm's A, row-major, each group of
// weight rows sharing a scale padded with zeros to whole kAmxPad steps; decoded weight rows are its B in VNNI
// pairs (brgemm.h), kAmxCols columns per sub-panel. Block scales multiply each group's partial sums.
template <typename T>
void panel_gemm_bf16(const RowDecoder& decode, const T* g, int64_t M, const TransposedOperand& op, T* out,
                     int64_t ldo) {
  const int64_t N = op.N, K = op.K;
  const bool block = op.layout.kind == ScaleKind::Block;
  const KSegments seg = k_segments_for(block, op.layout.bn, N, kAmxPad);  // along N, the reduced dimension
  const int64_t Np = seg.packed_size(), P = seg.padded;
  const int terms = std::max(kBf16Terms<T>, op.layout.kind == ScaleKind::Channel ? 2 : 1);
  auto* G = scratch<c10::BFloat16>(Slot::Activations, size_t(terms * M * Np));
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m++)
      for (int64_t s = 0; s < seg.count; s++)
        for (int64_t j = 0; j < P; j++) {
          const int64_t n = seg.begin(s) + j;
          uint16_t bits[3] = {};
          if (j < seg.size(s)) split_float_bf16(float(g[m * N + n]) * channel_scale(op, n), terms, bits);
          for (int t = 0; t < terms; t++) G[(t * M + m) * Np + s * P + j].x = bits[t];
        }
  });
  at::parallel_for(0, ceil_div(K, kPanelCols), 1, [&](int64_t i0, int64_t i1) {
    AmxTileScope amx;
    float* acc = scratch<float>(Slot::Tile, size_t((block ? 2 : 1) * M * kPanelCols));
    float* part = acc + M * kPanelCols;  // one scale group's sums (block scales)
    auto* panel = scratch<c10::BFloat16>(Slot::Panel, size_t(kAmxDepth * kPanelCols + 2 * kPanelCols));
    auto* rowbuf = panel + kAmxDepth * kPanelCols;  // two decoded rows, interleaved into VNNI pairs
    for (int64_t i = i0; i < i1; i++) {
      const int64_t k0 = i * kPanelCols, kw = std::min(kPanelCols, K - k0);
      std::fill(acc, acc + M * kPanelCols, 0.f);
      for (int64_t s = 0; s < seg.count; s++) {
        for (int64_t d0 = 0; d0 < P; d0 += kAmxDepth) {
          const int64_t depth = std::min(kAmxDepth, P - d0);
          // rows d0 .. d0 + depth of this group (zero past its end) as VNNI sub-panels of kAmxCols columns
          for (int64_t r = 0; r < depth; r += 2) {
            for (int64_t h = 0; h < 2; h++) {
              c10::BFloat16* dst = rowbuf + h * kPanelCols;
              if (d0 + r + h < seg.size(s)) decode(op.w + (seg.begin(s) + d0 + r + h) * K + k0, kw, dst);
              else std::fill(dst, dst + kw, c10::BFloat16(0.f));
            }
            for (int64_t c = 0; c * kAmxCols < kw; c++) {
              const int64_t cw = std::min(kAmxCols, kw - c * kAmxCols);
              c10::BFloat16* sub = panel + c * kAmxDepth * kAmxCols + r * cw;
              for (int64_t j = 0; j < cw; j++) {
                sub[2 * j] = rowbuf[c * kAmxCols + j];
                sub[2 * j + 1] = rowbuf[kPanelCols + c * kAmxCols + j];
              }
            }
          }
          for (int64_t m0 = 0; m0 < M; m0 += kAmxRows) {
            const int64_t mw = std::min(kAmxRows, M - m0);
            for (int64_t c = 0; c * kAmxCols < kw; c++) {
              const int64_t cw = std::min(kAmxCols, kw - c * kAmxCols);
              float* C = (block ? part : acc) + m0 * kPanelCols + c * kAmxCols;
              for (int t = 0; t < terms; t++)
                at::native::cpublas::brgemm(mw, cw, depth, Np, cw, kPanelCols, !block || t > 0 || d0 > 0,
                                            G + (t * M + m0) * Np + s * P + d0, panel + c * kAmxDepth * kAmxCols, C,
                                            true);
            }
          }
        }
        if (block)
          for_k_blocks(op, k0, kw, [&](int64_t ka, int64_t kb, int64_t b) {
            const float sc = op.scale[s * op.layout.kb + b];
            for (int64_t m = 0; m < M; m++)
              for (int64_t k = ka - k0; k < kb - k0; k++) acc[m * kPanelCols + k] += sc * part[m * kPanelCols + k];
          });
      }
      write_out(acc, kPanelCols, M, k0, kw, tensor_scale(op), out, ldo);
    }
  });
}

}  // namespace

int64_t transposed_gemm_min_rows() { return kGemmMinRows; }

template <typename T>
void transposed_matmul(const T* g, int64_t M, const TransposedOperand& op, T* out, int64_t ldo) {
  if (M == 0 || op.K == 0) return;
  const RowDecoder decode{fp8_kernels(isa()), op.code};
  if (M < kGemmMinRows) return row_walk(decode, g, M, op, out, ldo);
  if (amx_gemm_available()) return panel_gemm_bf16(decode, g, M, op, out, ldo);
  panel_gemm_f32(decode, g, M, op, out, ldo);
}

template void transposed_matmul<float>(const float*, int64_t, const TransposedOperand&, float*, int64_t);
template void transposed_matmul<c10::BFloat16>(const c10::BFloat16*, int64_t, const TransposedOperand&,
                                               c10::BFloat16*, int64_t);
template void transposed_matmul<c10::Half>(const c10::Half*, int64_t, const TransposedOperand&, c10::Half*, int64_t);

}  // namespace lowbit::cpu
