// fp8 e4m3fn decode for the CPU kernels, in chunks of 32 codes.
//
// Every kernel set decodes a chunk into the same order of 32 floats (kChunkOrder), so the packed
// activations are shared: position p of a chunk holds code k = kChunkOrder[p]. The AVX2 decode produces that
// order without a single cross-lane byte shuffle (even and odd bytes are converted separately), which keeps
// it off the shuffle port that would otherwise bound the decode below memory bandwidth.
//
// The decoded value is dec(code) / 256, exactly: e4m3 (bias 7) moved into a half (bias 15) keeps all bits,
// subnormals included, and half subnormals convert exactly (F16C ignores DAZ). The kernels multiply the
// reduced sum by 256 once (exact: a power of two). Codes 0x7F / 0xFF would decode to 480 / 256, so the AVX2
// path tracks NaN codes per weight row and the epilogue makes those outputs NaN; the portable table holds NaN.
#pragma once
#include <array>
#include <cstdint>

#include "cpu/fp8.h"

namespace lowbit::cpu {

constexpr int kChunk = 32;
constexpr float kDecodeUnscale = 256.f;  // dec(code) == kDecodeUnscale * decoded value

constexpr std::array<uint8_t, kChunk> make_chunk_order() {
  std::array<uint8_t, kChunk> o{};
  // vector q of 8 floats: q = 0 even codes 0..14, 1 even 16..30, 2 odd 1..15, 3 odd 17..31
  for (int p = 0; p < kChunk; p++) o[p] = uint8_t((p / 8 & 1) * 16 + (p / 16) + 2 * (p % 8));
  return o;
}
inline constexpr std::array<uint8_t, kChunk> kChunkOrder = make_chunk_order();

// bf16 activations (the AVX-512 BF16 and Arm bf16 tiles): chunks of 64 codes, position p holds code
// kBf16ChunkOrder[p] -- the order of 16-bit words that byte unpacks of 64 decoded codes produce (8 codes per 128-bit
// lane and half); NEON's zip1 / zip2 of 16 decoded codes give it too (arm/bf16.cpp).
constexpr int kBf16Chunk = 64;
constexpr std::array<uint8_t, kBf16Chunk> make_bf16_chunk_order() {
  std::array<uint8_t, kBf16Chunk> o{};
  for (int p = 0; p < kBf16Chunk; p++) o[p] = uint8_t(16 * (p % 32 / 8) + 8 * (p / 32) + p % 8);
  return o;
}
inline constexpr std::array<uint8_t, kBf16Chunk> kBf16ChunkOrder = make_bf16_chunk_order();
// Positions 2i and 2i + 1 hold consecutive codes (the bf16 GEMM packs x in such pairs).
constexpr bool bf16_chunk_pairs_consecutive() {
  for (int p = 0; p < kBf16Chunk; p += 2)
    if (kBf16ChunkOrder[p + 1] != kBf16ChunkOrder[p] + 1) return false;
  return true;
}
static_assert(bf16_chunk_pairs_consecutive(), "kBf16ChunkOrder");

constexpr std::array<float, 256> make_fp8_table_unscaled() {
  std::array<float, 256> t{};
  // NaN codes keep their NaN without arithmetic on it: clang refuses a constant expression that computes a NaN
  for (int i = 0; i < 256; i++) {
    const float v = fp8_e4m3_value(uint8_t(i));
    t[i] = (i & 0x7F) == 0x7F ? v : v / kDecodeUnscale;
  }
  return t;
}
inline constexpr std::array<float, 256> kFp8TableUnscaled = make_fp8_table_unscaled();

inline int64_t round_up_chunk(int64_t n) { return (n + kChunk - 1) / kChunk * kChunk; }

// Whether codes [0, n) hold a NaN code (0x7F or 0xFF): the slow check, for the rare rows a fast one flagged.
inline bool has_nan_code(const uint8_t* code, int64_t n) {
  for (int64_t k = 0; k < n; k++)
    if ((code[k] & 0x7F) == 0x7F) return true;
  return false;
}

// Portable: 32 codes -> dst[p] = dec(code[kChunkOrder[p]]) / 256, NaN codes give NaN.
inline void decode_chunk_portable(const uint8_t* code, float* dst) {
  for (int p = 0; p < kChunk; p++) dst[p] = kFp8TableUnscaled[code[kChunkOrder[p]]];
}


}  // namespace lowbit::cpu
