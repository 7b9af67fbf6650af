// The AVX-512 4-bit kernels (w4_kernels.h). A chunk of 32 codes is 16 bytes: vpmovzxbd puts each byte in a
// 32-bit lane, whose low nibble (the even code) indexes a 16-float table in one register by vpermps (which reads
// only an index's low 4 bits) and whose high nibble, shifted down, the odd code: 4 instructions per 32 codes and
// weight row, enough to keep up with the memory at batch 1. A group's table holds its 16 decoded weights
// (w4_kernels.h), so the decode is exact per element; where a chunk's two halves lie in two groups (group size 16)
// vpermt2ps picks from both tables. Group sizes that are not multiples of 16 take the portable loops.
#include <cstring>

#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include "cpu/arch/kernel_set.h"
#include "cpu/arch/x86/target.h"

#include <immintrin.h>
#include "cpu/gemv_prefetch.h"

namespace lowbit::cpu {
namespace {

// The group's 16 decoded weights. value * scale + bias rounds the product first: an empty asm between the two
// keeps the compiler from fusing them into an fma.
LOWBIT_TARGET_AVX512 inline __m512 group_table(__m512 values, const W4Group& p) {
  if (!p.has_bias) return _mm512_mul_ps(_mm512_sub_ps(values, _mm512_set1_ps(p.zp)), _mm512_set1_ps(p.scale));
  __m512 prod = _mm512_mul_ps(values, _mm512_set1_ps(p.scale));
  asm("" : "+v"(prod));
  return _mm512_add_ps(prod, _mm512_set1_ps(p.bias));
}

// The tables of one weight row along K: chunk by chunk, the table of each half's group.
struct RowTables {
  W4BlockGroups blocks;
  int64_t ga = -1, gb = -1;
  __m512 a, b;  // the first half's table, the second's (where it is another group)
  bool two = false;
};

LOWBIT_TARGET_AVX512 inline __attribute__((always_inline)) void advance(RowTables& t, const W4Operand& op,
                                                                        const float* byte_table, __m512 values,
                                                                        int64_t n, bool second_half) {
  const int64_t g0 = t.blocks.next();
  const int64_t g1 = second_half ? t.blocks.next() : g0;
  if (g0 != t.ga) {
    if (g0 == t.gb) t.a = t.b;
    else t.a = group_table(values, w4_group(op, byte_table, n, g0));
    t.ga = g0;
  }
  t.two = g1 != g0;
  if (t.two) {
    t.b = group_table(values, w4_group(op, byte_table, n, g1));
    t.gb = g1;
  }
}

// 32 codes (valid of them; the rest decode to 0) -> the even codes' weights e and the odd ones' o.
LOWBIT_TARGET_AVX512 inline __attribute__((always_inline)) void decode_chunk(const uint8_t* code, int64_t valid,
                                                                             const RowTables& t, __m512& e,
                                                                             __m512& o) {
  __m128i bytes;
  if (valid >= kW4Chunk) {
    bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(code));
  } else {  // the row's last bytes, never read past it
    alignas(16) uint8_t tmp[16] = {};
    std::memcpy(tmp, code, size_t((valid + 1) / 2));
    bytes = _mm_load_si128(reinterpret_cast<const __m128i*>(tmp));
  }
  const __m512i idx = _mm512_cvtepu8_epi32(bytes);
  const __m512i hi = _mm512_srli_epi32(idx, 4);
  if (!t.two) {
    e = _mm512_permutexvar_ps(idx, t.a);
    o = _mm512_permutexvar_ps(hi, t.a);
  } else {  // lanes 8..15 (the second half's codes) index the second table: bit 4 of vpermt2ps's index
    const __m512i second = _mm512_set_epi32(16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i nib = _mm512_set1_epi32(0xF);
    e = _mm512_permutex2var_ps(t.a, _mm512_or_si512(_mm512_and_si512(idx, nib), second), t.b);
    o = _mm512_permutex2var_ps(t.a, _mm512_or_si512(hi, second), t.b);
  }
  if (valid < kW4Chunk) {  // lane i holds codes 2i (e) and 2i + 1 (o)
    const __m512i lane2 = _mm512_slli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 1);
    const __m512i v = _mm512_set1_epi32(int(valid));
    e = _mm512_maskz_mov_ps(_mm512_cmplt_epi32_mask(lane2, v), e);
    o = _mm512_maskz_mov_ps(_mm512_cmplt_epi32_mask(_mm512_add_epi32(lane2, _mm512_set1_epi32(1)), v), o);
  }
}

constexpr auto kPrefetchHint = _MM_HINT_T0;

template <int MR, int NR>
LOWBIT_TARGET_AVX512 void gemv_tile_t(const float* x, int64_t ldx, const W4Operand& op, int64_t n0, float* sums) {
  const int64_t K = op.K, rb = op.row_bytes();
  const uint8_t* w = op.codes + n0 * rb;
  const float* byte_table = w4_byte_scale_table(op.scale_enc);
  const __m512 values = _mm512_loadu_ps(op.values);
  RowTables t[NR] = {};
  for (int r = 0; r < NR; r++) t[r].blocks = W4BlockGroups(op, 0);
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; m++)
    for (int r = 0; r < NR; r++) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += kW4Chunk) {
    const int64_t valid = K - k, byte = k / 2;
    if ((byte & 63) == 0)
      for (int r = 0; r < NR; r++) _mm_prefetch(gemv_prefetch_target(w, rb, r, NR, byte), kPrefetchHint);
    for (int r = 0; r < NR; r++) {
      advance(t[r], op, byte_table, values, n0 + r, valid > 16);
      __m512 e, o;
      decode_chunk(w + r * rb + byte, valid, t[r], e, o);
      for (int m = 0; m < MR; m++) {
        const float* xp = x + m * ldx + k;
        acc[m][r] = _mm512_fmadd_ps(_mm512_loadu_ps(xp + 16), o, _mm512_fmadd_ps(_mm512_loadu_ps(xp), e, acc[m][r]));
      }
    }
  }
  for (int m = 0; m < MR; m++)
    for (int r = 0; r < NR; r++) sums[m * NR + r] = _mm512_reduce_add_ps(acc[m][r]);
}

struct Tiles {
  template <int MR, int NR, bool>
  static constexpr W4GemvTileFn get() { return &gemv_tile_t<MR, NR>; }
};

void gemv_tile(int mr, int nr, const float* x, int64_t ldx, const W4Operand& op, int64_t n0, float* sums) {
  if (!w4_blocks_in_groups(op)) return kW4KernelsPortable.gemv_tile(mr, nr, x, ldx, op, n0, sums);
  pick_gemv_tile<W4GemvTileFn, Tiles>(false, mr, nr)(x, ldx, op, n0, sums);
}

// Calls fn(p, e, o) for each chunk of codes [k0, k0 + n) of row n (p: its first position relative to k0).
template <typename F>
LOWBIT_TARGET_AVX512 inline __attribute__((always_inline)) void for_each_chunk(const W4Operand& op, int64_t row,
                                                                               int64_t k0, int64_t n, F&& fn) {
  const float* byte_table = w4_byte_scale_table(op.scale_enc);
  const __m512 values = _mm512_loadu_ps(op.values);
  RowTables t;
  t.blocks = W4BlockGroups(op, k0 / 16);
  const uint8_t* codes = op.codes + row * op.row_bytes();
  const int64_t k1 = std::min(op.K, k0 + n);
  for (int64_t k = k0; k < k1; k += kW4Chunk) {
    const int64_t valid = k1 - k;
    advance(t, op, byte_table, values, row, valid > 16);
    __m512 e, o;
    decode_chunk(codes + k / 2, valid, t, e, o);
    fn(k - k0, e, o);
  }
}

LOWBIT_TARGET_AVX512 void decode_rows(const W4Operand& op, int64_t n0, int64_t nrows, int64_t k0, int64_t n,
                                      float* dst, int64_t ldd) {
  if (!w4_blocks_in_groups(op)) return kW4KernelsPortable.decode_rows(op, n0, nrows, k0, n, dst, ldd);
  const int64_t written = w4_padded(std::max<int64_t>(0, std::min(op.K - k0, n)));
  for (int64_t r = 0; r < nrows; r++) {
    float* d = dst + r * ldd;
    for_each_chunk(op, n0 + r, k0, n, [&](int64_t p, __m512 e, __m512 o) LOWBIT_TARGET_AVX512 {
      _mm512_storeu_ps(d + p, e);
      _mm512_storeu_ps(d + p + 16, o);
    });
    std::memset(d + written, 0, size_t(w4_padded(n) - written) * 4);
  }
}

LOWBIT_TARGET_AVX512 void dequantize_rows(const W4Operand& op, int64_t n0, int64_t nrows, float* dst, int64_t ldd) {
  if (!w4_blocks_in_groups(op)) return kW4KernelsPortable.dequantize_rows(op, n0, nrows, dst, ldd);
  // natural order: codes 2i, 2i + 1 from lane i of e and o
  const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  for (int64_t r = 0; r < nrows; r++) {
    float* d = dst + r * ldd;
    for_each_chunk(op, n0 + r, 0, op.K, [&](int64_t p, __m512 e, __m512 o) LOWBIT_TARGET_AVX512 {
      const __m512 a = _mm512_permutex2var_ps(e, lo, o), b = _mm512_permutex2var_ps(e, hi, o);
      const int64_t left = op.K - p;
      if (left >= kW4Chunk) {
        _mm512_storeu_ps(d + p, a);
        _mm512_storeu_ps(d + p + 16, b);
      } else {
        _mm512_mask_storeu_ps(d + p, __mmask16(left >= 16 ? 0xFFFF : (1u << left) - 1), a);
        if (left > 16) _mm512_mask_storeu_ps(d + p + 16, __mmask16((1u << (left - 16)) - 1), b);
      }
    });
  }
}

}  // namespace

extern const W4Kernels kW4KernelsAvx512{&gemv_tile, &decode_rows, &dequantize_rows};

}  // namespace lowbit::cpu
