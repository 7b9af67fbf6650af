// int8_mm on the CPU: exact int32 accumulation (int8_kernels.h), then acc * x_scale[m] * w_scale[n] + bias in
// fp32, rounded once to out_dtype. Few rows: GEMV-style tiles over the int8 rows as they are, weight rows split
// across threads. More rows: a cache-blocked GEMM over sign-extended weight panels and packed activation strips,
// or on CPUs with AMX, oneDNN's int8 brgemm (brgemm.h) over the weight rows as they are.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <type_traits>

#include "checks.h"
#include "cpu/brgemm.h"
#include "cpu/dispatch.h"
#include "cpu/arch/kernel_set.h"
#include "cpu/int8_mm.h"
#include "cpu/parallel.h"
#include "cpu/workspace.h"

namespace lowbit::cpu {
namespace {

constexpr int64_t kGemmMinRows = 8;  // below: GEMV-style tiles (a first guess, not tuned yet)
// With AMX the GEMM wins from 2 rows (K = 4096, N = 14336, weights in L3: 2.5 ms at 2 to 9 rows, the tiles take
// 3.5 ms at 2 rows); one row stays with the tiles (2.0 ms).
constexpr int64_t kAmxGemmMinRows = 2;
constexpr int64_t kMBlock = 256;     // activation rows packed at a time; their strips of one K chunk stay in L2
constexpr int64_t kNBlock = 48;      // weight rows per parallel work item (a whole number of panels)
constexpr int64_t kKChunk = 512;     // k per panel: a panel of up to 6 x 512 int16 stays in L1
constexpr int64_t kPackK = 256;     // k positions per pack item (a multiple of every group size)
constexpr int64_t kSumGrainValues = 4096;  // values per task of the row sums
static_assert(kNBlock % 4 == 0 && kNBlock % 6 == 0 && kMBlock % 32 == 0 && kKChunk % 4 == 0 && kPackK % 4 == 0,
              "blocking");

struct Epilogue {
  const float* xs;
  const float* ws;
  int64_t ws_stride;  // 0: one scale for all columns
  const float* bias;
  float operator()(int64_t m, int64_t n, int32_t acc) const {
    const float v = float(acc) * xs[m] * ws[n * ws_stride];
    return bias ? v + bias[n] : v;
  }
};

template <typename T>
void gemv(const Int8Kernels& kern, const int8_t* x, int64_t M, const int8_t* w, int64_t N, int64_t K,
          const Epilogue& ep, T* out) {
  const int64_t rows_per_pass = M == 1 ? 4 : 2;
  parallel_chunks(N, stream_chunk(N, kInt8TileRows, 16), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1;) {
      const int nr = int(std::min(rows_per_pass, n1 - n));
      for (int64_t m = 0; m < M; m += kInt8TileRows) {
        const int mr = int(std::min<int64_t>(kInt8TileRows, M - m));
        int32_t acc[kInt8TileRows * kInt8TileRows];
        kern.gemv_tile(mr, nr, x + m * K, w + n * K, K, acc);
        for (int i = 0; i < mr; i++)
          for (int r = 0; r < nr; r++) out[(m + i) * N + n + r] = T(ep(m + i, n + r, acc[i * nr + r]));
      }
      n += nr;
    }
  });
}

// Rows m0 .. m0 + mb of x as strips of W rows in groups of G consecutive k (zero beyond K): element (row i of
// strip j, k) at (j * Kr * W + (k - k % G) * w_j + G * i + k % G), where w_j = W, or, with narrow_last, the rows
// left for the last strip (an operand of that width, as AMX's brgemm takes it); a full last strip is zero beyond
// mb. Unless null, sums[m] = sum_k x[m0 + m, k]. A work item is kPackK positions of one strip (its own stretch of
// dst), so that a 64-row block still gives every thread work; the row sums are a second, row-parallel pass.
template <typename XT, int G>
void pack_strips(const int8_t* x, int64_t m0, int64_t mb, int64_t K, int64_t Kr, int64_t W, bool narrow_last,
                 XT* dst, int32_t* sums) {
  static_assert(kPackK % G == 0, "pack items start on a group");
  const int64_t items_per_strip = ceil_div(Kr, kPackK);
  // int8 quads are 4-byte VNNI units: where the kernel set has a vector pack (kernel_set.h), it moves whole blocks
  // of kVnniPackRows rows and kVnniPackUnits quads that lie inside the rows and K
  constexpr bool kQuads = std::is_same_v<XT, int8_t> && G == 4;
  const VnniPackFn vector_pack = kQuads ? kernel_set().vnni_pack : nullptr;
  static constexpr std::array<uint8_t, kVnniPackUnits> kInOrder = [] {
    std::array<uint8_t, kVnniPackUnits> to{};
    for (int u = 0; u < kVnniPackUnits; u++) to[size_t(u)] = uint8_t(u);
    return to;
  }();
  static_assert(kPackK % (4 * kVnniPackUnits) == 0, "pack items start on a vector block");
  at::parallel_for(0, ceil_div(mb, W) * items_per_strip, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t it = i0; it < i1; it++) {
      const int64_t j = it / items_per_strip, k0 = it % items_per_strip * kPackK, k1 = std::min(Kr, k0 + kPackK);
      const int64_t wj = narrow_last ? std::min(W, mb - j * W) : W;
      XT* strip = dst + j * Kr * W;
      // rows [0, vr) and positions [k0, kv) of this item by blocks, the rest by the loop below
      const int64_t block_k = 4 * kVnniPackUnits;
      const int64_t vr = vector_pack ? std::min(wj, mb - j * W) / kVnniPackRows * kVnniPackRows : 0;
      const int64_t kv = vr > 0 ? k0 + std::max<int64_t>(0, std::min(k1, K) - k0) / block_k * block_k : k0;
      for (int64_t r = 0; r < vr; r += kVnniPackRows)
        for (int64_t k = k0; k < kv; k += block_k)
          vector_pack(x + (m0 + j * W + r) * K + k, K, kInOrder.data(),
                      reinterpret_cast<uint32_t*>(strip + k * wj) + r, wj);
      for (int64_t i = 0; i < wj; i++) {
        const int64_t m = j * W + i;
        XT* d = strip + G * i;
        const int8_t* src = m < mb ? x + (m0 + m) * K : nullptr;
        for (int64_t k = i < vr ? kv : k0; k < k1; k += G) {
          if (src && k + G <= K)
            for (int e = 0; e < G; e++) d[k * wj + e] = XT(src[k + e]);
          else  // past K or past the rows: zeros, which meet the weight's padding
            for (int e = 0; e < G; e++) d[k * wj + e] = src && k + e < K ? XT(src[k + e]) : XT(0);
        }
      }
    }
  });
  if (!sums) return;
  at::parallel_for(0, mb, rows_grain(K, kSumGrainValues), [&](int64_t r0, int64_t r1) {
    for (int64_t m = r0; m < r1; m++) {
      int32_t sum = 0;
      for (int64_t k = 0; k < K; k++) sum += x[(m0 + m) * K + k];
      sums[m] = sum;
    }
  });
}

// XT / WT: the element types of activation strips and weight panels for group size G (int8_kernels.h).
template <typename XT, typename WT, int G, typename T>
void gemm(const Int8Kernels& kern, const int8_t* x, int64_t M, const int8_t* w, int64_t N, int64_t K,
          const Epilogue& ep, T* out) {
  const int64_t Kr = ceil_div(K, G) * G, R = kern.panel_rows, W = kern.strip, tile_size = R * W;
  constexpr bool kOffsetW = G == 4;  // weights stored as w + 128, corrected by 128 * row sums of x
  for (int64_t m0 = 0; m0 < M; m0 += kMBlock) {
    const int64_t mb = std::min(kMBlock, M - m0), S = ceil_div(mb, W);
    XT* xs = scratch<XT>(Slot::Activations, size_t(S * Kr * W));
    int32_t xsum[kMBlock];
    pack_strips<XT, G>(x, m0, mb, K, Kr, W, /*narrow_last=*/false, xs, kOffsetW ? xsum : nullptr);
    at::parallel_for(0, ceil_div(N, kNBlock), 1, [&](int64_t b0, int64_t b1) {
      const int64_t P = kNBlock / R;
      int32_t* ct = scratch<int32_t>(Slot::Tile, size_t(P * S * tile_size));
      WT* panel = scratch<WT>(Slot::Panel, size_t(R * kKChunk));
      for (int64_t b = b0; b < b1; b++) {
        const int64_t nb0 = b * kNBlock, nb1 = std::min(N, nb0 + kNBlock), np = ceil_div(nb1 - nb0, R);
        for (int64_t kc = 0; kc < K; kc += kKChunk) {
          const int64_t cn = std::min(kKChunk, K - kc), len = ceil_div(cn, G) * G;
          for (int64_t i = 0; i < np; i++) {
            for (int64_t r = 0; r < R; r++) {
              const int64_t row = nb0 + i * R + r;
              WT* d = panel + r * kKChunk;
              int64_t k = 0;
              if (row < nb1) {  // a plain loop, vectorized by the compiler
                const int8_t* src = w + row * K + kc;
                for (; k < cn; k++) d[k] = kOffsetW ? WT(uint8_t(src[k]) ^ 0x80) : WT(src[k]);
              }
              for (; k < len; k++) d[k] = WT(0);
            }
            for (int64_t j = 0; j < S; j++)
              kern.gemm_micro(panel, kKChunk, xs + (j * Kr + kc) * W, len, ct + (i * S + j) * tile_size, kc > 0);
          }
        }
        // rows of out are written contiguously; the tiles (P x S x R x W int32) are still in L1
        for (int64_t m = 0; m < mb; m++) {
          const int64_t j = m / W, q = m % W;
          for (int64_t row = nb0; row < nb1; row++) {
            const int64_t i = (row - nb0) / R, r = (row - nb0) % R;
            uint32_t acc = uint32_t(ct[(i * S + j) * tile_size + r * W + q]);
            if (kOffsetW) acc -= 128u * uint32_t(xsum[m]);  // modulo 2^32: exact when the true sum fits
            out[(m0 + m) * N + row] = T(ep(m0 + m, row, int32_t(acc)));
          }
        }
      }
    });
  }
  release_scratch_above_cap(Slot::Activations);
}

// AMX blocking: weight rows per work item (the brgemm's A), activation rows per call (its N), k per call. A 64-row
// block of int8 weights at K = 1024 is 64 KB. Measured at M = 64 and 256 (K = 4096, N = 14336): 7-11 ms and
// 24-27 ms for the brgemm calls against 12.5 ms and 44 ms for the AVX-512 VNNI GEMM with quantization.
constexpr int64_t kAmxRows = 64;
constexpr int64_t kAmxCols = 64;
constexpr int64_t kAmxDepth = 1024;

// Activation rows packed at a time: a block's packed quads (at most kAmxBlockBytes, or one kAmxCols block) stay
// in the thread's scratch from call to call, where a packed copy of all of x (M = 4608, K = 12288: 57 MB) was
// mapped, faulted in and given back on every call; each block reads the weights again.
constexpr int64_t kAmxBlockBytes = 8 << 20;

// int8 x int8 in AMX tiles, exact int32 sums (AMX adds int32 modulo 2^32, like the other paths). K is padded to
// whole VNNI quads: x with zeros when packed; when K % 4 != 0, the brgemm reads w from a copy with rows K4 apart.
template <typename T>
void gemm_amx(const int8_t* x, int64_t M, const int8_t* w, int64_t N, int64_t K, const Epilogue& ep, T* out) {
  const int64_t K4 = ceil_div(K, 4) * 4;
  const int64_t Mb = std::min(M, std::max(kAmxCols, kAmxBlockBytes / K4 / kAmxCols * kAmxCols));
  // a block of x in VNNI quads, kAmxCols rows at a time (width mw, the brgemm's N and ldb): quad q of the block's
  // row c0 + j at xp + c0 * K4 + (q * mw + j) * 4
  int8_t* xp = scratch<int8_t>(Slot::Activations, size_t(Mb * K4));
  for (int64_t mb0 = 0; mb0 < M; mb0 += Mb) {
    const int64_t mb = std::min(Mb, M - mb0);
    pack_strips<int8_t, 4>(x, mb0, mb, K, K4, kAmxCols, /*narrow_last=*/true, xp, nullptr);
    at::parallel_for(0, ceil_div(N, kAmxRows), 1, [&](int64_t b0, int64_t b1) {
      AmxTileScope amx;
      int8_t* padded = K4 != K ? scratch<int8_t>(Slot::Panel, size_t(kAmxRows * K4)) : nullptr;
      int32_t* acc = scratch<int32_t>(Slot::Tile, size_t(kAmxRows * kAmxCols));
      for (int64_t b = b0; b < b1; b++) {
        const int64_t r0 = b * kAmxRows, nr = std::min(kAmxRows, N - r0);
        const int8_t* a = w + r0 * K;
        if (padded) {
          // rows K4 apart; what lies past K meets x's zero padding (an exact 0 in integers)
          for (int64_t r = 0; r < nr; r++) std::copy(w + (r0 + r) * K, w + (r0 + r + 1) * K, padded + r * K4);
          a = padded;
        }
        for (int64_t c0 = 0; c0 < mb; c0 += kAmxCols) {
          const int64_t mw = std::min(kAmxCols, mb - c0), m0 = mb0 + c0;
          const int8_t* xb = xp + c0 * K4;
          for (int64_t k = 0; k < K4; k += kAmxDepth)
            at::native::cpublas::brgemm(nr, mw, std::min(kAmxDepth, K4 - k), K4, mw, mw, k > 0,
                                        reinterpret_cast<const signed char*>(a + k),
                                        reinterpret_cast<const signed char*>(xb + k * mw), acc, true);
          for (int64_t m = 0; m < mw; m++)
            for (int64_t r = 0; r < nr; r++) out[(m0 + m) * N + r0 + r] = T(ep(m0 + m, r0 + r, acc[r * mw + m]));
        }
      }
      release_scratch_above_cap(Slot::Panel);
    });
  }
  release_scratch_above_cap(Slot::Activations);
}

at::Tensor int8_mm(const at::Tensor& xq, const at::Tensor& x_scale, const at::Tensor& wq, const at::Tensor& w_scale,
                   const std::optional<at::Tensor>& bias, std::optional<at::ScalarType> out_dtype) {
  const Int8MmArgs a = check_int8_mm(xq, x_scale, wq, w_scale, bias, out_dtype);
  at::Tensor out = at::empty({a.M, a.N}, a.xq.options().dtype(a.out_dtype));
  if (a.M == 0 || a.N == 0) return shaped(out, a.out_shape);
  const at::Tensor bias_f32 = bias_as_float(a.bias);
  const Epilogue ep{a.x_scale.data_ptr<float>(), a.w_scale.data_ptr<float>(),
                    a.w_layout.kind == ScaleKind::Channel ? 1 : 0,
                    bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr};
  const Int8Kernels& kern = kernel_set().int8;
  const int8_t* x = a.xq.data_ptr<int8_t>();
  const int8_t* w = a.wq.data_ptr<int8_t>();
  LOWBIT_DISPATCH_FLOAT_TYPES(a.out_dtype, "int8_mm", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    const bool amx = amx_gemm_available();
    if (a.M < (amx ? kAmxGemmMinRows : kGemmMinRows) || a.K == 0) gemv(kern, x, a.M, w, a.N, a.K, ep, o);
    else if (amx) gemm_amx(x, a.M, w, a.N, a.K, ep, o);
    else if (kern.group == 4) gemm<int8_t, uint8_t, 4>(kern, x, a.M, w, a.N, a.K, ep, o);
    else gemm<int16_t, int16_t, 2>(kern, x, a.M, w, a.N, a.K, ep, o);
  });
  return shaped(out, a.out_shape);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> int8_pack_strips(const at::Tensor& xq, int64_t W, int64_t G, bool narrow_last) {
  TORCH_CHECK(xq.scalar_type() == at::kChar && xq.dim() == 2 && xq.is_contiguous() && xq.device().is_cpu(),
              "int8_pack_strips: xq must be a contiguous int8 [M, K] CPU tensor");
  TORCH_CHECK(G == 2 || G == 4, "int8_pack_strips: G must be 2 or 4, got ", G);
  TORCH_CHECK(W > 0, "int8_pack_strips: W must be positive, got ", W);
  const int64_t M = xq.size(0), K = xq.size(1), Kr = ceil_div(K, G) * G, S = ceil_div(M, W);
  const int64_t size = (narrow_last ? M : S * W) * Kr;  // a narrowed last strip holds just the rows left
  // -1: unwritten; a full strip of slack past the layout shows a write beyond it instead of corrupting the heap
  at::Tensor packed = at::full({size + Kr * W}, -1, xq.options().dtype(G == 2 ? at::kShort : at::kChar));
  at::Tensor sums = at::empty({M}, xq.options().dtype(at::kInt));
  const int8_t* x = xq.data_ptr<int8_t>();
  if (G == 2) pack_strips<int16_t, 2>(x, 0, M, K, Kr, W, narrow_last, packed.data_ptr<int16_t>(), sums.data_ptr<int32_t>());
  else pack_strips<int8_t, 4>(x, 0, M, K, Kr, W, narrow_last, packed.data_ptr<int8_t>(), sums.data_ptr<int32_t>());
  return {packed, sums};
}

}  // namespace lowbit::cpu

TORCH_LIBRARY_IMPL(lowbit, CPU, m) {
  m.impl("int8_mm", &lowbit::cpu::int8_mm);
}
