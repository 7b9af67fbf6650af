// A plain parallel read of a buffer, for the benchmark's streaming-read bandwidth baseline: the rate at
// which these cores can pull bytes from memory, against which the GEMV's weight stream is compared. It uses
// the widest loads the CPU has (so the baseline is not flattered by a slow reader).
#include "cpu/read_bandwidth.h"

#include <ATen/Parallel.h>

#include <vector>

#include "cpu/isa.h"
#include "cpu/parallel.h"

#if LOWBIT_X86
#include <immintrin.h>
#endif

namespace lowbit::cpu {
namespace {

uint64_t xor_words(const uint64_t* p, int64_t n) {
  uint64_t acc = 0;
  for (int64_t i = 0; i < n; i++) acc ^= p[i];
  return acc;
}

#if LOWBIT_X86
LOWBIT_TARGET_AVX2 uint64_t xor_words_avx2(const uint64_t* p, int64_t n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const auto* v = reinterpret_cast<const __m256i*>(p + i);
    a0 = _mm256_xor_si256(a0, _mm256_loadu_si256(v));
    a1 = _mm256_xor_si256(a1, _mm256_loadu_si256(v + 1));
    a2 = _mm256_xor_si256(a2, _mm256_loadu_si256(v + 2));
    a3 = _mm256_xor_si256(a3, _mm256_loadu_si256(v + 3));
  }
  alignas(32) uint64_t t[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(t), _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3)));
  return t[0] ^ t[1] ^ t[2] ^ t[3] ^ xor_words(p + i, n - i);
}
#endif

}  // namespace

int64_t stream_read(const at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(), "stream_read: needs a contiguous CPU tensor");
  const auto* p = static_cast<const uint64_t*>(t.data_ptr());
  const int64_t words = int64_t(t.nbytes() / sizeof(uint64_t));
#if LOWBIT_X86
  auto* fn = isa() >= Isa::Avx2 ? &xor_words_avx2 : &xor_words;
#else
  auto* fn = &xor_words;
#endif
  std::vector<uint64_t> partial(size_t(at::get_num_threads()) + 1, 0);
  // shared out like the GEMVs' rows (parallel.h): a fixed split would make the baseline wait for the slowest core
  parallel_chunks(words, stream_chunk(words, 8, 1 << 12), [&](int64_t b0, int64_t b1) {
    partial[size_t(at::get_thread_num())] ^= fn(p + b0, b1 - b0);
  });
  uint64_t r = 0;
  for (uint64_t v : partial) r ^= v;
  return int64_t(r);
}

}  // namespace lowbit::cpu
