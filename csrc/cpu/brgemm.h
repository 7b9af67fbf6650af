// oneDNN's batch-reduce GEMM micro-kernel as torch exposes it (at::native::cpublas::brgemm), for the GEMM
// regimes of fp8_mm (bf16 panels) and int8_mm (int8) on CPUs with AMX. C[M, N] (+)= A[M, K] B[K, N]: A row-major,
// B in VNNI order -- each row of B holds G consecutive k of one column (G = 4 / element size) -- and C row-major.
// The callers pass weight rows as A and packed activations as B, so C is an [out column][activation row] tile.
#pragma once
#include <ATen/native/CPUBlas.h>

#include <cstdint>

#include "cpu/arch/kernel_set.h"

namespace lowbit::cpu {

// Whether the GEMM regimes of fp8_mm and int8_mm run on AMX now: torch's brgemm takes VNNI-packed
// operands only with AMX (oneDNN's avx512_core_amx: AMX-BF16 and AMX-INT8) and while torch.backends.mkldnn is
// enabled (elsewhere it would throw), and the kernel set that runs (capped by a test switch) hands its GEMMs to AMX.
inline bool amx_gemm_available() {
  return kernel_set().amx_gemm && at::native::cpublas::could_pack(at::kBFloat16);
}

// The bf16 GEMM for products scaled segment by segment along K (Bf16Segments) on AMX: the kernel set's tile kernel,
// or null where it has none (brgemm per segment, each segment's sums scaled in memory) or AMX does not run.
inline Bf16GemmFn amx_segment_gemm() { return amx_gemm_available() ? kernel_set().amx_bf16_gemm : nullptr; }

// Offset of element (k, column j) of a VNNI-packed B whose rows are `width` columns wide.
template <int G>
constexpr int64_t vnni_offset(int64_t k, int64_t j, int64_t width) {
  return (k / G) * G * width + j * G + k % G;
}

// Releases the AMX tile state a thread's brgemm calls configured, before the thread runs other work (nothing to
// release where the GEMMs do not run on AMX: the bf16 panel GEMM's scope on other CPUs).
struct AmxTileScope {
  AmxTileScope() = default;
  AmxTileScope(const AmxTileScope&) = delete;
  AmxTileScope& operator=(const AmxTileScope&) = delete;
  ~AmxTileScope() {
    if (amx) at::native::cpublas::brgemm_release(true);
  }
  bool amx = amx_gemm_available();
};

}  // namespace lowbit::cpu
