// fp8_grouped_mm (MoE): group g owns rows offsets[g] .. offsets[g + 1] of x and uses expert expert_ids[g].
// Both kernels reuse the dense bodies (fp8_gemv.h, fp8_gemm.h) with the expert's weight and scale slices.
//   fp8_grouped_tiles   step 1 of both: one thread lays the rows out as segments and 32-row tiles (below).
//   fp8_grouped_gemv_*  decode, few rows per group: grid (ceil(N / 4), G + 1), 64 threads = 2 simdgroups of
//                       2 output columns each; a group's rows (its segment of the table) go in passes of 8 (one
//                       pass for <= 8 rows), so each selected expert's weights are read once per group.
//                       Grid slot g == G zeroes the rows in no group.
//   fp8_grouped_gemm_*  prefill, step 2: grid (ceil(N / 32), ceil(T / 32) + G + 1), 128 threads; threadgroup
//                       y finds its segment and tile in the step-1 table (a binary search) and computes it,
//                       so only the row tiles that exist run: ceil(T / 32) + G + 1 at most, not T x G.
// A group with expert id -1 zeroes its rows; an empty group has no rows (clamping: fp8_grouped.h).
#include <metal_stdlib>
#include "fp8_gemv.h"
#include "fp8_gemm.h"
#include "fp8_grouped.h"
#include "instantiate.h"
using namespace metal;

template <typename T>
kernel void fp8_grouped_gemv(
    device const T* x [[buffer(0)]],
    device const uchar* w [[buffer(1)]],
    device const float* scale [[buffer(2)]],
    device const uint* tiles [[buffer(3)]],
    device const int* expert_ids [[buffer(4)]],
    device T* out [[buffer(5)]],
    constant Fp8GroupedMmParams& p [[buffer(6)]],
    uint2 tgid [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  constexpr uint kThreads = kFp8GemvSimdgroups * 32;
  constexpr uint kCols = kFp8GemvSimdgroups * kFp8GemvColsRows;  // output columns per threadgroup
  const uint g = tgid.y;
  const uint c0 = tgid.x * kCols, c1 = min(c0 + kCols, p.N);
  if (g == p.G) {
    zero_rows_in_no_group<T>(out, p.N, tiles, p, 0, p.T, c0, c1, tid, kThreads);
    return;
  }
  const GroupSpan s = group_span(tiles, expert_ids, g, p);
  if (s.begin == s.end) {
    return;
  }
  if (s.expert < 0) {
    zero_rows<T>(out, p.N, s.begin, s.end, c0, c1, tid, kThreads);
    return;
  }
  const uint n0 = c0 + sg * kFp8GemvColsRows;
  if (n0 >= p.N) {
    return;  // the whole simdgroup; no barrier follows
  }
  device const uchar* we = w + ulong(s.expert) * p.N * p.K;
  device const float* se = scale + ulong(s.expert) * p.scale_stride;
  const bool vec_loads = (p.flags & kFp8VecLoads) != 0;
  for (uint r = s.begin; r < s.end; r += kFp8GemvRows) {
    gemv_body<T, kFp8GemvRows, kFp8GemvColsRows>(x + ulong(r) * p.K, min(kFp8GemvRows, s.end - r), we, se, p.scale,
                                                 no_bias(), out + ulong(r) * p.N, n0, p.N, p.K, vec_loads, lane);
  }
}

// The prefill tile table, tiles[2 * (G + 3)]: segments s = 0 .. G + 1 in row order -- s = 0 the rows before
// the first group, s = 1 + g group g, s = G + 1 the rows after the last group -- with row bounds
// bound[s] .. bound[s + 1] (bound = tiles[0 .. G + 3)) and first 32-row tile first[s] (first = tiles[G + 3 ..),
// first[G + 2] = the number of tiles). The bounds are the offsets clamped to [0, T] and made non-decreasing (a
// running max): valid offsets are unchanged, malformed ones still give disjoint segments inside [0, T], so the
// tiles never exceed sum ceil(rows / 32) <= ceil(T / 32) + G + 1, the GEMM's grid y. One thread: G is at most
// a few thousand, and the loads are independent of each other.
kernel void fp8_grouped_tiles(
    device const int* offsets [[buffer(0)]],
    device uint* tiles [[buffer(1)]],
    constant Fp8GroupedMmParams& p [[buffer(2)]]) {
  device uint* bound = tiles;
  device uint* first = tiles + p.G + 3;
  uint row = 0, tile = 0;
  bound[0] = 0;
  first[0] = 0;
  for (uint s = 0; s <= p.G + 1; s++) {
    const uint end = s <= p.G ? max(row, clamp_row(offsets[s], p.T)) : p.T;
    tile += (end - row + kFp8GemmTile - 1) / kFp8GemmTile;
    row = end;
    bound[s + 1] = end;
    first[s + 1] = tile;
  }
}

template <typename T>
kernel void fp8_grouped_gemm(
    device const T* x [[buffer(0)]],
    device const uchar* w [[buffer(1)]],
    device const float* scale [[buffer(2)]],
    device const uint* tiles [[buffer(3)]],
    device const int* expert_ids [[buffer(4)]],
    device T* out [[buffer(5)]],
    constant Fp8GroupedMmParams& p [[buffer(6)]],
    uint2 tgid [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup T xs[kFp8GemmTile * kGemmXStride];
  threadgroup half ws[kFp8GemmTile * kGemmWStride];
  const GroupTile gt = group_tile(tiles, expert_ids, tgid.y, p);
  if (gt.rows == 0) {
    return;  // past the tiles that exist; the whole threadgroup
  }
  const uint m0 = gt.m0, rows = gt.rows, id = uint(gt.expert);
  const uint n0 = tgid.x * kFp8GemmTile, c1 = min(n0 + kFp8GemmTile, p.N);
  if (gt.expert < 0) {
    zero_rows<T>(out, p.N, m0, m0 + rows, n0, c1, tid, kFp8GemmThreads);
    return;
  }
  device const uchar* we = w + ulong(id) * p.N * p.K;
  device const float* se = scale + ulong(id) * p.scale_stride;
  fp8_gemm_tile<T>(x + ulong(m0) * p.K, rows, we, se, p.scale, no_bias(), out + ulong(m0) * p.N, n0, p.N, p.K,
                   (p.flags & kFp8VecLoads) != 0, xs, ws, tid, sg, lane);
}

LOWBIT_KERNEL(fp8_grouped_gemv, fp8_grouped_gemv, float)
LOWBIT_KERNEL(fp8_grouped_gemv, fp8_grouped_gemv, half)
LOWBIT_KERNEL(fp8_grouped_gemv, fp8_grouped_gemv, bfloat)
LOWBIT_KERNEL(fp8_grouped_gemm, fp8_grouped_gemm, float)
LOWBIT_KERNEL(fp8_grouped_gemm, fp8_grouped_gemm, half)
LOWBIT_KERNEL(fp8_grouped_gemm, fp8_grouped_gemm, bfloat)
