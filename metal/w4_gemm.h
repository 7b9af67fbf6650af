// The tiled 4-bit products on 8x8 simdgroup matrices, shared by w4_mm's GEMM (w4_gemm.metal) and w4_mm_t's
// (w4_mm_t.metal), and by the grouped ones (w4_grouped_mm.metal, w4_grouped_mm_t.metal). Both stage a 32 x 32 tile of the weight W[n0 .. n0 + 32, k0 .. k0 + 32) decoded to fp32 in
// threadgroup memory (each weight decoded once per tile, exactly as the format defines it: no scale is folded
// into a partial sum) and a 32 x 32 tile of the activations (or grad_out) as fp32, then 4 simdgroups in a 2 x 2
// arrangement run 2 x 2 simdgroup_float8x8 multiply-accumulates each, in fp32. w4_mm's B operand is the
// weight tile read transposed (B(k, n) = W[n, k]), w4_mm_t's the tile as it lies (B(n, k) = W[n, k]). Edge
// tiles are zero-filled past M, N and K; the padding never reaches a stored output.
#pragma once
#include <metal_stdlib>
#include "fp8_gemm.h"
#include "w4.h"
using namespace metal;

constant constexpr uint kW4TileStride = kGemmXStride;  // floats per threadgroup row (32 + 4: bank staggering)

// ws[r, c] = W[n0 + r, k0 + c] for n0 + r < N, k0 + c < K, else 0. Thread t decodes row t / 4, columns
// (t % 4) * 8 .. + 8: one 32-bit word of codes.
template <typename S, typename O>
inline void w4_stage_w(threadgroup float* ws, device const uchar* codes, device const uchar* scale,
                       device const uchar* offset, constant W4Params& p, uint n0, uint k0, uint tid) {
  const uint r = tid / 4, c = (tid % 4) * 8;
  const uint n = n0 + r, k = k0 + c, rb = (p.K + 1) / 2;
  float4 lo = float4(0.0f), hi = float4(0.0f);
  if (n < p.N && k < p.K) {
    const uint word = w4_load_word(codes + ulong(n) * rb, k / 2, rb, (p.flags & kW4CodesWord) != 0);
    w4_decode8<S, O>(p, word, scale, offset, ulong(n) * p.G, k, min(8u, p.K - k), lo, hi);
  }
  threadgroup float* dst = ws + r * kW4TileStride + c;
  *(threadgroup float4*)dst = lo;
  *(threadgroup float4*)(dst + 4) = hi;
}

struct W4TileAcc {
  simdgroup_float8x8 m[2][2];
};

inline W4TileAcc w4_zero_acc() {
  W4TileAcc acc;
  for (uint i = 0; i < 2; i++) {
    for (uint j = 0; j < 2; j++) {
      acc.m[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }
  }
  return acc;
}

// acc += A[sm .. sm + 16, 0 .. len) @ B[0 .. len, sb .. sb + 16): A = as (rows of the output), B = ws as it lies
// (TransposedB false: B(i, j) = ws[i, j]) or transposed (true: B(i, j) = ws[j, i]).
template <bool TransposedB>
inline void w4_tile_mma(thread W4TileAcc& acc, threadgroup const float* as, threadgroup const float* ws, uint sm,
                        uint sb, uint len) {
  for (uint kk = 0; kk < len; kk += 8) {  // len is the same for the whole threadgroup
    simdgroup_float8x8 a[2], b[2];
    for (uint i = 0; i < 2; i++) {
      simdgroup_load(a[i], as + (sm + 8 * i) * kW4TileStride + kk, kW4TileStride);
    }
    for (uint j = 0; j < 2; j++) {
      if (TransposedB) {
        simdgroup_load(b[j], ws + (sb + 8 * j) * kW4TileStride + kk, kW4TileStride, ulong2(0, 0), true);
      } else {
        simdgroup_load(b[j], ws + kk * kW4TileStride + sb + 8 * j, kW4TileStride);
      }
    }
    for (uint i = 0; i < 2; i++) {
      for (uint j = 0; j < 2; j++) {
        simdgroup_multiply_accumulate(acc.m[i][j], a[i], b[j], acc.m[i][j]);
      }
    }
  }
}

// out[r, c0 + c] = T(acc * gmul (+ bias[c0 + c])) for tile rows r < rows, columns c0 + c < cols; out points
// at the tile's first row (row stride ld).
template <typename T>
inline void w4_tile_store(thread const W4TileAcc& acc, device T* out, uint rows, uint c0, uint cols, uint ld,
                          float gmul, BiasRef bias, uint sm, uint sc, uint lane) {
  const uint2 fc = frag_coord(lane);
  for (uint i = 0; i < 2; i++) {
    const uint r = sm + 8 * i + fc.y;
    if (r >= rows) {
      continue;
    }
    for (uint j = 0; j < 2; j++) {
      for (uint e = 0; e < 2; e++) {
        const uint c = c0 + sc + 8 * j + fc.x + e;
        if (c < cols) {
          out[ulong(r) * ld + c] = T(add_bias(bias, acc.m[i][j].thread_elements()[e] * gmul, c));
        }
      }
    }
  }
}

// One w4_mm output tile: out[0 .. rows, n0 .. n0 + 32) = x[0 .. rows, :] @ W[n0 .. n0 + 32, :]^T * gmul (+ bias);
// x and out point at the tile's first row. K advances 32 per step. xs / ws: kW4GemmTile * kW4TileStride floats.
template <typename T, typename S, typename O>
inline void w4_gemm_tile(device const T* x, uint rows, device const uchar* codes, device const uchar* scale,
                         device const uchar* offset, constant W4Params& p, float gmul, BiasRef bias, device T* out,
                         uint n0, threadgroup float* xs, threadgroup float* ws, uint tid, uint sg, uint lane) {
  const uint sm = (sg / 2) * 16, sn = (sg % 2) * 16;  // this simdgroup's quarter of the tile
  W4TileAcc acc = w4_zero_acc();
  for (uint k0 = 0; k0 < p.K; k0 += kW4GemmTile) {
    const uint len = min(kW4GemmTile, p.K - k0);
    gemm_stage_x<T, float>(xs, x, rows, p.K, k0, len, (p.flags & kW4XVec) != 0, tid);  // A(m, k) = x[m, k]
    w4_stage_w<S, O>(ws, codes, scale, offset, p, n0, k0, tid);                             // B(k, n) = W[n, k]
    threadgroup_barrier(mem_flags::mem_threadgroup);
    w4_tile_mma<true>(acc, xs, ws, sm, sn, len);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the next step overwrites xs / ws
  }
  w4_tile_store<T>(acc, out, rows, n0, p.N, p.N, gmul, bias, sm, sn, lane);
}

// One w4_mm_t output tile: out[0 .. rows, k0 .. k0 + 32) = g[0 .. rows, :] @ W[:, k0 .. k0 + 32) * gmul; g and out
// point at the tile's first row. N (the reduction) advances 32 per step, W is read row-major as stored.
template <typename T, typename S, typename O>
inline void w4_mm_t_tile(device const T* g, uint rows, device const uchar* codes, device const uchar* scale,
                         device const uchar* offset, constant W4Params& p, float gmul, device T* out, uint k0,
                         threadgroup float* gs, threadgroup float* ws, uint tid, uint sg, uint lane) {
  const uint sm = (sg / 2) * 16, sk = (sg % 2) * 16;  // this simdgroup's quarter of the tile
  W4TileAcc acc = w4_zero_acc();
  for (uint n0 = 0; n0 < p.N; n0 += kW4GemmTile) {
    const uint len = min(kW4GemmTile, p.N - n0);
    gemm_stage_x<T, float>(gs, g, rows, p.N, n0, len, (p.flags & kW4XVec) != 0, tid);  // A(m, n) = g[m, n]
    w4_stage_w<S, O>(ws, codes, scale, offset, p, n0, k0, tid);                             // B(n, k) = W[n, k]
    threadgroup_barrier(mem_flags::mem_threadgroup);
    w4_tile_mma<false>(acc, gs, ws, sm, sk, len);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the next step overwrites gs / ws
  }
  w4_tile_store<T>(acc, out, rows, k0, p.K, p.K, gmul, no_bias(), sm, sk, lane);
}
