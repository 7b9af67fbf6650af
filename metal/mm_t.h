// The transposed products of the backward passes, out[M, K] = g[M, N] @ (dec(W[N, K]) * scale), shared by
// fp8_mm_t / int8_weight_mm_t (mm_t.metal) and fp8_grouped_mm_t (fp8_grouped_mm_t.metal).
//
// The reduction runs over N, the rows of W, so W is read row-major, as stored, as the B operand
// (B(n, k) = W[n, k]): no transpose, in memory or in the loads. A weight code (Fp8Code, Int8Code) says how
// four bytes decode to floats (exactly: every e4m3 and int8 value is a float). Scales: per tensor the sum is
// multiplied once, at the end; per channel and per block the scale varies along the reduction, so each
// decoded weight is multiplied by its scale in fp32 before the product (one rounding per product, the size
// of the fp32 accumulation error). Sums are fp32; the output is rounded once.
//
//   mm_t_gemv_rows  few rows (M <= 8): a threadgroup of kMmTGemvSimdgroups simdgroups owns 128 output
//                   columns, each lane 4 of them; simdgroup s walks rows n = s, s + 8, ... of W (32 lanes read
//                   128 contiguous bytes of a row) and accumulates g[m, n] * W[n, k .. k + 4) in registers.
//                   The simdgroups' sums are added in threadgroup memory in simdgroup order: no atomics, the
//                   same bits for every thread schedule.
//   mm_t_gemm_tile  more rows: a 32 x 32 output tile, 4 simdgroups of 2 x 2 simdgroup_float8x8 accumulators;
//                   N advances 32 per step, staging g[32 rows, 32] and the scaled decoded W[32 rows, 32
//                   columns] as float in threadgroup memory, both loaded with simdgroup_load as they lie.
#pragma once
#include <metal_stdlib>
#include "fp8.h"
#include "fp8_gemm.h"
#include "scale.h"
using namespace metal;

struct Fp8Code {
  static float4 decode4(uint word) { return fp8x4_to_float4(as_type<uchar4>(word)); }
  static float decode(uchar b) { return fp8_e4m3_to_float(b); }
};

struct Int8Code {
  static float4 decode4(uint word) { return float4(as_type<char4>(word)); }
  static float decode(uchar b) { return float(as_type<char>(b)); }
};

// dec(W[n, k .. k + 4)) times the per-channel / per-block scale, zeros at columns >= K. row = W + n * K;
// k is a multiple of 4. vec: kMmTWeightVec (4-byte aligned rows).
template <typename Code>
inline float4 mm_t_weight4(device const uchar* row, uint n, uint k, uint K, bool vec, device const float* scale,
                           constant ScaleParams& sp) {
  if (k >= K) {
    return float4(0.0f);
  }
  float4 v;
  if (vec && k + 4 <= K) {
    v = Code::decode4(*(device const uint*)(row + k));
  } else {
    for (uint j = 0; j < 4; j++) {
      v[j] = k + j < K ? Code::decode(row[k + j]) : 0.0f;
    }
  }
  if (sp.kind == kScalePerChannel) {
    v *= scale[n];
  } else if (sp.kind == kScalePerBlock) {
    if (sp.bk % 4 == 0) {
      v *= weight_scale(sp, scale, n, k);  // the 4 columns lie in one K block
    } else {
      for (uint j = 0; j < 4; j++) {
        if (k + j < K) {
          v[j] *= weight_scale(sp, scale, n, k + j);
        }
      }
    }
  }
  return v;
}

inline float mm_t_final_scale(constant ScaleParams& sp, device const float* scale) {
  return sp.kind == kScalePerTensor ? scale[0] : 1.0f;
}

// out[m, k0 + c] for m < nrows (<= MR, the same for the whole threadgroup), c < 128, k0 + c < K. g and out point
// at the first row (row strides N and K). red: kMmTGemvSimdgroups * 32 float4 of threadgroup memory.
// Every thread of the threadgroup must call this (it has barriers).
template <typename T, typename Code, uint MR>
inline void mm_t_gemv_rows(device const T* g, uint nrows, device const uchar* w, device const float* scale,
                           constant ScaleParams& sp, device T* out, uint k0, uint N, uint K, bool w_vec,
                           threadgroup float4* red, uint tid, uint sg, uint lane) {
  const uint k = k0 + lane * kMmTGemvLaneCols;
  float4 acc[MR];
  for (uint m = 0; m < MR; m++) {
    acc[m] = float4(0.0f);
  }
  if (k < K) {
    for (uint n = sg; n < N; n += kMmTGemvSimdgroups) {
      const float4 wv = mm_t_weight4<Code>(w + ulong(n) * K, n, k, K, w_vec, scale, sp);
      for (uint m = 0; m < MR; m++) {
        if (m < nrows) {
          acc[m] += float(g[ulong(m) * N + n]) * wv;
        }
      }
    }
  }
  const float s = mm_t_final_scale(sp, scale);
  for (uint m = 0; m < MR; m++) {
    if (m >= nrows) {
      break;
    }
    red[sg * 32 + lane] = acc[m];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid < kMmTGemvCols && k0 + tid < K) {
      float sum = 0.0f;
      for (uint i = 0; i < kMmTGemvSimdgroups; i++) {
        sum += red[i * 32 + tid / kMmTGemvLaneCols][tid % kMmTGemvLaneCols];
      }
      out[ulong(m) * K + k0 + tid] = T(sum * s);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the next row overwrites red
  }
}

// Stage dec(W[n0 + r, k0 + c]) * scale for rows r < len and columns c < 32 as float, zeros past len or K:
// thread t stages row t / 4, columns (t % 4) * 8 .. + 8.
template <typename Code>
inline void mm_t_stage_w(threadgroup float* ws, device const uchar* w, device const float* scale,
                         constant ScaleParams& sp, uint n0, uint len, uint k0, uint K, bool w_vec, uint tid) {
  const uint r = tid / 4, c = (tid % 4) * 8;
  float4 lo = float4(0.0f), hi = float4(0.0f);
  if (r < len) {
    const uint n = n0 + r;
    device const uchar* row = w + ulong(n) * K;
    lo = mm_t_weight4<Code>(row, n, k0 + c, K, w_vec, scale, sp);
    hi = mm_t_weight4<Code>(row, n, k0 + c + 4, K, w_vec, scale, sp);
  }
  threadgroup float* dst = ws + r * kGemmXStride + c;
  *(threadgroup float4*)dst = lo;
  *(threadgroup float4*)(dst + 4) = hi;
}

// out[r, k0 + c] for tile rows r < rows and columns k0 + c < K; g and out point at the tile's first row (row
// strides N and K). gs, ws: threadgroup arrays of kFp8GemmTile * kGemmXStride floats. Every thread of the
// threadgroup must call this (it has barriers).
template <typename T, typename Code>
inline void mm_t_gemm_tile(device const T* g, uint rows, device const uchar* w, device const float* scale,
                           constant ScaleParams& sp, device T* out, uint k0, uint N, uint K, uint flags,
                           threadgroup float* gs, threadgroup float* ws, uint tid, uint sg, uint lane) {
  const uint sm = (sg / 2) * 16, sk = (sg % 2) * 16;  // this simdgroup's quarter of the tile
  const bool g_vec = (flags & kMmTGradVec) != 0, w_vec = (flags & kMmTWeightVec) != 0;
  simdgroup_float8x8 acc[2][2];
  for (uint i = 0; i < 2; i++) {
    for (uint j = 0; j < 2; j++) {
      acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }
  }
  for (uint n0 = 0; n0 < N; n0 += kFp8GemmTile) {
    const uint len = min(kFp8GemmTile, N - n0);
    gemm_stage_x<T, float>(gs, g, rows, N, n0, len, g_vec, tid);  // A(m, n) = g[m, n]
    mm_t_stage_w<Code>(ws, w, scale, sp, n0, len, k0, K, w_vec, tid);  // B(n, k) = W[n, k] * scale
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint nn = 0; nn < len; nn += 8) {  // len is the same for the whole threadgroup
      simdgroup_float8x8 a[2], b[2];
      for (uint i = 0; i < 2; i++) {
        simdgroup_load(a[i], gs + (sm + 8 * i) * kGemmXStride + nn, kGemmXStride);
      }
      for (uint j = 0; j < 2; j++) {
        simdgroup_load(b[j], ws + nn * kGemmXStride + sk + 8 * j, kGemmXStride);
      }
      for (uint i = 0; i < 2; i++) {
        for (uint j = 0; j < 2; j++) {
          simdgroup_multiply_accumulate(acc[i][j], a[i], b[j], acc[i][j]);
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the next step overwrites gs / ws
  }
  const uint2 fc = frag_coord(lane);
  const float s = mm_t_final_scale(sp, scale);
  for (uint i = 0; i < 2; i++) {
    const uint r = sm + 8 * i + fc.y;
    if (r >= rows) {
      continue;
    }
    for (uint j = 0; j < 2; j++) {
      for (uint e = 0; e < 2; e++) {
        const uint k = k0 + sk + 8 * j + fc.x + e;
        if (k < K) {
          out[ulong(r) * K + k] = T(acc[i][j].thread_elements()[e] * s);
        }
      }
    }
  }
}
