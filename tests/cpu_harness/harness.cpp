// The torch-free kernel harness: every kernel set this CPU supports (csrc/cpu/arch/, built from the same sources
// as _C) against independent references and the portable set, on tails, odd K, empty sizes, NaN codes and -128.
// Exact where the contract is: int8 int32 sums, fp8 decode and dequantize, int8_quantize, the streaming read, the
// 4-bit decodes (per element, as the contract's formula);
// float64-bounded elsewhere. tests/test_cpu_harness.py builds and runs it (natively, and cross-compiled under
// qemu for other architectures). Prints one line per set; exits 1 when any check fails.
//
//   harness [--first-failure] [set ...]   check these sets (default: every set this CPU supports); stop at the
//                                         first failing check
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu/arch/kernel_set.h"
#include "cpu/arch/float16_bits.h"
#include "cpu/fp8_simd.h"

using namespace lowbit;
using namespace lowbit::cpu;

namespace {

int g_failures = 0;
int g_checks = 0;
const char* g_set = "";
// --first-failure: a run that only has to show that a set fails (a planted bug) ends at its first failing check;
// under qemu a whole set's checks take half a minute
bool g_stop_at_first_failure = false;

#define CHECK(cond, ...)                                                      \
  do {                                                                        \
    g_checks++;                                                               \
    if (!(cond)) {                                                            \
      if (++g_failures <= 20) {                                               \
        std::printf("FAIL %s: %s:%d: %s: ", g_set, __FILE__, __LINE__, #cond); \
        std::printf(__VA_ARGS__);                                             \
        std::printf("\n");                                                    \
      }                                                                       \
      if (g_stop_at_first_failure) {                                         \
        std::printf("FAILED %s: stopped at its first failure\n", g_set);     \
        std::exit(1);                                                         \
      }                                                                       \
    }                                                                         \
  } while (0)

// 64-byte aligned buffers (the tiles load packed activations and strips with aligned vector loads)
template <typename T>
struct Buf {
  T* p = nullptr;
  size_t n = 0;
  explicit Buf(size_t count, T fill = T()) : n(count) {
    p = static_cast<T*>(std::aligned_alloc(64, (count * sizeof(T) + 63) / 64 * 64 + 64));
    for (size_t i = 0; i < count; i++) p[i] = fill;
  }
  ~Buf() { std::free(p); }
  Buf(const Buf&) = delete;
  T& operator[](size_t i) { return p[i]; }
};

std::mt19937 g_rng(1234);

// e4m3fn by its definition, in double: an independent reference for the sets' table and half-bits decodes
double e4m3_ref(uint8_t b) {
  if ((b & 0x7F) == 0x7F) return NAN;
  const int e = (b >> 3) & 0xF, m = b & 7;
  const double v = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
  return (b & 0x80) ? -v : v;
}
bool is_nan_code(uint8_t b) { return (b & 0x7F) == 0x7F; }

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float float_of_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// random codes, every tenth row salted with NaN codes where `nan` says so
std::vector<uint8_t> random_codes(int64_t n, bool nan) {
  std::vector<uint8_t> c(static_cast<size_t>(n));
  for (auto& v : c) {
    v = uint8_t(g_rng());
    if (!nan && is_nan_code(v)) v ^= 1;
  }
  return c;
}

// ---- fp8 ----

void check_decode_rows(const KernelSet& s) {
  for (int64_t n : {1, 5, 31, 32, 33, 64, 100}) {
    const int64_t K = n + 7, nrows = 3, k0 = 3, ldd = round_up_chunk(n) + 32;
    const auto w = random_codes(K * nrows, true);
    Buf<float> dst(size_t(nrows * ldd), -1.f);
    bool nan[3] = {};
    s.fp8.decode_rows(w.data(), K, nrows, k0, n, dst.p, ldd, nan);
    for (int64_t r = 0; r < nrows; r++) {
      bool row_has_nan = false;
      for (int64_t p = 0; p < round_up_chunk(n); p++) {
        const int64_t k = p / kChunk * kChunk + kChunkOrder[size_t(p % kChunk)];
        const float got = dst[size_t(r * ldd + p)];
        if (k >= n) {
          CHECK(bits_of(got) == 0, "decode_rows padding n=%lld p=%lld: %g", (long long)n, (long long)p, got);
          continue;
        }
        const uint8_t code = w[size_t(r * K + k0 + k)];
        if (is_nan_code(code)) {
          row_has_nan = true;
          continue;  // NaN, or a value with nan[r] set: checked below
        }
        CHECK(double(got) == e4m3_ref(code) / 256, "decode_rows code 0x%02x: %g", code, got);
      }
      if (row_has_nan) {
        bool all_nan = true;
        for (int64_t k = 0; k < n; k++)
          if (is_nan_code(w[size_t(r * K + k0 + k)])) {
            const int64_t p = k / kChunk * kChunk;
            for (int q = 0; q < kChunk; q++)
              if (p + q < round_up_chunk(n) && p + kChunkOrder[size_t(q)] == k)
                all_nan = all_nan && std::isnan(dst[size_t(r * ldd + p + q)]);
          }
        CHECK(nan[r] || all_nan, "decode_rows n=%lld: row %lld holds a NaN code, neither flagged nor decoded NaN",
              (long long)n, (long long)r);
      }
    }
  }
}

void check_decode_rows_bf16(const KernelSet& s) {
  if (!s.fp8.decode_rows_bf16) return;
  for (int64_t n : {1, 63, 64, 65, 130}) {
    const int64_t K = n + 5, nrows = 2, k0 = 5, padded = (n + kBf16Chunk - 1) / kBf16Chunk * kBf16Chunk;
    const int64_t ldd = padded + 64;
    const auto w = random_codes(K * nrows + 256, true);  // the decode may read (not use) up to a chunk past a row
    Buf<uint16_t> dst(size_t(nrows * ldd), 0xAAAA);
    s.fp8.decode_rows_bf16(w.data(), K, nrows, k0, n, dst.p, ldd);
    for (int64_t r = 0; r < nrows; r++)
      for (int64_t p = 0; p < padded; p++) {
        const int64_t k = p / kBf16Chunk * kBf16Chunk + kBf16ChunkOrder[size_t(p % kBf16Chunk)];
        const uint16_t got = dst[size_t(r * ldd + p)];
        if (k >= n) {
          CHECK(got == 0, "decode_rows_bf16 padding: 0x%04x", got);
          continue;
        }
        const uint8_t code = w[size_t(r * K + k0 + k)];
        const double v = double(float_of_bits(uint32_t(got) << 16));
        if (is_nan_code(code)) CHECK(std::isnan(v), "decode_rows_bf16 NaN code 0x%02x: %g", code, v);
        else CHECK(v == e4m3_ref(code) / 256, "decode_rows_bf16 code 0x%02x: %g", code, v);
      }
  }
}

void check_dequantize(const KernelSet& s, const KernelSet& portable) {
  for (int64_t n : {0, 1, 7, 15, 16, 17, 31, 33, 100})
    for (float scale : {1.f, 0.37f, 3.1e-5f, 7.5e3f})
      for (DequantOut kind : {DequantOut::F32, DequantOut::BF16, DequantOut::F16}) {
        auto c = random_codes(n, true);
        if (n >= 3) c[0] = 0x7F, c[1] = 0xFF, c[2] = 0x80;  // NaN codes and -0
        const size_t bytes = size_t(n * element_size(kind));
        std::vector<uint8_t> got(bytes + 16, 0xAB), want(bytes + 16, 0xAB);
        s.fp8.dequantize_run(c.data(), n, scale, got.data(), kind);
        portable.fp8.dequantize_run(c.data(), n, scale, want.data(), kind);
        CHECK(got == want, "dequantize_run n=%lld scale=%g kind=%d differs from portable (or wrote past n)",
              (long long)n, double(scale), int(kind));
        if (kind == DequantOut::F32)  // the portable reference itself: one rounding of the exact product
          for (int64_t k = 0; k < n; k++) {
            float v;
            std::memcpy(&v, want.data() + 4 * k, 4);
            const double ref = e4m3_ref(c[size_t(k)]) * double(scale);
            CHECK(std::isnan(ref) ? std::isnan(v) : v == float(ref), "portable dequantize code 0x%02x", c[size_t(k)]);
          }
      }
}

// packed activations of one row: segment s, position p of a chunk holds code k = order[p] of that chunk
template <typename T, size_t C>
void pack_row(const std::vector<T>& x, const KSegments& seg, const std::array<uint8_t, C>& order, T* dst) {
  for (int64_t s = 0; s < seg.count; s++)
    for (int64_t p = 0; p < seg.padded; p++) {
      const int64_t k = p / int64_t(C) * int64_t(C) + order[size_t(p % int64_t(C))];
      dst[s * seg.padded + p] = k < seg.size(s) ? x[size_t(seg.begin(s) + k)] : T(0);
    }
}

// The GEMV tiles (fp32 or bf16 x) against float64: sums within the error bound of fp32 accumulation.
template <bool kBf16>
void check_gemv(const KernelSet& s) {
  if (kBf16 && !s.fp8.gemv_tile_bf16) return;
  std::uniform_real_distribution<float> ud(-2.f, 2.f);
  for (int64_t K : {0, 1, 31, 32, 33, 100, 257})
    for (int64_t bk : {int64_t(0), int64_t(32), int64_t(48)})
      for (int mr = 1; mr <= kMaxTileRows; mr++)
        for (int nr = 1; nr <= kMaxTileRows; nr++) {
          const bool block = bk > 0;
          const KSegments seg = k_segments_for(block, bk, K, kBf16 ? kBf16Chunk : kChunk);
          const int64_t ldx = seg.packed_size();
          const bool with_nan = K > 0 && (K + mr + nr) % 3 == 0;
          const auto w = random_codes(K * nr, false);
          std::vector<uint8_t> wn = w;
          if (with_nan) wn[size_t((nr - 1) * K + K / 2)] = K % 2 ? 0x7F : 0xFF;  // the last row holds a NaN code
          using X = std::conditional_t<kBf16, uint16_t, float>;
          Buf<X> xp(size_t(mr * ldx + 64));
          std::vector<std::vector<double>> xv(static_cast<size_t>(mr));
          for (int m = 0; m < mr; m++) {
            std::vector<X> row(static_cast<size_t>(K));
            for (int64_t k = 0; k < K; k++) {
              float v = ud(g_rng);
              if (kBf16) {
                const uint16_t b = uint16_t(bits_of(v) >> 16);
                row[size_t(k)] = X(b);
                v = float_of_bits(uint32_t(b) << 16);
              } else {
                row[size_t(k)] = X(v);
              }
              xv[size_t(m)].push_back(v);
            }
            if constexpr (kBf16) pack_row(row, seg, kBf16ChunkOrder, xp.p + m * ldx);
            else pack_row(row, seg, kChunkOrder, xp.p + m * ldx);
          }
          std::vector<std::vector<float>> bsv(static_cast<size_t>(nr));
          const float* bs[kMaxTileRows] = {};
          for (int r = 0; r < nr; r++) {
            for (int64_t b = 0; b < seg.count; b++) bsv[size_t(r)].push_back(0.5f + float(b + r) * 0.25f);
            bs[r] = bsv[size_t(r)].data();
          }
          float sums[kMaxTileRows * kMaxTileRows];
          bool nan[kMaxTileRows] = {};
          if constexpr (kBf16)
            s.fp8.gemv_tile_bf16(mr, nr, xp.p, ldx, wn.data(), K, block ? bs : nullptr, seg, sums, nan);
          else
            s.fp8.gemv_tile(mr, nr, xp.p, ldx, wn.data(), K, block ? bs : nullptr, seg, sums, nan);
          for (int m = 0; m < mr; m++)
            for (int r = 0; r < nr; r++) {
              const float got = sums[m * nr + r];
              if (with_nan && r == nr - 1) {
                CHECK(nan[r] || std::isnan(got), "gemv K=%lld: a NaN code neither flagged nor NaN", (long long)K);
                continue;
              }
              CHECK(!nan[r], "gemv K=%lld mr=%d nr=%d: row %d flagged NaN without a NaN code", (long long)K, mr, nr, r);
              double ref = 0, mag = 0;
              for (int64_t k = 0; k < K; k++) {
                const double t = xv[size_t(m)][size_t(k)] * e4m3_ref(w[size_t(r * K + k)]) / 256 *
                                 (block ? double(bs[r][k / seg.len]) : 1.0);
                ref += t;
                mag += std::fabs(t);
              }
              // fp32 accumulation of K terms: |error| <= (K + a few) * 2^-24 * sum |terms|, and the scale step
              const double bound = (double(K) + 8) * std::ldexp(1.0, -24) * mag * 2 + 1e-30;
              CHECK(std::fabs(double(got) - ref) <= bound,
                    "gemv%s K=%lld bk=%lld mr=%d nr=%d m=%d r=%d: %.9g vs %.9g (bound %.3g)", kBf16 ? "_bf16" : "",
                    (long long)K, (long long)bk, mr, nr, m, r, double(got), ref, bound);
            }
        }
}

// ---- int8 ----

std::vector<int8_t> random_int8(int64_t n) {
  std::vector<int8_t> v(static_cast<size_t>(n));
  for (auto& x : v) x = int8_t(g_rng());
  return v;
}

void check_int8_gemv(const KernelSet& s) {
  for (int64_t K : {0, 1, 15, 16, 17, 63, 64, 65, 200})
    for (int mr = 1; mr <= kInt8TileRows; mr++)
      for (int nr = 1; nr <= kInt8TileRows; nr++) {
        auto x = random_int8(mr * K), w = random_int8(nr * K);
        if (K > 0) x[0] = -128, w[0] = -128;  // the one product vpmaddubsw-style tricks get wrong
        std::vector<int32_t> acc(size_t(mr * nr), 0x5A5A5A5A);
        s.int8.gemv_tile(mr, nr, x.data(), w.data(), K, acc.data());
        for (int m = 0; m < mr; m++)
          for (int r = 0; r < nr; r++) {
            int64_t ref = 0;
            for (int64_t k = 0; k < K; k++) ref += int64_t(x[size_t(m * K + k)]) * w[size_t(r * K + k)];
            CHECK(acc[size_t(m * nr + r)] == ref, "int8 gemv K=%lld mr=%d nr=%d: %d vs %lld", (long long)K, mr, nr,
                  acc[size_t(m * nr + r)], (long long)ref);
          }
      }
  // the largest sums: every product 128 * 128 (exact while K < 2^17)
  const int64_t K = 4096;
  std::vector<int8_t> x(size_t(K), -128), w(size_t(K), -128);
  int32_t acc = 0;
  s.int8.gemv_tile(1, 1, x.data(), w.data(), K, &acc);
  CHECK(acc == 128 * 128 * K, "int8 gemv all -128: %d", acc);
}

// The GEMM micro-tile: panel_rows weight rows x strip activation rows over len k, packed as int8_kernels.h says.
void check_int8_gemm_micro(const KernelSet& s) {
  const int G = s.int8.group, R = s.int8.panel_rows, W = s.int8.strip;
  for (int64_t len : {int64_t(G), int64_t(4 * G), int64_t(64), int64_t(64 + G)})
    for (bool accumulate : {false, true}) {
      const int64_t ldp = len + 2 * G;
      auto w = random_int8(R * ldp), x = random_int8(W * len);
      w[0] = -128, x[0] = -128;
      Buf<int16_t> panel16(size_t(R * ldp)), xs16(size_t(len * W));
      Buf<uint8_t> panel8(size_t(R * ldp));
      Buf<int8_t> xs8(size_t(len * W));
      for (int r = 0; r < R; r++)
        for (int64_t k = 0; k < ldp; k++) {
          panel16[size_t(r * ldp + k)] = w[size_t(r * ldp + k)];
          panel8[size_t(r * ldp + k)] = uint8_t(w[size_t(r * ldp + k)]) ^ 0x80;  // w + 128
        }
      for (int64_t k = 0; k < len; k++)
        for (int j = 0; j < W; j++) {
          const size_t at = size_t((k / G) * W * G + j * G + k % G);  // [k group][strip row][group]
          xs16[at] = x[size_t(j * len + k)];
          xs8[at] = x[size_t(j * len + k)];
        }
      Buf<int32_t> tile(size_t(R * W));
      std::vector<int32_t> start(static_cast<size_t>(R * W));
      for (auto& v : start) v = int32_t(g_rng() % 2001) - 1000;
      for (int i = 0; i < R * W; i++) tile[size_t(i)] = accumulate ? start[size_t(i)] : 0x5A5A5A5A;
      const void* panel = G == 2 ? static_cast<const void*>(panel16.p) : panel8.p;
      const void* xs = G == 2 ? static_cast<const void*>(xs16.p) : xs8.p;
      s.int8.gemm_micro(panel, ldp, xs, len, tile.p, accumulate);
      for (int r = 0; r < R; r++)
        for (int j = 0; j < W; j++) {
          int64_t ref = accumulate ? start[size_t(r * W + j)] : 0;
          for (int64_t k = 0; k < len; k++) {
            const int64_t wk = G == 2 ? w[size_t(r * ldp + k)] : w[size_t(r * ldp + k)] + 128;
            ref += wk * x[size_t(j * len + k)];
          }
          CHECK(tile[size_t(r * W + j)] == int32_t(ref), "gemm_micro len=%lld acc=%d r=%d j=%d: %d vs %lld",
                (long long)len, int(accumulate), r, j, tile[size_t(r * W + j)], (long long)ref);
        }
    }
}

void check_quantize(const KernelSet& s, const KernelSet& portable) {
  std::uniform_real_distribution<float> ud(-3.f, 3.f);
  for (int64_t K : {0, 1, 7, 31, 32, 33, 100})
    for (int kind = 0; kind < 4; kind++) {  // plain, all zero, a NaN, an infinity
      std::vector<float> x(static_cast<size_t>(K));
      for (auto& v : x) v = kind == 1 ? 0.f : ud(g_rng);
      if (K > 0 && kind == 2) x[size_t(K - 1)] = NAN;
      if (K > 0 && kind == 3) x[size_t(K / 2)] = -INFINITY;
      if (K > 2 && kind == 0) x[1] = 127.f * 0.5f, x[0] = -127.f;  // ties and the absmax at -127
      std::vector<int8_t> got(size_t(K) + 8, 0x55), want(size_t(K) + 8, 0x55);
      const float sg = s.int8.quantize_row(x.data(), K, got.data());
      const float sw = portable.int8.quantize_row(x.data(), K, want.data());
      CHECK(bits_of(sg) == bits_of(sw) && got == want, "quantize_row K=%lld kind=%d differs from portable",
            (long long)K, kind);
      double amax = 0;  // the portable reference itself
      for (float v : x) amax = std::fmax(amax, std::fabs(double(v)));
      if (kind >= 2 && K > 0) CHECK(std::isnan(sw), "quantize_row: non-finite row scale %g", double(sw));
      else CHECK(sw == float(amax) / 127.f, "quantize_row scale %g vs %g", double(sw), amax / 127);
    }
}

// ---- the row loops ----

void check_axpy(const KernelSet& s) {
  std::uniform_real_distribution<float> ud(-1.f, 1.f);
  for (int64_t n : {0, 1, 7, 31, 32, 33, 100})
    for (int64_t mr : {1, 3}) {
      const int64_t lda = n + 5;
      std::vector<float> c(static_cast<size_t>(mr)), v(static_cast<size_t>(n)), acc(static_cast<size_t>(mr * lda));
      for (auto& e : c) e = ud(g_rng);
      for (auto& e : v) e = ud(g_rng);
      for (auto& e : acc) e = ud(g_rng);
      std::vector<float> before = acc;
      s.axpy_rows(mr, c.data(), v.data(), n, acc.data(), lda);
      for (int64_t m = 0; m < mr; m++)
        for (int64_t p = 0; p < lda; p++) {
          const size_t i = size_t(m * lda + p);
          if (p >= n) {
            CHECK(bits_of(acc[i]) == bits_of(before[i]), "axpy_rows wrote past n=%lld", (long long)n);
            continue;
          }
          const double ref = double(before[i]) + double(c[size_t(m)]) * v[size_t(p)];
          // one fused or two separate roundings
          const double bound = 2 * std::ldexp(1.0, -24) * (std::fabs(double(before[i])) + std::fabs(ref) + 1e-30);
          CHECK(std::fabs(double(acc[i]) - ref) <= bound, "axpy_rows n=%lld: %g vs %g", (long long)n,
                double(acc[i]), ref);
        }
    }
}

// ---- 4-bit (w4_kernels.h) ----

// A random 4-bit weight of one shape, format, scale encoding and offset kind, with its buffers.
struct W4Case {
  std::vector<uint8_t> codes, scale, offset;
  W4Operand op;
};

// The stored bits of scale / bias v in encoding enc (float encodings; one-byte ones take random bytes instead).
void put_scale(W4Scale enc, float v, std::vector<uint8_t>& dst, int64_t i) {
  if (enc == W4Scale::F32) std::memcpy(dst.data() + 4 * i, &v, 4);
  const uint16_t h = enc == W4Scale::F16 ? float_to_half_bits(v) : float_to_bf16_bits(v);
  if (enc == W4Scale::F16 || enc == W4Scale::BF16) std::memcpy(dst.data() + 2 * i, &h, 2);
}

W4Case make_w4(const W4Format& f, W4Scale enc, bool with_offset, int64_t N, int64_t K, int64_t group, bool nan) {
  W4Case c;
  const int64_t G = (K + group - 1) / group, rb = (K + 1) / 2;
  const int64_t esize = enc == W4Scale::F32 ? 4 : (enc == W4Scale::F16 || enc == W4Scale::BF16) ? 2 : 1;
  c.codes.resize(size_t(N * rb));
  for (auto& b : c.codes) b = uint8_t(g_rng());
  c.scale.resize(size_t(N * G * esize) + 1);
  std::uniform_real_distribution<float> us(0.01f, 0.3f), ub(-1.f, 1.f);
  for (int64_t i = 0; i < N * G; i++) {
    // every finite e4m3 byte (subnormals, negatives); e8m0 from 2^-127 (the subnormal 0) to 2^3
    if (enc == W4Scale::E4M3) c.scale[size_t(i)] = uint8_t(g_rng() % 0x7F) | uint8_t(g_rng() % 2 ? 0x80 : 0);
    else if (enc == W4Scale::E8M0) c.scale[size_t(i)] = uint8_t(i % 7 == 0 ? 0 : 100 + g_rng() % 31);
    else put_scale(enc, us(g_rng), c.scale, i);
  }
  if (nan && N * G > 2) {  // a NaN scale in one group, an infinite one in another (float encodings)
    const int64_t i = (N * G) / 2;
    if (enc == W4Scale::E4M3) c.scale[size_t(i)] = 0x7F;
    else if (enc == W4Scale::E8M0) c.scale[size_t(i)] = 0xFF;
    else put_scale(enc, NAN, c.scale, i), put_scale(enc, INFINITY, c.scale, 0);
  }
  if (with_offset && f.offset == W4Offset::ZeroPoint) {
    c.offset.resize(size_t(N * G));
    for (auto& z : c.offset) z = uint8_t(g_rng());
  } else if (with_offset && f.offset == W4Offset::Bias) {
    c.offset.resize(size_t(N * G * esize));
    for (int64_t i = 0; i < N * G; i++) put_scale(enc, ub(g_rng), c.offset, i);
  }
  W4Operand& op = c.op;
  op.codes = c.codes.data();
  op.scale = c.scale.data();
  op.scale_enc = enc;
  op.offset = c.offset.empty() ? nullptr : c.offset.data();
  op.offset_kind = f.offset;
  op.values = f.values;
  op.N = N, op.K = K, op.group = group, op.G = G;
  return c;
}

// w[n, k] by the contract's formula, element by element: the product rounded to fp32 before the bias
float w4_ref(const W4Operand& op, int64_t n, int64_t k) {
  const int code = (op.codes[n * ((op.K + 1) / 2) + k / 2] >> ((k & 1) * 4)) & 0xF;
  const int64_t i = n * op.G + k / op.group;
  const float s = w4_scale_to_float(op.scale_enc, op.scale, i), v = op.values[code];
  if (op.offset && op.offset_kind == W4Offset::ZeroPoint) return (v - float(static_cast<const int8_t*>(op.offset)[i])) * s;
  if (op.offset && op.offset_kind == W4Offset::Bias) {
    volatile float prod = v * s;
    return prod + w4_scale_to_float(op.scale_enc, op.offset, i);
  }
  return v * s;
}

bool same_float(float a, float b) { return (std::isnan(a) && std::isnan(b)) || bits_of(a) == bits_of(b); }

// The nearest bf16 of finite v (ties to even) computed in double, and a finite v too large for it truncated
// (w4_kernels.h's rule): the harness's own rounding, not the kernels'.
double bf16_nearest(double v) {
  if (v == 0) return v;
  int e;
  std::frexp(v, &e);                              // |v| in [2^(e-1), 2^e)
  const int q = std::max(e - 8, -133);            // the bf16 quantum's exponent (subnormals: 2^-133)
  const double r = std::ldexp(std::nearbyint(std::ldexp(v, -q)), q);
  if (std::fabs(r) > 3.3895313892515355e38) return std::ldexp(std::trunc(std::ldexp(v, -q)), q);
  return r;
}

// decode_rows_bf16: every term against the harness's own rounding of the exact decode (times a global scale of 1
// or not), one and two terms, every window of 64 * j codes, zero past K up to whole 64-code chunks.
void check_w4_bf16_panels(const KernelSet& s, const W4Operand& plain, const char* fmt) {
  if (!s.w4.decode_rows_bf16) return;
  const int64_t N = plain.N, K = plain.K;
  for (float global : {1.f, 1.1f})
  for (int terms : {1, 2})
    for (int64_t win : {int64_t(64), int64_t(128), (K + 63) / 64 * 64}) {
      const int64_t ld = win + 8, ts = N * ld + 4;
      Buf<uint16_t> d(size_t(terms * ts), 0xBEEF);
      int bad = 0;
      for (int64_t k0 = 0; k0 < K; k0 += win) {
        W4Operand op = plain;
        op.global = global;
        s.w4.decode_rows_bf16(op, 0, N, k0, win, terms, d.p, ld, ts);
        for (int64_t n = 0; n < N; n++)
          for (int64_t k = k0; k < k0 + win; k++) {
            const float wg = k < K ? w4_ref(op, n, k) * global : 0.f;  // the fp32 product
            const double w = wg;
            const float hi = w4_bf16_float(d[size_t(n * ld + k - k0)]);
            if (std::isnan(w) || std::isinf(w)) {
              bad += !(std::isnan(w) ? std::isnan(hi) : double(hi) == w);
              if (terms == 2) bad += d[size_t(ts + n * ld + k - k0)] != 0;
              continue;
            }
            const double h = bf16_nearest(w);
            bad += double(hi) != h;
            if (terms == 2) bad += double(w4_bf16_float(d[size_t(ts + n * ld + k - k0)])) != bf16_nearest(w - h);
          }
      }
      CHECK(bad == 0, "w4 decode_rows_bf16 %s K=%lld group=%lld window=%lld terms=%d global=%g: %d words differ",
            fmt, (long long)K, (long long)plain.group, (long long)win, terms, double(global), bad);
    }
}

// x for the bf16 GEMV: normal values, or (kHard) steps of 128 that send the digit planes (w4_kernels.h) down each
// of their ways -- by (step + row) % 8: normal; a value 2^20 times the rest (16 binades: the bf16 step); +-254 with
// 2^-8 (15 binades, the largest integers the digits hold, both signs); 255 with 2^-8 (one past them); zeros and
// denormals; an inf or a NaN; values near 2^-118 (2^e below the planes' floor); normal with a few denormals.
enum class W4XKind { Normal, Hard };
uint16_t w4_x_value(W4XKind kind, int m, int64_t k, std::normal_distribution<float>& normal) {
  const uint16_t v = float_to_bf16_bits(normal(g_rng));
  if (kind == W4XKind::Normal) return v;
  const int64_t j = k % kW4Bf16Step;
  switch ((k / kW4Bf16Step + m) % 8) {
    case 1: return j == 5 ? float_to_bf16_bits(normal(g_rng) * 1048576.f) : v;
    case 2: return j == 3 ? 0x437E : j == 4 ? 0xC37E : j == 9 ? 0x3B80 : uint16_t(v & 0x807F) | 0x3F80;
    case 3: return j == 7 ? 0x437F : j == 8 ? 0x3B80 : uint16_t(v & 0x807F) | 0x3F80;
    case 4: return j % 3 == 0 ? uint16_t(v & 0x807F) : uint16_t(0);
    case 5: return j == 11 ? (m % 2 ? 0x7F80 : 0x7FC0) : v;
    case 6: return uint16_t(v & 0x807F) | 0x0480;
    case 7: return j % 17 == 0 ? uint16_t(v & 0x807F) : v;
    default: return v;
  }
}

// The bf16-activation GEMV over ranges of rows (where a set has one and takes the weight): x packed here in the
// bf16 order (w4_kernels.h), with the fp32 group sums behind each row for weights with offsets, and the set's digit
// planes where it reads them, against float64. The kernel scales each group's sum once (the contract), so its bound
// is that of fp32 sums over |x| (|v s| + |o|); a row with a non-finite weight or x must give a non-finite sum (NaN
// or inf: the contract allows either). The set's activation pack, where it has one, must give the same words and
// sums within their bound, and the planes of w4_plane_step bit for bit.
void check_w4_gemv_rows_bf16(const KernelSet& s, const W4Operand& op, const char* fmt,
                             W4XKind kind = W4XKind::Normal) {
  if (!s.w4.gemv_rows_bf16 || !s.w4.gemv_bf16_takes(op)) return;
  const int64_t N = op.N, K = op.K, Kp = w4_bf16_padded(K);
  const int64_t gs = w4_bf16_row_group_sums(op), group = op.G <= 1 ? K : op.group;
  const int64_t plane_words = s.w4.pack_plane_steps ? w4_plane_steps_bytes(K) / 2 : 0;
  const int64_t ldx = Kp + 2 * gs + plane_words + 6;
  std::normal_distribution<float> normal(0.f, 1.f);
  Buf<uint16_t> xp(size_t(kMaxTileRows * ldx + 64), 0);
  std::vector<double> xv(size_t(kMaxTileRows * K));
  for (int m = 0; m < kMaxTileRows; m++) {
    uint16_t* row = xp.p + m * ldx;
    for (int64_t k = 0; k < K; k++) {
      row[w4_bf16_pos(k)] = w4_x_value(kind, m, k, normal);
      xv[size_t(m * K + k)] = w4_bf16_float(row[w4_bf16_pos(k)]);
    }
    std::fill(row + Kp, row + ldx, uint16_t(0xFFFF));  // past the sums: NaN, which nothing may read
    float* sums = reinterpret_cast<float*>(row + Kp);
    for (int64_t g = 0; g < gs; g++) {
      double t = 0;
      for (int64_t k = g * group; k < std::min(K, (g + 1) * group); k++) t += xv[size_t(m * K + k)];
      sums[g] = float(t);
    }
    if (s.w4.pack_bf16_row) {
      const double* xin = xv.data() + m * K;
      std::vector<uint16_t> nat(static_cast<size_t>(K)), got(size_t(Kp + 2 * gs + plane_words), 0xBEEF);
      for (int64_t k = 0; k < K; k++) nat[size_t(k)] = float_to_bf16_bits(float(xin[k]));
      s.w4.pack_bf16_row(nat.data(), K, group, gs, got.data());
      CHECK(std::equal(got.begin(), got.begin() + Kp, row), "w4 pack_bf16_row %s K=%lld: words differ", fmt,
            (long long)K);
      for (int64_t g = 0; g < gs; g++) {
        float v;
        std::memcpy(&v, got.data() + Kp + 2 * g, 4);
        double mag = 0;
        for (int64_t k = g * group; k < std::min(K, (g + 1) * group); k++) mag += std::fabs(xin[k]);
        CHECK(std::isfinite(mag) ? std::fabs(double(v) - sums[g]) <= double(group + 16) * std::ldexp(mag, -23)
                                 : !std::isfinite(v),
              "w4 pack_bf16_row %s K=%lld group sum %lld: %.9g vs %.9g", fmt, (long long)K, (long long)g, double(v),
              double(sums[g]));
      }
      if (plane_words) {  // the planes: w4_plane_step's bytes, and behind the row's sums, where the GEMV reads them
        uint16_t* planes = got.data() + Kp + 2 * gs;
        // in two calls, as threads split a row: the steps before the last, then the last
        const int64_t steps = Kp / kW4Bf16Step;
        for (const auto& range : {std::pair<int64_t, int64_t>{0, steps - 1}, {steps - 1, steps}})
          s.w4.pack_plane_steps(nat.data(), K, range.first, range.second, reinterpret_cast<W4PlaneStep*>(planes));
        int differ = 0;
        for (int64_t k = 0; k < Kp; k += kW4Bf16Step) {
          W4PlaneStep want;
          w4_plane_step(nat.data() + k, K - k, want);
          differ += std::memcmp(&want, planes + k / kW4Bf16Step * int64_t(sizeof want) / 2, sizeof want) != 0;
        }
        CHECK(differ == 0, "w4 pack_plane_steps %s K=%lld: %d plane steps differ", fmt, (long long)K, differ);
        std::copy(planes, planes + plane_words, row + Kp + 2 * gs);
      }
    }
  }
  const float* byte_table = w4_byte_scale_table(op.scale_enc);
  for (int mr = 1; mr <= kMaxTileRows; mr++)
    for (const auto& range : {std::pair<int64_t, int64_t>{0, N}, {1, N}, {N - 1, N}, {2, std::min<int64_t>(N, 4)}, {1, 1}}) {
      const int64_t n0 = range.first, n1 = range.second, lds = n1 - n0 + 3;
      std::vector<float> sums(size_t(mr * lds), 7.f);
      s.w4.gemv_rows_bf16(mr, xp.p, ldx, op, n0, n1, sums.data(), lds);
      for (int m = 0; m < mr; m++)
        for (int64_t n = n0; n < n0 + lds; n++) {
          const float got = sums[size_t(m * lds + n - n0)];
          if (n >= n1) {
            CHECK(got == 7.f, "w4 gemv_rows_bf16 %s wrote past the range", fmt);
            continue;
          }
          double ref = 0, mag = 0;
          for (int64_t k = 0; k < K; k++) {
            const W4Group p = w4_group(op, byte_table, n, op.G <= 1 ? 0 : k / op.group);
            const int code = (op.codes[n * op.row_bytes() + k / 2] >> ((k & 1) * 4)) & 0xF;
            const double x = xv[size_t(m * K + k)];
            ref += x * double(w4_ref(op, n, k));
            mag += std::fabs(x) * (std::fabs(double(op.values[code]) * p.scale) + std::fabs(double(p.zp) * p.scale) +
                                   std::fabs(double(p.bias)));
          }
          const double bound = (double(K) + 64) * std::ldexp(mag, -22) + 1e-30;
          CHECK(std::isfinite(ref) ? std::fabs(double(got) - ref) <= bound : !std::isfinite(got),
                "w4 gemv_rows_bf16 %s K=%lld group=%lld mr=%d rows [%lld, %lld) m=%d n=%lld: %.9g vs %.9g", fmt,
                (long long)K, (long long)op.group, mr, (long long)n0, (long long)n1, m, (long long)n, double(got), ref);
        }
    }
}

void check_w4_case(const KernelSet& s, const W4Operand& op, const char* fmt) {
  const int64_t N = op.N, K = op.K, Kp = w4_padded(K);
  // natural-order decode: every element exact
  Buf<float> nat(size_t(N * K + 1), -7.f);
  s.w4.dequantize_rows(op, 0, N, nat.p, K);
  int bad = 0;
  for (int64_t n = 0; n < N; n++)
    for (int64_t k = 0; k < K; k++) bad += !same_float(nat[size_t(n * K + k)], w4_ref(op, n, k));
  CHECK(bad == 0, "w4 dequantize_rows %s K=%lld group=%lld: %d elements differ", fmt, (long long)K,
        (long long)op.group, bad);
  // packed decode of every window of 32 * j codes, zero past K
  for (int64_t win : {int64_t(32), int64_t(64), Kp}) {
    if (win == 0) continue;
    Buf<float> pk(size_t(N * win + 1), -7.f);
    bad = 0;
    for (int64_t k0 = 0; k0 < K; k0 += win) {
      s.w4.decode_rows(op, 0, N, k0, win, pk.p, win);
      for (int64_t n = 0; n < N; n++)
        for (int64_t k = k0; k < k0 + win; k++) {
          const float want = k < K ? w4_ref(op, n, k) : 0.f;
          bad += !same_float(pk[size_t(n * win + w4_packed_pos(k - k0))], want);
        }
    }
    CHECK(bad == 0, "w4 decode_rows %s K=%lld group=%lld window=%lld: %d elements differ", fmt, (long long)K,
          (long long)op.group, (long long)win, bad);
  }
  check_w4_bf16_panels(s, op, fmt);
  check_w4_gemv_rows_bf16(s, op, fmt);
  // GEMV tiles against float64, every (mr, nr)
  std::uniform_real_distribution<float> ux(-2.f, 2.f);
  for (int mr = 1; mr <= kMaxTileRows; mr++)
    for (int nr = 1; nr <= std::min<int64_t>(kMaxTileRows, N); nr++) {
      Buf<float> xp(size_t(mr * Kp + 16), 0.f);
      std::vector<double> xv(size_t(mr * K));
      for (int m = 0; m < mr; m++)
        for (int64_t k = 0; k < K; k++) xp[size_t(m * Kp + w4_packed_pos(k))] = float(xv[size_t(m * K + k)] = ux(g_rng));
      const int64_t n0 = N - nr;
      float sums[kMaxTileRows * kMaxTileRows];
      s.w4.gemv_tile(mr, nr, xp.p, Kp, op, n0, sums);
      for (int m = 0; m < mr; m++)
        for (int r = 0; r < nr; r++) {
          double ref = 0, mag = 0;
          for (int64_t k = 0; k < K; k++) {
            const double t = xv[size_t(m * K + k)] * double(w4_ref(op, n0 + r, k));
            ref += t;
            mag += std::fabs(t);
          }
          const float got = sums[m * nr + r];
          const double bound = (double(K) + 8) * std::ldexp(1.0, -24) * mag * 2 + 1e-30;
          CHECK(std::isnan(ref) ? std::isnan(got) : std::fabs(double(got) - ref) <= bound,
                "w4 gemv %s K=%lld group=%lld mr=%d nr=%d m=%d r=%d: %.9g vs %.9g", fmt, (long long)K,
                (long long)op.group, mr, nr, m, r, double(got), ref);
        }
    }
}

void check_w4(const KernelSet& s) {
  for (const W4Format& f : kW4Formats)
    for (int enc = 0; enc <= int(W4Scale::E8M0); enc++) {
      if (!(f.scales & w4_scale_bit(W4Scale(enc)))) continue;
      for (int64_t K : {1, 31, 32, 33, 100, 257})
        for (int64_t group : {16, 32, 48, 128, 1000, 5})
          for (bool offset : {false, true}) {
            if (offset && f.offset == W4Offset::None) continue;
            const W4Case c = make_w4(f, W4Scale(enc), offset, 5, K, group, (K + group) % 3 == 0);
            check_w4_case(s, c.op, f.name);
          }
      // the bf16 GEMV's longer rows (windows of group scales) and ranges of several tiles
      for (int64_t K : {1000, 4500})
        for (int64_t group : {16, 32, 64, 256})
          for (bool offset : {false, true}) {
            if (offset && f.offset == W4Offset::None) continue;
            const W4Case c = make_w4(f, W4Scale(enc), offset, 11, K, group, false);
            check_w4_gemv_rows_bf16(s, c.op, f.name);
            if (s.w4.pack_plane_steps) check_w4_gemv_rows_bf16(s, c.op, f.name, W4XKind::Hard);
          }
      // ranges of many tiles and a rest (37 rows), groups of whole steps and per channel, partial last steps
      for (int64_t K : {100, 1000, 2100})
        for (int64_t group : {int64_t(128), int64_t(256), K})
          for (bool offset : {false, true}) {
            if (offset && f.offset == W4Offset::None) continue;
            const W4Case c = make_w4(f, W4Scale(enc), offset, 37, K, group, K == 1000);
            check_w4_gemv_rows_bf16(s, c.op, f.name);
            if (s.w4.pack_plane_steps) check_w4_gemv_rows_bf16(s, c.op, f.name, W4XKind::Hard);
          }
    }
}

void check_xor_words(const KernelSet& s) {
  for (int64_t n : {0, 1, 15, 16, 17, 100}) {
    std::vector<uint64_t> w(static_cast<size_t>(n));
    uint64_t ref = 0;
    for (auto& v : w) {
      v = (uint64_t(g_rng()) << 32) ^ g_rng();
      ref ^= v;
    }
    CHECK(s.xor_words(w.data(), n) == ref, "xor_words n=%lld", (long long)n);
  }
}

// The VNNI activation pack (where a set has one): every unit of the block where `to` sends it, nothing else written;
// rows at an odd stride from an odd address, a random permutation of the units, VNNI rows wider than the block.
void check_vnni_pack(const KernelSet& s) {
  CHECK(s.vnni_pack != nullptr || !s.amx_gemm, "a set with amx_gemm has a vnni_pack");
  if (!s.vnni_pack) return;
  for (int64_t ldd : {int64_t(kVnniPackRows), int64_t(64), int64_t(37)}) {
    const int64_t ldx = 4 * kVnniPackUnits + 13;  // bytes
    Buf<uint8_t> x(size_t(kVnniPackRows * ldx + 1));
    for (size_t i = 0; i < x.n; i++) x[i] = uint8_t(g_rng());
    std::array<uint8_t, kVnniPackUnits> to{};
    for (int j = 0; j < kVnniPackUnits; j++) to[size_t(j)] = uint8_t(j);
    std::shuffle(to.begin(), to.end(), g_rng);
    const uint32_t sentinel = 0xDEADBEEF;
    Buf<uint32_t> dst(size_t(kVnniPackUnits * ldd), sentinel);
    const uint8_t* rows = x.p + 1;
    s.vnni_pack(rows, ldx, to.data(), dst.p, ldd);
    std::vector<bool> hit(dst.n, false);
    for (int64_t i = 0; i < kVnniPackRows; i++)
      for (int64_t j = 0; j < kVnniPackUnits; j++) {
        uint32_t want;
        std::memcpy(&want, rows + i * ldx + 4 * j, 4);
        const size_t at = size_t(to[size_t(j)] * ldd + i);
        hit[at] = true;
        CHECK(dst[at] == want, "vnni_pack ldd=%lld row %lld unit %lld: %08x, want %08x", (long long)ldd,
              (long long)i, (long long)j, dst[at], want);
      }
    for (size_t a = 0; a < dst.n; a++)
      if (!hit[a]) CHECK(dst[a] == sentinel, "vnni_pack ldd=%lld wrote outside the block at %zu", (long long)ldd, a);
  }
}

// The bf16 GEMM (where a set has one): C (+)= A B over A row-major, B in VNNI pairs (kernel_set.h's Bf16GemmFn), on
// row and column tails, K past one depth block and K = 0, strides wider than the operands. Small integers give
// exact sums (checked exactly); random values are bounded against float64; a NaN in A poisons its row, an infinity
// in B its column, a bf16 denormal in A reads as zero; nothing is written outside C's M x N.
void check_bf16_gemm(const char* name, Bf16GemmFn gemm) {
  std::uniform_int_distribution<int> small(-8, 8);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (bool integers : {true, false})
    for (int64_t M : {1, 6, 7, 13, 64})
      for (int64_t N : {1, 16, 17, 64, 65, 130})
        for (int64_t K : {0, 2, 30, 64, 256, 258, 600})
          for (bool add : {false, true}) {
            const int64_t lda = K + 6, ldb = N + 3, ldc = N + 5;
            std::vector<uint16_t> A(size_t(M * lda), 0x7FC0), B(size_t((K / 2) * 2 * ldb), 0x7FC0);  // NaN outside
            for (int64_t i = 0; i < M; i++)
              for (int64_t k = 0; k < K; k++)
                A[size_t(i * lda + k)] = float_to_bf16_bits(integers ? float(small(g_rng)) : normal(g_rng));
            for (int64_t k = 0; k < K; k++)
              for (int64_t j = 0; j < N; j++)
                B[size_t((k / 2) * 2 * ldb + 2 * j + k % 2)] =
                    float_to_bf16_bits(integers ? float(small(g_rng)) : normal(g_rng));
            const bool specials = !integers && K >= 30 && M > 1 && N > 2;
            if (specials) {
              A[size_t(lda + 3)] = 0x7FC0;    // row 1: NaN
              A[size_t(5)] = 0x0001;          // row 0: a denormal, read as zero
              B[size_t(4 * ldb + 2 * 2)] = 0x7F80;  // column 2: +inf at k = 4
            }
            const float sentinel = 12345.f;
            Buf<float> C(size_t(M * ldc), sentinel);
            std::vector<float> start(size_t(M * ldc), sentinel);
            for (int64_t i = 0; i < M; i++)
              for (int64_t j = 0; j < N; j++) start[size_t(i * ldc + j)] = add ? float(small(g_rng)) : sentinel;
            for (size_t i = 0; i < start.size(); i++) C[i] = start[i];
            gemm(M, N, K, A.data(), lda, B.data(), ldb, C.p, ldc, add, nullptr);
            for (int64_t i = 0; i < M; i++)
              for (int64_t j = 0; j < ldc; j++) {
                const float got = C[size_t(i * ldc + j)];
                if (j >= N) {
                  CHECK(got == sentinel, "%s M=%lld N=%lld K=%lld wrote C[%lld][%lld] past N", name, (long long)M,
                        (long long)N, (long long)K, (long long)i, (long long)j);
                  continue;
                }
                double ref = add ? double(start[size_t(i * ldc + j)]) : 0.0, mag = std::fabs(ref);
                bool nan = false, inf = false;
                for (int64_t k = 0; k < K; k++) {
                  const uint16_t a = A[size_t(i * lda + k)];
                  // denormals (and zero) read as zero
                  const double av = (a & 0x7F80) == 0 ? 0.0 : double(w4_bf16_float(a));
                  const double bv = w4_bf16_float(B[size_t((k / 2) * 2 * ldb + 2 * j + k % 2)]);
                  nan = nan || std::isnan(av) || (std::isinf(bv) && av == 0.0);
                  inf = inf || std::isinf(bv);
                  if (!std::isinf(bv) && !std::isnan(av)) {
                    ref += av * bv;
                    mag += std::fabs(av * bv);
                  }
                }
                if (nan) {
                  CHECK(std::isnan(got), "%s M=%lld N=%lld K=%lld C[%lld][%lld] = %g, want NaN", name, (long long)M,
                        (long long)N, (long long)K, (long long)i, (long long)j, got);
                } else if (inf) {
                  CHECK(std::isinf(got), "%s M=%lld N=%lld K=%lld C[%lld][%lld] = %g, want inf", name, (long long)M,
                        (long long)N, (long long)K, (long long)i, (long long)j, got);
                } else {
                  const double bound = integers ? 0.0 : double(K + 2) * std::ldexp(mag, -24);
                  CHECK(std::fabs(double(got) - ref) <= bound,
                        "%s M=%lld N=%lld K=%lld add=%d C[%lld][%lld] = %.9g, want %.9g", name, (long long)M,
                        (long long)N, (long long)K, int(add), (long long)i, (long long)j, got, ref);
                }
              }
          }
}

// The bf16 GEMM with segments (Bf16Segments): each segment's sums scaled per row -- segments shorter and longer than
// the GEMM's depth blocks, a partial last one, rows and columns with tails, with and without add; against float64.
void check_bf16_gemm_segments(const char* name, Bf16GemmFn gemm) {
  std::normal_distribution<float> normal(0.f, 1.f);
  for (int64_t M : {1, 3, 4, 7, 33, 64})
    for (int64_t N : {5, 16, 64, 70})
      for (int64_t K : {64, 320, 600})
        for (int64_t len : {2, 32, 64, 128, 300})
          for (bool add : {false, true}) {
            const int64_t lda = K + 2, ldb = N + 1, ldc = N + 3, ns = (K + len - 1) / len;
            std::vector<uint16_t> A(size_t(M * lda)), B(size_t(K * ldb));
            for (auto& v : A) v = float_to_bf16_bits(normal(g_rng));
            for (auto& v : B) v = float_to_bf16_bits(normal(g_rng));
            std::vector<float> scale(size_t(M * ns));
            for (auto& v : scale) v = normal(g_rng);
            std::vector<const float*> srow(static_cast<size_t>(M));
            for (int64_t i = 0; i < M; i++) srow[size_t(i)] = scale.data() + i * ns;
            const Bf16Segments segs{len, srow.data()};
            // C starts at a different value in every element (a sum added to the wrong one shows), 7 past N
            Buf<float> C(size_t(M * ldc), 7.f);
            for (int64_t i = 0; i < M; i++)
              for (int64_t j = 0; j < N; j++) C[size_t(i * ldc + j)] = float(i * N + j);
            gemm(M, N, K, A.data(), lda, B.data(), ldb, C.p, ldc, add, &segs);
            for (int64_t i = 0; i < M; i++)
              for (int64_t j = 0; j < N; j++) {
                double ref = add ? double(i * N + j) : 0.0, mag = std::fabs(ref);
                for (int64_t sg = 0; sg < ns; sg++) {
                  double part = 0, part_mag = 0;
                  for (int64_t k = sg * len; k < std::min(K, (sg + 1) * len); k++) {
                    const double p = double(w4_bf16_float(A[size_t(i * lda + k)])) *
                                     w4_bf16_float(B[size_t((k / 2) * 2 * ldb + 2 * j + k % 2)]);
                    part += p;
                    part_mag += std::fabs(p);
                  }
                  ref += scale[size_t(i * ns + sg)] * part;
                  mag += std::fabs(scale[size_t(i * ns + sg)]) * part_mag;
                }
                const float got = C[size_t(i * ldc + j)];
                CHECK(std::fabs(double(got) - ref) <= double(K + ns + 2) * std::ldexp(mag, -24),
                      "%s segments M=%lld N=%lld K=%lld len=%lld add=%d C[%lld][%lld] = %.9g, want %.9g",
                      name, (long long)M, (long long)N, (long long)K, (long long)len, int(add), (long long)i, (long long)j,
                      got, ref);
              }
            for (int64_t i = 0; i < M; i++)
              for (int64_t j = N; j < ldc; j++)
                CHECK(C[size_t(i * ldc + j)] == 7.f, "%s segments wrote C[%lld][%lld] past N", name, (long long)i,
                      (long long)j);
          }
}

// A set's bf16 GEMMs: the vector one, and the AMX tile one (where the set has one; it runs on tiles where the CPU
// has AMX and the OS grants the tile state, K and the segment lengths multiples of 32 -- here K = 64, 256 and 320 with
// segments of 32, 64 and 128 -- and is the vector GEMM elsewhere).
void check_bf16_gemms(const KernelSet& s) {
  CHECK(s.bf16_gemm == nullptr || (s.vnni_pack != nullptr && s.fp8.decode_rows_bf16 != nullptr),
        "a set with a bf16 GEMM packs VNNI pairs and decodes bf16 panels");
  CHECK(s.amx_bf16_gemm == nullptr || (s.amx_gemm && s.bf16_gemm != nullptr),
        "a set with an AMX bf16 GEMM hands its GEMMs to AMX and has the vector one");
  for (auto [name, gemm] : {std::pair<const char*, Bf16GemmFn>{"bf16_gemm", s.bf16_gemm},
                            std::pair<const char*, Bf16GemmFn>{"amx_bf16_gemm", s.amx_bf16_gemm}}) {
    if (gemm == nullptr) continue;
    check_bf16_gemm(name, gemm);
    check_bf16_gemm_segments(name, gemm);
  }
}

void check_set(const KernelSet& s, const KernelSet& portable) {
  g_set = s.name;
  const int before = g_failures, checks = g_checks;
  check_decode_rows(s);
  check_decode_rows_bf16(s);
  check_dequantize(s, portable);
  check_gemv<false>(s);
  check_gemv<true>(s);
  check_int8_gemv(s);
  check_int8_gemm_micro(s);
  check_quantize(s, portable);
  check_axpy(s);
  check_xor_words(s);
  check_w4(s);
  check_vnni_pack(s);
  check_bf16_gemms(s);
  std::printf("%s %s: %d checks\n", g_failures == before ? "ok" : "FAILED", s.name, g_checks - checks);
}

}  // namespace

int main(int argc, char** argv) {
  const KernelSet& portable = *kernel_sets().front();
  std::vector<std::string> wanted;
  for (int i = 1; i < argc; i++) {
    if (std::string(argv[i]) == "--first-failure")
      g_stop_at_first_failure = true;
    else
      wanted.push_back(argv[i]);
  }
  for (const KernelSet* s : kernel_sets()) {
    const bool named = std::find(wanted.begin(), wanted.end(), s->name) != wanted.end();
    if (!wanted.empty() && !named) continue;
    if (!cpu_supports(*s)) {
      std::printf("%s %s: this CPU lacks its features\n", named ? "FAILED" : "skipped", s->name);
      if (named) g_failures++;
      continue;
    }
    check_set(*s, portable);
  }
  // the set the kernels use on this CPU (kernel_set(): the last supported one), when every set was checked
  if (wanted.empty()) std::printf("selected %s\n", kernel_set().name);
  return g_failures == 0 ? 0 : 1;
}
