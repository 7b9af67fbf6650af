// AMX tiles for the amx kernel set's own loops (the batch-1 4-bit GEMV in w4_avx512.cpp; the GEMMs reach AMX through
// torch's brgemm instead, brgemm.h). The loops name tile operations through these wrappers, so that the torch-free
// harness can build them with LOWBIT_AMX_EMULATED: the same kernels on plain C++ tiles, run on any AVX-512 CPU
// (CI has no AMX), with the instructions' documented arithmetic (TDPBF16PS: bf16 pairs multiplied exactly,
// accumulated in fp32 round-to-nearest-even, bf16 denormal inputs read as zero, denormal results flushed to zero).
// Tile numbers are compile-time constants in both builds (the instructions encode them).
#pragma once
#include <cstdint>
#include <cstring>

#include "cpu/arch/x86/target.h"

#if LOWBIT_AMX_EMULATED
#define LOWBIT_TARGET_AMX LOWBIT_TARGET_AVX512BF16
#else
#include <immintrin.h>
#define LOWBIT_TARGET_AMX                                                                                    \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx512bf16,amx-tile," \
                        "amx-bf16")))
#endif

namespace lowbit::cpu::amx {

// The 64-byte operand of LDTILECFG (palette 1: up to 8 tiles of up to 16 rows of 64 bytes).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  void set(int tile, int rows_, int colsb_) {
    rows[tile] = uint8_t(rows_);
    colsb[tile] = uint16_t(colsb_);
  }
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

#if LOWBIT_AMX_EMULATED
struct EmulatedTiles {
  TileConfig cfg;
  bool configured = false;
  alignas(64) uint8_t t[8][16 * 64];
};
inline EmulatedTiles& emulated_tiles() {
  static thread_local EmulatedTiles tiles;
  return tiles;
}
// A tile instruction without a loaded configuration raises #UD on the CPU: the emulation stops the harness.
inline EmulatedTiles& configured_tiles() {
  EmulatedTiles& e = emulated_tiles();
  if (!e.configured) __builtin_trap();
  return e;
}
inline float bf16_daz(uint16_t h) {
  const uint32_t b = (h & 0x7F80u) == 0 ? uint32_t(h & 0x8000u) << 16 : uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
inline float ftz(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  if ((b & 0x7F800000u) == 0) b &= 0x80000000u;
  std::memcpy(&f, &b, 4);
  return f;
}
inline void load_config(const TileConfig& c) {
  EmulatedTiles& e = emulated_tiles();
  e.cfg = c;
  e.configured = true;
  std::memset(e.t, 0, sizeof(e.t));
}
inline void release() { emulated_tiles().configured = false; }
template <int T>
inline void zero() {
  std::memset(configured_tiles().t[T], 0, 16 * 64);
}
template <int T>
inline void load(const void* p, int64_t stride) {
  EmulatedTiles& e = configured_tiles();
  for (int r = 0; r < e.cfg.rows[T]; r++)
    std::memcpy(e.t[T] + r * 64, static_cast<const char*>(p) + r * stride, e.cfg.colsb[T]);
}
template <int T>
inline void store(void* p, int64_t stride) {
  EmulatedTiles& e = configured_tiles();
  for (int r = 0; r < e.cfg.rows[T]; r++)
    std::memcpy(static_cast<char*>(p) + r * stride, e.t[T] + r * 64, e.cfg.colsb[T]);
}
// C[m][n] += sum over pairs k of A[m][2k] B[k][2n] + A[m][2k + 1] B[k][2n + 1], the instruction's order
template <int C, int A, int B>
inline void dp_bf16(){
  EmulatedTiles& e = configured_tiles();
  const int M = e.cfg.rows[C], N = e.cfg.colsb[C] / 4, pairs = e.cfg.colsb[A] / 4;
  for (int m = 0; m < M; m++)
    for (int n = 0; n < N; n++) {
      float acc;
      std::memcpy(&acc, e.t[C] + m * 64 + 4 * n, 4);
      for (int k = 0; k < pairs; k++) {
        uint16_t a[2], b[2];
        std::memcpy(a, e.t[A] + m * 64 + 4 * k, 4);
        std::memcpy(b, e.t[B] + k * 64 + 4 * n, 4);
        acc = ftz(acc + bf16_daz(a[0]) * bf16_daz(b[0]));
        acc = ftz(acc + bf16_daz(a[1]) * bf16_daz(b[1]));
      }
      std::memcpy(e.t[C] + m * 64 + 4 * n, &acc, 4);
    }
}
#else
LOWBIT_TARGET_AMX inline void load_config(const TileConfig& c) { _tile_loadconfig(&c); }
LOWBIT_TARGET_AMX inline void release() { _tile_release(); }
// The tile number is an immediate of the instruction: `%c` prints the constant into the register's name (the
// compilers' own macros paste the argument's spelling, which a template parameter does not have). "memory": the
// loads read what vector stores just staged, the stores write what vector loads read next.
template <int T>
LOWBIT_TARGET_AMX inline __attribute__((always_inline)) void zero() {
  __asm__ volatile("tilezero %%tmm%c0" ::"i"(T));
}
template <int T>
LOWBIT_TARGET_AMX inline __attribute__((always_inline)) void load(const void* p, int64_t stride) {
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(p), "r"(stride), "i"(T) : "memory");
}
template <int T>
LOWBIT_TARGET_AMX inline __attribute__((always_inline)) void store(void* p, int64_t stride) {
  __asm__ volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(p), "r"(stride), "i"(T) : "memory");
}
template <int C, int A, int B>
LOWBIT_TARGET_AMX inline __attribute__((always_inline)) void dp_bf16() {
  __asm__ volatile("tdpbf16ps %%tmm%c0, %%tmm%c1, %%tmm%c2" ::"i"(B), "i"(A), "i"(C));
}
#endif

}  // namespace lowbit::cpu::amx
