// fp8_grouped_mm_t (MoE backward): out[r, :] = g[r, :] @ (dec(W[e]) * scale[e]) for the rows r of group g
// with expert e = expert_ids[g]; rows of -1 groups and rows in no group are zero. The dense bodies of mm_t.h
// on the expert's weight and scale slices, laid out over the groups like fp8_grouped_mm's (fp8_grouped.h):
//   fp8_grouped_mm_t_gemv_rows_*  decode, few rows per group: grid (ceil(K / 128), G + 1), 256 threads; a group's
//                            rows (its segment of fp8_grouped_tiles' table, run first by the plan) go in
//                            passes of 8, so each selected expert's weights are read once per group. Grid slot
//                            g == G zeroes the rows in no group.
//   fp8_grouped_mm_t_gemm_*  prefill: grid (ceil(K / 32), ceil(T / 32) + G + 1), 128 threads; threadgroup y
//                            computes the row tile y of fp8_grouped_tiles' table (run first by the plan).
// Fp8GroupedMmParams::flags holds MmTFlags here.
#include <metal_stdlib>
#include "fp8_grouped.h"
#include "mm_t.h"
#include "instantiate.h"
using namespace metal;

template <typename T>
kernel void fp8_grouped_mm_t_gemv(
    device const T* g [[buffer(0)]],
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
  constexpr uint kThreads = kMmTGemvSimdgroups * 32;
  threadgroup float4 red[kMmTGemvSimdgroups * 32];
  const uint k0 = tgid.x * kMmTGemvCols, c1 = min(k0 + kMmTGemvCols, p.K);
  if (tgid.y == p.G) {
    zero_rows_in_no_group<T>(out, p.K, tiles, p, 0, p.T, k0, c1, tid, kThreads);
    return;
  }
  const GroupSpan s = group_span(tiles, expert_ids, tgid.y, p);
  if (s.begin == s.end) {
    return;  // the whole threadgroup
  }
  if (s.expert < 0) {
    zero_rows<T>(out, p.K, s.begin, s.end, k0, c1, tid, kThreads);
    return;
  }
  device const uchar* we = w + ulong(s.expert) * p.N * p.K;
  device const float* se = scale + ulong(s.expert) * p.scale_stride;
  const bool w_vec = (p.flags & kMmTWeightVec) != 0;
  for (uint r = s.begin; r < s.end; r += kMmTGemvRows) {
    mm_t_gemv_rows<T, Fp8Code, kMmTGemvRows>(g + ulong(r) * p.N, min(kMmTGemvRows, s.end - r), we, se, p.scale,
                                             out + ulong(r) * p.K, k0, p.N, p.K, w_vec, red, tid, sg, lane);
  }
}

template <typename T>
kernel void fp8_grouped_mm_t_gemm(
    device const T* g [[buffer(0)]],
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
  // alignas(16): float4 stores (mm_t.h): MSL promises a float array only 4-byte alignment
  alignas(16) threadgroup float gs[kFp8GemmTile * kGemmXStride];
  alignas(16) threadgroup float ws[kFp8GemmTile * kGemmXStride];
  const GroupTile gt = group_tile(tiles, expert_ids, tgid.y, p);
  if (gt.rows == 0) {
    return;  // past the tiles that exist; the whole threadgroup
  }
  const uint k0 = tgid.x * kFp8GemmTile;
  if (gt.expert < 0) {
    zero_rows<T>(out, p.K, gt.m0, gt.m0 + gt.rows, k0, min(k0 + kFp8GemmTile, p.K), tid, kFp8GemmThreads);
    return;
  }
  device const uchar* we = w + ulong(gt.expert) * p.N * p.K;
  device const float* se = scale + ulong(gt.expert) * p.scale_stride;
  mm_t_gemm_tile<T, Fp8Code>(g + ulong(gt.m0) * p.N, gt.rows, we, se, p.scale, out + ulong(gt.m0) * p.K, k0, p.N,
                             p.K, p.flags, gs, ws, tid, sg, lane);
}

LOWBIT_KERNEL(fp8_grouped_mm_t_gemv_rows, fp8_grouped_mm_t_gemv, float)
LOWBIT_KERNEL(fp8_grouped_mm_t_gemv_rows, fp8_grouped_mm_t_gemv, half)
LOWBIT_KERNEL(fp8_grouped_mm_t_gemv_rows, fp8_grouped_mm_t_gemv, bfloat)
LOWBIT_KERNEL(fp8_grouped_mm_t_gemm, fp8_grouped_mm_t_gemm, float)
LOWBIT_KERNEL(fp8_grouped_mm_t_gemm, fp8_grouped_mm_t_gemm, half)
LOWBIT_KERNEL(fp8_grouped_mm_t_gemm, fp8_grouped_mm_t_gemm, bfloat)
