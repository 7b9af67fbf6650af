// The bf16 kernel set (Armv8.6 FEAT_BF16: Apple M2 and later, Graviton 3+, Grace): the i8mm set with a GEMV tile
// for bf16 activations on bfdot -- the contract of x86's AVX-512 BF16 tile (fp8_kernels.h): fp8 codes decoded by
// table lookup straight to bf16 (exact: e4m3 values / 256 have at most 4 significant bits and a normal bf16
// exponent; NaN codes decode to NaN), bf16 x bf16 products summed in fp32, the activations' bf16 bits as they are
// (they never pass through half).
//
// The packed order is the x86 one, kBf16ChunkOrder (fp8_simd.h: chunks of 64, position p holds code
// 16 * (p % 32 / 8) + 8 * (p / 32) + p % 8), which the driver's packing shares with every set. It costs NEON
// nothing: 16 codes at 16q decode to two vectors of 8 bf16, codes 16q..16q+7 (positions 8q..8q+7) and codes
// 16q+8..16q+15 (positions 32+8q..), which zip1 / zip2 of the decoded low and high bytes give in that order.
//
// What Arm specifies for BFDOT (and BFMMLA, which is defined by the same pair step): without FEAT_EBF16, or with
// FPCR.EBF == 0 (Linux and macOS leave it 0), each lane adds a[2i] * b[2i] + a[2i+1] * b[2i+1] unfused: the two
// products are rounded to fp32 -- exact here, a product of two bf16 has at most 16 significant bits -- their sum
// is rounded, and that is added to the fp32 lane and rounded again, both roundings in the non-IEEE round-to-odd
// mode (an inexact result gets bit 0 set: at most 1 ulp off, not half an ulp), FPCR ignored; denormal inputs and
// results flushed to zero (as vdpbf16ps does: only below about 1e-38), only the default NaN generated (NaN codes
// still give NaN sums). With FEAT_EBF16 and FPCR.EBF == 1 the pair sum is fused and rounding follows FPCR (round
// to nearest): never worse. So each bfdot step errs by at most 2^-23 relative of its pair and of the lane's
// partial sum: over K / 8 steps per lane (two lanes chains per (m, r), 4 lanes each) and the final reductions,
// well inside the harness's fp32-accumulation bound (K + 8) * 2^-24 * 2 * sum |terms| (tests/cpu_harness).
// qemu-aarch64 (-cpu max) emulates exactly this: round-to-odd, flush-to-zero, default NaN.
//
// The GEMM regime: on Arm there is no AMX (amx_gemm stays false), so fp8_matmul.cpp's GEMM runs fp32 panels
// (decode_rows) in torch's fp32 GEMM and nothing calls decode_rows_bf16, which stays null.
#include <arm_neon.h>

#include <cstring>

#include "cpu/arch/arm/target.h"
#include "cpu/arch/kernel_set.h"
#include "cpu/fp8_simd.h"
#include "cpu/gemv_prefetch.h"

namespace lowbit::cpu {

const KernelSet& kernel_set_i8mm();
W4Kernels w4_kernels_bf16(const W4Kernels& base);  // w4_bf16.cpp

namespace {

// the high and low byte of the bf16 bits of dec(code) / 256, code < 128 (dec(0x7F) is NaN: 0x7FC0)
struct Bf16Tables {
  uint8_t hi[128];
  uint8_t lo[128];
  Bf16Tables() {
    for (int c = 0; c < 128; c++) {
      uint32_t u;
      std::memcpy(&u, &kFp8TableUnscaled[size_t(c)], sizeof(u));  // exact in bf16: the low 16 bits are zero
      hi[c] = uint8_t(u >> 24);
      lo[c] = uint8_t(u >> 16);
    }
  }
};
const Bf16Tables kBf16Tables;

struct Tables {
  uint8x16x4_t hi[2], lo[2];  // entries 0..63 and 64..127
};

inline Tables load_tables() {
  Tables t;
  for (int h = 0; h < 2; h++)
    for (int i = 0; i < 4; i++) {
      t.hi[h].val[i] = vld1q_u8(kBf16Tables.hi + 64 * h + 16 * i);
      t.lo[h].val[i] = vld1q_u8(kBf16Tables.lo + 64 * h + 16 * i);
    }
  return t;
}

// 16 codes -> their bf16 bits: d[0] codes 0..7, d[1] codes 8..15
LOWBIT_TARGET_BF16 inline __attribute__((always_inline)) void decode16(uint8x16_t b, const Tables& t,
                                                                     bfloat16x8_t d[2]) {
  const uint8x16_t idx = vandq_u8(b, vdupq_n_u8(0x7F)), idx_hi = veorq_u8(idx, vdupq_n_u8(0x40));
  // tbl: indices past 63 give 0; tbx: indices past 63 keep the lane (idx ^ 0x40 puts 64..127 at 0..63)
  const uint8x16_t hi = vorrq_u8(vqtbx4q_u8(vqtbl4q_u8(t.hi[0], idx), t.hi[1], idx_hi), vandq_u8(b, vdupq_n_u8(0x80)));
  const uint8x16_t lo = vqtbx4q_u8(vqtbl4q_u8(t.lo[0], idx), t.lo[1], idx_hi);
  d[0] = vreinterpretq_bf16_u8(vzip1q_u8(lo, hi));
  d[1] = vreinterpretq_bf16_u8(vzip2q_u8(lo, hi));
}

LOWBIT_TARGET_BF16 inline bfloat16x8_t load_bf16(const uint16_t* p) { return vreinterpretq_bf16_u16(vld1q_u16(p)); }

// one chunk of 64 codes of weight row r against MR activation rows at packed position p: two accumulators per
// (m, r), one per half of the chunk (a bfdot chain per tile row would stall on its latency)
template <int MR, int NR>
LOWBIT_TARGET_BF16 inline __attribute__((always_inline)) void dot_chunk(float32x4_t (&acc)[MR][NR][2], int r,
                                                                      const uint8_t* code, const Tables& t,
                                                                      const uint16_t* xs, int64_t ldx, int64_t p) {
  for (int q = 0; q < 4; q++) {
    bfloat16x8_t d[2];
    decode16(vld1q_u8(code + 16 * q), t, d);
    for (int m = 0; m < MR; m++) {
      const uint16_t* xp = xs + m * ldx + p;
      acc[m][r][0] = vbfdotq_f32(acc[m][r][0], d[0], load_bf16(xp + 8 * q));
      acc[m][r][1] = vbfdotq_f32(acc[m][r][1], d[1], load_bf16(xp + 32 + 8 * q));
    }
  }
}

template <int MR, int NR, bool kBlock>
LOWBIT_TARGET_BF16 void gemv_tile_bf16_t(const uint16_t* x, int64_t ldx, const uint8_t* w, int64_t K,
                                         const float* const* bscale, const KSegments& seg, float* sums) {
  const GemvPrefetch prefetch(w, K, NR);
  const Tables t = load_tables();
  float32x4_t tot[MR][NR];
  for (int m = 0; m < MR; m++)
    for (int r = 0; r < NR; r++) tot[m][r] = vdupq_n_f32(0.f);
  for (int64_t s = 0; s < seg.count; s++) {
    const int64_t k0 = seg.begin(s), n = seg.size(s), full = n / kBf16Chunk * kBf16Chunk;
    const uint16_t* xs = x + s * seg.padded;
    float32x4_t acc[MR][NR][2];
    for (int m = 0; m < MR; m++)
      for (int r = 0; r < NR; r++) acc[m][r][0] = acc[m][r][1] = vdupq_n_f32(0.f);
    for (int64_t k = 0; k < full; k += kBf16Chunk) {
      for (int r = 0; r < NR; r++)  // each weight row its own stream (gemv_prefetch.h)
        __builtin_prefetch(prefetch(r, k0 + k));
      for (int r = 0; r < NR; r++) dot_chunk<MR, NR>(acc, r, w + r * K + k0 + k, t, xs, ldx, k);
    }
    if (full < n)  // the last, partial chunk through a zero-padded copy: never read past a weight row
      for (int r = 0; r < NR; r++) {
        uint8_t tmp[kBf16Chunk] = {};
        std::memcpy(tmp, w + r * K + k0 + full, size_t(n - full));
        dot_chunk<MR, NR>(acc, r, tmp, t, xs, ldx, full);
      }
    for (int m = 0; m < MR; m++)
      for (int r = 0; r < NR; r++) {
        const float32x4_t a = vaddq_f32(acc[m][r][0], acc[m][r][1]);
        tot[m][r] = kBlock ? vfmaq_n_f32(tot[m][r], a, bscale[r][s]) : a;
      }
  }
  for (int m = 0; m < MR; m++)
    for (int r = 0; r < NR; r++) sums[m * NR + r] = vaddvq_f32(tot[m][r]);
}

using GemvBf16Fn = void (*)(const uint16_t*, int64_t, const uint8_t*, int64_t, const float* const*, const KSegments&,
                            float*);

struct Bf16Tiles {  // this file's tile family, for pick_gemv_tile
  template <int MR, int NR, bool kBlock>
  static constexpr GemvBf16Fn get() { return &gemv_tile_bf16_t<MR, NR, kBlock>; }
};

void gemv_tile_bf16(int mr, int nr, const uint16_t* x, int64_t ldx, const uint8_t* w, int64_t K,
                    const float* const* bscale, const KSegments& seg, float* sums, bool* /*nan: decoded as NaN*/) {
  pick_gemv_tile<GemvBf16Fn, Bf16Tiles>(bscale != nullptr, mr, nr)(x, ldx, w, K, bscale, seg, sums);
}

}  // namespace

const KernelSet& kernel_set_bf16() {
  const KernelSet& i8mm = kernel_set_i8mm();
  static const KernelSet s{
      "bf16",
      kFeatDotprod | kFeatI8mm | kFeatBf16,
      Fp8Kernels{i8mm.fp8.gemv_tile, &gemv_tile_bf16, i8mm.fp8.decode_rows, nullptr, i8mm.fp8.dequantize_run},
      i8mm.int8,
      w4_kernels_bf16(i8mm.w4),
      i8mm.axpy_rows,
      i8mm.xor_words,
      false,  // no AMX on Arm: the GEMM regimes run fp32 panels
      nullptr,
  };
  return s;
}

}  // namespace lowbit::cpu
