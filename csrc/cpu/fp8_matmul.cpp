#include "cpu/fp8_matmul.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/bit_cast.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "cpu/bf16_terms.h"
#include "cpu/brgemm.h"
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

// The panel decoders pad only to a whole chunk; a short last segment would leave stale scratch (maybe NaN) up
// to the segment's padded length, which the zero-padded activations still multiply (0 * NaN = NaN).
template <typename E>
void zero_segment_tail(E* segment, int64_t ld, int64_t nrows, int64_t written, int64_t padded) {
  for (int64_t r = 0; written < padded && r < nrows; r++)
    std::fill(segment + r * ld + written, segment + r * ld + padded, E(0));
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
        zero_segment_tail(panel + s * P, Kp, nr, ceil_div(seg.size(s), kChunk) * kChunk, P);
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

// The bf16 GEMM's blocking: weight rows per decoded panel (the brgemm's A: 64 x K bf16, 512 KB at K = 4096, kept
// in L2), activation rows per brgemm call (its N) and K positions per call (A and B blocks of 64 KB). Picked by
// the best of 12 alternating runs at M = 64, 256, 1024 (K = 4096, N = 14336) on a Sapphire Rapids; this shared
// machine's run-to-run spread (up to 2x) hides differences much below 20%.
constexpr int64_t kBf16Panel = 64;
constexpr int64_t kBf16Cols = 64;
constexpr int64_t kBf16Depth = 512;

// x [M, K] -> the brgemm's B, term by term (term t at dst + t * M * Kp), for each block of kBf16Cols rows: the
// block of rows m0.. (width mw) at + m0 * Kp in VNNI pairs (brgemm.h), positions in kBf16ChunkOrder per segment,
// zero padded.
template <typename T>
void pack_bf16_vnni(const T* x, int64_t M, const KSegments& seg, uint16_t* dst) {
  const int64_t Kp = seg.packed_size(), P = seg.padded;
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m++) {
      const int64_t b0 = m / kBf16Cols * kBf16Cols, mw = std::min(kBf16Cols, M - b0);
      uint16_t* d = dst + b0 * Kp;
      for (int64_t s = 0; s < seg.count; s++) {
        const T* src = x + m * seg.K + seg.begin(s);
        const int64_t n = seg.size(s);
        for (int64_t c = 0; c < P; c += kBf16Chunk)
          for (int q = 0; q < kBf16Chunk; q++) {
            const int64_t k = c + kBf16ChunkOrder[q], at = vnni_offset<2>(s * P + c + q, m - b0, mw);
            uint16_t terms[kBf16Terms<T>] = {};
            if (k < n) split_bf16(src[k], terms);
            for (int t = 0; t < kBf16Terms<T>; t++) d[t * M * Kp + at] = terms[t];
          }
      }
    }
  });
}

// On a CPU with AMX (amx_gemm_available): decoded bf16 panels times the packed activation terms in torch's
// oneDNN brgemm, fp32 accumulation; at M = 64, 3x (bf16, half x) and 2x (float x) faster there than fp32 panels in
// the fp32 GEMM. The sums are the fp32 path's: decoded weights and bf16 terms are exact in bf16, their products
// exact in fp32. (AMX, like vdpbf16ps, reads bf16 denormals -- below 1e-38 -- as zero.) Block scales multiply each
// segment's sums.
template <typename T>
void gemm_bf16(const Fp8Kernels& kern, const T* x, int64_t M, const Fp8Operand& op, T* out, int64_t ldo) {
  const KSegments seg = k_segments_for(op.layout.kind == ScaleKind::Block, op.layout.bk, op.K, kBf16Chunk);
  const int64_t Kp = seg.packed_size(), P = seg.padded, N = op.N;
  const bool block = op.layout.kind == ScaleKind::Block;
  uint16_t* xp = scratch<uint16_t>(Slot::Activations, size_t(kBf16Terms<T> * M * Kp));
  pack_bf16_vnni(x, M, seg, xp);
  at::parallel_for(0, ceil_div(N, kBf16Panel), 1, [&](int64_t b0, int64_t b1) {
    AmxTileScope amx;
    auto* panel = scratch<c10::BFloat16>(Slot::Panel, size_t(kBf16Panel * Kp));
    float* acc = scratch<float>(Slot::Tile, size_t(2 * kBf16Panel * kBf16Cols));
    float* part = acc + kBf16Panel * kBf16Cols;  // one segment's sums (block scales)
    for (int64_t b = b0; b < b1; b++) {
      const int64_t r0 = b * kBf16Panel, nr = std::min(kBf16Panel, N - r0);
      for (int64_t s = 0; s < seg.count; s++) {
        uint16_t* segment = reinterpret_cast<uint16_t*>(panel) + s * P;
        kern.decode_rows_bf16(op.w + r0 * op.K, op.K, nr, seg.begin(s), seg.size(s), segment, Kp);
        zero_segment_tail(segment, Kp, nr, ceil_div(seg.size(s), kBf16Chunk) * kBf16Chunk, P);
      }
      for (int64_t m0 = 0; m0 < M; m0 += kBf16Cols) {
        const int64_t mw = std::min(kBf16Cols, M - m0);
        const auto* xb = reinterpret_cast<const c10::BFloat16*>(xp + m0 * Kp);
        for (int64_t s = 0; s < seg.count; s++) {
          // this segment's sums, in K steps of at most kBf16Depth positions: acc directly without block scales
          float* c = block ? part : acc;
          for (int t = 0; t < kBf16Terms<T>; t++)
            for (int64_t k = 0; k < P; k += kBf16Depth)
              at::native::cpublas::brgemm(nr, mw, std::min(kBf16Depth, P - k), Kp, mw, mw, t > 0 || k > 0,
                                          panel + s * P + k, xb + t * M * Kp + (s * P + k) * mw, c, true);
          if (block)
            for (int64_t r = 0; r < nr; r++) {
              const float bs = block_scale_row(op, r0 + r)[s];
              float* a = acc + r * mw;
              const float* p = part + r * mw;
              for (int64_t m = 0; m < mw; m++) a[m] = s == 0 ? bs * p[m] : a[m] + bs * p[m];
            }
        }
        for (int64_t m = 0; m < mw; m++)
          for (int64_t r = 0; r < nr; r++)
            out[(m0 + m) * ldo + r0 + r] = T(finish(op, r0 + r, acc[r * mw + m], false));
      }
    }
  });
}

// Whether the GEMM regime runs on AMX (as bf16 panels and bf16 terms of x).
bool bf16_amx_gemm(const Fp8Kernels& kern) { return kern.decode_rows_bf16 != nullptr && amx_gemm_available(); }

}  // namespace

int64_t gemm_min_rows() { return bf16_amx_gemm(fp8_kernels(isa())) ? kAmxGemmMinRows : kGemmMinRows; }

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
  const bool amx = bf16_amx_gemm(kern);
  if (M >= (amx ? kAmxGemmMinRows : kGemmMinRows)) {
    if (amx) return gemm_bf16(kern, x, M, op, out, ldo);
    return gemm(kern, x, M, op, k_segments(op.layout, op.K), out, ldo);
  }
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
