// The inner loops of int8_mm, one implementation per instruction set (int8_kernels_avx2.cpp,
// int8_kernels_portable.cpp); int8_mm.cpp drives them. Every path accumulates exactly in int32: products of
// int8 values (-128 included) widened to int16 pairs, summed in int32 (exact while K < 2^17).
//
// Layouts:
// - GEMV-style tiles read MR activation rows and NR weight rows as they are (int8, K apart).
// - GEMM micro-tiles are kInt8PanelRows weight rows x kStrip activation rows: the weight rows sign-extended into a
//   panel of int16 [kInt8PanelRows][ldp], the activations packed as strips of int16 pairs [pair][kStrip][2].
#pragma once
#include <cstdint>

#include "cpu/isa.h"

namespace lowbit::cpu {

constexpr int kStrip = 16;       // activation rows per GEMM micro-tile (two AVX2 vectors of int32)
constexpr int kInt8TileRows = 4;  // the largest MR and NR of a GEMV tile

// Weight rows per int8 GEMM micro-tile: 4 x 16 leaves AVX2 registers for the products that vpmaddwd makes
// before they are added (a 6 x 16 tile would spill).
constexpr int kInt8PanelRows = 4;

struct Int8Kernels {
  // acc[m * nr + r] = sum_{k < K} x[m * K + k] * w[r * K + k], m < mr <= 4, r < nr <= 4
  void (*gemv_tile)(int mr, int nr, const int8_t* x, const int8_t* w, int64_t K, int32_t* acc);
  // tile[r * kStrip + j] (+)= sum_{k < len} panel[r * ldp + k] * xs[(k / 2) * 2 * kStrip + 2 * j + k % 2];
  // len even
  void (*gemm_micro)(const int16_t* panel, int64_t ldp, const int16_t* xs, int64_t len, int32_t* tile, bool accumulate);
};

const Int8Kernels& int8_kernels_portable();
#if LOWBIT_X86
const Int8Kernels& int8_kernels_avx2();
#endif
inline const Int8Kernels& int8_kernels(Isa i) {
#if LOWBIT_X86
  if (i >= Isa::Avx2) return int8_kernels_avx2();
#endif
  (void)i;
  return int8_kernels_portable();
}

}  // namespace lowbit::cpu
