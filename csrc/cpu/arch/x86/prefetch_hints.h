// Which cache level the AVX-512 kernels prefetch their weight streams into (gemv_prefetch.h says where).
#pragma once
#include <immintrin.h>

namespace lowbit::cpu {

// Into L1: the fp32-activation GEMV tiles and the panel decodes. At batch 1 on a Sapphire Rapids (2 threads,
// weights from DRAM) the fp8 tile streamed 18-20 GB/s against 15-18 with the L2 hint, in alternating runs; a tile's
// rows are used within a few microseconds, long before L1 would evict them.
constexpr auto kPrefetchHint = _MM_HINT_T0;

// The outer-level hint: the GEMV tiles with few instructions per byte (bf16 activations on fp8 and 4-bit weights,
// int8 on int8), whose lines in flight are more than L1's miss buffers hold. With the L1 hint the 4-bit bf16 tile
// streamed 21-23 GB/s on a 2-core Zen 4 where it streams 26-39 GB/s with this one (alternating builds); with 16
// threads on Sapphire Rapids the fp8 tile came a few percent closer to the read bandwidth, and no slower at 2.
constexpr auto kOuterPrefetchHint = _MM_HINT_T2;

}  // namespace lowbit::cpu
