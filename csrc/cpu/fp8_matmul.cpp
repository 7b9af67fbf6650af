#include "cpu/fp8_matmul.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <limits>
#include <type_traits>

#include "cpu/fp8_simd.h"
#include "cpu/workspace.h"

namespace lowbit::cpu {
namespace {

// GEMM: weight rows decoded per parallel work item (kGemmPanel x K floats, 4 MB at K = 4096), decoded once for
// all M activation rows. Smaller panels make MKL choose its no-copy kernels, which measured slower.
constexpr int64_t kGemmPanel = 256;

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

// One segment of one activation row into packed positions: chunk by chunk in `order`, zero padded.
template <typename T, typename D, size_t kC>
inline void pack_segment(const T* src, int64_t n, int64_t padded, const std::array<uint8_t, kC>& order, D* dst) {
  for (int64_t c = 0; c < padded; c += int64_t(kC))
    for (size_t p = 0; p < kC; p++) {
      const int64_t k = c + order[p];
      dst[c + int64_t(p)] = k < n ? D(src[k]) : D(0);
    }
}

// x [M, K] -> packed fp32 segments: segment s of row m at dst + s * seg_stride + m * row_stride.
template <typename T>
void pack(const T* x, int64_t M, const KSegments& seg, float* dst, int64_t row_stride, int64_t seg_stride) {
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m++)
      for (int64_t s = 0; s < seg.count; s++)
        pack_segment(x + m * seg.K + seg.begin(s), seg.size(s), seg.padded, kChunkOrder,
                     dst + s * seg_stride + m * row_stride);
  });
}

// Decode a panel of weight rows into packed positions, then one optimized fp32 GEMM (torch's, MKL here) over
// all M rows: the decoded panel is reused M times, and no dequantized copy of the whole weight exists. Block
// scales: a batched GEMM gives each K segment's partial sums, which the epilogue scales and adds.
template <typename T>
void gemm(const Fp8Kernels& kern, const T* x, int64_t M, const Fp8Operand& op, const KSegments& seg, T* out,
          int64_t ldo) {
  const int64_t Kp = seg.packed_size(), N = op.N, kb = seg.count, P = seg.padded;
  const bool block = op.layout.kind == ScaleKind::Block;
  float* xp = scratch<float>(Slot::Activations, size_t(M * Kp));
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor X;
  if (block) {  // [segment][row][position]: one batch per K segment
    pack(x, M, seg, xp, P, M * P);
    X = at::from_blob(xp, {kb, M, P}, f32);
  } else {
    pack(x, M, seg, xp, Kp, P);
    X = at::from_blob(xp, {M, Kp}, f32);
  }
  at::parallel_for(0, ceil_div(N, kGemmPanel), 1, [&](int64_t b0, int64_t b1) {
    float* panel = scratch<float>(Slot::Panel, size_t(kGemmPanel * Kp));
    float* acc = scratch<float>(Slot::Tile, size_t((block ? kb : 1) * M * kGemmPanel));
    for (int64_t b = b0; b < b1; b++) {
      const int64_t r0 = b * kGemmPanel, nr = std::min(kGemmPanel, N - r0);
      bool nan[kGemmPanel] = {};
      for (int64_t s = 0; s < kb; s++) {
        kern.decode_rows(op.w + r0 * op.K, op.K, nr, seg.begin(s), seg.size(s), panel + s * P, Kp, nan);
        // decode_rows pads only to a whole chunk; a short last segment leaves stale scratch (maybe NaN) up to P,
        // which the zero-padded activations would still multiply (0 * NaN = NaN)
        const int64_t written = ceil_div(seg.size(s), kChunk) * kChunk;
        for (int64_t r = 0; written < P && r < nr; r++)
          std::fill(panel + r * Kp + s * P + written, panel + r * Kp + s * P + P, 0.f);
      }
      if (block) {
        at::Tensor C = at::from_blob(acc, {kb, M, nr}, f32);
        at::bmm_out(C, X, at::from_blob(panel, {kb, P, nr}, {P, 1, Kp}, f32));
      } else {
        // panel @ x^T into a transposed accumulator: measured faster with MKL than x @ panel^T
        at::Tensor C = at::from_blob(acc, {nr, M}, f32);
        at::mm_out(C, at::from_blob(panel, {nr, Kp}, f32), X.t());
      }
      for (int64_t m = 0; m < M; m++)
        for (int64_t r = 0; r < nr; r++) {
          float sum = 0.f;
          if (block) {
            const float* bs = block_scale_row(op, r0 + r);
            for (int64_t s = 0; s < kb; s++) sum += bs[s] * acc[(s * M + m) * nr + r];
          } else {
            sum = acc[r * M + m];
          }
          out[m * ldo + r0 + r] = T(finish(op, r0 + r, sum, nan[r]));
        }
    }
  });
}

}  // namespace

KSegments k_segments_for(bool block, int64_t bk, int64_t K, int64_t chunk) {
  KSegments s;
  s.K = K;
  if (K == 0) return s;
  s.len = block ? std::min(bk, K) : K;
  s.count = ceil_div(K, s.len);
  s.padded = ceil_div(s.len, chunk) * chunk;
  return s;
}

KSegments k_segments(const ScaleLayout& layout, int64_t K) {
  return k_segments_for(layout.kind == ScaleKind::Block, layout.bk, K, kChunk);
}

template <typename T>
GemvActivations gemv_activations(const Fp8Kernels& kern, const ScaleLayout& layout, int64_t K) {
  GemvActivations a;
  a.bf16 = std::is_same_v<T, c10::BFloat16> && kern.gemv_tile_bf16 != nullptr;
  a.seg = k_segments_for(layout.kind == ScaleKind::Block, layout.bk, K, a.bf16 ? kBf16Chunk : kChunk);
  return a;
}

template <typename T>
void pack_rows(const GemvActivations& acts, const T* x, int64_t M, void* dst) {
  const KSegments& seg = acts.seg;
  if (!acts.bf16) return pack(x, M, seg, static_cast<float*>(dst), seg.packed_size(), seg.padded);
  if constexpr (std::is_same_v<T, c10::BFloat16>) {  // the bf16 bits as they are
    auto* d = static_cast<uint16_t*>(dst);
    const auto* bits = reinterpret_cast<const uint16_t*>(x);
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; m++)
        for (int64_t s = 0; s < seg.count; s++)
          pack_segment(bits + m * seg.K + seg.begin(s), seg.size(s), seg.padded, kBf16ChunkOrder,
                       d + m * seg.packed_size() + s * seg.padded);
    });
  }
}

template <typename T>
void gemv_rows(const Fp8Kernels& kern, const GemvActivations& acts, const void* xp, int64_t M, const Fp8Operand& op,
               int64_t n0, int64_t n1, T* out, int64_t ldo) {
  const KSegments& seg = acts.seg;
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
      if (acts.bf16)
        kern.gemv_tile_bf16(mr, nr, static_cast<const uint16_t*>(xp) + m * ldx, ldx, op.w + n * K, K,
                            block ? bs : nullptr, seg, sums, nan);
      else
        kern.gemv_tile(mr, nr, static_cast<const float*>(xp) + m * ldx, ldx, op.w + n * K, K, block ? bs : nullptr,
                       seg, sums, nan);
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
  if (M >= kGemmMinRows) return gemm(kern, x, M, op, k_segments(op.layout, op.K), out, ldo);
  const GemvActivations acts = gemv_activations<T>(kern, op.layout, op.K);
  void* xp = scratch<uint8_t>(Slot::Activations, size_t(M * acts.row_bytes()));
  pack_rows(acts, x, M, xp);
  at::parallel_for(0, op.N, 16, [&](int64_t n0, int64_t n1) { gemv_rows(kern, acts, xp, M, op, n0, n1, out, ldo); });
}

#define LOWBIT_INSTANTIATE(T)                                                                                  \
  template void fp8_matmul<T>(const T*, int64_t, const Fp8Operand&, T*, int64_t);                              \
  template GemvActivations gemv_activations<T>(const Fp8Kernels&, const ScaleLayout&, int64_t);                \
  template void pack_rows<T>(const GemvActivations&, const T*, int64_t, void*);                                \
  template void gemv_rows<T>(const Fp8Kernels&, const GemvActivations&, const void*, int64_t, const Fp8Operand&, \
                             int64_t, int64_t, T*, int64_t);
LOWBIT_INSTANTIATE(float)
LOWBIT_INSTANTIATE(c10::BFloat16)
LOWBIT_INSTANTIATE(c10::Half)
#undef LOWBIT_INSTANTIATE

}  // namespace lowbit::cpu
