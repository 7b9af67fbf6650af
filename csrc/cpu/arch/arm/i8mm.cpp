// The i8mm kernel set (Armv8.6 FEAT_I8MM: Apple M2 and later, Graviton 3+, Grace): the dotprod set with the int8
// GEMM micro-tile on usdot, the unsigned x signed byte dot product -- the same contract as x86's vpdpbusd (group 4,
// weights stored as w + 128, the driver subtracting 128 * sum_k x; int8_kernels.h), so int8_mm packs for both alike.
#include <arm_neon.h>

#include <cstring>

#include "cpu/arch/arm/target.h"
#include "cpu/arch/kernel_set.h"

namespace lowbit::cpu {

const KernelSet& kernel_set_dotprod();

namespace {

constexpr int kPanelRows = 4;
constexpr int kStrip = 16;  // activation rows per micro-tile: four vectors of 4 int32

// 4 x 16 register tile: per 4 k, four vectors of activation quads (signed, [k group][strip row][4]) and one
// broadcast weight quad per panel row (unsigned) feed 16 usdot.
LOWBIT_TARGET_I8MM void gemm_micro(const void* panel_, int64_t ldp, const void* xs_, int64_t len, int32_t* tile,
                                   bool accumulate) {
  const auto* panel = static_cast<const uint8_t*>(panel_);
  const auto* xs = static_cast<const int8_t*>(xs_);
  int32x4_t c[kPanelRows][kStrip / 4];
  for (int r = 0; r < kPanelRows; r++)
    for (int v = 0; v < kStrip / 4; v++) c[r][v] = accumulate ? vld1q_s32(tile + r * kStrip + 4 * v) : vdupq_n_s32(0);
  for (int64_t k = 0; k < len; k += 4) {
    int8x16_t b[kStrip / 4];
    for (int v = 0; v < kStrip / 4; v++) b[v] = vld1q_s8(xs + k * kStrip + 16 * v);
    for (int r = 0; r < kPanelRows; r++) {
      uint32_t quad;
      std::memcpy(&quad, panel + r * ldp + k, sizeof(quad));
      const uint8x16_t a = vreinterpretq_u8_u32(vdupq_n_u32(quad));
      for (int v = 0; v < kStrip / 4; v++) c[r][v] = vusdotq_s32(c[r][v], a, b[v]);
    }
  }
  for (int r = 0; r < kPanelRows; r++)
    for (int v = 0; v < kStrip / 4; v++) vst1q_s32(tile + r * kStrip + 4 * v, c[r][v]);
}

}  // namespace

const KernelSet& kernel_set_i8mm() {
  const KernelSet& dotprod = kernel_set_dotprod();
  static const KernelSet s{
      "i8mm",
      kFeatDotprod | kFeatI8mm,
      dotprod.fp8,
      Int8Kernels{dotprod.int8.gemv_tile, 4, kPanelRows, kStrip, &gemm_micro, dotprod.int8.quantize_row},
      dotprod.w4,
      dotprod.axpy_rows,
      dotprod.xor_words,
      false,
      nullptr,
  };
  return s;
}

}  // namespace lowbit::cpu
