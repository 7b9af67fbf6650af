// A plain parallel read of a buffer, for the benchmark's streaming-read bandwidth baseline: the rate at
// which these cores can pull bytes from memory, against which the GEMV's weight stream is compared.
#include "cpu/read_bandwidth.h"

#include <ATen/Parallel.h>

#include <cstring>

namespace lowbit::cpu {

int64_t stream_read(const at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(), "stream_read: needs a contiguous CPU tensor");
  const auto* p = static_cast<const uint8_t*>(t.data_ptr());
  const int64_t words = int64_t(t.nbytes() / sizeof(uint64_t));
  constexpr int kLanes = 8;  // independent xor chains, vectorized by the compiler
  std::vector<uint64_t> partial(size_t(at::get_num_threads()) + 1, 0);
  at::parallel_for(0, words / kLanes, 4096, [&](int64_t b0, int64_t b1) {
    uint64_t acc[kLanes] = {};
    for (int64_t b = b0; b < b1; b++) {
      uint64_t v[kLanes];
      std::memcpy(v, p + b * kLanes * sizeof(uint64_t), sizeof(v));
      for (int l = 0; l < kLanes; l++) acc[l] ^= v[l];
    }
    uint64_t r = 0;
    for (int l = 0; l < kLanes; l++) r ^= acc[l];
    partial[size_t(at::get_thread_num())] ^= r;
  });
  uint64_t r = 0;
  for (uint64_t v : partial) r ^= v;
  return int64_t(r);
}

}  // namespace lowbit::cpu
