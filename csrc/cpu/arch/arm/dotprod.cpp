// The dotprod kernel set (Armv8.2 FEAT_DotProd: Apple M1 and later, Graviton 2+, Ampere Altra, Grace): the NEON set
// with int8 GEMV tiles on sdot, four exact signed byte products summed into each int32 lane per instruction.
#include <arm_neon.h>

#include <cstring>

#include "cpu/arch/arm/target.h"
#include "cpu/arch/kernel_set.h"
#include "cpu/gemv_prefetch.h"

namespace lowbit::cpu {

const KernelSet& kernel_set_neon();

namespace {

// acc[m][r] += the 16 products at x rows xp[m] and weight rows wp[r]
template <int MR, int NR>
LOWBIT_TARGET_DOTPROD inline __attribute__((always_inline)) void dot_step(int32x4_t (&acc)[MR][NR],
                                                                          const int8_t* const* xp,
                                                                          const int8_t* const* wp) {
  int8x16_t xv[MR];
  for (int m = 0; m < MR; m++) xv[m] = vld1q_s8(xp[m]);
  for (int r = 0; r < NR; r++) {
    const int8x16_t wv = vld1q_s8(wp[r]);
    for (int m = 0; m < MR; m++) acc[m][r] = vdotq_s32(acc[m][r], xv[m], wv);
  }
}

template <int MR, int NR>
LOWBIT_TARGET_DOTPROD void gemv_tile_t(const int8_t* x, const int8_t* w, int64_t K, int32_t* out) {
  const GemvPrefetch prefetch(w, K, NR);
  constexpr int kStep = 16;
  int32x4_t acc[MR][NR];
  for (int m = 0; m < MR; m++)
    for (int r = 0; r < NR; r++) acc[m][r] = vdupq_n_s32(0);
  const int8_t* xp[MR];
  const int8_t* wp[NR];
  const int64_t full = K / kStep * kStep;
  for (int64_t k = 0; k < full; k += kStep) {
    if ((k & 63) == 0)  // each weight row its own stream (gemv_prefetch.h)
      for (int r = 0; r < NR; r++) __builtin_prefetch(prefetch(r, k));
    int8_tile_rows_at(x, w, K, k, xp, wp);
    dot_step<MR, NR>(acc, xp, wp);
  }
  if (full < K) {
    int8_t xt[MR][kStep], wt[NR][kStep];
    int8_tile_rows_padded(x, w, K, full, xt, wt, xp, wp);
    dot_step<MR, NR>(acc, xp, wp);
  }
  for (int m = 0; m < MR; m++)
    for (int r = 0; r < NR; r++) out[m * NR + r] = vaddvq_s32(acc[m][r]);
}

struct DotTiles {
  template <int MR, int NR>
  static constexpr Int8GemvTileFn get() { return &gemv_tile_t<MR, NR>; }
};

void gemv_tile(int mr, int nr, const int8_t* x, const int8_t* w, int64_t K, int32_t* acc) {
  run_int8_gemv_tile<DotTiles>(mr, nr, x, w, K, acc);
}

}  // namespace

const KernelSet& kernel_set_dotprod() {
  const KernelSet& neon = kernel_set_neon();
  static const KernelSet s{
      "dotprod",
      kFeatDotprod,
      neon.fp8,
      Int8Kernels{&gemv_tile, neon.int8.group, neon.int8.panel_rows, neon.int8.strip, neon.int8.gemm_micro,
                  neon.int8.quantize_row},
      neon.w4,
      neon.axpy_rows,
      neon.xor_words,
      false,
      nullptr,
  };
  return s;
}

}  // namespace lowbit::cpu
