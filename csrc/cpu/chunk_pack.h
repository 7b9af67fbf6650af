// Activation rows into the packed orders of the CPU tiles (fp8_simd.h's chunk orders, w4_kernels.h's), shared by
// the fp8 and 4-bit products. The order is a template constant: whole chunks then move through constant offsets,
// unrolled, where a run-time order table with a bounds check per element (or a position computed per element) cost
// about 1 ns per value -- 15-25 us for the 8 rows of a batch-1 MoE call, serial before any thread streams weights.
#pragma once
#include <cstdint>

namespace lowbit::cpu {

// n values of src into dst [padded] (padded: a multiple of the chunk), chunk by chunk: dst[c + p] = src[c + kOrder[p]],
// zero past n.
template <const auto& kOrder, typename T, typename D>
inline void pack_chunks(const T* src, int64_t n, int64_t padded, D* dst) {
  constexpr int64_t kC = int64_t(kOrder.size());
  int64_t c = 0;
  for (; c + kC <= n; c += kC) {
    const T* s = src + c;
    D* d = dst + c;
#pragma GCC unroll 128
    for (int64_t p = 0; p < kC; p++) d[p] = D(s[kOrder[p]]);
  }
  for (; c < padded; c += kC)
    for (int64_t p = 0; p < kC; p++) {
      const int64_t k = c + kOrder[p];
      dst[c + p] = k < n ? D(src[k]) : D(0);
    }
}

// out[s * stride] = the fp32 sum of src[s * len, min(n, (s + 1) * len)) for every segment s of n values: a row of
// x summed over each group (or block) of a weight whose offsets multiply those sums (w = q * scale + offset).
template <typename T>
inline void segment_sums(const T* src, int64_t n, int64_t len, float* out, int64_t stride = 1) {
  for (int64_t s = 0, k = 0; k < n; s++) {
    float sum = 0.f;
    for (const int64_t end = k + len < n ? k + len : n; k < end; k++) sum += float(src[k]);
    out[s * stride] = sum;
  }
}

}  // namespace lowbit::cpu
