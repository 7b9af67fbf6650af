// The NEON 4-bit kernels (w4_kernels.h), also the dotprod, i8mm and bf16 sets'. A group's 16 decoded weights are
// 64 bytes, four q registers: tbl with four registers looks up any byte of them, so a code c becomes the byte
// indices 4c .. 4c + 3 (the code times 4, spread over a lane by one tbl, or-ed with 0 1 2 3) and one tbl gives four
// weights. A half-chunk of 8 bytes (16 codes, one group: w4_blocks_in_groups) decodes into its 8 even codes'
// weights and its 8 odd ones'. Group sizes that are not multiples of 16 take the portable loops.
#include <arm_neon.h>

#include <algorithm>
#include <cstring>

#include "cpu/arch/arm/target.h"
#include "cpu/arch/kernel_set.h"
#include "cpu/gemv_prefetch.h"

namespace lowbit::cpu {
namespace {

// A group's 16 decoded weights: value * scale + bias rounds the product first (the empty asm keeps the compiler
// from fusing the two into an fma), (value - zp) * scale otherwise, as w4_decode_value.
LOWBIT_TARGET_NEON inline uint8x16x4_t group_table(const float* values, const W4Group& p) {
  const float32x4_t s = vdupq_n_f32(p.scale);
  uint8x16x4_t t;
  for (int i = 0; i < 4; i++) {
    float32x4_t v = vld1q_f32(values + 4 * i);
    if (!p.has_bias) {
      v = vmulq_f32(vsubq_f32(v, vdupq_n_f32(p.zp)), s);
    } else {
      v = vmulq_f32(v, s);
      asm("" : "+w"(v));
      v = vaddq_f32(v, vdupq_n_f32(p.bias));
    }
    t.val[i] = vreinterpretq_u8_f32(v);
  }
  return t;
}

// 8 bytes of codes, or the row's last `valid` codes (staged through a zeroed copy: never read past the row).
LOWBIT_TARGET_NEON inline uint8x8_t load_half(const uint8_t* code, int64_t valid) {
  if (valid >= 16) return vld1_u8(code);
  uint8_t tmp[8] = {};
  std::memcpy(tmp, code, size_t((valid + 1) / 2));
  return vld1_u8(tmp);
}

// A half's weights: d[0], d[1] its even codes 0, 2, .. 14 (four each), d[2], d[3] its odd codes 1, 3, .. 15; codes
// at or past `valid` decode to 0 (the packed x past K is 0, and a table entry may be inf or NaN).
LOWBIT_TARGET_NEON inline __attribute__((always_inline)) void decode_half(uint8x8_t bytes, int64_t valid,
                                                                          const uint8x16x4_t& t, float32x4_t (&d)[4]) {
  // lanes 0..7: the even codes times 4; 8..15: the odd ones
  const uint8x16_t idx = vcombine_u8(vshl_n_u8(vand_u8(bytes, vdup_n_u8(0x0F)), 2),
                                     vand_u8(vshr_n_u8(bytes, 2), vdup_n_u8(0x3C)));
  static const uint8_t kSpread[4][16] = {{0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3},
                                         {4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7},
                                         {8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 11},
                                         {12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15}};
  static const uint8_t kBytes[16] = {0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3};
  const uint8x16_t within = vld1q_u8(kBytes);
  for (int j = 0; j < 4; j++)
    d[j] = vreinterpretq_f32_u8(vqtbl4q_u8(t, vorrq_u8(vqtbl1q_u8(idx, vld1q_u8(kSpread[j])), within)));
  if (valid < 16) {
    static const uint32_t kCode[4][4] = {{0, 2, 4, 6}, {8, 10, 12, 14}, {1, 3, 5, 7}, {9, 11, 13, 15}};
    const uint32x4_t v = vdupq_n_u32(uint32_t(valid));
    for (int j = 0; j < 4; j++)
      d[j] = vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(d[j]), vcltq_u32(vld1q_u32(kCode[j]), v)));
  }
}

// Calls fn(p, d) for each half-chunk of codes [k0, k0 + n) of row `row`, k0 a multiple of 32 (p: where the half's
// even codes sit in the packed order, relative to k0; its odd ones 16 further).
template <typename F>
LOWBIT_TARGET_NEON inline __attribute__((always_inline)) void for_each_half(const W4Operand& op, int64_t row,
                                                                            int64_t k0, int64_t n, F&& fn) {
  const uint8_t* codes = op.codes + row * op.row_bytes();
  w4_for_each_block<uint8x16x4_t>(
      op, row, k0, n, [&](const W4Group& p) { return group_table(op.values, p); },
      [&](int64_t k, int64_t valid, const uint8x16x4_t& t) {
        float32x4_t d[4];
        decode_half(load_half(codes + k / 2, valid), valid, t, d);
        const int64_t r = k - k0;
        fn((r & ~int64_t(31)) + (r & 16) / 2, d);
      });
}

// The tile walks half-chunks; each row keeps its group's table until the group changes (every row's groups change
// together). Four weights per tbl, one fma per four codes and activation row.
template <int MR, int NR>
LOWBIT_TARGET_NEON void gemv_tile_t(const float* x, int64_t ldx, const W4Operand& op, int64_t n0, float* sums) {
  const int64_t K = op.K, rb = op.row_bytes();
  const uint8_t* w = op.codes + n0 * rb;
  const GemvPrefetch prefetch(w, rb, NR);
  const float* byte_table = w4_byte_scale_table(op.scale_enc);
  float32x4_t acc[MR][NR];
  for (int m = 0; m < MR; m++)
    for (int r = 0; r < NR; r++) acc[m][r] = vdupq_n_f32(0.f);
  uint8x16x4_t t[NR];
  W4BlockGroups blocks(op, 0);
  int64_t ga = -1;
  for (int64_t k = 0; k < K; k += 16) {
    if ((k & 127) == 0)
      for (int r = 0; r < NR; r++) __builtin_prefetch(prefetch(r, k / 2));
    const int64_t g = blocks.next();
    if (g != ga)
      for (int r = 0; r < NR; r++) t[r] = group_table(op.values, w4_group(op, byte_table, n0 + r, g));
    ga = g;
    const int64_t valid = K - k, p = (k & ~int64_t(31)) + (k & 16) / 2;
    for (int r = 0; r < NR; r++) {
      float32x4_t d[4];
      decode_half(load_half(w + r * rb + k / 2, valid), valid, t[r], d);
      for (int m = 0; m < MR; m++) {
        const float* xp = x + m * ldx + p;
        acc[m][r] = vfmaq_f32(acc[m][r], vld1q_f32(xp), d[0]);
        acc[m][r] = vfmaq_f32(acc[m][r], vld1q_f32(xp + 4), d[1]);
        acc[m][r] = vfmaq_f32(acc[m][r], vld1q_f32(xp + 16), d[2]);
        acc[m][r] = vfmaq_f32(acc[m][r], vld1q_f32(xp + 20), d[3]);
      }
    }
  }
  for (int m = 0; m < MR; m++)
    for (int r = 0; r < NR; r++) sums[m * NR + r] = vaddvq_f32(acc[m][r]);
}

struct Tiles {
  template <int MR, int NR, bool>
  static constexpr W4GemvTileFn get() { return &gemv_tile_t<MR, NR>; }
};

void gemv_tile(int mr, int nr, const float* x, int64_t ldx, const W4Operand& op, int64_t n0, float* sums) {
  if (!w4_blocks_in_groups(op)) return kW4KernelsPortable.gemv_tile(mr, nr, x, ldx, op, n0, sums);
  pick_gemv_tile<W4GemvTileFn, Tiles>(false, mr, nr)(x, ldx, op, n0, sums);
}

LOWBIT_TARGET_NEON void decode_rows(const W4Operand& op, int64_t n0, int64_t nrows, int64_t k0, int64_t n, float* dst,
                                    int64_t ldd) {
  if (!w4_blocks_in_groups(op)) return kW4KernelsPortable.decode_rows(op, n0, nrows, k0, n, dst, ldd);
  for (int64_t r = 0; r < nrows; r++) {
    float* d = dst + r * ldd;
    std::memset(d, 0, size_t(w4_padded(n)) * 4);  // a chunk's missing second half, and whole chunks past K
    for_each_half(op, n0 + r, k0, n, [&](int64_t p, const float32x4_t(&v)[4]) {
      vst1q_f32(d + p, v[0]);
      vst1q_f32(d + p + 4, v[1]);
      vst1q_f32(d + p + 16, v[2]);
      vst1q_f32(d + p + 20, v[3]);
    });
  }
}

LOWBIT_TARGET_NEON void dequantize_rows(const W4Operand& op, int64_t n0, int64_t nrows, float* dst, int64_t ldd) {
  if (!w4_blocks_in_groups(op)) return kW4KernelsPortable.dequantize_rows(op, n0, nrows, dst, ldd);
  for (int64_t r = 0; r < nrows; r++) {
    float* d = dst + r * ldd;
    int64_t k = 0;
    for_each_half(op, n0 + r, 0, op.K, [&](int64_t, const float32x4_t(&v)[4]) {
      float tmp[16];  // natural order: the even and odd codes interleaved
      const float32x4x2_t lo{{v[0], v[2]}}, hi{{v[1], v[3]}};
      vst2q_f32(tmp, lo);
      vst2q_f32(tmp + 8, hi);
      std::memcpy(d + k, tmp, size_t(std::min<int64_t>(16, op.K - k)) * 4);
      k += 16;
    });
  }
}

}  // namespace

extern const W4Kernels kW4KernelsNeon{&gemv_tile, &decode_rows, &dequantize_rows};

}  // namespace lowbit::cpu
