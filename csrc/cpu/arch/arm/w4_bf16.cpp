// The bf16 set's 4-bit GEMV for bf16 activations (W4Kernels::gemv_rows_bf16; FEAT_BF16: Apple M2 and later,
// Graviton 3+), the contract of the AVX-512 tile: codes decoded straight to bf16 (the format's values are exact
// there: w4_bf16_tile_takes), bfdot pairs summed in fp32, each group's sum scaled once and its zero point or bias
// times the group's sum of x added (w4_kernels.h); bfdot's rounding is bf16.cpp's (round to odd, at most 1 ulp a
// step). The fp32 tile (w4_neon.cpp) spends a 4-register tbl, a tbl and an orr per four codes and an fma per four
// products; this one a tbl and a trn per eight codes and a bfdot per eight products: about a third of the
// instructions per code.
//
// The bf16 order (w4_kernels.h: a step of 128 codes is 32 words of 4 codes, position 32 j + i holds nibble j of word
// i) decodes register by register: 16 bytes of codes are words 8a .. 8a + 7, their bytes' low nibbles are nibbles 0
// and 2 of each word, their high nibbles 1 and 3. A tbl of the values' low bf16 bytes and one of their high bytes
// by either, then trn1 / trn2 of the two, give nibbles 0 and 2 (1 and 3) of the 8 words as bf16: positions
// 32 j + 8 a .. + 7, where the packed activations are. The pack itself is vld4: words 4 i + j of 32 words land in
// register j.
#include <arm_neon.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "cpu/arch/arm/target.h"
#include "cpu/arch/kernel_set.h"
#include "cpu/gemv_prefetch.h"

namespace lowbit::cpu {
namespace {

// Groups whose scales (and offsets) a tile decodes at once per row.
constexpr int64_t kWindowGroups = 64;

// The low and high bytes of the 16 values' bf16 bits (their floats' high halves).
struct ValueBytes {
  uint8x16_t lo, hi;
};

LOWBIT_TARGET_BF16 inline ValueBytes value_bytes(const float* values) {
  uint8_t lo[16], hi[16];
  for (int i = 0; i < 16; i++) {
    uint32_t u;
    std::memcpy(&u, &values[i], 4);
    lo[i] = uint8_t(u >> 16);
    hi[i] = uint8_t(u >> 24);
  }
  return {vld1q_u8(lo), vld1q_u8(hi)};
}

// 8 stored scales of a one-byte encoding at p as fp32 (lo: the first 4), the values of w4_scale_to_float. E4M3:
// the byte sign-extended to 16 bits, shifted left by 7, bit 14 cleared, is a half of 1/256 the value (subnormals
// stay subnormal), widened exactly; 0x7F and 0xFF are NaN. E8M0: 2^(b - 127) as the fp32 exponent field b, 0 the
// subnormal 2^-127, 0xFF NaN.
template <W4Scale kEnc>
LOWBIT_TARGET_BF16 inline __attribute__((always_inline)) void scales8(const void* p, float32x4_t& lo,
                                                                      float32x4_t& hi) {
  const uint8x8_t b = vld1_u8(static_cast<const uint8_t*>(p));
  // the NaN bytes' all-ones lanes, widened by sign extension
  const int16x8_t nan16 =
      vmovl_s8(vreinterpret_s8_u8(vceq_u8(vorr_u8(b, vdup_n_u8(kEnc == W4Scale::E4M3 ? 0x80 : 0)), vdup_n_u8(0xFF))));
  const uint32x4_t nan_lo = vreinterpretq_u32_s32(vmovl_s16(vget_low_s16(nan16)));
  const uint32x4_t nan_hi = vreinterpretq_u32_s32(vmovl_high_s16(nan16));
  const float32x4_t nan = vdupq_n_f32(std::numeric_limits<float>::quiet_NaN());
  if constexpr (kEnc == W4Scale::E4M3) {
    const int16x8_t h = vandq_s16(vshlq_n_s16(vmovl_s8(vreinterpret_s8_u8(b)), 7), vdupq_n_s16(int16_t(0xBF80)));
    const float16x8_t f = vreinterpretq_f16_s16(h);
    lo = vmulq_n_f32(vcvt_f32_f16(vget_low_f16(f)), 256.f);
    hi = vmulq_n_f32(vcvt_high_f32_f16(f), 256.f);
  } else {  // E8M0
    const uint16x8_t w = vmovl_u8(b);
    const uint32x4_t e_lo = vmovl_u16(vget_low_u16(w)), e_hi = vmovl_high_u16(w);
    const uint32x4_t sub = vdupq_n_u32(0x00400000u), zero = vdupq_n_u32(0);
    lo = vreinterpretq_f32_u32(vbslq_u32(vceqq_u32(e_lo, zero), sub, vshlq_n_u32(e_lo, 23)));
    hi = vreinterpretq_f32_u32(vbslq_u32(vceqq_u32(e_hi, zero), sub, vshlq_n_u32(e_hi, 23)));
  }
  lo = vbslq_f32(nan_lo, nan, lo);
  hi = vbslq_f32(nan_hi, nan, hi);
}

// Stored scales (or biases: the same encoding) i .. i + count - 1 as fp32, zero up to `to`. One-byte encodings 8 at
// a time (nvfp4 has a scale per 16 codes: its table loads were a tenth of its instructions); the 16- and 32-bit
// ones by the loop (bf16 scales 8 at a time counted 4% more instructions for int4 g128, not fewer).
template <W4Scale kEnc>
LOWBIT_TARGET_BF16 void decode_floats_t(const void* p, int64_t i, int64_t count, int64_t to, float* dst) {
  int64_t j = 0;
  if constexpr (kEnc == W4Scale::E4M3 || kEnc == W4Scale::E8M0) {
    const uint8_t* base = static_cast<const uint8_t*>(p) + i;
    for (; j + 8 <= count; j += 8) {
      float32x4_t lo, hi;
      scales8<kEnc>(base + j, lo, hi);
      vst1q_f32(dst + j, lo);
      vst1q_f32(dst + j + 4, hi);
    }
  }
  const float* byte_table = w4_byte_scale_table(kEnc);
  for (; j < count; j++)
    dst[j] = byte_table ? byte_table[static_cast<const uint8_t*>(p)[i + j]] : w4_scale_to_float(kEnc, p, i + j);
  std::fill(dst + count, dst + to, 0.f);
}

LOWBIT_TARGET_BF16 void decode_floats(W4Scale enc, const void* p, int64_t i, int64_t count, int64_t to, float* dst) {
  switch (enc) {
    case W4Scale::F32: return decode_floats_t<W4Scale::F32>(p, i, count, to, dst);
    case W4Scale::F16: return decode_floats_t<W4Scale::F16>(p, i, count, to, dst);
    case W4Scale::BF16: return decode_floats_t<W4Scale::BF16>(p, i, count, to, dst);
    case W4Scale::E4M3: return decode_floats_t<W4Scale::E4M3>(p, i, count, to, dst);
    case W4Scale::E8M0: break;
  }
  decode_floats_t<W4Scale::E8M0>(p, i, count, to, dst);
}

// What the tiles of a range of rows share (made once per range, as the AVX-512 set's: a MoE expert's short rows).
struct RowsSetup {
  int64_t n0, rb, Kp, full, G, group, window;
  bool offsets;
  ValueBytes vb;
  GemvPrefetch prefetch;

  LOWBIT_TARGET_BF16 RowsSetup(const W4Operand& op, int64_t n0, int nr)
      : n0(n0), rb(op.row_bytes()), Kp(w4_bf16_padded(op.K)), full(op.K / kW4Bf16Step * kW4Bf16Step),
        G(std::max<int64_t>(op.G, 1)), group(op.G <= 1 ? Kp : op.group),
        // codes per window: a whole number of steps and of groups
        window(op.G <= 1 ? Kp : kWindowGroups * op.group),
        offsets(op.offset != nullptr && op.offset_kind != W4Offset::None), vb(value_bytes(op.values)),
        prefetch(op.codes + n0 * rb, rb, nr) {}
};

// One register of a step: 16 bytes of codes -> nibbles 0..3 of their 8 words as bf16 (d[j]).
LOWBIT_TARGET_BF16 inline __attribute__((always_inline)) void decode_register(const uint8_t* w, const ValueBytes& vb,
                                                                            bfloat16x8_t (&d)[4]) {
  const uint8x16_t c = vld1q_u8(w);
  const uint8x16_t n02 = vandq_u8(c, vdupq_n_u8(0x0F)), n13 = vshrq_n_u8(c, 4);
  const uint8x16_t lo02 = vqtbl1q_u8(vb.lo, n02), hi02 = vqtbl1q_u8(vb.hi, n02);
  const uint8x16_t lo13 = vqtbl1q_u8(vb.lo, n13), hi13 = vqtbl1q_u8(vb.hi, n13);
  d[0] = vreinterpretq_bf16_u8(vtrn1q_u8(lo02, hi02));
  d[1] = vreinterpretq_bf16_u8(vtrn1q_u8(lo13, hi13));
  d[2] = vreinterpretq_bf16_u8(vtrn2q_u8(lo02, hi02));
  d[3] = vreinterpretq_bf16_u8(vtrn2q_u8(lo13, hi13));
}

// Two accumulator chains per (activation row, weight row), for the even and the odd registers of a step (one chain
// per pair of rows would wait on bfdot's latency).
constexpr int kChains = 2;

// The fp32 scales of the lanes of register a's sums at step k, for groups of 2^kShift codes (16, 32, 64): lane q
// sums codes k + 32 a + 8 q .. + 7. sc: the row's window of scales from group `base`.
template <int kShift>
LOWBIT_TARGET_BF16 inline __attribute__((always_inline)) float32x4_t lane_scales(const float* sc, int64_t k, int a,
                                                                               int64_t base) {
  const float* s = sc + ((k + 32 * a) >> kShift) - base;
  if constexpr (kShift == 4) {  // lanes 0, 1 in one group, 2, 3 in the next
    const float32x2_t v = vld1_f32(s);
    return vcombine_f32(vdup_lane_f32(v, 0), vdup_lane_f32(v, 1));
  } else {
    return vld1q_dup_f32(s);
  }
}

// One step (128 codes) at code k of the tile's rows, whose step bytes are w + r * rb. Register by register, so that
// the register's activations are loaded once for all the tile's rows. kShift > 0 (small groups): each pair of
// registers' sums is scaled into tot; otherwise the sums stay in acc until the group ends.
template <int MR, int NR, int kShift>
LOWBIT_TARGET_BF16 inline __attribute__((always_inline)) void step(float32x4_t (&acc)[MR][NR][kChains],
                                                                 float32x4_t (&tot)[MR][NR], const uint16_t* x,
                                                                 int64_t ldx, const uint8_t* w, int64_t rb,
                                                                 const ValueBytes& vb, int64_t k,
                                                                 const float (*sc)[kWindowGroups + 1], int64_t base) {
#pragma GCC unroll 4
  for (int a = 0; a < 4; a++) {
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
      bfloat16x8_t d[4];
      decode_register(w + r * rb + 16 * a, vb, d);
#pragma GCC unroll 4
      for (int m = 0; m < MR; m++) {
        const uint16_t* xp = x + m * ldx + k + 8 * a;
        float32x4_t& s = acc[m][r][a % kChains];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) s = vbfdotq_f32(s, d[j], vreinterpretq_bf16_u16(vld1q_u16(xp + 32 * j)));
      }
    }
    if constexpr (kShift > 0)
      if (a % kChains == kChains - 1)
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++)
#pragma GCC unroll 2
          for (int c = 0; c < kChains; c++) {
            const float32x4_t sv = lane_scales<kShift>(sc[r], k, a - (kChains - 1) + c, base);
#pragma GCC unroll 4
            for (int m = 0; m < MR; m++) {
              tot[m][r] = vfmaq_f32(tot[m][r], acc[m][r][c], sv);
              acc[m][r][c] = vdupq_n_f32(0.f);
            }
          }
  }
}

// Rows n .. n + NR - 1: sums[m * lds + r].
template <int MR, int NR, int kShift>
LOWBIT_TARGET_BF16 void tile(const RowsSetup& s, const uint16_t* x, int64_t ldx, const W4Operand& op, int64_t n,
                             float* sums, int64_t lds) {
  constexpr int C = kChains;
  const GemvPrefetch prefetch = s.prefetch.rows_on(n - s.n0);
  const uint8_t* codes = op.codes + n * s.rb;
  float32x4_t acc[MR][NR][C], tot[MR][NR];
  for (int m = 0; m < MR; m++)
    for (int r = 0; r < NR; r++) {
      tot[m][r] = vdupq_n_f32(0.f);
      for (int c = 0; c < C; c++) acc[m][r][c] = vdupq_n_f32(0.f);
    }
  float sc[NR][kWindowGroups + 1], off[NR][kWindowGroups];  // +1: the pair a group-16 lane pair loads
  for (int64_t w0 = 0; w0 < s.Kp; w0 += s.window) {
    const int64_t base = w0 / s.group, count = std::min(kWindowGroups, s.G - base);  // per channel: group Kp
    for (int r = 0; r < NR; r++) {
      const int64_t i = (n + r) * op.G + base;
      decode_floats(op.scale_enc, op.scale, i, count, kWindowGroups + 1, sc[r]);
      if (!s.offsets) continue;
      if (op.offset_kind == W4Offset::Bias) {
        decode_floats(op.scale_enc, op.offset, i, count, kWindowGroups, off[r]);
      } else {  // w = (value - zp) * scale: the offset is -(zp * scale)
        const int8_t* zp = static_cast<const int8_t*>(op.offset) + i;
        for (int64_t j = 0; j < count; j++) off[r][j] = -(float(zp[j]) * sc[r][j]);
        std::fill(off[r] + count, off[r] + kWindowGroups, 0.f);
      }
      // the window's offsets times the groups' sums of x (zero past the last group: w4_bf16_group_sums)
      for (int m = 0; m < MR; m++) {
        const float* xs = reinterpret_cast<const float*>(x + m * ldx + s.Kp) + base;
        for (int64_t j = 0; j < count; j += 4)
          tot[m][r] = vfmaq_f32(tot[m][r], vld1q_f32(off[r] + j), vld1q_f32(xs + j));
      }
    }
    const int64_t w1 = std::min(s.Kp, w0 + s.window);
    for (int64_t g0 = w0; g0 < w1; g0 += kShift > 0 ? w1 - w0 : s.group) {  // one group at a time (large groups)
      const int64_t g1 = std::min(w1, g0 + (kShift > 0 ? w1 - w0 : s.group));
      for (int64_t k = g0; k < g1; k += kW4Bf16Step) {
        for (int r = 0; r < NR; r++) __builtin_prefetch(prefetch(r, k / 2));
        if (k < s.full) {
          step<MR, NR, kShift>(acc, tot, x, ldx, codes + k / 2, s.rb, s.vb, k, sc, base);
          continue;
        }
        uint8_t tail[NR][kW4Bf16Step / 2] = {};  // the last, partial step: never read past a row (x is zero there)
        for (int r = 0; r < NR; r++) std::memcpy(tail[r], codes + r * s.rb + k / 2, size_t(s.rb - k / 2));
        step<MR, NR, kShift>(acc, tot, x, ldx, tail[0], kW4Bf16Step / 2, s.vb, k, sc, base);
      }
      if constexpr (kShift == 0)
        for (int r = 0; r < NR; r++) {
          const float scale = sc[r][(g0 - w0) / s.group];
          for (int m = 0; m < MR; m++) {
            float32x4_t a = acc[m][r][0];
            for (int c = 1; c < C; c++) a = vaddq_f32(a, acc[m][r][c]);
            tot[m][r] = vfmaq_n_f32(tot[m][r], a, scale);
            for (int c = 0; c < C; c++) acc[m][r][c] = vdupq_n_f32(0.f);
          }
        }
    }
  }
  for (int m = 0; m < MR; m++)
    for (int r = 0; r < NR; r++) sums[m * lds + r] = vaddvq_f32(tot[m][r]);
}

// Rows [n0, n1) in tiles of NR rows, one setup for them; the rows left in tiles of fewer rows.
template <int MR, int NR, int kShift>
LOWBIT_TARGET_BF16 void rows_t(const uint16_t* x, int64_t ldx, const W4Operand& op, int64_t n0, int64_t n1,
                               float* sums, int64_t lds) {
  int64_t n = n0;
  if (n1 - n0 >= NR) {
    const RowsSetup s(op, n0, NR);
    for (; n + NR <= n1; n += NR) tile<MR, NR, kShift>(s, x, ldx, op, n, sums + (n - n0), lds);
  }
  if constexpr (NR > 1)
    if (n < n1) rows_t<MR, NR - 1, kShift>(x, ldx, op, n, n1, sums + (n - n0), lds);
}

using RowsFn = void (*)(const uint16_t*, int64_t, const W4Operand&, int64_t, int64_t, float*, int64_t);

// One activation row: 4 weight rows per tile share its activations; more rows: fewer weight rows, so that the
// accumulators (MR x NR x 2) stay in the 32 registers.
template <int kShift>
constexpr RowsFn kRows[kMaxTileRows] = {&rows_t<1, 4, kShift>, &rows_t<2, 2, kShift>, &rows_t<3, 2, kShift>,
                                        &rows_t<4, 1, kShift>};

void gemv_rows_bf16(int mr, const uint16_t* x, int64_t ldx, const W4Operand& op, int64_t n0, int64_t n1, float* sums,
                    int64_t lds) {
  if (n1 <= n0) return;
  const int64_t group = op.G <= 1 ? 0 : op.group;
  const RowsFn* rows = group == 16 ? kRows<4> : group == 32 ? kRows<5> : group == 64 ? kRows<6> : kRows<0>;
  rows[mr - 1](x, ldx, op, n0, n1, sums, lds);
}

// W4Kernels::pack_bf16_row: vld4 of 32 words puts words 4 i + j in register j, positions 32 j + 8 c.. of the step's
// c-th 32 words; the group sums add the words widened to fp32 (a bf16 word is its float's high half).
LOWBIT_TARGET_BF16 void pack_bf16_row(const uint16_t* x, int64_t K, int64_t group, int64_t group_sums, uint16_t* dst) {
  const int64_t Kp = w4_bf16_padded(K);
  for (int64_t k = 0; k < Kp; k += kW4Bf16Step)
    for (int c = 0; c < 4; c++) {
      const int64_t at = k + 32 * c, left = K - at;
      uint16_t tmp[32] = {};
      if (left > 0 && left < 32) std::memcpy(tmp, x + at, size_t(left) * 2);
      const uint16x8x4_t v = vld4q_u16(left >= 32 ? x + at : tmp);
      for (int j = 0; j < 4; j++) vst1q_u16(dst + k + 32 * j + 8 * c, v.val[j]);
    }
  if (group_sums == 0) return;
  float* sums = reinterpret_cast<float*>(dst + Kp);
  int64_t g = 0;
  for (int64_t k0 = 0; k0 < K; k0 += group, g++) {
    const int64_t k1 = std::min(K, k0 + group);
    float32x4_t acc = vdupq_n_f32(0.f);
    int64_t k = k0;
    for (; k + 4 <= k1; k += 4) acc = vaddq_f32(acc, vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(x + k), 16)));
    float t = vaddvq_f32(acc);
    for (; k < k1; k++) t += w4_bf16_float(x[k]);
    sums[g] = t;
  }
  for (; g < group_sums; g++) sums[g] = 0.f;
}

}  // namespace

// The bf16 set's 4-bit kernels: the NEON ones (base) with the bf16 GEMV and its pack.
W4Kernels w4_kernels_bf16(const W4Kernels& base) {
  W4Kernels k = base;
  k.gemv_bf16_takes = &w4_bf16_tile_takes;
  k.gemv_rows_bf16 = &gemv_rows_bf16;
  k.pack_bf16_row = &pack_bf16_row;
  return k;
}

}  // namespace lowbit::cpu
