// The fp8 weight of the M5 tensor-op GEMM (mpp_gemm.h), shared by fp8_mm's prefill kernel
// (fp8_gemm_apple10.metal) and fp8_grouped_mm's (fp8_grouped_mm_apple10.metal); fp8_gemm.h is its portable twin
// and this file keeps its numerics: fp8 weights decode exactly into T (half or bfloat: every e4m3 value is exact
// in both; as llama.cpp's and MLX's quantized tensor-op kernels do, they are decoded into threadgroup memory: the
// fp8 formats the tensor units take are not e4m3fn with its NaN codes), activations stay in their own dtype. At
// the end of a K block the block's partial sums are multiplied by its scale (design.md); per-tensor and
// per-channel scales multiply once in the epilogue.
#pragma once
#include <metal_stdlib>
#include "fp8.h"
#include "mpp_gemm.h"
#include "scale.h"
using namespace metal;

// The fp8 weight of mpp_gemm_tile: rows of K e4m3 bytes, segments that never cross a K block of block scales;
// a block's partial sums are multiplied by the block's scale as they fold, per-tensor and per-channel scales once
// in the epilogue.
template <typename T>
struct Fp8MppWeight {
  device const uchar* w;
  device const float* scale;
  constant ScaleParams* sp;
  uint N, K;
  bool block;

  uint segment_end(uint k0, uint K) const {
    const uint k1 = min(k0 + kFp8MppBK, K);
    return block ? uint(min(ulong(k1), ulong(k0 - k0 % sp->bk) + sp->bk)) : k1;  // stay inside one K block
  }
  bool folds_after(uint k1, uint K) const { return k1 == K || (block && k1 % sp->bk == 0); }
  // consecutive threads read consecutive bytes of a row
  void stage(threadgroup T* ws, device const T*, uint, uint n0, uint k0, uint k1, uint tid) const {
    const uint len = k1 - k0;
    for (uint e = tid; e < kFp8MppBN * kFp8MppBK; e += kFp8MppThreads) {
      const uint r = e / kFp8MppBK, kk = e % kFp8MppBK;
      ws[e] = n0 + r < N && kk < len ? T(fp8_e4m3_to_float(w[ulong(n0 + r) * K + k0 + kk])) : T(0.0f);
    }
  }
  float fold(float part, uint, uint n, uint k0) const {
    return part * (block && n < N ? weight_scale(*sp, scale, n, k0) : 1.0f);
  }
  float finish(float acc, uint n) const { return block ? acc : acc * weight_scale(*sp, scale, n, 0); }
};

// out[r, n0 + c] = x[r, :] . dec(w[n0 + c, :]) * scales (+ bias) for r < rows, n0 + c < N (mpp_gemm_tile).
template <typename T, uint BM>
inline void fp8_gemm_mpp_tile(device T* x, uint rows, device const uchar* w, device const float* scale,
                              constant ScaleParams& sp, BiasRef bias, device T* out, uint n0, uint N, uint K,
                              threadgroup T* ws, uint tid) {
  const Fp8MppWeight<T> weight{w, scale, &sp, N, K, sp.kind == kScalePerBlock};
  mpp_gemm_tile<T, BM>(x, rows, weight, bias, out, n0, N, K, ws, tid);
}
