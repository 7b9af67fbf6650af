#include "cpu/transposed_matmul.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <c10/util/bit_cast.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <type_traits>

#include "cpu/brgemm.h"
#include "cpu/arch/kernel_set.h"
#include "cpu/fp8_simd.h"
#include "cpu/workspace.h"


namespace lowbit::cpu {
namespace {

// Row walk: below this many rows of g (its accumulators, M x kWalkMaxCols floats, stay in L1 / L2). The panel
// GEMM decodes each weight element once for all rows too, but pays a GEMM's packing per panel: a first guess.
constexpr int64_t kGemmMinRows = 8;
// Columns of out per work item of the row walk: K split so that each thread gets a few items, each row segment
// read at least kWalkMinCols bytes at a time (whole cache lines, a prefetcher-friendly stream).
constexpr int64_t kWalkMinCols = 256;
constexpr int64_t kWalkMaxCols = 2048;

// int8 codes times one scale, rounded once to `kind` (F32 or BF16, round to nearest even): written so that the
// compiler vectorizes it (a quiet NaN stays NaN through the bf16 rounding: its top mantissa bit is kept).
void dequantize_int8_run(const int8_t* q, int64_t n, float scale, void* out, DequantOut kind) {
  if (kind == DequantOut::F32) {
    auto* o = static_cast<float*>(out);
    for (int64_t k = 0; k < n; k++) o[k] = float(q[k]) * scale;
    return;
  }
  auto* o = static_cast<uint16_t*>(out);
  for (int64_t k = 0; k < n; k++) {
    const uint32_t b = c10::bit_cast<uint32_t>(float(q[k]) * scale);
    o[k] = uint16_t((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
  }
}

// A run of one weight row's codes times one scale, rounded once to `kind`: fp8 through the fp8 kernels'
// dequantize_run (NaN codes give NaN), int8 through dequantize_int8_run. With scale 1 and fp32 the decode is exact.
struct RowDecoder {
  const Fp8Kernels& fp8;
  WeightCode code;
  void operator()(const uint8_t* c, int64_t n, float scale, void* dst, DequantOut kind) const {
    if (code == WeightCode::Fp8) return fp8.dequantize_run(c, n, scale, dst, kind);
    dequantize_int8_run(reinterpret_cast<const int8_t*>(c), n, scale, dst, kind);
  }
};

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
  const AxpyRowsFn axpy = kernel_set().axpy_rows;
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
          decode(op.w + n * K + k0, kw, 1.f, row, DequantOut::F32);
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

// GEMM regime: K in column panels; each panel of the weight (all N rows, kw columns) is dequantized -- every
// scale applied, one rounding to the GEMM's element type -- and multiplied with g in a torch GEMM (oneDNN's bf16
// GEMM where the CPU has AMX and g is bf16; MKL's fp32 GEMM otherwise). With bf16 panels the product is the one
// the bf16 layer computes on the dequantized weight (fp8_dequantize's bits); fp16 g runs in fp32 (a dequantized
// weight may not fit fp16's range).
//
// One panel at a time: all threads decode it into a shared buffer (in the last-level cache), then one GEMM over
// all threads multiplies it (panels of whole rows: the GEMM library blocks them well). The panel grows with the
// threads so that each gets enough of the GEMM's output, but no more than that: a larger panel falls out of the
// cache between its decode and its GEMM. Per-thread panels (each thread decoding and multiplying its own)
// measured slower at 2 and at 16 threads.
constexpr int64_t kPanelBytesPerThread = int64_t(2) << 20;
constexpr int64_t kMinPanelBytes = int64_t(8) << 20;
constexpr int64_t kMinPanelCols = 256;  // a narrower B makes the GEMM library's blocking poor
constexpr int64_t kPanelAlign = 64;     // widths in steps of whole cache lines of fp32 output
constexpr int64_t kPrefetchRows = 8;

// Columns [k0, k0 + kw) of every weight row, dequantized to `kind` into dst[n * kw + j], rows in parallel.
void dequantize_panel(const RowDecoder& decode, const TransposedOperand& op, int64_t k0, int64_t kw, DequantOut kind,
                      uint8_t* dst) {
  const int64_t N = op.N, K = op.K, es = element_size(kind), group = rows_per_scale(op);
  const bool block = op.layout.kind == ScaleKind::Block;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
      const uint8_t* row = op.w + n * K;
      uint8_t* o = dst + n * kw * es;
      // a row gives only kw bytes, K bytes from the next: too short a run for the hardware prefetchers
      if (n + kPrefetchRows < n1)
        for (int64_t c = 0; c < kw; c += 64) __builtin_prefetch(row + kPrefetchRows * K + k0 + c);
      auto run = [&](int64_t ka, int64_t kb, float sc) { decode(row + ka, kb - ka, sc, o + (ka - k0) * es, kind); };
      if (!block) run(k0, k0 + kw, tensor_scale(op) * channel_scale(op, n));
      else
        for_k_blocks(op, k0, kw, [&](int64_t ka, int64_t kb, int64_t b) {
          run(ka, kb, op.scale[(n / group) * op.layout.kb + b]);
        });
    }
  });
}

template <typename T>
void panel_gemm(const RowDecoder& decode, const T* g, int64_t M, const TransposedOperand& op, T* out, int64_t ldo) {
  const int64_t N = op.N, K = op.K;
  const at::TensorOptions t_opts = at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value);
  const at::Tensor out_all = at::from_blob(out, {M, K}, {ldo, 1}, t_opts);
  if (N == 0) {
    out_all.zero_();
    return;
  }
  const bool bf16 = std::is_same_v<T, c10::BFloat16> && transposed_panels_bf16();
  const DequantOut kind = bf16 ? DequantOut::BF16 : DequantOut::F32;
  const auto gemm_opts = at::TensorOptions().dtype(bf16 ? at::kBFloat16 : at::kFloat);
  const int64_t es = element_size(kind);
  const at::Tensor A = at::from_blob(const_cast<T*>(g), {M, N}, t_opts).to(gemm_opts.dtype());  // g if types agree
  auto multiply = [&](uint8_t* panel, int64_t k0, int64_t kw) {
    const at::Tensor B = at::from_blob(panel, {N, kw}, gemm_opts);
    at::Tensor C = out_all.narrow(1, k0, kw);
    if (C.scalar_type() == A.scalar_type()) at::mm_out(C, A, B);
    else C.copy_(at::mm(A, B));
  };
  const int64_t bytes = std::max(kMinPanelBytes, kPanelBytesPerThread * int64_t(at::get_num_threads()));
  const int64_t kc = std::min(std::max(bytes / (N * es) / kPanelAlign * kPanelAlign, kMinPanelCols), K);
  const at::Tensor panel = at::empty({N * kc * es}, at::TensorOptions().dtype(at::kByte));
  for (int64_t k0 = 0; k0 < K; k0 += kc) {
    const int64_t kw = std::min(kc, K - k0);
    dequantize_panel(decode, op, k0, kw, kind, panel.data_ptr<uint8_t>());
    multiply(panel.data_ptr<uint8_t>(), k0, kw);
  }
}

}  // namespace

int64_t transposed_gemm_min_rows() { return kGemmMinRows; }
// torch's bf16 GEMM runs on bf16 hardware: AMX, or AVX-512 BF16 (the CPUs whose kernel set has a bf16 GEMM) through
// oneDNN while torch.backends.mkldnn is enabled (else torch's own loops: no faster than fp32 panels).
bool transposed_panels_bf16() {
  return amx_gemm_available() || (kernel_set().bf16_gemm != nullptr && at::globalContext().userEnabledMkldnn());
}

template <typename T>
void transposed_matmul(const T* g, int64_t M, const TransposedOperand& op, T* out, int64_t ldo) {
  if (M == 0 || op.K == 0) return;
  const RowDecoder decode{kernel_set().fp8, op.code};
  if (M < kGemmMinRows) return row_walk(decode, g, M, op, out, ldo);
  panel_gemm(decode, g, M, op, out, ldo);
}

template void transposed_matmul<float>(const float*, int64_t, const TransposedOperand&, float*, int64_t);
template void transposed_matmul<c10::BFloat16>(const c10::BFloat16*, int64_t, const TransposedOperand&,
                                               c10::BFloat16*, int64_t);
template void transposed_matmul<c10::Half>(const c10::Half*, int64_t, const TransposedOperand&, c10::Half*, int64_t);

}  // namespace lowbit::cpu
