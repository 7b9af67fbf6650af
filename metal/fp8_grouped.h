// Groups of rows for the grouped (MoE) kernels, shared by fp8_grouped_mm (fp8_grouped_mm.metal), its
// transposed product fp8_grouped_mm_t (fp8_grouped_mm_t.metal) and the 4-bit ones (w4_grouped.h): group spans, zeroing the rows a kernel does
// not compute, and the lookup of a prefill threadgroup's row tile in fp8_grouped_tiles' table.
// Every kernel, decode and prefill, reads its rows from that table: offsets clamped to [0, T] and made
// non-decreasing (a running max), and ids outside [0, E) act as -1. So malformed values (validated on the host
// where the plan can read them, not on mps) never index outside a buffer, no two groups share a row, and the
// decode and prefill kernels compute the same rows.
// P: the op's params (Fp8GroupedMmParams, W4GroupedParams), read for its rows T, experts E and groups G.
#pragma once
#include <metal_stdlib>
#include "params.h"
using namespace metal;

struct GroupSpan {
  uint begin, end;  // rows [begin, end), 0 <= begin <= end <= T
  int expert;       // -1: zero rows
};

inline uint clamp_row(int o, uint T) {
  return o < 0 ? 0u : min(uint(o), T);
}

inline int checked_expert(int id, uint E) {
  return (id >= 0 && uint(id) < E) ? id : -1;
}

// Group g's rows: segment g + 1 of the tile table (bound = tiles[0 .. G + 3), fp8_grouped_tiles)
template <typename P>
inline GroupSpan group_span(device const uint* tiles, device const int* ids, uint g, constant P& p) {
  GroupSpan s;
  s.begin = tiles[g + 1];
  s.end = tiles[g + 2];
  s.expert = checked_expert(ids[g], p.E);
  return s;
}

// out[r0 .. r1, c0 .. c1) = 0 (row stride `cols`), spread over the threadgroup's threads
template <typename T>
inline void zero_rows(device T* out, uint cols, uint r0, uint r1, uint c0, uint c1, uint tid, uint nthreads) {
  if (r0 >= r1 || c0 >= c1) {
    return;
  }
  const uint w = c1 - c0;
  for (uint i = tid; i < (r1 - r0) * w; i += nthreads) {
    out[ulong(r0 + i / w) * cols + c0 + i % w] = T(0.0f);
  }
}

// Rows in no group, the table's first and last segments: before the first group and after the last one
template <typename T, typename P>
inline void zero_rows_in_no_group(device T* out, uint cols, device const uint* tiles, constant P& p, uint r0, uint r1,
                                  uint c0, uint c1, uint tid, uint nthreads) {
  const uint first = tiles[1], last = tiles[p.G + 1];
  zero_rows<T>(out, cols, r0, min(r1, first), c0, c1, tid, nthreads);
  zero_rows<T>(out, cols, max(r0, last), r1, c0, c1, tid, nthreads);
}

// Prefill threadgroup y's tile in the table of fp8_grouped_tiles (fp8_grouped_mm.metal): rows m0 .. m0 + rows
// of one segment and the segment's expert (-1 for the rows in no group, a -1 group or a bad id).
// rows == 0: y is past the tiles that exist.
struct GroupTile {
  uint m0, rows;
  int expert;
};

template <typename P>
inline GroupTile group_tile(device const uint* tiles, device const int* expert_ids, uint y, constant P& p) {
  device const uint* bound = tiles;
  device const uint* first = tiles + p.G + 3;
  GroupTile t;
  t.m0 = 0;
  t.rows = 0;
  t.expert = -1;
  if (y >= first[p.G + 2]) {
    return t;
  }
  uint lo = 0, hi = p.G + 2;  // first[lo] <= y < first[hi]: the last segment starting at or before tile y
  while (hi - lo > 1) {
    const uint mid = (lo + hi) / 2;
    if (first[mid] <= y) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  t.m0 = bound[lo] + (y - first[lo]) * kFp8GemmTile;
  t.rows = min(kFp8GemmTile, bound[lo + 1] - t.m0);
  t.expert = lo >= 1 && lo <= p.G ? checked_expert(expert_ids[lo - 1], p.E) : -1;
  return t;
}
