// The AVX2 4-bit kernels (w4_kernels.h), also the AVX-VNNI set's. A 16-entry table does not fit one 8-lane vpermps:
// each half-chunk of 8 bytes (16 codes, one group: w4_blocks_in_groups) looks its codes up in the table's two
// halves and picks by the code's bit 3 (vblendvps on the bit shifted to the sign). Group sizes that are not
// multiples of 16 take the portable loops.
#include <algorithm>
#include <cstring>

// GCC 12 sees the tables of a row as maybe unset before its first group fills them
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include "cpu/arch/kernel_set.h"
#include "cpu/arch/x86/target.h"

#include <immintrin.h>
#include "cpu/arch/x86/fp8_avx2.h"
#include "cpu/gemv_prefetch.h"

namespace lowbit::cpu {
namespace {

struct Table {
  __m256 lo, hi;  // entries 0..7, 8..15
};

LOWBIT_TARGET_AVX2 inline Table group_table(const float* values, const W4Group& p) {
  Table t;
  const __m256 s = _mm256_set1_ps(p.scale);
  __m256 v[2] = {_mm256_loadu_ps(values), _mm256_loadu_ps(values + 8)};
  for (__m256& x : v) {
    if (!p.has_bias) {
      x = _mm256_mul_ps(_mm256_sub_ps(x, _mm256_set1_ps(p.zp)), s);
    } else {  // the product rounded first: the empty asm keeps it from fusing into an fma
      x = _mm256_mul_ps(x, s);
      asm("" : "+x"(x));
      x = _mm256_add_ps(x, _mm256_set1_ps(p.bias));
    }
  }
  t.lo = v[0];
  t.hi = v[1];
  return t;
}

LOWBIT_TARGET_AVX2 inline __m256 lookup(const Table& t, __m256i index, __m256i select) {
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(t.lo, index), _mm256_permutevar8x32_ps(t.hi, index),
                          _mm256_castsi256_ps(select));
}

// 8 bytes of codes, or the row's last `valid` codes (staged through a zeroed copy: never read past the row).
LOWBIT_TARGET_AVX2 inline __m128i load_half(const uint8_t* code, int64_t valid) {
  if (valid >= 16) return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(code));
  alignas(16) uint8_t tmp[16] = {};
  std::memcpy(tmp, code, size_t((valid + 1) / 2));
  return _mm_load_si128(reinterpret_cast<const __m128i*>(tmp));
}

// 16 codes (valid of them; the rest decode to 0): e = the 8 even codes' weights, o = the odd ones'.
LOWBIT_TARGET_AVX2 inline __attribute__((always_inline)) void decode_half(__m128i bytes, int64_t valid,
                                                                          const Table& t, __m256& e, __m256& o) {
  const __m256i idx = _mm256_cvtepu8_epi32(bytes);
  e = lookup(t, idx, _mm256_slli_epi32(idx, 28));
  o = lookup(t, _mm256_srli_epi32(idx, 4), _mm256_slli_epi32(idx, 24));
  if (valid < 16) {
    const __m256i lane2 = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14), v = _mm256_set1_epi32(int(valid));
    e = _mm256_and_ps(e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(v, lane2)));
    o = _mm256_and_ps(o, _mm256_castsi256_ps(_mm256_cmpgt_epi32(v, _mm256_add_epi32(lane2, _mm256_set1_epi32(1)))));
  }
}

// One chunk at code k of the tile's rows (valid codes of it): its first half by table a, its second by b.
template <int MR, int NR>
LOWBIT_TARGET_AVX2 inline __attribute__((always_inline)) void chunk_step(__m256 (&acc)[MR][NR], const float* x,
                                                                         int64_t ldx, const uint8_t* w, int64_t rb,
                                                                         int64_t k, int64_t valid,
                                                                         const Table (&ta)[NR], const Table (&tb)[NR]) {
  for (int r = 0; r < NR; r++)
    for (int h = 0; h < 2 && valid > 16 * h; h++) {
      __m256 e, o;
      const int64_t v = valid - 16 * h;
      decode_half(load_half(w + r * rb + k / 2 + 8 * h, v), v, h ? tb[r] : ta[r], e, o);
      for (int m = 0; m < MR; m++) {
        const float* xp = x + m * ldx + k + 8 * h;
        acc[m][r] = _mm256_fmadd_ps(_mm256_loadu_ps(xp + 16), o, _mm256_fmadd_ps(_mm256_loadu_ps(xp), e, acc[m][r]));
      }
    }
}

// As the AVX-512 tile: runs of whole chunks inside one group in a tight loop, the rest chunk by chunk (the
// last, partial one outside the loop: its staging copy is a call).
template <int MR, int NR>
LOWBIT_TARGET_AVX2 void gemv_tile_t(const float* x, int64_t ldx, const W4Operand& op, int64_t n0, float* sums) {
  const int64_t K = op.K, rb = op.row_bytes(), full = K / kW4Chunk * kW4Chunk;
  const uint8_t* w = op.codes + n0 * rb;
  const GemvPrefetch prefetch(w, rb, NR);
  const float* byte_table = w4_byte_scale_table(op.scale_enc);
  __m256 acc[MR][NR];
  Table ta[NR], tb[NR];
  for (int m = 0; m < MR; m++)
    for (int r = 0; r < NR; r++) acc[m][r] = _mm256_setzero_ps();
  W4BlockGroups blocks(op, 0);
  int64_t ga = -1;
  for (int64_t k = 0; k < K;) {
    const int64_t g0 = blocks.next(), g1 = K - k > 16 ? blocks.next() : g0;
    if (g0 != ga)
      for (int r = 0; r < NR; r++) ta[r] = group_table(op.values, w4_group(op, byte_table, n0 + r, g0));
    ga = g0;
    if (g1 != g0 || k >= full) {
      if (g1 != g0)
        for (int r = 0; r < NR; r++) tb[r] = group_table(op.values, w4_group(op, byte_table, n0 + r, g1));
      chunk_step<MR, NR>(acc, x, ldx, w, rb, k, K - k, ta, g1 != g0 ? tb : ta);
      if (g1 != g0)
        for (int r = 0; r < NR; r++) ta[r] = tb[r];
      ga = g1;
      k += kW4Chunk;
      continue;
    }
    const int64_t run = std::min(1 + blocks.left / 2, (full - k) / kW4Chunk);
    blocks.left -= 2 * (run - 1);
    for (const int64_t end = k + run * kW4Chunk; k < end; k += kW4Chunk) {
      if ((k & 127) == 0)
        for (int r = 0; r < NR; r++) _mm_prefetch(prefetch(r, k / 2), _MM_HINT_T0);
      chunk_step<MR, NR>(acc, x, ldx, w, rb, k, kW4Chunk, ta, ta);
    }
  }
  for (int m = 0; m < MR; m++)
    for (int r = 0; r < NR; r++) sums[m * NR + r] = avx2::hsum(acc[m][r]);
}

// Groups of 16 codes with a scale alone (nvfp4; int4 g16): a table per group and row cost about as much as the
// group's codes (two multiplies and a scale decode per 16 codes). The codes decode through the values' one table,
// and each half-chunk's products are scaled as a sum: acc += (x_e . e + x_o . o) * scale. (At 32 codes a group
// the tables' cost is halved and this walk's extra multiply per half measured no faster.)
template <int MR, int NR>
LOWBIT_TARGET_AVX2 void gemv_tile_g16_t(const float* x, int64_t ldx, const W4Operand& op, int64_t n0, float* sums) {
  const int64_t K = op.K, rb = op.row_bytes();
  const uint8_t* w = op.codes + n0 * rb;
  const GemvPrefetch prefetch(w, rb, NR);
  const float* byte_table = w4_byte_scale_table(op.scale_enc);
  const Table t{_mm256_loadu_ps(op.values), _mm256_loadu_ps(op.values + 8)};
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; m++)
    for (int r = 0; r < NR; r++) acc[m][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {  // half-chunks: group k / 16
    if ((k & 127) == 0)
      for (int r = 0; r < NR; r++) _mm_prefetch(prefetch(r, k / 2), _MM_HINT_T0);
    const int64_t valid = K - k, p = (k & ~int64_t(31)) + (k & 16) / 2;  // the half's even codes' position
    for (int r = 0; r < NR; r++) {
      __m256 e, o;
      decode_half(load_half(w + r * rb + k / 2, valid), valid, t, e, o);
      const __m256 s = _mm256_set1_ps(w4_group(op, byte_table, n0 + r, k / 16).scale);
      for (int m = 0; m < MR; m++) {
        const float* xp = x + m * ldx + p;
        const __m256 part = _mm256_fmadd_ps(_mm256_loadu_ps(xp + 16), o, _mm256_mul_ps(_mm256_loadu_ps(xp), e));
        acc[m][r] = _mm256_fmadd_ps(part, s, acc[m][r]);
      }
    }
  }
  for (int m = 0; m < MR; m++)
    for (int r = 0; r < NR; r++) sums[m * NR + r] = avx2::hsum(acc[m][r]);
}

template <bool kG16>
struct Tiles {
  template <int MR, int NR, bool>
  static constexpr W4GemvTileFn get() {
    if constexpr (kG16) return &gemv_tile_g16_t<MR, NR>;
    else return &gemv_tile_t<MR, NR>;
  }
};

void gemv_tile(int mr, int nr, const float* x, int64_t ldx, const W4Operand& op, int64_t n0, float* sums) {
  if (!w4_blocks_in_groups(op)) return kW4KernelsPortable.gemv_tile(mr, nr, x, ldx, op, n0, sums);
  const bool scale_only = !op.offset || op.offset_kind == W4Offset::None;
  if (scale_only && op.G > 1 && op.group == 16)
    return pick_gemv_tile<W4GemvTileFn, Tiles<true>>(false, mr, nr)(x, ldx, op, n0, sums);
  pick_gemv_tile<W4GemvTileFn, Tiles<false>>(false, mr, nr)(x, ldx, op, n0, sums);
}

// Calls fn(p, h, e, o) for each half-chunk h of each chunk of codes [k0, k0 + n) of row `row` (p: the chunk's first
// position relative to k0).
template <typename F>
LOWBIT_TARGET_AVX2 inline __attribute__((always_inline)) void for_each_half(const W4Operand& op, int64_t row,
                                                                            int64_t k0, int64_t n, F&& fn) {
  const uint8_t* codes = op.codes + row * op.row_bytes();
  w4_for_each_block<Table>(
      op, row, k0, n, [&](const W4Group& p) LOWBIT_TARGET_AVX2 { return group_table(op.values, p); },
      [&](int64_t k, int64_t valid, const Table& t) LOWBIT_TARGET_AVX2 {
        __m256 e, o;
        decode_half(load_half(codes + k / 2, valid), valid, t, e, o);
        fn((k - k0) & ~int64_t(31), int((k - k0) & 16) / 16, e, o);
      });
}

LOWBIT_TARGET_AVX2 void decode_rows(const W4Operand& op, int64_t n0, int64_t nrows, int64_t k0, int64_t n, float* dst,
                                    int64_t ldd) {
  if (!w4_blocks_in_groups(op)) return kW4KernelsPortable.decode_rows(op, n0, nrows, k0, n, dst, ldd);
  for (int64_t r = 0; r < nrows; r++) {
    float* d = dst + r * ldd;
    std::memset(d, 0, size_t(w4_padded(n)) * 4);  // a chunk's missing second half, and whole chunks past K
    for_each_half(op, n0 + r, k0, n, [&](int64_t p, int h, __m256 e, __m256 o) LOWBIT_TARGET_AVX2 {
      _mm256_storeu_ps(d + p + 8 * h, e);
      _mm256_storeu_ps(d + p + 16 + 8 * h, o);
    });
  }
}

LOWBIT_TARGET_AVX2 void dequantize_rows(const W4Operand& op, int64_t n0, int64_t nrows, float* dst, int64_t ldd) {
  if (!w4_blocks_in_groups(op)) return kW4KernelsPortable.dequantize_rows(op, n0, nrows, dst, ldd);
  for (int64_t r = 0; r < nrows; r++) {
    float* d = dst + r * ldd;
    for_each_half(op, n0 + r, 0, op.K, [&](int64_t p, int h, __m256 e, __m256 o) LOWBIT_TARGET_AVX2 {
      // interleave: codes 2i, 2i + 1 of the half
      const __m256 a = _mm256_unpacklo_ps(e, o), b = _mm256_unpackhi_ps(e, o);
      alignas(32) float tmp[16];
      _mm256_store_ps(tmp, _mm256_permute2f128_ps(a, b, 0x20));
      _mm256_store_ps(tmp + 8, _mm256_permute2f128_ps(a, b, 0x31));
      const int64_t k = p + 16 * h;
      std::memcpy(d + k, tmp, size_t(std::min<int64_t>(16, op.K - k)) * 4);
    });
  }
}

}  // namespace

extern const W4Kernels kW4KernelsAvx2{&gemv_tile, &decode_rows, &dequantize_rows};

}  // namespace lowbit::cpu
