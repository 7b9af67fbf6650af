// The register-resident fp8 GEMV body, shared by fp8_mm's M == 1 and small-M kernels (fp8_gemv.metal) and
// fp8_grouped_mm's decode kernel (fp8_grouped_mm.metal), which differ only in how they find their rows.
//
// A simdgroup owns R consecutive weight rows (output columns n0 .. n0 + R) and up to MR activation rows.
// Per step, lane l reads the 16 weight bytes at k = 16 l + 512 s of each of its R rows: the 32 lanes of one
// load cover 512 contiguous bytes of a row, four whole 128-byte lines. Each chunk is decoded once into
// floats; then for each activation row the 16 matching activations are loaded once into registers and
// dotted against the R decoded chunks. Partial sums stay in fp32 registers; one simd_sum per output at
// the end. No threadgroup memory, no barrier: a simdgroup whose rows are all past N may simply return.
#pragma once
#include <metal_stdlib>
#include "fp8.h"
#include "scale.h"
using namespace metal;

constant constexpr uint kGemvChunk = 16;              // weight bytes per lane per row per step: one uint4
constant constexpr uint kGemvStep = 32 * kGemvChunk;  // K a simdgroup advances per step

// 16 consecutive values of one row
struct Chunk16 {
  float4 q[4];
};

template <uint MR, uint R>
struct GemvAcc {
  float v[MR][R];
};

inline Chunk16 zero_chunk() {
  Chunk16 c;
  for (uint i = 0; i < 4; i++) {
    c.q[i] = float4(0.0f);
  }
  return c;
}

inline float dot16(thread const Chunk16& a, thread const Chunk16& b) {
  return dot(a.q[0], b.q[0]) + dot(a.q[1], b.q[1]) + dot(a.q[2], b.q[2]) + dot(a.q[3], b.q[3]);
}

// The fp8 codes w[0 .. len) decoded, zeros past len (len <= 16). Vec: w is 16-byte aligned and len == 16.
template <bool Vec>
inline Chunk16 load_fp8_chunk(device const uchar* w, uint len) {
  Chunk16 c;
  if (Vec) {
    const uint4 v = *(device const uint4*)w;
    c.q[0] = fp8x4_to_float4(as_type<uchar4>(v.x));
    c.q[1] = fp8x4_to_float4(as_type<uchar4>(v.y));
    c.q[2] = fp8x4_to_float4(as_type<uchar4>(v.z));
    c.q[3] = fp8x4_to_float4(as_type<uchar4>(v.w));
  } else if (len == kGemvChunk) {
    for (uint i = 0; i < 4; i++) {
      c.q[i] = fp8x4_to_float4(uchar4(*(device const packed_uchar4*)(w + 4 * i)));
    }
  } else {
    for (uint i = 0; i < 4; i++) {
      for (uint j = 0; j < 4; j++) {
        const uint k = 4 * i + j;
        c.q[i][j] = k < len ? fp8_e4m3_to_float(w[k]) : 0.0f;
      }
    }
  }
  return c;
}

// 16 activations at a 16-byte aligned x as floats (exact), in 16-byte loads: four for float,
inline Chunk16 load_x16_aligned(device const float* x) {
  Chunk16 c;
  for (uint i = 0; i < 4; i++) {
    c.q[i] = *(device const float4*)(x + 4 * i);
  }
  return c;
}

// two for half / bfloat.
template <typename T>
inline Chunk16 load_x16_aligned(device const T* x) {
  Chunk16 c;
  for (uint h = 0; h < 2; h++) {
    const uint4 v = *(device const uint4*)(x + 8 * h);
    c.q[2 * h] = float4(as_type<vec<T, 4>>(v.xy));
    c.q[2 * h + 1] = float4(as_type<vec<T, 4>>(v.zw));
  }
  return c;
}

// Activations x[0 .. len) as floats (exact for every T), zeros past len. Vec: x is 16-byte aligned, len == 16.
template <typename T, bool Vec>
inline Chunk16 load_x_chunk(device const T* x, uint len) {
  Chunk16 c;
  if (Vec) {
    c = load_x16_aligned(x);
  } else {
    for (uint i = 0; i < 4; i++) {
      for (uint j = 0; j < 4; j++) {
        const uint k = 4 * i + j;
        c.q[i][j] = k < len ? float(x[k]) : 0.0f;
      }
    }
  }
  return c;
}

// Block scales whose K extent is not a multiple of 16 can change inside a chunk: then each decoded weight
// is scaled (one fp32 rounding per product, well inside the accumulation error). Extents that are multiples
// of 16 (128 in every checkpoint format) scale the chunk's partial sum instead.
inline void scale_chunk_per_element(thread Chunk16& c, constant ScaleParams& sp, device const float* scale, uint n,
                                    uint k, uint len) {
  for (uint i = 0; i < 4; i++) {
    for (uint j = 0; j < 4; j++) {
      const uint kk = 4 * i + j;
      if (kk < len) {
        c.q[i][j] *= weight_scale(sp, scale, n, k + kk);
      }
    }
  }
}

// acc[m][r] += x[m, :] . dec(w[n0 + r, :]) (block scales applied per K block), over this lane's chunks.
template <typename T, uint MR, uint R, bool Vec>
inline void gemv_accumulate(thread GemvAcc<MR, R>& acc, device const T* x, uint nrows, device const uchar* w,
                            device const float* scale, constant ScaleParams& sp, uint n0, uint N, uint K, uint lane) {
  const bool block = sp.kind == kScalePerBlock;
  const bool chunk_in_one_block = block && sp.bk % kGemvChunk == 0;  // chunks start at multiples of 16
  for (uint k = lane * kGemvChunk; k < K; k += kGemvStep) {
    const uint len = min(kGemvChunk, K - k);  // 16 except in the last chunk of a K that is not a multiple of 16
    Chunk16 wc[R];
    float s[R];
    for (uint r = 0; r < R; r++) {
      const uint n = n0 + r;
      s[r] = 1.0f;
      if (n < N) {
        wc[r] = load_fp8_chunk<Vec>(w + ulong(n) * K + k, len);
        if (chunk_in_one_block) {
          s[r] = weight_scale(sp, scale, n, k);
        } else if (block) {
          scale_chunk_per_element(wc[r], sp, scale, n, k, len);
        }
      } else {
        wc[r] = zero_chunk();  // a row past N: read nothing
      }
    }
    for (uint m = 0; m < MR; m++) {
      if (m < nrows) {
        const Chunk16 xc = load_x_chunk<T, Vec>(x + ulong(m) * K + k, len);
        for (uint r = 0; r < R; r++) {
          acc.v[m][r] += dot16(wc[r], xc) * s[r];
        }
      }
    }
  }
}

// The whole GEMV for one simdgroup: out[m, n0 + r] = T(sum * scale + bias) for m < nrows, n0 + r < N.
// x and out point at the first of the nrows activation / output rows (row strides K and N).
// Every lane reaches every simd_sum (nrows is the same for the whole simdgroup).
template <typename T, uint MR, uint R>
inline void fp8_gemv_rows(device const T* x, uint nrows, device const uchar* w, device const float* scale,
                          constant ScaleParams& sp, device const float* bias, bool has_bias, device T* out, uint n0,
                          uint N, uint K, bool vec_loads, uint lane) {
  GemvAcc<MR, R> acc;
  for (uint m = 0; m < MR; m++) {
    for (uint r = 0; r < R; r++) {
      acc.v[m][r] = 0.0f;
    }
  }
  if (vec_loads) {
    gemv_accumulate<T, MR, R, true>(acc, x, nrows, w, scale, sp, n0, N, K, lane);
  } else {
    gemv_accumulate<T, MR, R, false>(acc, x, nrows, w, scale, sp, n0, N, K, lane);
  }
  for (uint m = 0; m < MR; m++) {
    if (m >= nrows) {
      break;
    }
    for (uint r = 0; r < R; r++) {
      const float sum = simd_sum(acc.v[m][r]);
      const uint n = n0 + r;
      if (lane == (m * R + r) % 32 && n < N) {  // spread the stores over the lanes
        float v = sp.kind == kScalePerBlock ? sum : sum * weight_scale(sp, scale, n, 0);
        if (has_bias) {
          v += bias[n];
        }
        out[ulong(m) * N + n] = T(v);
      }
    }
  }
}
