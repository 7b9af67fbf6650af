// The avx512amx set's bf16 GEMM on AMX tiles (amx.h), for the products oneDNN's brgemm serves badly: sums scaled
// segment by segment along K (4-bit group scales, fp8 block scales). Through brgemm each segment (64-128 codes) is a
// call whose sums go to memory for a scalar loop to scale, which cost more than a second bf16 term: the 4-bit
// integer formats took two terms on AMX instead of one (w4_matmul.cpp). Here each segment's block of 32 x 32 sums
// is made in four tiles and scaled by one pass of AVX-512.
#include "cpu/arch/x86/amx.h"

#include <immintrin.h>

#include <algorithm>
#include <vector>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define LOWBIT_TARGET_AMX __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,amx-tile,amx-bf16")))

namespace lowbit::cpu {

const KernelSet& kernel_set_avx512();

namespace {

// Tile registers: sums C[a][b] in tmm(2a + b), rows of A in tmm(4 + a), columns of B in tmm(6 + b); a block is up to
// 2 x 2 tiles of 16 x 16 sums. GCC's tile intrinsics are asm statements that name their register by its literal
// number and declare no memory access: LOWBIT_AMX_MEMORY orders them against the plain loads and stores around them.
#define LOWBIT_AMX_MEMORY() asm volatile("" ::: "memory")
constexpr int kTileRows = 16, kTileDepth = 32, kBlock = 32;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The configuration of a block of rows[a] x cols[b] sums (0: that tile row / column unused).
TileConfig block_config(const int (&rows)[2], const int (&cols)[2]) {
  TileConfig c;
  for (int a = 0; a < 2; a++)
    for (int b = 0; b < 2; b++)
      if (rows[a] && cols[b]) {
        c.rows[2 * a + b] = uint8_t(rows[a]);
        c.colsb[2 * a + b] = uint16_t(cols[b] * 4);
      }
  for (int a = 0; a < 2; a++)
    if (rows[a]) {
      c.rows[4 + a] = uint8_t(rows[a]);
      c.colsb[4 + a] = uint16_t(kTileDepth * 2);
    }
  for (int b = 0; b < 2; b++)
    if (cols[b]) {
      c.rows[6 + b] = uint8_t(kTileDepth / 2);
      c.colsb[6 + b] = uint16_t(cols[b] * 4);
    }
  return c;
}

// GCC's _tile_loadconfig gives its asm only the configuration's first 8 bytes as input: the compiler may drop the
// stores of the rest before it (which made ldtilecfg fault). The whole 64 bytes are this asm's input.
inline __attribute__((always_inline)) void load_tile_config(const TileConfig& config) {
  asm volatile("ldtilecfg %0" ::"m"(config));
}

struct Operands {
  const uint16_t* A;
  int64_t lda;
  const uint16_t* B;
  int64_t ldb;
  float* C;
  int64_t ldc;
};

// The products of depth [k0, k1) into the block's tiles (which hold what they held before).
template <int MT, int NT>
LOWBIT_TARGET_AMX inline __attribute__((always_inline)) void multiply(const Operands& o, int64_t k0, int64_t k1) {
  const int64_t sa = o.lda * 2, sb = o.ldb * 4;
  for (int64_t k = k0; k < k1; k += kTileDepth) {
    const uint16_t* a = o.A + k;
    const uint16_t* b = o.B + k * o.ldb;  // row k / 2 of pairs: (k / 2) * 2 * ldb
    _tile_loadd(4, a, sa);
    _tile_loadd(6, b, sb);
    if constexpr (NT > 1) _tile_loadd(7, b + 2 * kTileRows, sb);
    if constexpr (MT > 1) _tile_loadd(5, a + kTileRows * o.lda, sa);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NT > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (MT > 1) _tile_dpbf16ps(2, 5, 6);
    if constexpr (MT > 1 && NT > 1) _tile_dpbf16ps(3, 5, 7);
  }
}

template <int MT, int NT>
LOWBIT_TARGET_AMX inline __attribute__((always_inline)) void zero_tiles() {
  _tile_zero(0);
  if constexpr (NT > 1) _tile_zero(1);
  if constexpr (MT > 1) _tile_zero(2);
  if constexpr (MT > 1 && NT > 1) _tile_zero(3);
}

// The tiles to sums[32][32] (tile a, b at row 16 a, column 16 b).
template <int MT, int NT>
LOWBIT_TARGET_AMX inline __attribute__((always_inline)) void store_tiles(float* sums) {
  constexpr int64_t s = kBlock * 4;
  LOWBIT_AMX_MEMORY();  // the last segment's reads of sums come first
  _tile_stored(0, sums, s);
  if constexpr (NT > 1) _tile_stored(1, sums + kTileRows, s);
  if constexpr (MT > 1) _tile_stored(2, sums + kTileRows * kBlock, s);
  if constexpr (MT > 1 && NT > 1) _tile_stored(3, sums + kTileRows * kBlock + kTileRows, s);
  LOWBIT_AMX_MEMORY();
}

// One block of C with segments: each segment's sums in the tiles, then scaled into the block's accumulators (rows
// of 32 floats), which go into C once at the end (C = acc, or C += acc where add). Scaling into C itself, segment
// by segment, stalled where C's rows are narrow: at 8 columns two rows share a cache line, and each row's masked
// load waited for the masked store of the row before it (twice the block's time).
template <int MT, int NT>
LOWBIT_TARGET_AMX void segment_block(const Operands& o, int64_t K, bool add, const Bf16Segments& segs,
                                     const int (&rows)[2], const int (&cols)[2]) {
  alignas(64) float sums[kBlock * kBlock], acc[kBlock * kBlock];
  const int nrows = rows[0] + rows[1];
  // masked: a narrow tile leaves the rest of its rows in sums unwritten (stack bytes that read as denormals took
  // microcode assists)
  const __mmask16 mask[2] = {__mmask16((1u << cols[0]) - 1), __mmask16((1u << cols[1]) - 1)};
  for (int64_t s = 0, k0 = 0; k0 < K; s++, k0 += segs.len) {
    zero_tiles<MT, NT>();
    multiply<MT, NT>(o, k0, std::min(K, k0 + segs.len));
    store_tiles<MT, NT>(sums);
    for (int i = 0; i < nrows; i++) {
      const __m512 scale = _mm512_set1_ps(segs.scales[i][s]);
#pragma GCC unroll 2
      for (int b = 0; b < NT; b++) {
        const int at = i * kBlock + kTileRows * b;
        const __m512 v = _mm512_maskz_load_ps(mask[b], sums + at);
        _mm512_store_ps(acc + at, s == 0 ? _mm512_mul_ps(scale, v) : _mm512_fmadd_ps(scale, v, _mm512_load_ps(acc + at)));
      }
    }
  }
  float* const C = o.C;  // a local: the stores into C would make the compiler reload o.C for every row
  const int64_t ldc = o.ldc;
  for (int i = 0; i < nrows; i++)
#pragma GCC unroll 2
    for (int b = 0; b < NT; b++) {
      float* c = C + i * ldc + kTileRows * b;
      const __m512 v = _mm512_load_ps(acc + i * kBlock + kTileRows * b);
      _mm512_mask_storeu_ps(c, mask[b], add ? _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask[b], c)) : v);
    }
}

using SegmentFn = void (*)(const Operands&, int64_t, bool, const Bf16Segments&, const int (&)[2], const int (&)[2]);
constexpr SegmentFn kSegment[2][2] = {{&segment_block<1, 1>, &segment_block<1, 2>},
                                      {&segment_block<2, 1>, &segment_block<2, 2>}};

// The blocks of C in turn, the tiles configured for each block's shape (loaded again only where it changes), each
// through all of K. (Taking each segment through every block before the next, so that a segment's rows of A and
// columns of B came from L1 for all but the first block, measured the same.)
LOWBIT_TARGET_AMX void tile_gemm(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda, const uint16_t* B,
                                 int64_t ldb, float* C, int64_t ldc, bool add, const Bf16Segments& segs) {
  int loaded[4] = {-1, -1, -1, -1};  // the rows and columns of the block shape the tiles are configured for
  for (int64_t i0 = 0; i0 < M; i0 += kBlock)
    for (int64_t j0 = 0; j0 < N; j0 += kBlock) {
      const int64_t mr = std::min<int64_t>(kBlock, M - i0), nc = std::min<int64_t>(kBlock, N - j0);
      const int rows[2] = {int(std::min<int64_t>(kTileRows, mr)), int(std::max<int64_t>(0, mr - kTileRows))};
      const int cols[2] = {int(std::min<int64_t>(kTileRows, nc)), int(std::max<int64_t>(0, nc - kTileRows))};
      if (rows[0] != loaded[0] || rows[1] != loaded[1] || cols[0] != loaded[2] || cols[1] != loaded[3]) {
        const TileConfig config = block_config(rows, cols);
        load_tile_config(config);
        loaded[0] = rows[0], loaded[1] = rows[1], loaded[2] = cols[0], loaded[3] = cols[1];
      }
      const Operands o{A + i0 * lda, lda, B + 2 * j0, ldb, C + i0 * ldc + j0, ldc};
      const int mt = rows[1] ? 2 : 1, nt = cols[1] ? 2 : 1;
      kSegment[mt - 1][nt - 1](o, K, add, Bf16Segments{segs.len, segs.scales + i0}, rows, cols);
    }
}

}  // namespace

bool amx_tiles_granted() {
#if defined(__linux__) && defined(SYS_arch_prctl)
  static const bool granted = [] {
    if ((cpu_features() & kFeatAmx) == 0) return false;
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
#else
  return false;
#endif
}

void amx_bf16_gemm(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb,
                   float* C, int64_t ldc, bool add, const Bf16Segments* segs) {
  const bool tiles = K > 0 && K % kTileDepth == 0 && (segs == nullptr || segs->len % kTileDepth == 0);
  if (!tiles) return kernel_set_avx512().bf16_gemm(M, N, K, A, lda, B, ldb, C, ldc, add, segs);
  if (segs != nullptr) return tile_gemm(M, N, K, A, lda, B, ldb, C, ldc, add, *segs);
  // the unscaled product (no caller on AMX: brgemm serves it) as one segment of all K, each row's scale 1
  const float one = 1.f;
  const std::vector<const float*> ones(size_t(M), &one);
  tile_gemm(M, N, K, A, lda, B, ldb, C, ldc, add, Bf16Segments{K, ones.data()});
}

}  // namespace lowbit::cpu
