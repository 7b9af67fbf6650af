// The inner loops of int8_mm and int8_quantize, a table of function pointers in every kernel set (kernel_set.h);
// int8_mm.cpp and int8_quantize.cpp drive them. Every path accumulates exactly in int32 (exact while
// K < 2^17): signed x signed products, -128 included.
//
// GEMV-style tiles read MR activation rows and NR weight rows as they are (int8, K apart).
// GEMM micro-tiles are panel_rows weight rows x `strip` activation rows. The k axis is cut into groups of
// `group` consecutive values (the lanes of one multiply-add instruction): activations are packed as strips
// [k group][strip rows][group], weights as a panel [panel_rows][k] of the same element type.
// - group 2: int16 (sign-extended) pairs, for vpmaddwd (AVX2) and the portable loops.
// - group 4: byte quads for vpdpbusd (AVX-VNNI on 256 bits, AVX512-VNNI on 512), which multiplies unsigned by signed bytes: the weights are
//   stored as w + 128 (w ^ 0x80) and the driver subtracts 128 * sum_k x[m, k] (exact modulo 2^32, so exact
//   whenever the true sum fits in int32).
#pragma once
#include <cstdint>
#include <cstring>
#include <limits>

namespace lowbit::cpu {

constexpr int kInt8TileRows = 4;  // the largest MR and NR of a GEMV tile

struct Int8Kernels {
  // acc[m * nr + r] = sum_{k < K} x[m * K + k] * w[r * K + k], m < mr <= 4, r < nr <= 4
  void (*gemv_tile)(int mr, int nr, const int8_t* x, const int8_t* w, int64_t K, int32_t* acc);
  int group;          // 2: int16 pairs; 4: byte quads with offset weights (see above)
  int panel_rows;     // weight rows per micro-tile
  int strip;          // activation rows per micro-tile (two vectors of int32 lanes)
  // tile[r * strip + j] (+)= sum_{k < len} panel[r * ldp + k] * x(j, k), len a multiple of group;
  // panel / xs point to int16 (group 2) or uint8 / int8 (group 4) elements.
  void (*gemm_micro)(const void* panel, int64_t ldp, const void* xs, int64_t len, int32_t* tile, bool accumulate);
  // int8_quantize of one row: returns scale = max |x[k]| / 127 and writes q[k] = rint(x[k] / scale) clamped to
  // +-127 (fp32 division, round half to even; 0 for an all-zero row). A row holding NaN or +-inf gets scale
  // NaN (kNonFiniteRowScale) and q = 0. The same bits on every path.
  float (*quantize_row)(const float* x, int64_t K, int8_t* q);
};

// The absmax of a row is found on the bits of |x|: for non-negative floats the unsigned order of the bits is
// the numeric order, and every NaN lies above +inf, so one integer max gives the absmax and tells whether the
// row holds a NaN or an infinity (a float max would skip NaNs).
inline uint32_t abs_bits(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof(b));
  return b & 0x7FFFFFFFu;
}
constexpr uint32_t kFloatInfBits = 0x7F800000u;
inline constexpr float kNonFiniteRowScale = std::numeric_limits<float>::quiet_NaN();  // bits 0x7FC00000, as on Metal

// max(amax_bits, abs_bits(x[k]) for k < K)
uint32_t absmax_bits(const float* x, int64_t K, uint32_t amax_bits);
// The scale of a row whose absmax has bits amax_bits: absmax / 127, or kNonFiniteRowScale.
float row_scale(uint32_t amax_bits);

// The portable quantize_row, also the tail of the vectorized ones.
float quantize_row_portable(const float* x, int64_t K, int8_t* q);
// q = 0 unless scale > 0 (so a NaN scale gives 0)
void quantize_with_scale(const float* x, int64_t K, float scale, int8_t* q);

// The row pointers of a GEMV tile that steps its MR activation rows and NR weight rows (K values apart) S values
// at a time: xp / wp at column k of every row ...
template <int MR, int NR>
inline void int8_tile_rows_at(const int8_t* x, const int8_t* w, int64_t K, int64_t k, const int8_t* (&xp)[MR],
                              const int8_t* (&wp)[NR]) {
  for (int m = 0; m < MR; m++) xp[m] = x + m * K + k;
  for (int r = 0; r < NR; r++) wp[r] = w + r * K + k;
}
// ... and, for the last, partial step, at copies of columns [full, K) zero-padded to S values in xt / wt: the
// step never reads past a row.
template <int MR, int NR, int S>
inline void int8_tile_rows_padded(const int8_t* x, const int8_t* w, int64_t K, int64_t full, int8_t (&xt)[MR][S],
                                  int8_t (&wt)[NR][S], const int8_t* (&xp)[MR], const int8_t* (&wp)[NR]) {
  const size_t n = size_t(K - full);
  for (int m = 0; m < MR; m++) {
    std::memcpy(xt[m], x + m * K + full, n);
    std::memset(xt[m] + n, 0, S - n);
    xp[m] = xt[m];
  }
  for (int r = 0; r < NR; r++) {
    std::memcpy(wt[r], w + r * K + full, n);
    std::memset(wt[r] + n, 0, S - n);
    wp[r] = wt[r];
  }
}

// The GEMV tiles are templates over <activation rows MR, weight rows NR>; a call runs the instantiation
// Tiles::get<MR, NR>() for its run-time (mr, nr), picked from one table built once per tile family.
using Int8GemvTileFn = void (*)(const int8_t* x, const int8_t* w, int64_t K, int32_t* acc);
template <class Tiles>
void run_int8_gemv_tile(int mr, int nr, const int8_t* x, const int8_t* w, int64_t K, int32_t* acc) {
  static const Int8GemvTileFn table[kInt8TileRows][kInt8TileRows] = {
#define LOWBIT_ROW(M) \
  {Tiles::template get<M, 1>(), Tiles::template get<M, 2>(), Tiles::template get<M, 3>(), Tiles::template get<M, 4>()}
      LOWBIT_ROW(1), LOWBIT_ROW(2), LOWBIT_ROW(3), LOWBIT_ROW(4),
#undef LOWBIT_ROW
  };
  table[mr - 1][nr - 1](x, w, K, acc);
}

}  // namespace lowbit::cpu
