// Where the batch-1 GEMV tiles prefetch. A tile reads its nr weight rows side by side, each row a stream of K
// bytes, and the next tile's rows follow in memory; the stream of row r goes on in row r of the next tile. The
// tiles fetch a fixed distance ahead along each stream, whatever K is. The same offset of the next tile's rows (a
// distance of K) is too far ahead for long rows (K = 14336: a slower stream on many threads); a distance that stops
// at the end of the row leaves the first lines of every next tile to the hardware prefetchers, which stop at 4 KB
// pages. Rows shorter than the distance (a MoE expert's down projection: K = 768 codes, 384 bytes) continue their
// stream through as many tiles as the distance spans, not only the next one: one tile ahead is too little time for a
// line to arrive.
#pragma once
#include <cstdint>

namespace lowbit::cpu {

constexpr int64_t kGemvPrefetchBytes = 2048;

// The address `ahead` bytes (kGemvPrefetchBytes unless given) past byte p along the stream of row r, in a tile of
// nr rows of K bytes at w: in the same row, or past its end in row r of a following tile. A tile that reads a second
// stream beside the weight's (its group scales) fetches it as far ahead in codes: a proportionally shorter distance.
inline const char* gemv_prefetch_target(const void* w, int64_t K, int r, int nr, int64_t p,
                                        int64_t ahead = kGemvPrefetchBytes) {
  const char* b = static_cast<const char*>(w);
  const int64_t q = p + ahead;
  if (q < K) return b + r * K + q;
  if (K >= ahead) return b + (nr + r) * K + (q - K);
  // rows shorter than the distance: the same offset, as many tiles on as the distance spans (loop-invariant)
  return b + (((ahead + K - 1) / K) * nr + r) * K + p;
}

}  // namespace lowbit::cpu
