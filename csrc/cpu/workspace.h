// Per-thread scratch memory that grows and is then reused: the kernels allocate nothing per call beyond the
// output. at::parallel_for runs on a persistent OpenMP pool, so worker buffers live across calls.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <memory>

namespace lowbit::cpu {

// Separate slots so that one thread can hold several buffers at once (the calling thread packs the
// activations into one slot and, as a worker of the same parallel_for, uses others).
enum class Slot : int { Activations = 0, Panel = 1, Tile = 2, Count = 3 };

// Test switch: fill every buffer handed out with 0xFF bytes (NaN as float, -1 as int8), so a kernel that reads
// scratch it did not write in this call fails loudly instead of depending on what an earlier call left there.
inline std::atomic<bool> g_poison_scratch{false};

// A 64-byte aligned buffer of at least n elements of T owned by the calling thread; contents unspecified.
template <typename T>
T* scratch(Slot slot, size_t n) {
  struct Buf {
    std::unique_ptr<void, decltype(&std::free)> p{nullptr, &std::free};
    size_t bytes = 0;
  };
  thread_local Buf bufs[int(Slot::Count)];
  Buf& b = bufs[int(slot)];
  const size_t want = (n * sizeof(T) + 63) / 64 * 64;
  if (want > b.bytes) {
    void* p = std::aligned_alloc(64, want);
    if (!p) throw std::bad_alloc();
    b.p.reset(p);
    b.bytes = want;
  }
  if (g_poison_scratch.load(std::memory_order_relaxed)) std::memset(b.p.get(), 0xFF, want);
  return static_cast<T*>(b.p.get());
}

}  // namespace lowbit::cpu
