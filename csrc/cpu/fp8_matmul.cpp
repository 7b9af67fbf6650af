#include "cpu/fp8_matmul.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <limits>

#include "cpu/fp8_simd.h"
#include "cpu/workspace.h"

namespace lowbit::cpu {
namespace {

// GEMM blocking. A block of kMBlock activation rows is packed once; for one K chunk its strips
// (kMBlock x kKChunk floats = 128 KB) stay in L2 while every panel of a work item streams through them.
constexpr int64_t kMBlock = 128;
constexpr int64_t kNBlock = 48;   // weight rows per parallel work item (8 panels of 6)
constexpr int64_t kKChunk = 256;  // codes per decoded panel: 6 x 256 floats stay in L1
static_assert(kNBlock % kPanelRows == 0 && kMBlock % kStrip == 0 && kKChunk % kChunk == 0, "blocking");

// Tensor / channel scales multiply after the K reduction (block scales were applied per segment), then bias.
inline float finish(const Fp8Operand& op, int64_t n, float sum, bool nan) {
  if (nan) return std::numeric_limits<float>::quiet_NaN();
  float v = sum * kDecodeUnscale;
  if (op.layout.kind == ScaleKind::Tensor) v *= op.scale[0];
  else if (op.layout.kind == ScaleKind::Channel) v *= op.scale[n];
  return op.bias ? v + op.bias[n] : v;
}

inline const float* block_scale_row(const Fp8Operand& op, int64_t n) {
  return op.scale + (n / op.layout.bn) * op.layout.kb;
}

// One segment of one activation row into packed positions: chunk by chunk in kChunkOrder, zero padded.
template <typename T, int64_t kStride>
inline void pack_segment(const T* src, int64_t n, int64_t padded, float* dst) {
  for (int64_t c = 0; c < padded; c += kChunk)
    for (int p = 0; p < kChunk; p++) {
      const int64_t k = c + kChunkOrder[p];
      dst[(c + p) * kStride] = k < n ? float(src[k]) : 0.f;
    }
}

// Rows m0 .. m0 + mb of x as strips of kStrip rows: dst[(j * ld + position) * kStrip + i] for row m0 + kStrip j + i.
template <typename T>
void pack_strips(const T* x, int64_t m0, int64_t mb, const KSegments& seg, float* dst) {
  const int64_t ld = seg.packed_size(), K = seg.K;
  at::parallel_for(0, ceil_div(mb, kStrip), 1, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; j++)
      for (int64_t i = 0; i < kStrip; i++) {
        float* d = dst + j * ld * kStrip + i;
        const int64_t m = j * kStrip + i;
        for (int64_t s = 0; s < seg.count; s++) {
          float* ds = d + s * seg.padded * kStrip;
          if (m < mb) pack_segment<T, kStrip>(x + (m0 + m) * K + seg.begin(s), seg.size(s), seg.padded, ds);
          else for (int64_t p = 0; p < seg.padded; p++) ds[p * kStrip] = 0.f;
        }
      }
  });
}

template <typename T>
void gemm(const Fp8Kernels& kern, const T* x, int64_t M, const Fp8Operand& op, const KSegments& seg, T* out,
          int64_t ldo) {
  const int64_t ld = seg.packed_size(), N = op.N, K = op.K;
  const bool block = op.layout.kind == ScaleKind::Block;
  constexpr int64_t kTile = kPanelRows * kStrip;
  for (int64_t m0 = 0; m0 < M; m0 += kMBlock) {
    const int64_t mb = std::min(kMBlock, M - m0), S = ceil_div(mb, kStrip);
    float* xs = scratch<float>(Slot::Activations, size_t(S * ld * kStrip));
    pack_strips(x, m0, mb, seg, xs);
    at::parallel_for(0, ceil_div(N, kNBlock), 1, [&](int64_t b0, int64_t b1) {
      constexpr int64_t P = kNBlock / kPanelRows;
      float* ct = scratch<float>(Slot::Tile, size_t(2 * P * S * kTile));  // totals, then block partials
      float* pt = ct + P * S * kTile;
      float* panel = scratch<float>(Slot::Panel, size_t(kPanelRows * kKChunk));
      for (int64_t b = b0; b < b1; b++) {
        const int64_t nb0 = b * kNBlock, nb1 = std::min(N, nb0 + kNBlock), np = ceil_div(nb1 - nb0, kPanelRows);
        bool nan[kNBlock] = {};
        for (int64_t s = 0; s < seg.count; s++) {
          const int64_t k0 = seg.begin(s), n = seg.size(s);
          for (int64_t kc = 0; kc < n; kc += kKChunk) {
            const int64_t cn = std::min(kKChunk, n - kc);
            const bool fresh = block ? kc == 0 : (kc == 0 && s == 0);
            for (int64_t i = 0; i < np; i++) {
              const int64_t r0 = nb0 + i * kPanelRows;
              const int nrows = int(std::min<int64_t>(kPanelRows, nb1 - r0));
              kern.decode_panel(op.w + r0 * K, K, nrows, k0 + kc, cn, panel, kKChunk, nan + i * kPanelRows);
              for (int64_t j = 0; j < S; j++)
                kern.gemm_micro(panel, kKChunk, xs + (j * ld + s * seg.padded + kc) * kStrip, round_up_chunk(cn),
                                (block ? pt : ct) + (i * S + j) * kTile, !fresh);
            }
          }
          if (!block) continue;
          for (int64_t i = 0; i < np; i++)
            for (int r = 0; r < kPanelRows; r++) {
              const int64_t row = nb0 + i * kPanelRows + r;
              const float sc = row < nb1 ? block_scale_row(op, row)[s] : 0.f;
              for (int64_t j = 0; j < S; j++) {
                float* c = ct + (i * S + j) * kTile + r * kStrip;
                const float* p = pt + (i * S + j) * kTile + r * kStrip;
                for (int q = 0; q < kStrip; q++) c[q] = s == 0 ? sc * p[q] : c[q] + sc * p[q];
              }
            }
        }
        for (int64_t i = 0; i < np; i++)
          for (int r = 0; r < kPanelRows; r++) {
            const int64_t row = nb0 + i * kPanelRows + r;
            if (row >= nb1) break;
            for (int64_t j = 0; j < S; j++)
              for (int q = 0; q < kStrip; q++) {
                const int64_t m = j * kStrip + q;
                if (m >= mb) break;
                out[(m0 + m) * ldo + row] = T(finish(op, row, ct[(i * S + j) * kTile + r * kStrip + q], nan[i * kPanelRows + r]));
              }
          }
      }
    });
  }
}

}  // namespace

KSegments k_segments(const ScaleLayout& layout, int64_t K) {
  KSegments s;
  s.K = K;
  if (K == 0) return s;
  s.len = layout.kind == ScaleKind::Block ? std::min(layout.bk, K) : K;
  s.count = ceil_div(K, s.len);
  s.padded = round_up_chunk(s.len);
  return s;
}

template <typename T>
void pack_rows(const T* x, int64_t M, const KSegments& seg, float* dst) {
  const int64_t ld = seg.packed_size();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m++)
      for (int64_t s = 0; s < seg.count; s++)
        pack_segment<T, 1>(x + m * seg.K + seg.begin(s), seg.size(s), seg.padded, dst + m * ld + s * seg.padded);
  });
}

template <typename T>
void gemv_rows(const Fp8Kernels& kern, const float* xp, int64_t M, const Fp8Operand& op, const KSegments& seg,
               int64_t n0, int64_t n1, T* out, int64_t ldo) {
  const int64_t ldx = seg.packed_size(), K = op.K;
  const bool block = op.layout.kind == ScaleKind::Block;
  // one activation row: 4 weight rows per pass share its loads; more rows: 2 weight rows x up to 4 x rows
  const int64_t rows_per_pass = M == 1 ? 4 : 2;
  for (int64_t n = n0; n < n1;) {
    const int nr = int(std::min(rows_per_pass, n1 - n));
    const float* bs[kMaxTileRows] = {};
    if (block)
      for (int r = 0; r < nr; r++) bs[r] = block_scale_row(op, n + r);
    bool nan[kMaxTileRows] = {};
    for (int64_t m = 0; m < M; m += kMaxTileRows) {  // later groups find the weight rows in L1
      const int mr = int(std::min<int64_t>(kMaxTileRows, M - m));
      float sums[kMaxTileRows * kMaxTileRows];
      kern.gemv_tile(mr, nr, xp + m * ldx, ldx, op.w + n * K, K, block ? bs : nullptr, seg, sums, nan);
      for (int i = 0; i < mr; i++)
        for (int r = 0; r < nr; r++) out[(m + i) * ldo + n + r] = T(finish(op, n + r, sums[i * nr + r], nan[r]));
    }
    n += nr;
  }
}

template <typename T>
void fp8_matmul(const T* x, int64_t M, const Fp8Operand& op, T* out, int64_t ldo) {
  if (M == 0 || op.N == 0) return;
  if (op.K == 0) {  // an empty sum: bias or zero, whatever the scale
    for (int64_t m = 0; m < M; m++)
      for (int64_t n = 0; n < op.N; n++) out[m * ldo + n] = T(op.bias ? op.bias[n] : 0.f);
    return;
  }
  const Fp8Kernels& kern = fp8_kernels(isa());
  const KSegments seg = k_segments(op.layout, op.K);
  if (M >= kGemmMinRows) return gemm(kern, x, M, op, seg, out, ldo);
  float* xp = scratch<float>(Slot::Activations, size_t(M * seg.packed_size()));
  pack_rows(x, M, seg, xp);
  at::parallel_for(0, op.N, 16, [&](int64_t n0, int64_t n1) { gemv_rows(kern, xp, M, op, seg, n0, n1, out, ldo); });
}

#define LOWBIT_INSTANTIATE(T)                                                                                  \
  template void fp8_matmul<T>(const T*, int64_t, const Fp8Operand&, T*, int64_t);                              \
  template void pack_rows<T>(const T*, int64_t, const KSegments&, float*);                                     \
  template void gemv_rows<T>(const Fp8Kernels&, const float*, int64_t, const Fp8Operand&, const KSegments&,     \
                             int64_t, int64_t, T*, int64_t);
LOWBIT_INSTANTIATE(float)
LOWBIT_INSTANTIATE(c10::BFloat16)
LOWBIT_INSTANTIATE(c10::Half)
#undef LOWBIT_INSTANTIATE

}  // namespace lowbit::cpu
