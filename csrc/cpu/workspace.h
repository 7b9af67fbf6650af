// Per-thread scratch memory that grows and is then reused: the kernels allocate nothing per call beyond the
// output. at::parallel_for runs on a persistent OpenMP pool, so worker buffers live across calls. The kernels
// size their requests by their tiles and K windows, never by a whole operand's padded copy; a buffer above
// kScratchKeepBytes (an unusual shape) is given back by release_scratch_above_cap at the end of its use, so
// that one odd call does not keep its memory for the life of the thread.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <new>

#include <sys/mman.h>
#include <unistd.h>

namespace lowbit::cpu {

// Separate slots so that one thread can hold several buffers at once (the calling thread packs the
// activations into one slot and, as a worker of the same parallel_for, uses others). Operand: a call's copies of a
// weight's small operands in the form the kernels read (the grouped w4 panels' fp32 group scales), made by the
// calling thread and read by all.
enum class Slot : int { Activations = 0, Panel = 1, Tile = 2, Accum = 3, Operand = 4, Count = 5 };

// Buffers up to this size stay with their thread across calls; larger ones are released after use.
constexpr size_t kScratchKeepBytes = size_t(16) << 20;

// Test switch: every buffer handed out is filled with 0xFF bytes (NaN as float, -1 as int8), so a kernel that
// reads scratch it did not write in this call fails loudly instead of depending on what an earlier call left
// there; and it is a fresh mapping whose end (the request rounded up to 64 bytes) meets an inaccessible page, so
// a kernel that reads or writes past what it asked for faults at once, as in the Metal emulator.
inline std::atomic<bool> g_poison_scratch{false};

namespace detail {

// Bytes held by every thread's scratch together, and the most held at once since the last reset (a test hook).
inline std::atomic<size_t> g_scratch_live{0}, g_scratch_high_water{0};

inline void count_scratch(size_t add, size_t sub) {
  if (sub) g_scratch_live.fetch_sub(sub, std::memory_order_relaxed);
  if (!add) return;
  const size_t now = g_scratch_live.fetch_add(add, std::memory_order_relaxed) + add;
  size_t high = g_scratch_high_water.load(std::memory_order_relaxed);
  while (now > high && !g_scratch_high_water.compare_exchange_weak(high, now, std::memory_order_relaxed)) {
  }
}

struct ScratchBuf {
  void* data = nullptr;
  size_t bytes = 0;
  void* map = nullptr;  // the guarded mapping holding data (test switch), else data came from aligned_alloc
  size_t map_len = 0;
  ScratchBuf() = default;
  ScratchBuf(const ScratchBuf&) = delete;
  ScratchBuf& operator=(const ScratchBuf&) = delete;
  ~ScratchBuf() { release(); }
  void release() {
    if (bytes) count_scratch(0, bytes);
    if (map) munmap(map, map_len);
    else std::free(data);
    data = map = nullptr;
    bytes = map_len = 0;
  }
};

inline ScratchBuf& thread_buffer(Slot slot) {
  thread_local ScratchBuf bufs[int(Slot::Count)];
  return bufs[int(slot)];
}

inline void* scratch_bytes(Slot slot, size_t want) {
  ScratchBuf& b = thread_buffer(slot);
  if (g_poison_scratch.load(std::memory_order_relaxed)) {
    b.release();
    const size_t page = size_t(sysconf(_SC_PAGESIZE)), body = (want + page - 1) / page * page;
    void* m = mmap(nullptr, body + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) throw std::bad_alloc();
    mprotect(static_cast<char*>(m) + body, page, PROT_NONE);
    b.map = m, b.map_len = body + page, b.bytes = want;
    count_scratch(want, 0);
    b.data = static_cast<char*>(m) + body - want;  // 64-byte aligned: want and the page are multiples of 64
    std::memset(b.data, 0xFF, want);
    return b.data;
  }
  if (want > b.bytes || b.map) {
    b.release();
    b.data = std::aligned_alloc(64, want);
    if (!b.data) throw std::bad_alloc();
    b.bytes = want;
    count_scratch(want, 0);
  }
  return b.data;
}

}  // namespace detail

// A 64-byte aligned buffer of at least n elements of T owned by the calling thread, one per slot (whatever T);
// contents unspecified. It stays valid until the same thread asks for the same slot again.
template <typename T>
T* scratch(Slot slot, size_t n) {
  return static_cast<T*>(detail::scratch_bytes(slot, std::max<size_t>(64, (n * sizeof(T) + 63) / 64 * 64)));
}

// Gives back the calling thread's buffer of `slot` if it is larger than kScratchKeepBytes; call it once the
// buffer is no longer needed (its pointer is invalid afterwards).
inline void release_scratch_above_cap(Slot slot) {
  detail::ScratchBuf& b = detail::thread_buffer(slot);
  if (b.bytes > kScratchKeepBytes) b.release();
}

// Bytes of scratch held at once at most since the last call, over all threads; then restarts from what is held now.
inline size_t scratch_high_water_and_reset() {
  const size_t high = detail::g_scratch_high_water.load();
  detail::g_scratch_high_water.store(detail::g_scratch_live.load());
  return high;
}

}  // namespace lowbit::cpu
