// A plain parallel read of a buffer, for the benchmark's streaming-read bandwidth baseline: the rate at
// which these cores can pull bytes from memory, against which the GEMV's weight stream is compared. It uses
// the widest loads of the kernel set that runs (so the baseline is not flattered by a slow reader).
#include "cpu/read_bandwidth.h"

#include <ATen/Parallel.h>

#include <vector>

#include "cpu/arch/kernel_set.h"
#include "cpu/parallel.h"

namespace lowbit::cpu {

int64_t stream_read(const at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(), "stream_read: needs a contiguous CPU tensor");
  const auto* p = static_cast<const uint64_t*>(t.data_ptr());
  const int64_t words = int64_t(t.nbytes() / sizeof(uint64_t));
  const XorWordsFn fn = kernel_set().xor_words;
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
