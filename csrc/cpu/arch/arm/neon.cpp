// The NEON kernel set (Advanced SIMD, in every aarch64 CPU: Apple silicon, Graviton, Ampere, Grace): fp8 GEMV
// tiles and decodes by integer widening to fp16 and fp32 FMA, int8 GEMV tiles on widening multiplies, the
// transposed products' row loop and the streaming read. The int8 GEMM micro-tile and int8_quantize are the
// portable set's (the compiler vectorizes them for NEON).
#include <arm_neon.h>

#include <cstring>

#include "cpu/arch/arm/target.h"
#include "cpu/arch/kernel_set.h"
#include "cpu/fp8_simd.h"
#include "cpu/gemv_prefetch.h"

namespace lowbit::cpu {

extern const W4Kernels kW4KernelsNeon;  // w4_neon.cpp

const KernelSet& kernel_set_portable();

namespace {
namespace fp8 {

// 16 codes -> the 8 even ones and the 8 odd ones as dec(code) / 256, exactly: as avx2::decode_chunk, each code in
// the high byte of a 16-bit lane, shifted right by one (arithmetic) to sign|exp|mant of a half, the copy of the
// sign at bit 14 cleared; fcvtl converts half subnormals exactly.
inline void decode16(uint8x16_t b, float32x4_t even[2], float32x4_t odd[2]) {
  const int16x8_t w = vreinterpretq_s16_u8(b), mask = vdupq_n_s16(int16_t(0xBF80));
  const float16x8_t he = vreinterpretq_f16_s16(vandq_s16(vshrq_n_s16(vshlq_n_s16(w, 8), 1), mask));
  const float16x8_t ho = vreinterpretq_f16_s16(vandq_s16(vshrq_n_s16(w, 1), mask));
  even[0] = vcvt_f32_f16(vget_low_f16(he));
  even[1] = vcvt_high_f32_f16(he);
  odd[0] = vcvt_f32_f16(vget_low_f16(ho));
  odd[1] = vcvt_high_f32_f16(ho);
}

// 32 codes -> 8 vectors of 4 floats in kChunkOrder (positions 0..15 the even codes, 16..31 the odd ones) without a
// shuffle. NaN codes decode to 480 / 256: nan_acc, the byte-wise max of (code | 0x80), is 0xFF somewhere iff the
// chunk holds one.
inline void decode_chunk(const uint8_t* code, float32x4_t d[8], uint8x16_t& nan_acc) {
  const uint8x16_t b0 = vld1q_u8(code), b1 = vld1q_u8(code + 16);
  const uint8x16_t sign = vdupq_n_u8(0x80);  // each code | 0x80 before the max: 0x7F must not lose to 0x80
  nan_acc = vmaxq_u8(nan_acc, vmaxq_u8(vorrq_u8(b0, sign), vorrq_u8(b1, sign)));
  decode16(b0, d, d + 4);
  decode16(b1, d + 2, d + 6);
}

inline bool has_nan(uint8x16_t nan_acc) { return vmaxvq_u8(nan_acc) == 0xFF; }

// the last, partial chunk of a segment, through a zero-padded copy (never read past a weight row)
inline void decode_tail(const uint8_t* code, int64_t n, float32x4_t d[8], uint8x16_t& nan_acc) {
  uint8_t tmp[kChunk] = {};
  std::memcpy(tmp, code, size_t(n));
  decode_chunk(tmp, d, nan_acc);
}

template <int MR, int NR>
inline __attribute__((always_inline)) void fma_rows(float32x4_t (&acc)[MR][NR], int r, const float32x4_t d[8],
                                                    const float* xs, int64_t ldx, int64_t p) {
  for (int m = 0; m < MR; m++) {
    const float* xp = xs + m * ldx + p;
    float32x4_t a = acc[m][r];
    for (int q = 0; q < 8; q++) a = vfmaq_f32(a, vld1q_f32(xp + 4 * q), d[q]);
    acc[m][r] = a;
  }
}

// As the x86 tiles: x rows stay in L1, weight rows stream from memory once per tile, each decoded chunk feeds all
// MR activation rows; NaN codes tracked for the whole tile, the rare tile holding one finds its rows afterwards.
template <int MR, int NR, bool kBlock>
void gemv_tile_t(const float* x, int64_t ldx, const uint8_t* w, int64_t K, const float* const* bscale,
                 const KSegments& seg, float* sums, bool* nan) {
  const GemvPrefetch prefetch(w, K, NR);
  float32x4_t tot[MR][NR];
  for (int m = 0; m < MR; m++)
    for (int r = 0; r < NR; r++) tot[m][r] = vdupq_n_f32(0.f);
  uint8x16_t nan_acc = vdupq_n_u8(0);
  for (int64_t s = 0; s < seg.count; s++) {
    const int64_t k0 = seg.begin(s), n = seg.size(s), full = n / kChunk * kChunk;
    const float* xs = x + s * seg.padded;
    float32x4_t acc[MR][NR];
    for (int m = 0; m < MR; m++)
      for (int r = 0; r < NR; r++) acc[m][r] = vdupq_n_f32(0.f);
    for (int64_t k = 0; k < full; k += kChunk) {
      if ((k & 63) == 0)  // each weight row its own stream (gemv_prefetch.h)
        for (int r = 0; r < NR; r++) __builtin_prefetch(prefetch(r, k0 + k));
      for (int r = 0; r < NR; r++) {
        float32x4_t d[8];
        decode_chunk(w + r * K + k0 + k, d, nan_acc);
        fma_rows<MR, NR>(acc, r, d, xs, ldx, k);
      }
    }
    if (full < n)
      for (int r = 0; r < NR; r++) {
        float32x4_t d[8];
        decode_tail(w + r * K + k0 + full, n - full, d, nan_acc);
        fma_rows<MR, NR>(acc, r, d, xs, ldx, full);
      }
    for (int m = 0; m < MR; m++)
      for (int r = 0; r < NR; r++) tot[m][r] = kBlock ? vfmaq_n_f32(tot[m][r], acc[m][r], bscale[r][s]) : acc[m][r];
  }
  for (int m = 0; m < MR; m++)
    for (int r = 0; r < NR; r++) sums[m * NR + r] = vaddvq_f32(tot[m][r]);
  if (has_nan(nan_acc))
    for (int r = 0; r < NR; r++) nan[r] = nan[r] || has_nan_code(w + r * K, K);
}

struct FloatTiles {  // this file's tile family, for pick_gemv_tile
  template <int MR, int NR, bool kBlock>
  static constexpr Fp8GemvTileFn get() { return &gemv_tile_t<MR, NR, kBlock>; }
};

void gemv_tile(int mr, int nr, const float* x, int64_t ldx, const uint8_t* w, int64_t K, const float* const* bscale,
               const KSegments& seg, float* sums, bool* nan) {
  pick_gemv_tile<Fp8GemvTileFn, FloatTiles>(bscale != nullptr, mr, nr)(x, ldx, w, K, bscale, seg, sums, nan);
}

void decode_rows(const uint8_t* w, int64_t K, int64_t nrows, int64_t k0, int64_t n, float* dst, int64_t ldd,
                 bool* nan) {
  const int64_t full = n / kChunk * kChunk;
  for (int64_t r = 0; r < nrows; r++) {
    const uint8_t* src = w + r * K + k0;
    float* d = dst + r * ldd;
    uint8x16_t nan_acc = vdupq_n_u8(0);
    float32x4_t v[8];
    for (int64_t k = 0; k < full; k += kChunk) {
      decode_chunk(src + k, v, nan_acc);
      for (int q = 0; q < 8; q++) vst1q_f32(d + k + 4 * q, v[q]);
    }
    if (full < n) {
      decode_tail(src + full, n - full, v, nan_acc);
      for (int q = 0; q < 8; q++) vst1q_f32(d + full + 4 * q, v[q]);
    }
    nan[r] = nan[r] || has_nan(nan_acc);
  }
}

// 4 values to bf16, rounded to nearest even like c10::BFloat16 (every NaN becomes 0x7FC0)
inline uint16x4_t to_bf16(float32x4_t v) {
  const uint32x4_t b = vreinterpretq_u32_f32(v);
  const uint32x4_t odd = vandq_u32(vshrq_n_u32(b, 16), vdupq_n_u32(1));
  const uint16x4_t r = vshrn_n_u32(vaddq_u32(b, vaddq_u32(odd, vdupq_n_u32(0x7FFF))), 16);
  const uint16x4_t is_nan = vmovn_u32(vmvnq_u32(vceqq_f32(v, v)));
  return vbsl_u16(is_nan, vdup_n_u16(0x7FC0), r);
}

// fp8_dequantize, 16 codes a step in natural order (each code widened into the high byte of a 16-bit lane), one
// rounding of dec * scale, NaN codes (decoded as 480 / 256) made NaN; fcvtn rounds to nearest even and keeps a NaN's
// sign and top payload, like c10::Half.
void dequantize_run(const uint8_t* code, int64_t n, float scale, void* out, DequantOut kind) {
  const int64_t full = n / 16 * 16;
  const float32x4_t unscale = vdupq_n_f32(kDecodeUnscale), s = vdupq_n_f32(scale);
  const float32x4_t nan_decoded = vdupq_n_f32(480.f / kDecodeUnscale), qnan = vdupq_n_f32(__builtin_nanf(""));
  const int16x8_t mask = vdupq_n_s16(int16_t(0xBF80));
  for (int64_t k = 0; k < full; k += 16) {
    const uint8x16_t b = vld1q_u8(code + k);
    float32x4_t v[4];
    for (int h = 0; h < 2; h++) {
      const uint16x8_t wide = vshll_n_u8(h == 0 ? vget_low_u8(b) : vget_high_u8(b), 8);
      const float16x8_t half = vreinterpretq_f16_s16(vandq_s16(vshrq_n_s16(vreinterpretq_s16_u16(wide), 1), mask));
      v[2 * h] = vcvt_f32_f16(vget_low_f16(half));
      v[2 * h + 1] = vcvt_high_f32_f16(half);
    }
    for (int q = 0; q < 4; q++)
      v[q] = vbslq_f32(vceqq_f32(vabsq_f32(v[q]), nan_decoded), qnan, vmulq_f32(vmulq_f32(v[q], unscale), s));
    switch (kind) {
      case DequantOut::F32:
        for (int q = 0; q < 4; q++) vst1q_f32(static_cast<float*>(out) + k + 4 * q, v[q]);
        break;
      case DequantOut::BF16:
        for (int q = 0; q < 4; q++) vst1_u16(static_cast<uint16_t*>(out) + k + 4 * q, to_bf16(v[q]));
        break;
      case DequantOut::F16:
        for (int q = 0; q < 4; q++)
          vst1_u16(static_cast<uint16_t*>(out) + k + 4 * q, vreinterpret_u16_f16(vcvt_f16_f32(v[q])));
        break;
    }
  }
  dequantize_run_portable(code + full, n - full, scale, static_cast<uint8_t*>(out) + full * element_size(kind), kind);
}

}  // namespace fp8

// int8 GEMV tiles: smull / smull2 give the exact int16 products of 8 byte pairs (|-128 * -128| fits), sadalp adds
// adjacent pairs of them into the int32 lanes.
namespace int8 {

constexpr int kStep = 16;

template <int MR, int NR>
inline __attribute__((always_inline)) void gemv_step(int32x4_t (&acc)[MR][NR], const int8_t* const* xp,
                                                     const int8_t* const* wp) {
  int8x16_t xv[MR];
  for (int m = 0; m < MR; m++) xv[m] = vld1q_s8(xp[m]);
  for (int r = 0; r < NR; r++) {
    const int8x16_t wv = vld1q_s8(wp[r]);
    for (int m = 0; m < MR; m++) {
      acc[m][r] = vpadalq_s16(acc[m][r], vmull_s8(vget_low_s8(xv[m]), vget_low_s8(wv)));
      acc[m][r] = vpadalq_s16(acc[m][r], vmull_high_s8(xv[m], wv));
    }
  }
}

template <int MR, int NR>
void gemv_tile_t(const int8_t* x, const int8_t* w, int64_t K, int32_t* out) {
  int32x4_t acc[MR][NR];
  for (int m = 0; m < MR; m++)
    for (int r = 0; r < NR; r++) acc[m][r] = vdupq_n_s32(0);
  const int8_t* xp[MR];
  const int8_t* wp[NR];
  const int64_t full = K / kStep * kStep;
  for (int64_t k = 0; k < full; k += kStep) {
    int8_tile_rows_at(x, w, K, k, xp, wp);
    gemv_step<MR, NR>(acc, xp, wp);
  }
  if (full < K) {
    int8_t xt[MR][kStep], wt[NR][kStep];
    int8_tile_rows_padded(x, w, K, full, xt, wt, xp, wp);
    gemv_step<MR, NR>(acc, xp, wp);
  }
  for (int m = 0; m < MR; m++)
    for (int r = 0; r < NR; r++) out[m * NR + r] = vaddvq_s32(acc[m][r]);
}

struct NeonTiles {
  template <int MR, int NR>
  static constexpr Int8GemvTileFn get() { return &gemv_tile_t<MR, NR>; }
};

void gemv_tile(int mr, int nr, const int8_t* x, const int8_t* w, int64_t K, int32_t* acc) {
  run_int8_gemv_tile<NeonTiles>(mr, nr, x, w, K, acc);
}

}  // namespace int8

void axpy_rows(int64_t mr, const float* c, const float* v, int64_t n, float* acc, int64_t lda) {
  const int64_t full = n / 16 * 16;
  for (int64_t m = 0; m < mr; m++) {
    float* a = acc + m * lda;
    for (int64_t p = 0; p < full; p += 16)
      for (int q = 0; q < 16; q += 4) vst1q_f32(a + p + q, vfmaq_n_f32(vld1q_f32(a + p + q), vld1q_f32(v + p + q), c[m]));
    for (int64_t p = full; p < n; p++) a[p] += c[m] * v[p];
  }
}

uint64_t xor_words(const uint64_t* p, int64_t n) {
  uint64x2_t a0 = vdupq_n_u64(0), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    a0 = veorq_u64(a0, vld1q_u64(p + i));
    a1 = veorq_u64(a1, vld1q_u64(p + i + 2));
    a2 = veorq_u64(a2, vld1q_u64(p + i + 4));
    a3 = veorq_u64(a3, vld1q_u64(p + i + 6));
  }
  const uint64x2_t a = veorq_u64(veorq_u64(a0, a1), veorq_u64(a2, a3));
  uint64_t r = vgetq_lane_u64(a, 0) ^ vgetq_lane_u64(a, 1);
  for (; i < n; i++) r ^= p[i];
  return r;
}

}  // namespace

const KernelSet& kernel_set_neon() {
  const Int8Kernels& portable = kernel_set_portable().int8;
  static const KernelSet s{
      "neon",
      0,  // every aarch64 CPU
      Fp8Kernels{&fp8::gemv_tile, nullptr, &fp8::decode_rows, nullptr, &fp8::dequantize_run},
      Int8Kernels{&int8::gemv_tile, portable.group, portable.panel_rows, portable.strip, portable.gemm_micro,
                  portable.quantize_row},
      kW4KernelsNeon,
      &axpy_rows,
      &xor_words,
      false,
      nullptr,
  };
  return s;
}

}  // namespace lowbit::cpu
