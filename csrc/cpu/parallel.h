// Work sharing of the CPU kernels: chunks handed out to the threads of the kernels that stream a weight (batch-1
// GEMVs, the fp8 GEMM's panels) and of the read-bandwidth baseline, and the grain of row loops.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace lowbit::cpu {

// Chunks per thread of a streamed range: enough that the threads that finish early take over the work of a
// slow one, few enough that each chunk is a long run of memory (a quarter MB of a Llama-3-8B projection at
// 16 threads).
constexpr int64_t kChunksPerThread = 16;

// Chunk length for n items over the current threads (per_thread chunks each): a multiple of `multiple`, at least
// `min_len`.
inline int64_t stream_chunk(int64_t n, int64_t multiple, int64_t min_len, int64_t per_thread = kChunksPerThread) {
  const int64_t chunks = per_thread * at::get_num_threads();
  const int64_t per = (n + chunks - 1) / chunks;
  return std::max(min_len, (per + multiple - 1) / multiple * multiple);
}

// Grain of an at::parallel_for over rows of row_len values: enough rows that a task holds min_values values.
inline int64_t rows_grain(int64_t row_len, int64_t min_values) {
  return std::max<int64_t>(1, min_values / std::max<int64_t>(1, row_len));
}

struct NoThreadScope {};

// Runs fn(i0, i1) over [0, n) in chunks of `chunk`, each taken by whichever thread asks next (an atomic
// counter), instead of one fixed share per thread: a streaming kernel takes as long as its slowest thread, and
// on cores shared with other work a fixed split waits for it while the others idle. Each thread holds a
// ThreadScope (constructed before its first chunk, destroyed after its last: tile state, scratch to give back)
// while it runs chunks. Inside a parallel region, or with one thread, the chunks run in order on the calling
// thread.
template <typename ThreadScope = NoThreadScope, typename F>
void parallel_chunks(int64_t n, int64_t chunk, const F& fn) {
  if (n <= 0) return;
  const int64_t chunks = (n + chunk - 1) / chunk;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(chunks, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    [[maybe_unused]] ThreadScope scope;
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks;
         c = next.fetch_add(1, std::memory_order_relaxed))
      fn(c * chunk, std::min(n, (c + 1) * chunk));
  });
}

}  // namespace lowbit::cpu
