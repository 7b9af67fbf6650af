// The AVX-512 4-bit kernels (w4_kernels.h). A chunk of 32 codes is 16 bytes: vpmovzxbd puts each byte in a
// 32-bit lane, whose low nibble (the even code) indexes a 16-float table in one register by vpermps (which reads
// only an index's low 4 bits) and whose high nibble, shifted down, the odd code: 4 instructions per 32 codes and
// weight row, enough to keep up with the memory at batch 1. A group's table holds its 16 decoded weights
// (w4_kernels.h), so the decode is exact per element; where a chunk's two halves lie in two groups (group size 16)
// vpermt2ps picks from both tables. Group sizes that are not multiples of 16 take the portable loops.
#include <cmath>
#include <cstring>
#include <limits>

#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include "cpu/arch/kernel_set.h"
#include "cpu/arch/x86/prefetch_hints.h"
#include "cpu/arch/x86/target.h"

#include <immintrin.h>
#include "cpu/arch/x86/avx512_sums.h"
#include "cpu/gemv_prefetch.h"

namespace lowbit::cpu {
namespace {

// The mask of a vector's first count lanes (all 16 for count >= 16).
inline __mmask16 first_lanes(int64_t count) { return count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1); }

// The group's 16 decoded weights. value * scale + bias rounds the product first: an empty asm between the two
// keeps the compiler from fusing them into an fma.
LOWBIT_TARGET_AVX512 inline __m512 group_table(__m512 values, const W4Group& p) {
  if (!p.has_bias) return _mm512_mul_ps(_mm512_sub_ps(values, _mm512_set1_ps(p.zp)), _mm512_set1_ps(p.scale));
  __m512 prod = _mm512_mul_ps(values, _mm512_set1_ps(p.scale));
  asm("" : "+v"(prod));
  return _mm512_add_ps(prod, _mm512_set1_ps(p.bias));
}

// 16 bytes of codes, or the row's last `valid` codes (a masked load: never past the row, no fault).
LOWBIT_TARGET_AVX512 inline __m128i load_codes(const uint8_t* code, int64_t valid) {
  if (valid >= kW4Chunk) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(code));
  return _mm_maskz_loadu_epi8(__mmask16((1u << ((valid + 1) / 2)) - 1), code);
}

// Codes 2i (e) and 2i + 1 (o) of lane i of a chunk looked up in table a, or -- kTwo: lanes 8..15, the chunk's
// second half, in table b (bit 4 of vpermt2ps's index).
template <bool kTwo>
LOWBIT_TARGET_AVX512 inline __attribute__((always_inline)) void lookup(__m128i bytes, __m512 a, __m512 b, __m512& e,
                                                                       __m512& o) {
  const __m512i idx = _mm512_cvtepu8_epi32(bytes);
  const __m512i hi = _mm512_srli_epi32(idx, 4);
  if constexpr (!kTwo) {
    e = _mm512_permutexvar_ps(idx, a);  // reads the index's low 4 bits: the low nibble
    o = _mm512_permutexvar_ps(hi, a);
  } else {
    const __m512i second = _mm512_set_epi32(16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0);
    e = _mm512_permutex2var_ps(a, _mm512_ternarylogic_epi32(idx, _mm512_set1_epi32(0xF), second, 0xEA), b);
    o = _mm512_permutex2var_ps(a, _mm512_or_si512(hi, second), b);
  }
}

// Zero the decoded weights of codes >= valid (the last chunk of a row).
LOWBIT_TARGET_AVX512 inline void mask_tail(int64_t valid, __m512& e, __m512& o) {
  const __m512i lane2 = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i v = _mm512_set1_epi32(int(valid));
  e = _mm512_maskz_mov_ps(_mm512_cmplt_epi32_mask(lane2, v), e);
  o = _mm512_maskz_mov_ps(_mm512_cmplt_epi32_mask(_mm512_add_epi32(lane2, _mm512_set1_epi32(1)), v), o);
}

// One chunk at code k of the tile's rows (valid codes of it) into the accumulators.
// Accumulators per (activation row, weight row): one activation row gives the even and the odd codes their own,
// so that no chain of two dependent FMAs per chunk bounds the tile (more rows keep enough chains in flight).
template <int MR>
constexpr int kAccs = MR == 1 ? 2 : 1;

template <int MR, int NR, bool kTwo>
LOWBIT_TARGET_AVX512 inline __attribute__((always_inline)) void chunk_step(__m512 (&acc)[MR][NR][kAccs<MR>],
                                                                           const float* x,
                                                                           int64_t ldx, const uint8_t* w, int64_t rb,
                                                                           int64_t k, int64_t valid,
                                                                           const __m512 (&ta)[NR],
                                                                           const __m512 (&tb)[NR]) {
  for (int r = 0; r < NR; r++) {
    __m512 e, o;
    lookup<kTwo>(load_codes(w + r * rb + k / 2, valid), ta[r], tb[r], e, o);
    if (valid < kW4Chunk) mask_tail(valid, e, o);
    for (int m = 0; m < MR; m++) {
      const float* xp = x + m * ldx + k;
      __m512& a = acc[m][r][0];
      __m512& b = acc[m][r][kAccs<MR> - 1];
      a = _mm512_fmadd_ps(_mm512_loadu_ps(xp), e, a);
      b = _mm512_fmadd_ps(_mm512_loadu_ps(xp + 16), o, b);
    }
  }
}

// 16 bf16 words from p (those of mask, the rest 0) as fp32: each word is the high half of its float.
LOWBIT_TARGET_AVX512 inline __attribute__((always_inline)) __m512 bf16x16_to_float(const uint16_t* p, __mmask16 mask) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

// 16 consecutive group scales (or biases) in encoding kEnc from index i, those of mask (the rest 0), decoded to fp32
// at once: exact conversions, the values of w4_scale_to_float.
template <W4Scale kEnc>
LOWBIT_TARGET_AVX512 inline __attribute__((always_inline)) __m512 scales16(const void* p, int64_t i, __mmask16 mask) {
  if constexpr (kEnc == W4Scale::F32) return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(p) + i);
  if constexpr (kEnc == W4Scale::BF16) return bf16x16_to_float(static_cast<const uint16_t*>(p) + i, mask);
  if constexpr (kEnc == W4Scale::F16)
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(p) + i));
  // one-byte encodings by integer arithmetic on the bits (a gather from a byte table measured slower here)
  const __m128i b8 = _mm_maskz_loadu_epi8(mask, static_cast<const uint8_t*>(p) + i);
  const __m512 nan = _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN());
  if constexpr (kEnc == W4Scale::E8M0) {  // 2^(b - 127): b in the fp32 exponent; b = 0 is the subnormal 2^-127, 0xFF NaN
    const __m512i b = _mm512_cvtepu8_epi32(b8);
    __m512i bits = _mm512_slli_epi32(b, 23);
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(b, _mm512_setzero_si512()), _mm512_set1_epi32(0x00400000));
    return _mm512_mask_mov_ps(_mm512_castsi512_ps(bits), _mm512_cmpeq_epi32_mask(b, _mm512_set1_epi32(0xFF)), nan);
  }
  // E4M3: the byte sign-extended to 16 bits and shifted left by 7, bit 14 cleared, is a half of 1/256 the value
  // (the sign in bit 15, exponent and mantissa in bits 7..13, subnormals still subnormal), which vcvtph2ps widens
  // exactly; 0x7F and 0xFF are NaN. Half the instructions of rebiasing the exponent in 32-bit lanes.
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b8), 7), _mm256_set1_epi16(short(0xBF80)));
  const __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
  return _mm512_mask_mov_ps(v, _mm_cmpeq_epi8_mask(_mm_or_si128(b8, _mm_set1_epi8(char(0x80))), _mm_set1_epi8(char(0xFF))),
                            nan);
}


LOWBIT_TARGET_AVX512 inline __m512 load_scales16(W4Scale enc, const void* p, int64_t i, int64_t count) {
  const __mmask16 mask = first_lanes(count);
  switch (enc) {
    case W4Scale::F32: return scales16<W4Scale::F32>(p, i, mask);
    case W4Scale::F16: return scales16<W4Scale::F16>(p, i, mask);
    case W4Scale::BF16: return scales16<W4Scale::BF16>(p, i, mask);
    case W4Scale::E4M3: return scales16<W4Scale::E4M3>(p, i, mask);
    case W4Scale::E8M0: break;
  }
  return scales16<W4Scale::E8M0>(p, i, mask);
}

// Scales i .. i + count - 1 into dst, zero up to the next multiple of 16: one loop per encoding, with no branch on the
// encoding per 16 scales (the nvfp4 GEMV decodes a scale every 16 codes).
template <W4Scale kEnc>
LOWBIT_TARGET_AVX512 inline __attribute__((always_inline)) void decode_scales_t(const void* p, int64_t i, int64_t count,
                                                                                float* dst) {
  for (int64_t j = 0; j < count; j += 16) _mm512_storeu_ps(dst + j, scales16<kEnc>(p, i + j, first_lanes(count - j)));
}
LOWBIT_TARGET_AVX512 inline __attribute__((always_inline)) void decode_scales(W4Scale enc, const void* p, int64_t i,
                                                                              int64_t count, float* dst) {
  switch (enc) {
    case W4Scale::F32: return decode_scales_t<W4Scale::F32>(p, i, count, dst);
    case W4Scale::F16: return decode_scales_t<W4Scale::F16>(p, i, count, dst);
    case W4Scale::BF16: return decode_scales_t<W4Scale::BF16>(p, i, count, dst);
    case W4Scale::E4M3: return decode_scales_t<W4Scale::E4M3>(p, i, count, dst);
    case W4Scale::E8M0: break;
  }
  decode_scales_t<W4Scale::E8M0>(p, i, count, dst);
}

LOWBIT_TARGET_AVX512 inline __m512 load_zero_points16(const int8_t* p, int64_t i, int64_t count) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(first_lanes(count), p + i)));
}

// The group tables of NR rows, from their scales (and zero points or biases) decoded 16 groups at a time into
// arrays that the tables broadcast from (a load, not a shuffle: the decode's shuffles have the port to themselves).
template <int NR>
struct GroupTables {
  enum Kind { kScale, kZeroPoint, kBias };
  const W4Operand& op;
  int64_t n0;
  __m512 values;
  alignas(64) float scale[NR][16], offset[NR][16];  // groups base .. base + 15
  int64_t base = -16;
  Kind kind;

  LOWBIT_TARGET_AVX512 GroupTables(const W4Operand& o, int64_t n)
      : op(o), n0(n), values(_mm512_loadu_ps(o.values)),
        kind(!o.offset ? kScale : o.offset_kind == W4Offset::Bias ? kBias
                                  : o.offset_kind == W4Offset::ZeroPoint ? kZeroPoint : kScale) {}
  LOWBIT_TARGET_AVX512 inline __attribute__((always_inline)) void table(int64_t g, __m512 (&t)[NR]) {
    if (g < base || g >= base + 16) {
      base = g & ~int64_t(15);
      const int64_t count = std::min<int64_t>(16, op.G - base);
      for (int r = 0; r < NR; r++) {
        const int64_t i = (n0 + r) * op.G + base;
        _mm512_store_ps(scale[r], load_scales16(op.scale_enc, op.scale, i, count));
        if (kind == kBias) _mm512_store_ps(offset[r], load_scales16(op.scale_enc, op.offset, i, count));
        if (kind == kZeroPoint)
          _mm512_store_ps(offset[r], load_zero_points16(static_cast<const int8_t*>(op.offset), i, count));
      }
    }
    const int64_t j = g - base;
    for (int r = 0; r < NR; r++) {
      const __m512 s = _mm512_set1_ps(scale[r][j]);
      if (kind == kScale) {
        t[r] = _mm512_mul_ps(values, s);
      } else if (kind == kZeroPoint) {
        t[r] = _mm512_mul_ps(_mm512_sub_ps(values, _mm512_set1_ps(offset[r][j])), s);
      } else {  // the product rounded first (see group_table)
        __m512 prod = _mm512_mul_ps(values, s);
        asm("" : "+v"(prod));
        t[r] = _mm512_add_ps(prod, _mm512_set1_ps(offset[r][j]));
      }
    }
  }
};

// Group sizes that are multiples of 32 (and one group per row): every chunk lies in one group, the groups' runs
// of chunks are a fixed length -- a plain loop nest that keeps the tables and accumulators in registers.
template <int MR, int NR>
LOWBIT_TARGET_AVX512 inline __attribute__((always_inline)) void gemv_aligned(__m512 (&acc)[MR][NR][kAccs<MR>],
                                                                             const float* x, int64_t ldx,
                                                                             const W4Operand& op, int64_t n0) {
  const int64_t K = op.K, rb = op.row_bytes(), full = K / kW4Chunk * kW4Chunk;
  const uint8_t* w = op.codes + n0 * rb;
  const GemvPrefetch prefetch(w, rb, NR);
  const int64_t per = op.G <= 1 ? full + kW4Chunk : op.group;
  GroupTables<NR> tables(op, n0);
  __m512 ta[NR];
  for (int64_t k = 0, g = 0; k < full; g++) {
    tables.table(g, ta);
    for (const int64_t end = std::min(full, k + per); k < end; k += kW4Chunk) {
      if ((k & 127) == 0)  // every 64 bytes of each row (gemv_prefetch.h)
        for (int r = 0; r < NR; r++) _mm_prefetch(prefetch(r, k / 2), kPrefetchHint);
      chunk_step<MR, NR, false>(acc, x, ldx, w, rb, k, kW4Chunk, ta, ta);
    }
  }
  if (full < K) {
    tables.table(op.G <= 1 ? 0 : full / op.group, ta);
    chunk_step<MR, NR, false>(acc, x, ldx, w, rb, full, K - full, ta, ta);
  }
}

// Group size 16: each chunk's halves are groups 2c and 2c + 1.
template <int MR, int NR>
LOWBIT_TARGET_AVX512 inline __attribute__((always_inline)) void gemv_g16(__m512 (&acc)[MR][NR][kAccs<MR>],
                                                                         const float* x, int64_t ldx,
                                                                         const W4Operand& op, int64_t n0) {
  const int64_t K = op.K, rb = op.row_bytes();
  const uint8_t* w = op.codes + n0 * rb;
  const GemvPrefetch prefetch(w, rb, NR);
  GroupTables<NR> tables(op, n0);
  __m512 ta[NR], tb[NR];
  for (int64_t k = 0; k < K; k += kW4Chunk) {
    if ((k & 127) == 0)
      for (int r = 0; r < NR; r++) _mm_prefetch(prefetch(r, k / 2), kPrefetchHint);
    tables.table(k / 16, ta);
    if (K - k > 16) {
      tables.table(k / 16 + 1, tb);
      chunk_step<MR, NR, true>(acc, x, ldx, w, rb, k, K - k, ta, tb);
    } else {
      chunk_step<MR, NR, false>(acc, x, ldx, w, rb, k, K - k, ta, ta);
    }
  }
}

// Other multiples of 16 (48, 80, ...): runs of chunks inside one group, and chunks across two groups.
template <int MR, int NR>
LOWBIT_TARGET_AVX512 inline __attribute__((always_inline)) void gemv_general(__m512 (&acc)[MR][NR][kAccs<MR>],
                                                                             const float* x, int64_t ldx,
                                                                             const W4Operand& op, int64_t n0) {
  const int64_t K = op.K, rb = op.row_bytes(), full = K / kW4Chunk * kW4Chunk;
  const uint8_t* w = op.codes + n0 * rb;
  const GemvPrefetch prefetch(w, rb, NR);
  GroupTables<NR> tables(op, n0);
  __m512 ta[NR], tb[NR];
  for (int r = 0; r < NR; r++) ta[r] = tb[r] = _mm512_setzero_ps();
  W4BlockGroups blocks(op, 0);
  int64_t ga = -1;
  for (int64_t k = 0; k < K;) {
    const int64_t g0 = blocks.next(), g1 = K - k > 16 ? blocks.next() : g0;
    if (g0 != ga) tables.table(g0, ta);
    ga = g0;
    if (g1 != g0) {
      tables.table(g1, tb);
      chunk_step<MR, NR, true>(acc, x, ldx, w, rb, k, K - k, ta, tb);
      for (int r = 0; r < NR; r++) ta[r] = tb[r];
      ga = g1;
      k += kW4Chunk;
      continue;
    }
    if (k >= full) {  // the last, partial chunk
      chunk_step<MR, NR, false>(acc, x, ldx, w, rb, k, K - k, ta, tb);
      break;
    }
    // this chunk and the whole chunks after it in the same group
    const int64_t run = std::min(1 + blocks.left / 2, (full - k) / kW4Chunk);
    blocks.left -= 2 * (run - 1);
    for (const int64_t end = k + run * kW4Chunk; k < end; k += kW4Chunk) {
      if ((k & 127) == 0)
        for (int r = 0; r < NR; r++) _mm_prefetch(prefetch(r, k / 2), kPrefetchHint);
      chunk_step<MR, NR, false>(acc, x, ldx, w, rb, k, kW4Chunk, ta, tb);
    }
  }
}

enum class Walk { Aligned, G16, General };

template <int MR, int NR, Walk kWalk>
LOWBIT_TARGET_AVX512 void gemv_tile_t(const float* x, int64_t ldx, const W4Operand& op, int64_t n0, float* sums) {
  __m512 acc[MR][NR][kAccs<MR>];
  for (int m = 0; m < MR; m++)
    for (int r = 0; r < NR; r++)
      for (int i = 0; i < kAccs<MR>; i++) acc[m][r][i] = _mm512_setzero_ps();
  if constexpr (kWalk == Walk::Aligned) gemv_aligned<MR, NR>(acc, x, ldx, op, n0);
  else if constexpr (kWalk == Walk::G16) gemv_g16<MR, NR>(acc, x, ldx, op, n0);
  else gemv_general<MR, NR>(acc, x, ldx, op, n0);
  for (int m = 0; m < MR; m++) {
    __m512 row[NR];
    for (int r = 0; r < NR; r++) row[r] = kAccs<MR> == 1 ? acc[m][r][0] : _mm512_add_ps(acc[m][r][0], acc[m][r][1]);
    store_row_sums<NR>(row, sums + m * NR);
  }
}

template <Walk kWalk>
struct Tiles {
  template <int MR, int NR, bool>
  static constexpr W4GemvTileFn get() { return &gemv_tile_t<MR, NR, kWalk>; }
};

void gemv_tile(int mr, int nr, const float* x, int64_t ldx, const W4Operand& op, int64_t n0, float* sums) {
  if (!w4_blocks_in_groups(op)) return kW4KernelsPortable.gemv_tile(mr, nr, x, ldx, op, n0, sums);
  if (op.G <= 1 || op.group % 32 == 0)
    return pick_gemv_tile<W4GemvTileFn, Tiles<Walk::Aligned>>(false, mr, nr)(x, ldx, op, n0, sums);
  if (op.group == 16) return pick_gemv_tile<W4GemvTileFn, Tiles<Walk::G16>>(false, mr, nr)(x, ldx, op, n0, sums);
  pick_gemv_tile<W4GemvTileFn, Tiles<Walk::General>>(false, mr, nr)(x, ldx, op, n0, sums);
}

// bf16 activations (w4_kernels.h's bf16 order): a step of 128 codes is 64 bytes, 32 16-bit words of 4 codes each;
// vpermw reads an index's low 5 bits, so a 32-entry table (the 16 values as bf16, twice) decodes nibble j of
// every word after a shift by 4 j: 4 permutes and 3 shifts per 128 codes and row, half the work of the fp32
// tile's, which bounds it on many threads. vdpbf16ps multiplies pairs exactly (bf16 x bf16 fits fp32) and
// accumulates in fp32 (like every AVX-512 BF16 instruction it reads denormal inputs -- below 1e-38 -- as zero).
// A group's zero point or bias multiplies the group's sum of x (w4_kernels.h). Values inexact in bf16 stay on the
// fp32 tiles (w4_bf16_tile_takes).

// 64 bytes of codes at w: a whole step, or (kFull false) the step's `valid` codes inside K, the rest read as code 0
// (times a zero activation)
template <bool kFull>
LOWBIT_TARGET_AVX512 inline __attribute__((always_inline)) __m512i load_step_codes(const uint8_t* w, int64_t valid) {
  if constexpr (kFull) return _mm512_loadu_si512(w);
  const int64_t bytes = (valid + 1) / 2;
  return bytes >= 64 ? _mm512_loadu_si512(w) : _mm512_maskz_loadu_epi8(_cvtu64_mask64((uint64_t(1) << bytes) - 1), w);
}

// The step's 128 codes as bf16 values: d[j] holds nibble j of every 16-bit word of codes (the bf16 order)
template <bool kFull>
LOWBIT_TARGET_AVX512BF16 inline __attribute__((always_inline)) void decode_step_bf16(const uint8_t* w, int64_t valid,
                                                                                      __m512i table, __m512i (&d)[4]) {
  const __m512i b = load_step_codes<kFull>(w, valid);
  d[0] = _mm512_permutexvar_epi16(b, table);
  d[1] = _mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), table);
  d[2] = _mm512_permutexvar_epi16(_mm512_srli_epi16(b, 8), table);
  d[3] = _mm512_permutexvar_epi16(_mm512_srli_epi16(b, 12), table);
}

// One step at code k of the tile's rows into their sums (two chains per pair of rows: vdpbf16ps's latency).
template <int MR, int NR, bool kFull>
LOWBIT_TARGET_AVX512BF16 inline __attribute__((always_inline)) void step_bf16(__m512 (&part)[MR][NR][2],
                                                                               const uint16_t* x, int64_t ldx,
                                                                               const uint8_t* w, int64_t rb,
                                                                               const GemvPrefetch& prefetch, int64_t k,
                                                                               int64_t valid, __m512i table) {
#pragma GCC unroll 4
  for (int r = 0; r < NR; r++)  // one line of each row per step (gemv_prefetch.h)
    _mm_prefetch(prefetch(r, k / 2), kOuterPrefetchHint);
#pragma GCC unroll 4
  for (int r = 0; r < NR; r++) {
    __m512i d[4];
    decode_step_bf16<kFull>(w + r * rb + k / 2, valid, table, d);
#pragma GCC unroll 4
    for (int m = 0; m < MR; m++) {
      const uint16_t* xp = x + m * ldx + k;
      part[m][r][0] = _mm512_dpbf16_ps(part[m][r][0], (__m512bh)d[0], (__m512bh)_mm512_loadu_si512(xp));
      part[m][r][1] = _mm512_dpbf16_ps(part[m][r][1], (__m512bh)d[1], (__m512bh)_mm512_loadu_si512(xp + 32));
      part[m][r][0] = _mm512_dpbf16_ps(part[m][r][0], (__m512bh)d[2], (__m512bh)_mm512_loadu_si512(xp + 64));
      part[m][r][1] = _mm512_dpbf16_ps(part[m][r][1], (__m512bh)d[3], (__m512bh)_mm512_loadu_si512(xp + 96));
    }
  }
}

// The digit planes' step (w4_kernels.h, W4PlaneStep) at code k for activation rows whose step st[m] is exact: each
// row's codes as bytes u (kLookup: through the 16-byte table `u`; otherwise the nibbles are u), three digit
// planes' byte dot products combined by shifts, less off times the lanes' sums of x's integers, one conversion and
// one fma into part[m][r][0] per row pair. neg_off: -off, inv_mul: 1 / mul (W4PlaneCodes).
template <int MR, int NR, bool kFull, bool kLookup>
LOWBIT_TARGET_AVX512BF16 inline __attribute__((always_inline)) void step_planes(
    __m512 (&part)[MR][NR][2], const W4PlaneStep* const (&st)[MR], const uint8_t* w, int64_t rb,
    const GemvPrefetch& prefetch, int64_t k, int64_t valid, __m512i u, __m512i neg_off, float inv_mul) {
#pragma GCC unroll 4
  for (int r = 0; r < NR; r++) _mm_prefetch(prefetch(r, k / 2), kOuterPrefetchHint);
  __m512i init[MR];
  __m512 scale[MR];
#pragma GCC unroll 4
  for (int m = 0; m < MR; m++) {
    init[m] = _mm512_mullo_epi32(_mm512_loadu_si512(st[m]->lane_sums), neg_off);
    scale[m] = _mm512_set1_ps(st[m]->scale * inv_mul);
  }
  const __m512i low = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
  for (int r = 0; r < NR; r++) {
    const __m512i b = load_step_codes<kFull>(w + r * rb + k / 2, valid);
    __m512i even = _mm512_and_si512(b, low), odd = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
    if constexpr (kLookup) {
      even = _mm512_shuffle_epi8(u, even);
      odd = _mm512_shuffle_epi8(u, odd);
    }
#pragma GCC unroll 4
    for (int m = 0; m < MR; m++) {
      const int8_t(&d)[3][2][64] = st[m]->digits;
      __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), even, _mm512_loadu_si512(d[0][0]));
      a = _mm512_dpbusd_epi32(a, odd, _mm512_loadu_si512(d[0][1]));
      a = _mm512_slli_epi32(a, 8);
      a = _mm512_dpbusd_epi32(a, even, _mm512_loadu_si512(d[1][0]));
      a = _mm512_dpbusd_epi32(a, odd, _mm512_loadu_si512(d[1][1]));
      a = _mm512_slli_epi32(a, 8);
      a = _mm512_dpbusd_epi32(a, even, _mm512_loadu_si512(d[2][0]));
      a = _mm512_dpbusd_epi32(a, odd, _mm512_loadu_si512(d[2][1]));
      part[m][r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a, init[m])), scale[m], part[m][r][0]);
    }
  }
}

// tot += (part[0] + part[1]) * s[r] lane by lane; the parts restart from zero
template <int MR, int NR>
LOWBIT_TARGET_AVX512BF16 inline __attribute__((always_inline)) void scale_parts(__m512 (&tot)[MR][NR],
                                                                                 __m512 (&part)[MR][NR][2],
                                                                                 const __m512 (&s)[NR]) {
#pragma GCC unroll 4
  for (int r = 0; r < NR; r++)
#pragma GCC unroll 4
    for (int m = 0; m < MR; m++) {
      tot[m][r] = _mm512_fmadd_ps(_mm512_add_ps(part[m][r][0], part[m][r][1]), s[r], tot[m][r]);
      part[m][r][0] = part[m][r][1] = _mm512_setzero_ps();
    }
}

// Groups base .. base + 15 of the tile's rows with offsets: tot[m][r] += offset * (row m's sum of x over the group),
// lane by lane (the lanes are summed with the rest at the end; lanes past the last group add 0 * 0). The offset is
// the bias, or -(zero point * scale) for w = (value - zero point) * scale. sc[r * ld ..]: the groups' decoded scales.
template <int MR, int NR>
LOWBIT_TARGET_AVX512 inline __attribute__((always_inline)) void add_offsets(__m512 (&tot)[MR][NR],
                                                                            const W4Operand& op, const uint16_t* x,
                                                                            int64_t ldx, int64_t Kp, int64_t n0,
                                                                            int64_t base, int64_t count,
                                                                            const float* sc, int64_t ld) {
  __m512 xs[MR];
#pragma GCC unroll 4
  for (int m = 0; m < MR; m++) xs[m] = _mm512_loadu_ps(reinterpret_cast<const float*>(x + m * ldx + Kp) + base);
#pragma GCC unroll 4
  for (int r = 0; r < NR; r++) {
    const int64_t i = (n0 + r) * op.G + base;
    const __m512 o =
        op.offset_kind == W4Offset::Bias
            ? load_scales16(op.scale_enc, op.offset, i, count)
            : _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(),
                                          load_zero_points16(static_cast<const int8_t*>(op.offset), i, count)),
                            _mm512_loadu_ps(sc + r * ld));
#pragma GCC unroll 4
    for (int m = 0; m < MR; m++) tot[m][r] = _mm512_fmadd_ps(o, xs[m], tot[m][r]);
  }
}

// Groups per row whose scales the bf16 tile decodes at once for groups of 16-64 (4 KB a row of fp32 on the stack).
constexpr int64_t kScaleWindow = 256;

// What every tile of a range of rows shares: the decode table, the lane constants and the streams' prefetchers at
// the range's first row (made once per range: per tile, with a MoE expert's short rows, this setup and the
// prefetchers' divisions were a fifth of the tile).
struct Bf16RowsSetup {
  int64_t n0, K, rb, Kp, full, G, sb, srow, ob, orow, per;
  int group_shift;
  bool offsets;
  __m512i table, lane_group;
  // the digit planes (W4Kernels::pack_plane_steps): where they start in a row of x (words), and the codes' bytes
  int64_t planes_at = 0;
  __m512i plane_u, plane_neg_off;
  float plane_inv_mul = 1.f;
  const uint8_t* w;
  const char* srows;
  GemvPrefetch prefetch, scale_prefetch, offset_prefetch;

  // kSmall: group size 16, 32 or 64, several groups per step (gemv_tile_bf16_t); nr: rows per tile; planes: the
  // tiles read x's digit planes (the codes' bytes are worked out only then)
  LOWBIT_TARGET_AVX512 Bf16RowsSetup(const W4Operand& op, int64_t n0, int nr, bool small, bool planes)
      : n0(n0), K(op.K), rb(op.row_bytes()), Kp(w4_bf16_padded(K)), full(K / kW4Bf16Step * kW4Bf16Step),
        G(std::max<int64_t>(op.G, 1)), sb(w4_scale_bytes(op.scale_enc)), srow(G * sb),
        ob(op.offset_kind == W4Offset::ZeroPoint ? 1 : sb), orow(G * ob),
        // codes per scaling of the sums: a step, a group, or the row
        per(small ? kW4Bf16Step : op.G <= 1 ? Kp : op.group),
        // small groups by a shift: a division by op.group ran at every step
        group_shift(small ? __builtin_ctzll(op.group) : 0),
        offsets(op.offset != nullptr && op.offset_kind != W4Offset::None),
        w(op.codes + n0 * rb), srows(static_cast<const char*>(op.scale) + n0 * srow),
        prefetch(w, rb, nr),
        // the rows' scales are a second stream (an eighth of the codes' bytes for nvfp4's): fetched as far ahead in
        // codes as the codes are, or their misses stall every window's decode
        scale_prefetch(srows, srow, nr, ahead(op, sb)),
        // zero points or biases: a third stream, fetched as the scales are, and the rows' group sums of x behind
        // them
        offset_prefetch(offsets ? static_cast<const char*>(op.offset) + n0 * orow : srows, orow, nr, ahead(op, ob)) {
    // the values' high halves (exact bf16: gemv_bf16_takes), twice
    const __m256i words =
        _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(_mm512_loadu_ps(op.values)), 16));
    table = _mm512_inserti64x4(_mm512_castsi256_si512(words), words, 1);
    // small: lane l of a step's sums is in group l >> shift of the step's groups
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    lane_group = small ? _mm512_srli_epi32(lane, int(__builtin_ctzll(op.group / 8))) : lane;
    if (!planes) return;
    planes_at = w4_plane_steps_at(K, w4_bf16_row_group_sums(op));
    const W4PlaneCodes pc = w4_plane_codes(op);
    plane_u = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pc.u)));
    plane_neg_off = _mm512_set1_epi32(-pc.off);
    plane_inv_mul = pc.inv_mul;
  }
  static int64_t ahead(const W4Operand& op, int64_t bytes) {
    return std::max<int64_t>(64, kGemvPrefetchBytes * 2 / std::max<int64_t>(op.group, 1) * bytes);
  }
};

// How a bf16 tile reads x: its bf16 words alone, or with the digit planes behind them (W4Kernels::pack_plane_steps),
// the codes' bytes being the nibbles or looked up (W4PlaneCodes::identity).
enum class Planes { None, Nibbles, Lookup };

// kSmall: group size 16, 32 or 64, several groups per step: lane l of a step's fp32 sums covers codes 8 l .. 8 l + 7,
// so each step's sums are scaled lane by lane. Otherwise groups are whole steps (or the row): the sums of a group's
// steps are scaled once. Rows n0 .. n0 + NR - 1 of the range that `s` was made for: sums[m * lds + r]. kPlanes:
// steps that every row of x has exact in its planes take step_planes, the others the bf16 step.
template <int MR, int NR, bool kSmall, Planes kPlanes>
LOWBIT_TARGET_AVX512BF16 inline __attribute__((always_inline)) void gemv_tile_bf16_t(const Bf16RowsSetup& s,
                                                                                      const uint16_t* x, int64_t ldx,
                                                                                      const W4Operand& op, int64_t n0,
                                                                                      float* sums, int64_t lds) {
  const int64_t K = s.K, rb = s.rb, Kp = s.Kp, full = s.full, G = s.G, sb = s.sb, ob = s.ob, per = s.per;
  const uint8_t* w = op.codes + n0 * rb;
  const GemvPrefetch prefetch = s.prefetch.rows_on(n0 - s.n0), scale_prefetch = s.scale_prefetch.rows_on(n0 - s.n0),
                     offset_prefetch = s.offset_prefetch.rows_on(n0 - s.n0);
  const __m512i table = s.table;
  __m512 tot[MR][NR], part[MR][NR][2], sv[NR];
#pragma GCC unroll 4
  for (int m = 0; m < MR; m++)
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) tot[m][r] = part[m][r][0] = part[m][r][1] = _mm512_setzero_ps();
  // the decoded scales of groups base .. base + kWindow - 1 per row (and 16 more: a step's lanes read 16 from any
  // of its groups). kSmall: a window of kScaleWindow, decoded by one loop (per 16 groups, the decode inside the step
  // loop took as many instructions as the steps of nvfp4's 256 codes it scales). Larger groups: 16 at a time, with
  // no loop (the window's loop cost 5-8% on a MoE expert's short rows, K = 768, and saves nothing there).
  constexpr int64_t kWindow = kSmall ? kScaleWindow : 16;
  alignas(64) float sc[NR][kWindow + 16];
  int64_t base = -kWindow;
  for (int64_t k = 0, g = 0; k < Kp; g++) {
    for (const int64_t end = std::min(Kp, k + per); k < end; k += kW4Bf16Step) {
      if constexpr (kPlanes != Planes::None) {
        const W4PlaneStep* st[MR];
        bool exact = true;
#pragma GCC unroll 4
        for (int m = 0; m < MR; m++) {
          st[m] = reinterpret_cast<const W4PlaneStep*>(x + m * ldx + s.planes_at) + k / kW4Bf16Step;
          exact = exact && st[m]->exact;
        }
        constexpr bool kLookup = kPlanes == Planes::Lookup;
        if (exact) {
          if (k < full)
            step_planes<MR, NR, true, kLookup>(part, st, w, rb, prefetch, k, kW4Bf16Step, s.plane_u, s.plane_neg_off,
                                               s.plane_inv_mul);
          else
            step_planes<MR, NR, false, kLookup>(part, st, w, rb, prefetch, k, K - k, s.plane_u, s.plane_neg_off,
                                                s.plane_inv_mul);
          continue;
        }
      }
      if (k < full) step_bf16<MR, NR, true>(part, x, ldx, w, rb, prefetch, k, kW4Bf16Step, table);
      else step_bf16<MR, NR, false>(part, x, ldx, w, rb, prefetch, k, K - k, table);
    }
    // the step's first group (kSmall), or the group just summed
    const int64_t g0 = kSmall ? (k - kW4Bf16Step) >> s.group_shift : op.G <= 1 ? 0 : g;
    if (g0 >= base + kWindow) {
      base = g0 & ~int64_t(15);
      const int64_t count = std::min(kWindow, G - base);
#pragma GCC unroll 4
      for (int r = 0; r < NR; r++) {
        if constexpr (kSmall) {
          for (int64_t j = 0; j < count * sb; j += 64) _mm_prefetch(scale_prefetch(r, base * sb + j), kOuterPrefetchHint);
          decode_scales(op.scale_enc, op.scale, (n0 + r) * op.G + base, count, sc[r]);
        } else {
          _mm_prefetch(scale_prefetch(r, base * sb), kOuterPrefetchHint);
          _mm512_storeu_ps(sc[r], load_scales16(op.scale_enc, op.scale, (n0 + r) * op.G + base, count));
        }
      }
      if (s.offsets) {
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++)
          for (int64_t j = 0; j < count * ob; j += 64) _mm_prefetch(offset_prefetch(r, base * ob + j), kOuterPrefetchHint);
        for (int64_t j = 0; j < count; j += 16)
          add_offsets<MR, NR>(tot, op, x, ldx, Kp, n0, base + j, count - j, &sc[0][j], kWindow + 16);
      }
    }
    if constexpr (kSmall) {
#pragma GCC unroll 4
      for (int r = 0; r < NR; r++) sv[r] = _mm512_permutexvar_ps(s.lane_group, _mm512_loadu_ps(sc[r] + (g0 - base)));
    } else {  // a broadcast from memory: no shuffle port
#pragma GCC unroll 4
      for (int r = 0; r < NR; r++) sv[r] = _mm512_set1_ps(sc[r][g0 - base]);
    }
    scale_parts<MR, NR>(tot, part, sv);
  }
#pragma GCC unroll 4
  for (int m = 0; m < MR; m++) store_row_sums<NR>(tot[m], sums + m * lds);
}

// Rows [n0, n1) in tiles of NR rows, one setup for all; the rows left (fewer than NR) in tiles of fewer rows, whose
// prefetchers skip as many rows as those tiles hold.
template <int MR, int NR, bool kSmall, Planes kPlanes>
LOWBIT_TARGET_AVX512BF16 void gemv_rows_bf16_t(const uint16_t* x, int64_t ldx, const W4Operand& op, int64_t n0,
                                               int64_t n1, float* sums, int64_t lds) {
  int64_t n = n0;
  if (n1 - n0 >= NR) {
    const Bf16RowsSetup s(op, n0, NR, kSmall, kPlanes != Planes::None);
    for (; n + NR <= n1; n += NR) gemv_tile_bf16_t<MR, NR, kSmall, kPlanes>(s, x, ldx, op, n, sums + (n - n0), lds);
  }
  if constexpr (NR > 1)
    if (n < n1) gemv_rows_bf16_t<MR, NR - 1, kSmall, kPlanes>(x, ldx, op, n, n1, sums + (n - n0), lds);
}

using W4GemvRowsBf16Fn = void (*)(const uint16_t*, int64_t, const W4Operand&, int64_t, int64_t, float*, int64_t);

// One activation row: 4 weight rows per tile share its loads; more rows: 2 weight rows x up to 4 x rows.
template <bool kSmall, Planes kPlanes>
constexpr W4GemvRowsBf16Fn kRowsBf16[kMaxTileRows] = {
    &gemv_rows_bf16_t<1, 4, kSmall, kPlanes>, &gemv_rows_bf16_t<2, 2, kSmall, kPlanes>,
    &gemv_rows_bf16_t<3, 2, kSmall, kPlanes>, &gemv_rows_bf16_t<4, 2, kSmall, kPlanes>};

template <Planes kPlanes>
void gemv_rows_bf16_p(int mr, const uint16_t* x, int64_t ldx, const W4Operand& op, int64_t n0, int64_t n1,
                      float* sums, int64_t lds) {
  if (n1 <= n0) return;
  if (op.G > 1 && op.group < kW4Bf16Step) return kRowsBf16<true, kPlanes>[mr - 1](x, ldx, op, n0, n1, sums, lds);
  kRowsBf16<false, kPlanes>[mr - 1](x, ldx, op, n0, n1, sums, lds);
}

void gemv_rows_bf16(int mr, const uint16_t* x, int64_t ldx, const W4Operand& op, int64_t n0, int64_t n1, float* sums,
                    int64_t lds) {
  gemv_rows_bf16_p<Planes::None>(mr, x, ldx, op, n0, n1, sums, lds);
}

// W4Kernels::gemv_rows_bf16 of the planes set: x's rows carry their digit planes (pack_plane_steps); a weight
// whose codes are no small integers (W4PlaneCodes) takes the bf16 steps alone.
void gemv_rows_bf16_planes(int mr, const uint16_t* x, int64_t ldx, const W4Operand& op, int64_t n0, int64_t n1,
                           float* sums, int64_t lds) {
  const W4PlaneCodes pc = w4_plane_codes(op);
  if (!pc.ok) return gemv_rows_bf16_p<Planes::None>(mr, x, ldx, op, n0, n1, sums, lds);
  if (pc.identity) return gemv_rows_bf16_p<Planes::Nibbles>(mr, x, ldx, op, n0, n1, sums, lds);
  gemv_rows_bf16_p<Planes::Lookup>(mr, x, ldx, op, n0, n1, sums, lds);
}

// W4Kernels::pack_bf16_row. A step of 128 words is four vectors; bf16 position 32 j + i holds word 4 i + j, taken
// for i < 16 from the first two vectors and for i >= 16 from the last two, by two-source word permutes. The group
// sums add 16 values at a time, widened to fp32 (a bf16 word is the high half of its float), each group's lanes
// summed at its end.
LOWBIT_TARGET_AVX512 void pack_bf16_row(const uint16_t* x, int64_t K, int64_t group, int64_t group_sums, uint16_t* dst) {
  const int64_t Kp = w4_bf16_padded(K);
  const __m512i four = _mm512_set_epi16(60, 56, 52, 48, 44, 40, 36, 32, 28, 24, 20, 16, 12, 8, 4, 0,
                                        60, 56, 52, 48, 44, 40, 36, 32, 28, 24, 20, 16, 12, 8, 4, 0);
  for (int64_t k = 0; k < Kp; k += kW4Bf16Step) {
    __m512i v[4];
    for (int q = 0; q < 4; q++) {
      const int64_t left = K - k - 32 * q;
      v[q] = left >= 32 ? _mm512_loadu_si512(x + k + 32 * q)
             : left > 0 ? _mm512_maskz_loadu_epi16(__mmask32((uint64_t(1) << left) - 1), x + k + 32 * q)
                        : _mm512_setzero_si512();
    }
    for (int j = 0; j < 4; j++) {
      const __m512i idx = _mm512_add_epi16(four, _mm512_set1_epi16(short(j)));
      const __m512i lo = _mm512_permutex2var_epi16(v[0], idx, v[1]), hi = _mm512_permutex2var_epi16(v[2], idx, v[3]);
      _mm512_storeu_si512(dst + k + 32 * j, _mm512_mask_blend_epi16(0xFFFF0000u, lo, hi));
    }
  }
  if (group_sums == 0) return;
  float* sums = reinterpret_cast<float*>(dst + Kp);
  int64_t g = 0;
  for (int64_t k0 = 0; k0 < K; k0 += group, g++) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = k0, k1 = std::min(K, k0 + group); k < k1; k += 16)
      acc = _mm512_add_ps(acc, bf16x16_to_float(x + k, first_lanes(k1 - k)));
    sums[g] = _mm512_reduce_add_ps(acc);
  }
  for (; g < group_sums; g++) sums[g] = 0.f;
}

// b[0], .., b[3] as one vector
LOWBIT_TARGET_AVX512 inline __attribute__((always_inline)) __m512i join4(const __m128i* b) {
  const __m512i z = _mm512_inserti32x4(_mm512_castsi128_si512(b[0]), b[1], 1);
  return _mm512_inserti32x4(_mm512_inserti32x4(z, b[2], 2), b[3], 3);
}

// w4_plane_step with vectors (its bytes exactly): values x[0 .. valid) of one step, zero past valid. The values as
// 32-bit lanes, 16 codes a vector: exponent range, integers, digits; the digits narrowed to bytes in code order and
// split into even and odd codes by byte permutes; the lanes' sums of the integers by the GEMV's own dot products
// (the codes all 1).
LOWBIT_TARGET_AVX512BF16 void plane_step(const uint16_t* x, int64_t valid, W4PlaneStep& st) {
  __m512i w[8];
#pragma GCC unroll 8
  for (int q = 0; q < 8; q++) {
    const int64_t left = valid - 16 * q;
    const __m256i h = left >= 16 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16 * q))
                      : left > 0 ? _mm256_maskz_loadu_epi16(__mmask16((1u << left) - 1), x + 16 * q)
                                 : _mm256_setzero_si256();
    w[q] = _mm512_cvtepu16_epi32(h);
  }
  const __m512i byte = _mm512_set1_epi32(0xFF);
  __m512i e[8], lo = _mm512_set1_epi32(255), hi = _mm512_setzero_si512();
  __mmask16 normal[8], nonfinite = 0;
#pragma GCC unroll 8
  for (int q = 0; q < 8; q++) {
    e[q] = _mm512_and_si512(_mm512_srli_epi32(w[q], 7), byte);
    const __mmask16 top = _mm512_cmpeq_epi32_mask(e[q], byte);
    nonfinite |= top;
    normal[q] = _mm512_mask_cmpneq_epi32_mask(~top, e[q], _mm512_setzero_si512());
    lo = _mm512_mask_min_epu32(lo, normal[q], lo, e[q]);
    hi = _mm512_mask_max_epu32(hi, normal[q], hi, e[q]);
  }
  const int emin = int(_mm512_reduce_min_epu32(lo)), emax = int(_mm512_reduce_max_epu32(hi));
  const __m512i zero = _mm512_setzero_si512();
  auto store_tail = [&](float scale, int32_t exact) LOWBIT_TARGET_AVX512 {
    int32_t bits;
    std::memcpy(&bits, &scale, 4);
    _mm512_storeu_si512(reinterpret_cast<char*>(&st) + 448, _mm512_maskz_set1_epi32(1, bits));
    st.exact = exact;
  };
  // no digits: a step of zeros and denormals (exact where finite), or one the bf16 step takes (exact 0)
  auto empty = [&](int32_t exact) LOWBIT_TARGET_AVX512 {
    for (int i = 0; i < 7; i++) _mm512_storeu_si512(reinterpret_cast<char*>(&st) + 64 * i, zero);
    store_tail(1.f, exact);
  };
  if (emax == 0) return empty(nonfinite == 0);
  const int ulp = emin - 127 - 7;
  if (nonfinite != 0 || emax - emin > 15 || ulp < kW4PlaneMinExponent) return empty(0);
  const __m512i bias = _mm512_set1_epi32(128), imax = _mm512_set1_epi32(kW4PlaneMax), emin_v = _mm512_set1_epi32(emin);
  __m128i nb[3][8];  // [digit][16 codes]: bytes in code order
  __mmask16 over = 0;
#pragma GCC unroll 8
  for (int q = 0; q < 8; q++) {
    const __m512i m = _mm512_or_si512(_mm512_and_si512(w[q], _mm512_set1_epi32(0x7F)), bias);
    __m512i i = _mm512_maskz_sllv_epi32(normal[q], m, _mm512_sub_epi32(e[q], emin_v));
    i = _mm512_mask_sub_epi32(i, _mm512_test_epi32_mask(w[q], _mm512_set1_epi32(0x8000)), zero, i);
    over |= _mm512_cmpgt_epi32_mask(i, imax);
    const __m512i d0 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(i, bias), byte), bias);
    const __m512i i1 = _mm512_srai_epi32(_mm512_sub_epi32(i, d0), 8);
    const __m512i d1 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(i1, bias), byte), bias);
    const __m512i d2 = _mm512_srai_epi32(_mm512_sub_epi32(i1, d1), 8);
    const __m512i d[3] = {d2, d1, d0};
#pragma GCC unroll 3
    for (int p = 0; p < 3; p++) nb[p][q] = _mm512_cvtepi32_epi8(d[p]);
  }
  if (over != 0) return empty(0);
  const __m512i even_idx = _mm512_set_epi8(126, 124, 122, 120, 118, 116, 114, 112, 110, 108, 106, 104, 102, 100, 98, 96, 94,
                                     92, 90, 88, 86, 84, 82, 80, 78, 76, 74, 72, 70, 68, 66, 64, 62, 60, 58, 56, 54, 52,
                                     50, 48, 46, 44, 42, 40, 38, 36, 34, 32, 30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10,
                                     8, 6, 4, 2, 0);
  const __m512i odd_idx = _mm512_add_epi8(even_idx, _mm512_set1_epi8(1));
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i sums = zero;
#pragma GCC unroll 3
  for (int p = 0; p < 3; p++) {
    const __m512i z0 = join4(nb[p]), z1 = join4(nb[p] + 4);
    const __m512i even = _mm512_permutex2var_epi8(z0, even_idx, z1), odd = _mm512_permutex2var_epi8(z0, odd_idx, z1);
    _mm512_storeu_si512(st.digits[p][0], even);
    _mm512_storeu_si512(st.digits[p][1], odd);
    if (p > 0) sums = _mm512_slli_epi32(sums, 8);
    sums = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sums, ones, even), ones, odd);
  }
  _mm512_storeu_si512(st.lane_sums, sums);
  store_tail(std::ldexp(1.f, ulp), 1);
}

// W4Kernels::pack_plane_steps: each step's digit planes (w4_plane_step).
LOWBIT_TARGET_AVX512BF16 void pack_plane_steps(const uint16_t* x, int64_t K, int64_t s0, int64_t s1, W4PlaneStep* steps) {
  for (int64_t s = s0; s < s1; s++) plane_step(x + s * kW4Bf16Step, K - s * kW4Bf16Step, steps[s]);
}

// Calls fn(p, e, o) for each chunk of codes [k0, k0 + n) of row `row` (p: its first position relative to k0).
template <typename F>
LOWBIT_TARGET_AVX512 inline __attribute__((always_inline)) void for_each_chunk(const W4Operand& op, int64_t row,
                                                                               int64_t k0, int64_t n, F&& fn) {
  const float* byte_table = w4_byte_scale_table(op.scale_enc);
  const __m512 values = _mm512_loadu_ps(op.values);
  W4BlockGroups blocks(op, k0 / 16);
  const uint8_t* codes = op.codes + row * op.row_bytes();
  const int64_t k1 = std::min(op.K, k0 + n);
  int64_t ga = -1;
  __m512 ta = _mm512_setzero_ps(), tb = ta;
  for (int64_t k = k0; k < k1; k += kW4Chunk) {
    const int64_t valid = k1 - k, g0 = blocks.next(), g1 = valid > 16 ? blocks.next() : g0;
    if (g0 != ga) ta = group_table(values, w4_group(op, byte_table, row, g0));
    ga = g0;
    __m512 e, o;
    if (g1 != g0) {
      tb = group_table(values, w4_group(op, byte_table, row, g1));
      lookup<true>(load_codes(codes + k / 2, valid), ta, tb, e, o);
      ta = tb;
      ga = g1;
    } else {
      lookup<false>(load_codes(codes + k / 2, valid), ta, tb, e, o);
    }
    if (valid < kW4Chunk) mask_tail(valid, e, o);
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
        _mm512_mask_storeu_ps(d + p, first_lanes(left), a);
        if (left > 16) _mm512_mask_storeu_ps(d + p + 16, first_lanes(left - 16), b);
      }
    });
  }
}

// 16 floats -> their bf16 words (w4_bf16_round: nearest even, NaN quiet, finite values never to inf) in the low
// halves of the 32-bit lanes.
LOWBIT_TARGET_AVX512 inline __m512i bf16_round16(__m512 v) {
  const __m512i b = _mm512_castps_si512(v), trunc = _mm512_srli_epi32(b, 16), exp = _mm512_set1_epi32(0x7F80);
  const __m512i odd = _mm512_and_si512(trunc, _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), odd), 16);
  const __mmask16 finite = _mm512_cmpneq_epi32_mask(_mm512_and_si512(b, _mm512_set1_epi32(0x7F800000)),
                                                    _mm512_set1_epi32(0x7F800000));
  r = _mm512_mask_mov_epi32(r, _mm512_mask_cmpeq_epi32_mask(finite, _mm512_and_si512(r, exp), exp), trunc);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                               _mm512_or_si512(trunc, _mm512_set1_epi32(0x40)));
}

// One row's codes [k0, k0 + n) as kTerms bf16 words each (the GEMM's panels; the transposed product's rounded
// weights): each group's 16 weights decoded in fp32 and, where one is not exact in bf16, rounded -- term 0 the
// nearest bf16, term 1 the nearest of the rest (w4_bf16_remainder), w4_kernels.h's bits -- into the high halves of a table's lanes;
// then one two-table 16-bit permute per chunk and term picks each code's high half, the chunk's first group from
// words 0-31, its second (groups of 16) from words 32-63. Exact groups (nvfp4, mxfp4, the grouped panels' unit
// scales) cost two multiplies and a test each, not a rounding; the roundings are per group, not per weight.
template <int kTerms>
struct Bf16GroupTable {
  __m512i term[kTerms];
};

template <int kTerms>
LOWBIT_TARGET_AVX512 inline Bf16GroupTable<kTerms> bf16_group_table(__m512 values, const W4Group& p, __m512 global) {
  const __m512 t = _mm512_mul_ps(group_table(values, p), global);
  const __m512i bits = _mm512_castps_si512(t);
  Bf16GroupTable<kTerms> out;
  if (_mm512_test_epi32_mask(bits, _mm512_set1_epi32(0xFFFF)) == 0) {
    out.term[0] = bits;
    if constexpr (kTerms == 2) out.term[1] = _mm512_setzero_si512();
    return out;
  }
  const __m512i hi = bf16_round16(t);
  out.term[0] = _mm512_slli_epi32(hi, 16);
  if constexpr (kTerms == 2) {
    const __mmask16 finite = _mm512_cmpneq_epi32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7F800000)),
                                                      _mm512_set1_epi32(0x7F800000));
    const __m512 rest = _mm512_maskz_sub_ps(finite, t, _mm512_castsi512_ps(out.term[0]));
    out.term[1] = _mm512_slli_epi32(bf16_round16(rest), 16);
  }
  return out;
}

// The permute indices of a chunk's codes (`valid` of them at code, the rest read as 0): byte i -> dword i, code 2i
// (low nibble) indexing its low word and code 2i + 1 its high word, as word 2 c + 1 (a table lane's high half) of
// a Bf16GroupTable term: base holds, in each word, the 1 that picks a lane's high half and any table-select bits.
LOWBIT_TARGET_AVX512 inline __attribute__((always_inline)) __m512i bf16_chunk_index(const uint8_t* code, int64_t valid,
                                                                                    __m512i base) {
  const __m512i b = _mm512_cvtepu8_epi32(load_codes(code, valid));
  // (b << 1) & 0x1E | (b << 13) & 0x1E0000 | base: 0xEA is (A & B) | C
  const __m512i lo = _mm512_ternarylogic_epi32(_mm512_slli_epi32(b, 1), _mm512_set1_epi32(0x1E), base, 0xEA);
  return _mm512_ternarylogic_epi32(_mm512_slli_epi32(b, 13), _mm512_set1_epi32(0x1E0000), lo, 0xEA);
}

template <int kTerms>
LOWBIT_TARGET_AVX512 void decode_row_bf16(const W4Operand& op, int64_t row, int64_t k0, int64_t n, uint16_t* d,
                                          int64_t term_stride) {
  const float* byte_table = w4_byte_scale_table(op.scale_enc);
  const __m512 values = _mm512_loadu_ps(op.values), global = _mm512_set1_ps(op.global);
  // high halves; bytes 8..15 (codes 16..31) from the second table (bit 5 of vpermt2w's index)
  const __m512i base = _mm512_mask_set1_epi32(_mm512_set1_epi32(0x00010001), 0xFF00, 0x00210021);
  W4BlockGroups blocks(op, k0 / 16);
  const uint8_t* codes = op.codes + row * op.row_bytes();
  const int64_t k1 = std::min(op.K, k0 + n);
  int64_t ga = -1;
  Bf16GroupTable<kTerms> ta{};
  for (int64_t k = k0; k < k1; k += kW4Chunk) {
    const int64_t valid = k1 - k, g0 = blocks.next(), g1 = valid > 16 ? blocks.next() : g0;
    if (g0 != ga) ta = bf16_group_table<kTerms>(values, w4_group(op, byte_table, row, g0), global);
    const Bf16GroupTable<kTerms> tb =
        g1 != g0 ? bf16_group_table<kTerms>(values, w4_group(op, byte_table, row, g1), global) : ta;
    const __m512i idx = bf16_chunk_index(codes + k / 2, valid, base);
    const __mmask32 keep = valid < kW4Chunk ? __mmask32((uint64_t(1) << valid) - 1) : ~__mmask32(0);
#pragma GCC unroll 2
    for (int t = 0; t < kTerms; t++)
      _mm512_storeu_si512(d + t * term_stride + (k - k0),
                          _mm512_maskz_mov_epi16(keep, _mm512_permutex2var_epi16(ta.term[t], idx, tb.term[t])));
    ta = tb;
    ga = g1;
  }
}

// Groups of whole chunks (one group per row, or a multiple of 32 codes; windows start at whole chunks): every
// chunk lies in one group, so a group's table is made once, kept in registers for its run of chunks, and one
// single-table permute per chunk and term (vpermw reads the index's low 5 bits: bit 5, the second table's, is
// ignored) decodes the chunk, with no bookkeeping of the groups per chunk.
template <int kTerms>
LOWBIT_TARGET_AVX512 void decode_row_bf16_aligned(const W4Operand& op, int64_t row, int64_t k0, int64_t n,
                                                  uint16_t* d, int64_t term_stride) {
  const float* byte_table = w4_byte_scale_table(op.scale_enc);
  const __m512 values = _mm512_loadu_ps(op.values), global = _mm512_set1_ps(op.global);
  const __m512i high_halves = _mm512_set1_epi32(0x00010001);
  const uint8_t* codes = op.codes + row * op.row_bytes();
  const int64_t k1 = std::min(op.K, k0 + n);
  for (int64_t k = k0; k < k1;) {
    const int64_t g = op.G <= 1 ? 0 : k / op.group, end = op.G <= 1 ? k1 : std::min(k1, (g + 1) * op.group);
    const Bf16GroupTable<kTerms> ta = bf16_group_table<kTerms>(values, w4_group(op, byte_table, row, g), global);
    for (; k < end; k += kW4Chunk) {
      const int64_t valid = end - k;
      const __m512i idx = bf16_chunk_index(codes + k / 2, valid, high_halves);
      if (valid >= kW4Chunk) {
#pragma GCC unroll 2
        for (int t = 0; t < kTerms; t++)
          _mm512_storeu_si512(d + t * term_stride + (k - k0), _mm512_permutexvar_epi16(idx, ta.term[t]));
      } else {
        const __mmask32 keep = __mmask32((uint64_t(1) << valid) - 1);
#pragma GCC unroll 2
        for (int t = 0; t < kTerms; t++)
          _mm512_storeu_si512(d + t * term_stride + (k - k0),
                              _mm512_maskz_permutexvar_epi16(keep, idx, ta.term[t]));
      }
    }
  }
}

// One exact bf16 term of groups of 16 or 32 with one-byte scales and no offset (nvfp4's e2m1 values times e4m3
// scales, mxfp4's times e8m0 ones; global scale 1: the panels' one-term route): w4_exact_small_groups says when
// every value times every scale is an fp32 of at most 8 significant bits with a zero low half (or inf / NaN, as the
// table path gives them), whose high half is then the bf16 word itself. A chunk's codes are looked up once in the
// value table and its one or two groups' scales multiply its halves in one vector -- no table per group, which
// took most of the general path's time at 16 codes a group and half the aligned path's at 32.
bool w4_exact_small_groups(const W4Operand& op, int terms) {
  if (terms != 1 || op.G <= 1 || (op.group != 16 && op.group != 32) || op.offset != nullptr || op.global != 1.f)
    return false;
  if (op.scale_enc != W4Scale::E4M3 && op.scale_enc != W4Scale::E8M0) return false;
  for (int c = 0; c < 16; c++) {
    const float v = op.values[c];
    if (v == 0.f) continue;
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    const int field = int(bits >> 23 & 0xFF);
    // normal, at most 4 significant bits (e4m3 scales have 4), and far from fp32's overflow
    if (field == 0 || (bits & 0xFFFFF) != 0 || !(std::fabs(v) < 0x1p100f)) return false;
    // e4m3's smallest scale, 2^-9, keeps products above 2^-100 normal; e8m0's, 2^-127, makes them fp32 subnormals,
    // whose low half stays zero where the value's lowest bit is at least 2^-6
    const int lowest_bit = field - 127 - 23 + __builtin_ctz((bits & 0x7FFFFF) | 0x800000);
    if (op.scale_enc == W4Scale::E4M3 ? !(std::fabs(v) > 0x1p-100f) : lowest_bit < -6) return false;
  }
  return true;
}

LOWBIT_TARGET_AVX512 void decode_row_bf16_small_groups(const W4Operand& op, int64_t row, int64_t k0, int64_t n,
                                                       uint16_t* d) {
  const float* byte_table = w4_byte_scale_table(op.scale_enc);
  const __m512 values = _mm512_loadu_ps(op.values);
  const __m512i high_words = _mm512_set1_epi32(int32_t(0xFFFF0000u));
  const uint8_t* codes = op.codes + row * op.row_bytes();
  const uint8_t* scales = static_cast<const uint8_t*>(op.scale) + row * op.G;
  const int shift = op.group == 16 ? 4 : 5;
  const int64_t k1 = std::min(op.K, k0 + n);
  for (int64_t k = k0; k < k1; k += kW4Chunk) {
    const int64_t valid = k1 - k, g = k >> shift, g1 = (k + std::min<int64_t>(valid, kW4Chunk) - 1) >> shift;
    // lane i holds codes 2i and 2i + 1: lanes 0-7 the chunk's first 16 codes, 8-15 its second
    const __m512 s = _mm512_mask_blend_ps(__mmask16(0xFF00), _mm512_set1_ps(byte_table[scales[g]]),
                                          _mm512_set1_ps(byte_table[scales[g1]]));
    __m512 e, o;
    lookup<false>(load_codes(codes + k / 2, valid), values, values, e, o);
    // o * s's high half over e * s's: 0xCA is (A & B) | (~A & C)
    const __m512i words =
        _mm512_ternarylogic_epi32(high_words, _mm512_castps_si512(_mm512_mul_ps(o, s)),
                                  _mm512_srli_epi32(_mm512_castps_si512(_mm512_mul_ps(e, s)), 16), 0xCA);
    if (valid >= kW4Chunk) _mm512_storeu_si512(d + (k - k0), words);
    else _mm512_storeu_si512(d + (k - k0), _mm512_maskz_mov_epi16(__mmask32((uint64_t(1) << valid) - 1), words));
  }
}

// The panel decode goes row by row through a window of codes; the next row's window is a row of codes away (a
// page and more at K >= 8192), where the hardware prefetchers stop: its codes' and its groups' scale (and offset)
// lines are fetched kPanelPrefetchRows rows ahead, or every row would start with misses on both streams.
// Both helpers are always inlined: GCC 12 finds a function whose only effect is a prefetch free of side effects and
// drops its calls.
constexpr int64_t kPanelPrefetchRows = 4;
LOWBIT_TARGET_AVX512 inline __attribute__((always_inline)) void prefetch_lines(const void* begin, const void* end) {
  for (uintptr_t a = reinterpret_cast<uintptr_t>(begin) & ~uintptr_t(63); a < reinterpret_cast<uintptr_t>(end); a += 64)
    _mm_prefetch(reinterpret_cast<const char*>(a), kPrefetchHint);
}
LOWBIT_TARGET_AVX512 inline __attribute__((always_inline)) void prefetch_row_window(const W4Operand& op, int64_t row, int64_t k0, int64_t k1) {
  if (row >= op.N || k1 <= k0) return;
  const uint8_t* codes = op.codes + row * op.row_bytes();
  prefetch_lines(codes + k0 / 2, codes + (k1 + 1) / 2);
  const int64_t G = std::max<int64_t>(op.G, 1), g0 = op.G > 1 ? k0 / op.group : 0;
  const int64_t g1 = op.G > 1 ? (k1 - 1) / op.group + 1 : 1, sb = w4_scale_bytes(op.scale_enc);
  const auto* scale = static_cast<const uint8_t*>(op.scale) + row * G * sb;
  prefetch_lines(scale + g0 * sb, scale + g1 * sb);
  if (op.offset == nullptr) return;
  const int64_t ob = op.offset_kind == W4Offset::ZeroPoint ? 1 : sb;
  const auto* offset = static_cast<const uint8_t*>(op.offset) + row * G * ob;
  prefetch_lines(offset + g0 * ob, offset + g1 * ob);
}

LOWBIT_TARGET_AVX512 void decode_rows_bf16(const W4Operand& op, int64_t n0, int64_t nrows, int64_t k0, int64_t n,
                                           int terms, uint16_t* dst, int64_t ldd, int64_t term_stride) {
  if (!w4_blocks_in_groups(op))
    return kW4KernelsPortable.decode_rows_bf16(op, n0, nrows, k0, n, terms, dst, ldd, term_stride);
  const int64_t written = w4_padded(std::max<int64_t>(0, std::min(op.K - k0, n)));
  const int64_t padded = (n + kW4Bf16Chunk - 1) / kW4Bf16Chunk * kW4Bf16Chunk;
  const int64_t k1 = std::min(op.K, k0 + n);
  const bool aligned = (op.G <= 1 || op.group % kW4Chunk == 0) && k0 % kW4Chunk == 0;
  const bool small_groups = k0 % kW4Chunk == 0 && w4_exact_small_groups(op, terms);
  for (int64_t a = 1; a < kPanelPrefetchRows && a < nrows; a++) prefetch_row_window(op, n0 + a, k0, k1);
  for (int64_t r = 0; r < nrows; r++) {
    uint16_t* d = dst + r * ldd;
    if (r + kPanelPrefetchRows < nrows) prefetch_row_window(op, n0 + r + kPanelPrefetchRows, k0, k1);
    if (small_groups) {
      decode_row_bf16_small_groups(op, n0 + r, k0, n, d);
    } else if (aligned) {
      if (terms == 1) decode_row_bf16_aligned<1>(op, n0 + r, k0, n, d, term_stride);
      else decode_row_bf16_aligned<2>(op, n0 + r, k0, n, d, term_stride);
    } else if (terms == 1) {
      decode_row_bf16<1>(op, n0 + r, k0, n, d, term_stride);
    } else {
      decode_row_bf16<2>(op, n0 + r, k0, n, d, term_stride);
    }
    for (int t = 0; t < terms; t++) std::memset(d + t * term_stride + written, 0, size_t(padded - written) * 2);
  }
}

}  // namespace

extern const W4Kernels kW4KernelsAvx512{&gemv_tile,      &decode_rows,      &dequantize_rows, &w4_bf16_tile_takes,
                                         &gemv_rows_bf16, &decode_rows_bf16, &pack_bf16_row};
extern const W4Kernels kW4KernelsAvx512Planes{&gemv_tile,
                                               &decode_rows,
                                               &dequantize_rows,
                                               &w4_bf16_tile_takes,
                                               &gemv_rows_bf16_planes,
                                               &decode_rows_bf16,
                                               &pack_bf16_row,
                                               &pack_plane_steps};

}  // namespace lowbit::cpu
