// The AVX-512 kernel set (F, BW, VL, VNNI, VBMI, BF16: Sapphire Rapids and later, Zen 4 and later; a CPU without
// BF16, such as Ice Lake, runs the AVX2 set). It needs no AVX-VNNI (Zen 4 has none): its byte dot products are
// AVX-512 VNNI's. AMX is a flag of this set: the GEMM regimes hand bf16 / int8 panels to oneDNN's AMX brgemm where
// torch can pack for it (brgemm.h); elsewhere the bf16 panels go to this set's own bf16 GEMM (vdpbf16ps).
//
// fp8 GEMV tiles, float activations: the AVX2 decode's half vectors converted 16 at a time (vcvtph2ps zmm), which
// drops the lane extracts and halves the conversions and FMAs per code. At batch 1 the decode bounds the AVX2 tile
// below memory bandwidth; this one keeps up with it.
#include <algorithm>
#include <cstring>

// GCC 12 warns about the undefined pass-through operand inside its own AVX-512 intrinsics headers
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include "cpu/arch/kernel_set.h"
#include "cpu/arch/x86/amx.h"
#include "cpu/arch/x86/avx512_sums.h"
#include "cpu/arch/x86/fp8_avx2.h"
#include "cpu/arch/x86/prefetch_hints.h"
#include "cpu/arch/x86/target.h"
#include "cpu/gemv_prefetch.h"

namespace lowbit::cpu {

extern const W4Kernels kW4KernelsAvx512, kW4KernelsAvx512Planes;  // w4_avx512.cpp

const KernelSet& kernel_set_avx2();

namespace {
namespace fp8 {

// 32 codes -> positions 0..15 and 16..31 of kChunkOrder (the even, then the odd codes), as dec(code) / 256.
LOWBIT_TARGET_AVX512 inline void decode_chunk(const uint8_t* code, __m512 out[2], __m256i& nan_acc) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(code));
  nan_acc = _mm256_max_epu8(nan_acc, _mm256_or_si256(b, _mm256_set1_epi8(char(0x80))));
  const __m256i mask = _mm256_set1_epi16(short(0xBF80));  // see avx2::decode_chunk
  out[0] = _mm512_cvtph_ps(_mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(b, 8), 1), mask));
  out[1] = _mm512_cvtph_ps(_mm256_and_si256(_mm256_srai_epi16(b, 1), mask));
}

LOWBIT_TARGET_AVX512 inline void decode_tail(const uint8_t* code, int64_t n, __m512 out[2], __m256i& nan_acc) {
  alignas(32) uint8_t tmp[kChunk] = {};
  std::memcpy(tmp, code, size_t(n));
  decode_chunk(tmp, out, nan_acc);
}

template <int MR, int NR>
LOWBIT_TARGET_AVX512 inline __attribute__((always_inline)) void fma_rows(__m512 (&acc)[MR][NR], int r,
                                                                         const __m512 d[2], const float* xs,
                                                                         int64_t ldx, int64_t p) {
  for (int m = 0; m < MR; m++) {
    const float* xp = xs + m * ldx + p;
    acc[m][r] = _mm512_fmadd_ps(_mm512_load_ps(xp + 16), d[1], _mm512_fmadd_ps(_mm512_load_ps(xp), d[0], acc[m][r]));
  }
}

template <int MR, int NR, bool kBlock>
LOWBIT_TARGET_AVX512 void gemv_tile_t(const float* x, int64_t ldx, const uint8_t* w, int64_t K,
                                      const float* const* bscale, const KSegments& seg, float* sums, bool* nan) {
  const GemvPrefetch prefetch(w, K, NR);
  __m512 tot[MR][NR];
  for (int m = 0; m < MR; m++)
    for (int r = 0; r < NR; r++) tot[m][r] = _mm512_setzero_ps();
  __m256i nan_acc[NR];
  for (int r = 0; r < NR; r++) nan_acc[r] = _mm256_setzero_si256();
  for (int64_t s = 0; s < seg.count; s++) {
    const int64_t k0 = seg.begin(s), n = seg.size(s), full = n / kChunk * kChunk;
    const float* xs = x + s * seg.padded;
    __m512 acc[MR][NR];
    for (int m = 0; m < MR; m++)
      for (int r = 0; r < NR; r++) acc[m][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < full; k += kChunk) {
      if ((k & 63) == 0)  // see the AVX2 tile, and kPrefetchHint
        for (int r = 0; r < NR; r++) _mm_prefetch(prefetch(r, k0 + k), kPrefetchHint);
      for (int r = 0; r < NR; r++) {
        __m512 d[2];
        decode_chunk(w + r * K + k0 + k, d, nan_acc[r]);
        fma_rows<MR, NR>(acc, r, d, xs, ldx, k);
      }
    }
    if (full < n)
      for (int r = 0; r < NR; r++) {
        __m512 d[2];
        decode_tail(w + r * K + k0 + full, n - full, d, nan_acc[r]);
        fma_rows<MR, NR>(acc, r, d, xs, ldx, full);
      }
    for (int m = 0; m < MR; m++)
      for (int r = 0; r < NR; r++)
        tot[m][r] = kBlock ? _mm512_fmadd_ps(_mm512_set1_ps(bscale[r][s]), acc[m][r], tot[m][r]) : acc[m][r];
  }
  for (int m = 0; m < MR; m++) store_row_sums<NR>(tot[m], sums + m * NR);
  for (int r = 0; r < NR; r++) nan[r] = nan[r] || avx2::has_nan_code(nan_acc[r]);
}

struct FloatTiles {  // this file's tile family, for pick_gemv_tile
  template <int MR, int NR, bool kBlock>
  static constexpr Fp8GemvTileFn get() { return &gemv_tile_t<MR, NR, kBlock>; }
};

void gemv_tile(int mr, int nr, const float* x, int64_t ldx, const uint8_t* w, int64_t K, const float* const* bscale,
               const KSegments& seg, float* sums, bool* nan) {
  pick_gemv_tile<Fp8GemvTileFn, FloatTiles>(bscale != nullptr, mr, nr)(x, ldx, w, K, bscale, seg, sums, nan);
}

// bf16 activations: a byte-permute table decode straight to bf16 (e4m3 values are exact in bf16; the two
// 128-entry tables give the high and low byte of dec(code & 0x7F) / 256, NaN for 0x7F) and bf16 dot products
// with fp32 accumulation (vdpbf16ps: the products of two bf16 are exact in fp32; like every AVX-512 BF16
// instruction it treats denormal inputs and results as zero, which matters only below 1e-38).
struct Bf16Tables {
  alignas(64) uint8_t hi[128];
  alignas(64) uint8_t lo[128];
  Bf16Tables() {
    for (int c = 0; c < 128; c++) {
      uint32_t u;
      std::memcpy(&u, &kFp8TableUnscaled[c], sizeof(u));  // exact in bf16: the low 16 bits are zero
      hi[c] = uint8_t(u >> 24);
      lo[c] = uint8_t(u >> 16);
    }
  }
};
const Bf16Tables kBf16Tables;

// 64 codes (n < 64: the rest read as code 0) -> two vectors of 32 bf16 words in kBf16ChunkOrder
LOWBIT_TARGET_AVX512BF16 inline void decode_bf16(const uint8_t* code, int64_t n, const __m512i t[4], __m512i out[2]) {
  const __m512i b = n >= kBf16Chunk ? _mm512_loadu_si512(code)
                                    : _mm512_maskz_loadu_epi8(_cvtu64_mask64((uint64_t(1) << n) - 1), code);
  const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t[0], b, t[1]), b,
                                               _mm512_set1_epi8(char(0x80)), 0xF8);  // hi | (b & 0x80): the sign
  const __m512i lo = _mm512_permutex2var_epi8(t[2], b, t[3]);
  out[0] = _mm512_unpacklo_epi8(lo, hi);
  out[1] = _mm512_unpackhi_epi8(lo, hi);
}

// two accumulators per (m, r): the bf16 dot product has a long latency, one chain per tile row would stall
template <int MR, int NR>
LOWBIT_TARGET_AVX512BF16 inline __attribute__((always_inline)) void dot_rows(__m512 (&acc)[MR][NR][2], int r,
                                                                             const __m512i d[2], const uint16_t* xs,
                                                                             int64_t ldx, int64_t p) {
  for (int m = 0; m < MR; m++) {
    const uint16_t* xp = xs + m * ldx + p;
    acc[m][r][0] = _mm512_dpbf16_ps(acc[m][r][0], (__m512bh)d[0], (__m512bh)_mm512_load_si512(xp));
    acc[m][r][1] = _mm512_dpbf16_ps(acc[m][r][1], (__m512bh)d[1], (__m512bh)_mm512_load_si512(xp + 32));
  }
}

template <int MR, int NR, bool kBlock>
LOWBIT_TARGET_AVX512BF16 void gemv_tile_bf16_t(const uint16_t* x, int64_t ldx, const uint8_t* w, int64_t K,
                                               const float* const* bscale, const KSegments& seg, float* sums) {
  const GemvPrefetch prefetch(w, K, NR);
  const __m512i t[4] = {_mm512_load_si512(kBf16Tables.hi), _mm512_load_si512(kBf16Tables.hi + 64),
                        _mm512_load_si512(kBf16Tables.lo), _mm512_load_si512(kBf16Tables.lo + 64)};
  __m512 tot[MR][NR];
  for (int m = 0; m < MR; m++)
    for (int r = 0; r < NR; r++) tot[m][r] = _mm512_setzero_ps();
  for (int64_t s = 0; s < seg.count; s++) {
    const int64_t k0 = seg.begin(s), n = seg.size(s);
    const uint16_t* xs = x + s * seg.padded;
    __m512 acc[MR][NR][2];
    for (int m = 0; m < MR; m++)
      for (int r = 0; r < NR; r++) acc[m][r][0] = acc[m][r][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < n; k += kBf16Chunk) {
      for (int r = 0; r < NR; r++)  // see gemv_prefetch.h, and kOuterPrefetchHint
        _mm_prefetch(prefetch(r, k0 + k), kOuterPrefetchHint);
      for (int r = 0; r < NR; r++) {
        __m512i d[2];
        decode_bf16(w + r * K + k0 + k, n - k, t, d);
        dot_rows<MR, NR>(acc, r, d, xs, ldx, k);
      }
    }
    for (int m = 0; m < MR; m++)
      for (int r = 0; r < NR; r++) {
        const __m512 a = _mm512_add_ps(acc[m][r][0], acc[m][r][1]);
        tot[m][r] = kBlock ? _mm512_fmadd_ps(_mm512_set1_ps(bscale[r][s]), a, tot[m][r]) : a;
      }
  }
  for (int m = 0; m < MR; m++) store_row_sums<NR>(tot[m], sums + m * NR);
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

LOWBIT_TARGET_AVX512BF16 void decode_rows_bf16(const uint8_t* w, int64_t K, int64_t nrows, int64_t k0, int64_t n,
                                               uint16_t* dst, int64_t ldd) {
  const __m512i t[4] = {_mm512_load_si512(kBf16Tables.hi), _mm512_load_si512(kBf16Tables.hi + 64),
                        _mm512_load_si512(kBf16Tables.lo), _mm512_load_si512(kBf16Tables.lo + 64)};
  for (int64_t r = 0; r < nrows; r++)
    for (int64_t k = 0; k < n; k += kBf16Chunk) {
      // the next row, a page away at K = 4096 where the hardware prefetchers stop (see the GEMV tiles); past the
      // last row this touches whatever follows, which a prefetch may (it never faults)
      _mm_prefetch(reinterpret_cast<const char*>(w + (r + 1) * K + k0 + k), kPrefetchHint);
      __m512i d[2];
      decode_bf16(w + r * K + k0 + k, n - k, t, d);
      _mm512_storeu_si512(dst + r * ldd + k, d[0]);
      _mm512_storeu_si512(dst + r * ldd + k + 32, d[1]);
    }
}

}  // namespace fp8

namespace int8 {

// The same 6-row tile on 512-bit vectors: 6 x 32 activation rows, 12 vpdpbusd of 64 products each per 4 k.
LOWBIT_TARGET_AVX512VNNI void gemm_micro(const void* panel_, int64_t ldp, const void* xs_, int64_t len, int32_t* tile,
                                         bool accumulate) {
  const auto* panel = static_cast<const uint8_t*>(panel_);
  const auto* xs = static_cast<const int8_t*>(xs_);
#define LOWBIT_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define LOWBIT_INIT(R)                                                                          \
  __m512i c##R##a = accumulate ? _mm512_loadu_si512(tile + R * 32) : _mm512_setzero_si512();     \
  __m512i c##R##b = accumulate ? _mm512_loadu_si512(tile + R * 32 + 16) : _mm512_setzero_si512(); \
  const uint8_t* p##R = panel + R * ldp;
#define LOWBIT_DOT(R)                                    \
  std::memcpy(&quad, p##R + k, sizeof(quad));            \
  a = _mm512_set1_epi32(quad);                           \
  c##R##a = _mm512_dpbusd_epi32(c##R##a, a, b0);         \
  c##R##b = _mm512_dpbusd_epi32(c##R##b, a, b1);
#define LOWBIT_STORE(R)                                  \
  _mm512_storeu_si512(tile + R * 32, c##R##a);           \
  _mm512_storeu_si512(tile + R * 32 + 16, c##R##b);
  LOWBIT_ROWS(LOWBIT_INIT)
  for (int64_t k = 0; k < len; k += 4) {
    const __m512i b0 = _mm512_load_si512(xs + k * 32);
    const __m512i b1 = _mm512_load_si512(xs + k * 32 + 64);
    int32_t quad;
    __m512i a;
    LOWBIT_ROWS(LOWBIT_DOT)
  }
  LOWBIT_ROWS(LOWBIT_STORE)
#undef LOWBIT_ROWS
#undef LOWBIT_INIT
#undef LOWBIT_DOT
#undef LOWBIT_STORE
}

// GEMV tiles on 512-bit byte dot products. vpdpbusd multiplies unsigned by signed bytes: each weight vector is
// made unsigned by flipping its sign bit (w + 128) and x is the signed operand, so the sums hold 128 * sum_k x[m, k]
// too, which the same instruction counts (against ones) and the tile subtracts, modulo 2^32 (exact: the true sum
// fits). One load, one xor and one dot product per 64 weight bytes and x row leave the loop bound by memory;
// each weight row is its own stream of whole 4 KB pages (K = 4096), where the hardware prefetchers stop, so each
// stream is fetched ahead (gemv_prefetch.h), a line per row per step, with the outer-level hint: it streamed a few
// percent closer to the read bandwidth than the L1 hint at 2 and at 16 threads.
// acc[m][r] += the 64 products at k of x row m and weight row r (w + 128), xsum[m] += x's 64 values; bytes off
// `mask` load as 0 (weights then flip to 128, against x's zeros: no product)
template <int MR, int NR>
LOWBIT_TARGET_AVX512VNNI inline __attribute__((always_inline)) void gemv_vnni_step(
    __m512i (&acc)[MR][NR], __m512i (&xsum)[MR], const int8_t* x, const int8_t* w, int64_t K, int64_t k, __mmask64 mask) {
  const __m512i flip = _mm512_set1_epi8(char(0x80)), ones = _mm512_set1_epi8(1);
  __m512i xv[MR];
  for (int m = 0; m < MR; m++) {
    xv[m] = _mm512_maskz_loadu_epi8(mask, x + m * K + k);
    xsum[m] = _mm512_dpbusd_epi32(xsum[m], ones, xv[m]);
  }
  for (int r = 0; r < NR; r++) {
    const __m512i wv = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, w + r * K + k), flip);
    for (int m = 0; m < MR; m++) acc[m][r] = _mm512_dpbusd_epi32(acc[m][r], wv, xv[m]);
  }
}

template <int MR, int NR>
LOWBIT_TARGET_AVX512VNNI void gemv_tile_vnni_t(const int8_t* x, const int8_t* w, int64_t K, int32_t* out) {
  const GemvPrefetch prefetch(w, K, NR);
  __m512i acc[MR][NR], xsum[MR];
  for (int m = 0; m < MR; m++) {
    xsum[m] = _mm512_setzero_si512();
    for (int r = 0; r < NR; r++) acc[m][r] = _mm512_setzero_si512();
  }
  const int64_t full = K / 64 * 64;
  for (int64_t k = 0; k < full; k += 64) {
    for (int r = 0; r < NR; r++) _mm_prefetch(prefetch(r, k), kOuterPrefetchHint);
    gemv_vnni_step<MR, NR>(acc, xsum, x, w, K, k, ~__mmask64(0));
  }
  if (full < K) gemv_vnni_step<MR, NR>(acc, xsum, x, w, K, full, (__mmask64(1) << (K - full)) - 1);
  for (int m = 0; m < MR; m++) {
    const uint32_t offset = 128u * uint32_t(_mm512_reduce_add_epi32(xsum[m]));
    for (int r = 0; r < NR; r++) out[m * NR + r] = int32_t(uint32_t(_mm512_reduce_add_epi32(acc[m][r])) - offset);
  }
}

struct Avx512VnniTiles {
  template <int MR, int NR>
  static constexpr Int8GemvTileFn get() { return &gemv_tile_vnni_t<MR, NR>; }
};

void gemv_tile(int mr, int nr, const int8_t* x, const int8_t* w, int64_t K, int32_t* acc) {
  run_int8_gemv_tile<Avx512VnniTiles>(mr, nr, x, w, K, acc);
}

}  // namespace int8

// Transposes 16 rows of 16 32-bit lanes in place: r[j] lane i = r[i] lane j. Unpacks within 128-bit lanes give
// each lane four rows of one column; two 128-bit shuffles then gather a column's four lanes.
LOWBIT_TARGET_AVX512 inline void transpose16x16(__m512i (&r)[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // u[4 q + c], 128-bit lane l: column 4 l + c of rows 4 q .. 4 q + 3
  for (int q = 0; q < 16; q += 4) {
    u[q] = _mm512_unpacklo_epi64(t[q], t[q + 2]);
    u[q + 1] = _mm512_unpackhi_epi64(t[q], t[q + 2]);
    u[q + 2] = _mm512_unpacklo_epi64(t[q + 1], t[q + 3]);
    u[q + 3] = _mm512_unpackhi_epi64(t[q + 1], t[q + 3]);
  }
  for (int c = 0; c < 4; c++) {
    const __m512i a0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), a1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i b0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i b1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(a0, b0, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(a0, b0, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(a1, b1, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(a1, b1, 0xDD);
  }
}

namespace bf16_gemm {
// kernel_set.h's Bf16GemmFn. Register tile: R rows of A times V vectors of 16 columns of B; each k pair loads V B
// vectors and R pairs of A for R x V dot products (vdpbf16ps, as the GEMV tiles). The plain product's tile is 6 x 4:
// 24 accumulators beside the 4 B vectors and a broadcast A pair; with scales too. The tiles go through K in blocks of
// kDepth, each block's B (kDepth / 2 rows of 64 columns: 32 KB) read from L1 by every tile row of A.
constexpr int kTileRows = 6, kTileVecs = 4;
constexpr int64_t kDepth = 256;

// Every loop over a tile is unrolled before GCC's scalar replacement, which then keeps the accumulators in
// registers (without, GCC 12 stores them to the stack on every k step from 4 x 4 up).
template <int V>
LOWBIT_TARGET_AVX512BF16 inline __attribute__((always_inline)) void column_masks(__mmask16 last, __mmask16 (&mask)[V]) {
#pragma GCC unroll 8
  for (int v = 0; v < V; v++) mask[v] = v == V - 1 ? last : __mmask16(0xFFFF);
}

// acc (+)= A[:, k0:k1] B[k0:k1, :] for the tile's rows and columns
template <int R, int V>
LOWBIT_TARGET_AVX512BF16 inline __attribute__((always_inline)) void dot_steps(
    __m512 (&acc)[R][V], int64_t k0, int64_t k1, const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb,
    const __mmask16 (&mask)[V]) {
  for (int64_t k = k0; k < k1; k += 2) {
    const uint16_t* b = B + k * ldb;  // VNNI row k / 2
    __m512i bv[V];
#pragma GCC unroll 8
    for (int v = 0; v < V; v++) bv[v] = _mm512_maskz_loadu_epi32(mask[v], b + 32 * v);
#pragma GCC unroll 8
    for (int i = 0; i < R; i++) {
      int32_t pair;
      std::memcpy(&pair, A + i * lda + k, sizeof(pair));
      const __m512i a = _mm512_set1_epi32(pair);
#pragma GCC unroll 8
      for (int v = 0; v < V; v++) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], (__m512bh)a, (__m512bh)bv[v]);
    }
  }
}

template <int R, int V>
LOWBIT_TARGET_AVX512BF16 inline __attribute__((always_inline)) void load_or_zero(__m512 (&t)[R][V], bool add,
                                                                                  const float* C, int64_t ldc,
                                                                                  const __mmask16 (&mask)[V]) {
#pragma GCC unroll 8
  for (int i = 0; i < R; i++)
#pragma GCC unroll 8
    for (int v = 0; v < V; v++)
      t[i][v] = add ? _mm512_maskz_loadu_ps(mask[v], C + i * ldc + 16 * v) : _mm512_setzero_ps();
}

template <int R, int V>
LOWBIT_TARGET_AVX512BF16 inline __attribute__((always_inline)) void store(const __m512 (&t)[R][V], float* C,
                                                                           int64_t ldc, const __mmask16 (&mask)[V]) {
#pragma GCC unroll 8
  for (int i = 0; i < R; i++)
#pragma GCC unroll 8
    for (int v = 0; v < V; v++) _mm512_mask_storeu_ps(C + i * ldc + 16 * v, mask[v], t[i][v]);
}

// What the scaled tiles read beside the operands (see Bf16GemmFn): k0, k1 the depth block, seg the segment length.
struct Segments {
  int64_t k0, k1, seg;
  const float* const* scales;
};

template <int R, int V>
LOWBIT_TARGET_AVX512BF16 void tile(int64_t K, const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, float* C,
                                   int64_t ldc, bool add, __mmask16 last) {
  __mmask16 mask[V];
  column_masks<V>(last, mask);
  __m512 acc[R][V];
  load_or_zero<R, V>(acc, add, C, ldc, mask);
  dot_steps<R, V>(acc, 0, K, A, lda, B, ldb, mask);
  store<R, V>(acc, C, ldc, mask);
}

// Segment by segment: C += scale_i(s) * (the segment's sums of row i), C read and written at each segment's end (in
// L1: the registers hold one segment's sums). A segment cut by the block's end is scaled in two parts.
template <int R, int V>
LOWBIT_TARGET_AVX512BF16 void scaled_tile(const Segments& sg, const uint16_t* A, int64_t lda, const uint16_t* B,
                                          int64_t ldb, float* C, int64_t ldc, bool add, __mmask16 last) {
  __mmask16 mask[V];
  column_masks<V>(last, mask);
  for (int64_t k = sg.k0; k < sg.k1;) {
    const int64_t s = k / sg.seg, end = std::min(sg.k1, (s + 1) * sg.seg);
    __m512 acc[R][V];
    load_or_zero<R, V>(acc, false, C, ldc, mask);
    dot_steps<R, V>(acc, k, end, A, lda, B, ldb, mask);
#pragma GCC unroll 8
    for (int i = 0; i < R; i++) {
      const __m512 sc = _mm512_set1_ps(sg.scales[i][s]);
#pragma GCC unroll 8
      for (int v = 0; v < V; v++) {
        float* c = C + i * ldc + 16 * v;
        const __m512 t = _mm512_fmadd_ps(acc[i][v], sc, add ? _mm512_maskz_loadu_ps(mask[v], c) : _mm512_setzero_ps());
        _mm512_mask_storeu_ps(c, mask[v], t);
      }
    }
    add = true;
    k = end;
  }
}

using TileFn = void (*)(int64_t, const uint16_t*, int64_t, const uint16_t*, int64_t, float*, int64_t, bool, __mmask16);
using ScaledTileFn = void (*)(const Segments&, const uint16_t*, int64_t, const uint16_t*, int64_t, float*, int64_t,
                              bool, __mmask16);
template <int R>
struct TileRow {
  static constexpr TileFn get(int v) {
    return v == 1 ? &tile<R, 1> : v == 2 ? &tile<R, 2> : v == 3 ? &tile<R, 3> : &tile<R, 4>;
  }
  static constexpr ScaledTileFn scaled(int v) {
    return v == 1 ? &scaled_tile<R, 1> : v == 2 ? &scaled_tile<R, 2> : v == 3 ? &scaled_tile<R, 3> : &scaled_tile<R, 4>;
  }
};
static_assert(kTileRows == 6 && kTileVecs == 4, "the tables below list every tile");
#define LOWBIT_TILE_ROW(R) {TileRow<R>::get(1), TileRow<R>::get(2), TileRow<R>::get(3), TileRow<R>::get(4)}
constexpr TileFn kTiles[kTileRows][kTileVecs] = {LOWBIT_TILE_ROW(1), LOWBIT_TILE_ROW(2), LOWBIT_TILE_ROW(3),
                                                 LOWBIT_TILE_ROW(4), LOWBIT_TILE_ROW(5), LOWBIT_TILE_ROW(6)};
#undef LOWBIT_TILE_ROW
#define LOWBIT_TILE_ROW(R) \
  {TileRow<R>::scaled(1), TileRow<R>::scaled(2), TileRow<R>::scaled(3), TileRow<R>::scaled(4)}
constexpr ScaledTileFn kScaledTiles[kTileRows][kTileVecs] = {LOWBIT_TILE_ROW(1), LOWBIT_TILE_ROW(2),
                                                             LOWBIT_TILE_ROW(3), LOWBIT_TILE_ROW(4),
                                                             LOWBIT_TILE_ROW(5), LOWBIT_TILE_ROW(6)};
#undef LOWBIT_TILE_ROW

void gemm(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, float* C,
          int64_t ldc, bool add, const Bf16Segments* segs) {
  if (K == 0 && !add)  // an empty sum
    for (int64_t i = 0; i < M; i++) std::fill(C + i * ldc, C + i * ldc + N, 0.f);
  for (int64_t k0 = 0; k0 < K; k0 += kDepth) {
    const int64_t kd = std::min(kDepth, K - k0);
    for (int64_t j0 = 0; j0 < N; j0 += 16 * kTileVecs) {
      const int64_t nj = std::min<int64_t>(16 * kTileVecs, N - j0), vecs = (nj + 15) / 16;
      const __mmask16 last = __mmask16((1u << (nj - 16 * (vecs - 1))) - 1);
      const bool accumulate = add || k0 > 0;  // later depth blocks add to the earlier ones' sums
      for (int64_t i0 = 0; i0 < M; i0 += kTileRows) {
        const int64_t r = std::min<int64_t>(kTileRows, M - i0);
        float* c = C + i0 * ldc + j0;
        if (segs == nullptr) {
          kTiles[r - 1][vecs - 1](kd, A + i0 * lda + k0, lda, B + k0 * ldb + 2 * j0, ldb, c, ldc, accumulate, last);
        } else {
          const Segments sg{k0, k0 + kd, segs->len, segs->scales + i0};
          kScaledTiles[r - 1][vecs - 1](sg, A + i0 * lda, lda, B + 2 * j0, ldb, c, ldc, accumulate, last);
        }
      }
    }
  }
}
}  // namespace bf16_gemm

// kernel_set.h's VnniPackFn: the block's two halves of 16 units, each a 16 x 16 transpose (the scalar packs moved
// a unit, or a byte, at a time: a fifth of the AMX fp8 GEMM's time at M = 4096).
LOWBIT_TARGET_AVX512 void vnni_pack(const void* x, int64_t ldx, const uint8_t* to, uint32_t* dst, int64_t ldd) {
  static_assert(kVnniPackRows == 16 && kVnniPackUnits == 32, "one block is two 16 x 16 transposes");
  const char* rows = static_cast<const char*>(x);
  for (int h = 0; h < 2; h++) {
    __m512i r[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(rows + i * ldx + 64 * h);
    transpose16x16(r);
    for (int j = 0; j < 16; j++) _mm512_storeu_si512(dst + to[16 * h + j] * ldd, r[j]);
  }
}

}  // namespace

const KernelSet& kernel_set_avx512() {
  const KernelSet& avx2 = kernel_set_avx2();
  static const KernelSet s{
      "avx512",
      kFeatAvx2 | kFeatAvx512,
      // the fp32 GEMM panel decode and fp8_dequantize stay AVX2: the panel decode's cost is spread over all M
      // rows, and dequantize is bound by its writes
      Fp8Kernels{&fp8::gemv_tile, &fp8::gemv_tile_bf16, avx2.fp8.decode_rows, &fp8::decode_rows_bf16,
                 avx2.fp8.dequantize_run},
      Int8Kernels{&int8::gemv_tile, 4, 6, 32, &int8::gemm_micro, avx2.int8.quantize_row},
      kW4KernelsAvx512,
      avx2.axpy_rows,
      avx2.xor_words,
      true,
      &vnni_pack,
      &bf16_gemm::gemm,
  };
  return s;
}

// The AVX-512 set on Intel's AMX server cores (Sapphire Rapids and later), where vdpbf16ps issues about once per
// 2.4 cycles and vpdpbusd twice a cycle (Zen 4: once a cycle each): the 4-bit GEMV for bf16 x multiplies byte
// digit planes of x (w4_kernels.h) where the bf16 tile would multiply bf16 pairs, and the GEMMs' segment-scaled
// products run on its own AMX tile kernel (amx.cpp). The rest is the avx512 set.
const KernelSet& kernel_set_avx512amx() {
  static const KernelSet s = [] {
    KernelSet k = kernel_set_avx512();
    k.name = "avx512amx";
    k.w4 = kW4KernelsAvx512Planes;
    k.preferred = kFeatAmx;
    k.amx_bf16_gemm = amx_tiles_granted() ? &amx_bf16_gemm : nullptr;
    return k;
  }();
  return s;
}

}  // namespace lowbit::cpu
