// The inner loops of the fp8 x float products, a table of function pointers in every kernel set (kernel_set.h);
// fp8_matmul.cpp, fp8_dequantize.cpp and transposed_matmul.cpp drive them.
//
// Layouts shared by every set:
// - K is cut into segments: one per scale block along K (block scales multiply each segment's partial sum),
//   or one segment of all K. Each segment is padded to whole chunks of 32 (fp8_simd.h), so activations are
//   packed segment by segment, chunk by chunk in kChunkOrder, zeros in the padding.
// - GEMV-style tiles read MR packed activation rows [MR][ldx] and NR weight rows.
// - The GEMM decodes a panel of weight rows into the same packed positions and multiplies it with the packed
//   activations in an optimized GEMM (fp8_matmul.cpp): fp32 panels, or bf16 panels (kBf16ChunkOrder) for the
//   AMX brgemm or the set's bf16 GEMM.
#pragma once
#include <cstdint>

namespace lowbit::cpu {

struct KSegments {
  int64_t K = 0;
  int64_t len = 0;     // codes per segment (the last one may be shorter)
  int64_t count = 0;   // number of segments
  int64_t padded = 0;  // packed positions per segment: len rounded up to whole chunks
  int64_t begin(int64_t s) const { return s * len; }
  int64_t size(int64_t s) const { return len < K - s * len ? len : K - s * len; }
  int64_t packed_size() const { return count * padded; }
};

// Cut K into one segment per K block of bk codes (block) or one of all K, each padded to whole chunks of `chunk`.
inline KSegments k_segments_for(bool block, int64_t bk, int64_t K, int64_t chunk) {
  KSegments s;
  s.K = K;
  if (K == 0) return s;
  s.len = block && bk < K ? bk : K;
  s.count = (K + s.len - 1) / s.len;
  s.padded = (s.len + chunk - 1) / chunk * chunk;
  return s;
}

constexpr int kMaxTileRows = 4;  // the largest MR and NR of a GEMV tile

// One instantiation of an fp32-activation GEMV tile: Fp8Kernels::gemv_tile without the run-time (mr, nr).
using Fp8GemvTileFn = void (*)(const float* x, int64_t ldx, const uint8_t* w, int64_t K, const float* const* bscale,
                               const KSegments& seg, float* sums, bool* nan);

// The GEMV tiles are templates over <activation rows MR, weight rows NR, block scales?>; a call picks the
// instantiation for its run-time (mr, nr) from one table built once per tile family. Tiles::get<M, N, B>()
// returns the instantiation as a Fn.
template <class Fn, class Tiles>
Fn pick_gemv_tile(bool block, int mr, int nr) {
  static const Fn table[2][kMaxTileRows][kMaxTileRows] = {
#define LOWBIT_TILE_ROW(B, M)                                                                              \
  {Tiles::template get<M, 1, B>(), Tiles::template get<M, 2, B>(), Tiles::template get<M, 3, B>(), \
   Tiles::template get<M, 4, B>()}
      {LOWBIT_TILE_ROW(false, 1), LOWBIT_TILE_ROW(false, 2), LOWBIT_TILE_ROW(false, 3), LOWBIT_TILE_ROW(false, 4)},
      {LOWBIT_TILE_ROW(true, 1), LOWBIT_TILE_ROW(true, 2), LOWBIT_TILE_ROW(true, 3), LOWBIT_TILE_ROW(true, 4)},
#undef LOWBIT_TILE_ROW
  };
  return table[block][mr - 1][nr - 1];
}

// The element type fp8_dequantize writes.
enum class DequantOut : int { F32, BF16, F16 };
constexpr int64_t element_size(DequantOut kind) { return kind == DequantOut::F32 ? 4 : 2; }

struct Fp8Kernels {
  // sums[m * nr + r] = sum over segments s of bscale[r][s] (1 when bscale is null) times
  //   sum_k x[m * ldx + packed k] * dec(w[r * K + k]) / 256, for m < mr <= 4, r < nr <= 4;
  // nan[r] |= row r holds a NaN code (the path may instead let NaN flow through the sums).
  void (*gemv_tile)(int mr, int nr, const float* x, int64_t ldx, const uint8_t* w, int64_t K,
                    const float* const* bscale, const KSegments& seg, float* sums, bool* nan);
  // The same for bf16 activations, where the CPU has bf16 dot products (null otherwise): x holds bf16 bits,
  // segments padded to chunks of kBf16Chunk in kBf16ChunkOrder. Exact decode; NaN codes decode to NaN.
  void (*gemv_tile_bf16)(int mr, int nr, const uint16_t* x, int64_t ldx, const uint8_t* w, int64_t K,
                         const float* const* bscale, const KSegments& seg, float* sums, bool* nan);
  // Decode codes [k0, k0 + n) of rows w + r * K, r < nrows, into dst[r * ldd + p], p < round_up_chunk(n)
  // (packed positions, zero padding). nan[r] |= row r holds a NaN code in that range.
  void (*decode_rows)(const uint8_t* w, int64_t K, int64_t nrows, int64_t k0, int64_t n, float* dst, int64_t ldd,
                      bool* nan);
  // The same to bf16 bits, for the bf16 panel GEMM (null in sets without amx_gemm; Arm's bf16 set has none):
  // dst[r * ldd + p], p < n rounded up to kBf16Chunk, positions in kBf16ChunkOrder, zero padding. dec(code) / 256
  // is exact in bf16, and NaN codes decode to NaN.
  void (*decode_rows_bf16)(const uint8_t* w, int64_t K, int64_t nrows, int64_t k0, int64_t n, uint16_t* dst,
                           int64_t ldd);
  // fp8_dequantize of one run of codes under one scale: out[k] = dec(code[k]) * scale in fp32, rounded once to
  // `kind` (round to nearest even; NaN codes give NaN), k < n, in natural order. The same bits on every path.
  void (*dequantize_run)(const uint8_t* code, int64_t n, float scale, void* out, DequantOut kind);
};

// The portable dequantize_run, also the tail of the vectorized ones.
void dequantize_run_portable(const uint8_t* code, int64_t n, float scale, void* out, DequantOut kind);

}  // namespace lowbit::cpu
