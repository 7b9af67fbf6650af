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

// The addresses `ahead` bytes (kGemvPrefetchBytes unless given) past byte p along the stream of row r, in a tile of
// nr rows of K bytes at w: in the same row, or past its end in row r of a following tile. A tile that reads a second
// stream beside the weight's (its group scales) fetches it as far ahead in codes: a proportionally shorter distance.
// Made once per tile: the rows a stream skips to its target are worked out here, not at every step (where a short
// row's count of tiles was a 64-bit division per step that the compiler left in the loop).
class GemvPrefetch {
 public:
  GemvPrefetch(const void* w, int64_t K, int nr, int64_t ahead = kGemvPrefetchBytes)
      : base_(static_cast<const char*>(w)), K_(K), ahead_(ahead),
        // rows shorter than the distance: the same offset, as many tiles on as the distance spans
        skip_(K >= ahead ? nr : (ahead + K - 1) / (K > 0 ? K : 1) * nr) {}
  // The same streams `rows` rows further on (the next tiles of a range of rows): no division again.
  GemvPrefetch rows_on(int64_t rows) const {
    GemvPrefetch p = *this;
    p.base_ += rows * K_;
    return p;
  }
  const char* operator()(int r, int64_t p) const {
    const int64_t q = p + ahead_;
    if (q < K_) return base_ + r * K_ + q;
    if (K_ >= ahead_) return base_ + (skip_ + r) * K_ + (q - K_);
    return base_ + (skip_ + r) * K_ + p;
  }

 private:
  const char* base_;
  int64_t K_, ahead_, skip_;  // skip_: rows from a row to the one its stream goes on in
};

}  // namespace lowbit::cpu
