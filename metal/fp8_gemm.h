// The tiled fp8 GEMM body on 8x8 simdgroup matrices, shared by fp8_mm's large-M kernel (fp8_gemm.metal)
// and fp8_grouped_mm's prefill kernel (fp8_grouped_mm.metal), which differ only in where a tile's rows are.
//
// One threadgroup computes a 32 x 32 output tile (kFp8GemmTile) with 128 threads = 4 simdgroups in a 2 x 2
// arrangement, each owning a 16 x 16 quarter as 2 x 2 simdgroup_float8x8 accumulators. K advances in
// segments of at most 32: thread t stages row t / 4, elements (t % 4) * 8 .. + 8 of both the activation
// tile (as T) and the weight tile (decoded once into half, exact) in threadgroup memory; then each
// simdgroup runs the 8x8 multiply-accumulates with fp32 fragments (activations and weights widen exactly,
// so bf16 never passes through half and fp32 activations keep full precision).
//
// Block scales: a segment never crosses a K-block boundary (its end is clamped to the next multiple of bk,
// the rest of the tile is zero-filled), so the segment's products for column n all share one scale.
// Segments accumulate into `part`; at the end of each K block part * scale(n, block) is added to `acc`,
// i.e. the scale multiplies the block's partial sum in fp32, as design.md asks. With bk a multiple of 32
// (128 in every checkpoint format) no tile is padded; odd extents cost padded MMAs, never wrong results.
// Per-tensor and per-channel scales are one "block" spanning K and multiply once in the epilogue.
#pragma once
#include <metal_stdlib>
#include "bias.h"
#include "fp8.h"
#include "scale.h"
using namespace metal;

constant constexpr uint kGemmXStride = kFp8GemmTile + 4;  // threadgroup row strides (elements): padding
constant constexpr uint kGemmWStride = kFp8GemmTile + 8;  // staggers the rows over the memory banks

// Apple's simdgroup_matrix 8x8 layout: lane holds elements (row, col) and (row, col + 1); returns (col, row).
inline uint2 frag_coord(uint lane) {
  return uint2(((lane >> 3) & 1) * 4 + (lane & 1) * 2, ((lane >> 4) & 1) * 4 + ((lane >> 1) & 3));
}

// Stage activations x[r, k0 + kk] for the tile's rows r < rows, zeros elsewhere (past rows or the segment),
// as S (T itself, or float for kernels that load the tile with simdgroup_load into float matrices).
template <typename T, typename S = T>
inline void gemm_stage_x(threadgroup S* xs, device const T* x, uint rows, uint K, uint k0, uint len, bool vector_ok,
                         uint tid) {
  const uint r = tid / 4, kk = (tid % 4) * 8;
  threadgroup S* dst = xs + r * kGemmXStride + kk;
  device const T* src = x + ulong(r) * K + k0 + kk;
  if (vector_ok && r < rows && kk + 8 <= len) {
    const vec<T, 4> lo = *(device const vec<T, 4>*)src;
    const vec<T, 4> hi = *(device const vec<T, 4>*)(src + 4);
    for (uint j = 0; j < 4; j++) {
      dst[j] = S(lo[j]);
      dst[4 + j] = S(hi[j]);
    }
  } else {
    for (uint j = 0; j < 8; j++) {
      dst[j] = (r < rows && kk + j < len) ? S(src[j]) : S(0.0f);
    }
  }
}

// Stage decoded weights w[n0 + r, k0 + kk] for rows n0 + r < N, zeros elsewhere.
inline void gemm_stage_w(threadgroup half* ws, device const uchar* w, uint n0, uint N, uint K, uint k0, uint len,
                         bool vector_ok, uint tid) {
  const uint r = tid / 4, kk = (tid % 4) * 8;
  threadgroup half* dst = ws + r * kGemmWStride + kk;
  const bool row_ok = n0 + r < N;
  device const uchar* src = w + ulong(row_ok ? n0 + r : 0) * K + k0 + kk;
  if (vector_ok && row_ok && kk + 8 <= len) {
    const uint2 v = *(device const uint2*)src;
    const half4 lo = fp8x4_to_half4(as_type<uchar4>(v.x));
    const half4 hi = fp8x4_to_half4(as_type<uchar4>(v.y));
    for (uint j = 0; j < 4; j++) {
      dst[j] = lo[j];
      dst[4 + j] = hi[j];
    }
  } else {
    for (uint j = 0; j < 8; j++) {
      dst[j] = (row_ok && kk + j < len) ? fp8_e4m3_to_half(src[j]) : half(0.0f);
    }
  }
}

// out[r, n0 + c] for the tile rows r < rows and columns n0 + c < N. x and out point at the tile's first row
// (row strides K and N). xs / ws: threadgroup arrays of kFp8GemmTile * kGemmXStride / kGemmWStride elements.
// vec_loads: kFp8VecLoads. Every thread of the threadgroup must call this (it has barriers).
template <typename T>
inline void fp8_gemm_tile(device const T* x, uint rows, device const uchar* w, device const float* scale,
                          constant ScaleParams& sp, BiasRef bias, device T* out, uint n0,
                          uint N, uint K, bool vec_loads, threadgroup T* xs, threadgroup half* ws, uint tid, uint sg,
                          uint lane) {
  const uint sm = (sg / 2) * 16, sn = (sg % 2) * 16;  // this simdgroup's quarter of the tile
  const uint2 fc = frag_coord(lane);
  const bool block = sp.kind == kScalePerBlock;
  simdgroup_float8x8 acc[2][2], part[2][2];
  for (uint i = 0; i < 2; i++) {
    for (uint j = 0; j < 2; j++) {
      acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      part[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }
  }
  for (uint k0 = 0; k0 < K;) {
    uint k1 = min(k0 + kFp8GemmTile, K);
    if (block) {
      k1 = uint(min(ulong(k1), ulong(k0 - k0 % sp.bk) + sp.bk));  // stay inside one K block
    }
    const uint len = k1 - k0;
    const bool vec_seg = vec_loads && k0 % 8 == 0;  // 8-element staging runs start 16-byte aligned
    gemm_stage_x<T>(xs, x, rows, K, k0, len, vec_seg, tid);
    gemm_stage_w(ws, w, n0, N, K, k0, len, vec_seg, tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint kk = 0; kk < len; kk += 8) {  // len is the same for the whole threadgroup
      simdgroup_float8x8 a[2], b[2];
      for (uint i = 0; i < 2; i++) {  // A(m, k) = x
        threadgroup const T* src = xs + (sm + 8 * i + fc.y) * kGemmXStride + kk + fc.x;
        a[i].thread_elements()[0] = float(src[0]);
        a[i].thread_elements()[1] = float(src[1]);
      }
      for (uint j = 0; j < 2; j++) {  // B(k, n) = w[n, k]
        threadgroup const half* src = ws + (sn + 8 * j + fc.x) * kGemmWStride + kk + fc.y;
        b[j].thread_elements()[0] = float(src[0]);
        b[j].thread_elements()[1] = float(src[kGemmWStride]);
      }
      for (uint i = 0; i < 2; i++) {
        for (uint j = 0; j < 2; j++) {
          simdgroup_multiply_accumulate(part[i][j], a[i], b[j], part[i][j]);
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the next segment overwrites xs / ws
    if (k1 == K || (block && k1 % sp.bk == 0)) {       // end of a K block: fold its partial sums into acc
      for (uint j = 0; j < 2; j++) {
        const uint n = n0 + sn + 8 * j + fc.x;
        const float s0 = block && n < N ? weight_scale(sp, scale, n, k0) : 1.0f;
        const float s1 = block && n + 1 < N ? weight_scale(sp, scale, n + 1, k0) : 1.0f;
        for (uint i = 0; i < 2; i++) {
          acc[i][j].thread_elements()[0] += part[i][j].thread_elements()[0] * s0;
          acc[i][j].thread_elements()[1] += part[i][j].thread_elements()[1] * s1;
          part[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        }
      }
    }
    k0 = k1;
  }
  for (uint i = 0; i < 2; i++) {
    const uint r = sm + 8 * i + fc.y;
    if (r >= rows) {
      continue;
    }
    for (uint j = 0; j < 2; j++) {
      for (uint e = 0; e < 2; e++) {
        const uint n = n0 + sn + 8 * j + fc.x + e;
        if (n < N) {
          float v = acc[i][j].thread_elements()[e];
          if (!block) {
            v *= weight_scale(sp, scale, n, 0);
          }
          out[ulong(r) * N + n] = T(add_bias(bias, v, n));
        }
      }
    }
  }
}
