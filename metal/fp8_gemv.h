// The register-resident fp8 GEMV bodies, shared by fp8_mm's M == 1 and small-M kernels (fp8_gemv.metal) and
// fp8_grouped_mm's decode kernel (fp8_grouped_mm.metal), which differ only in how they find their rows.
//
// A simdgroup owns R consecutive weight rows (output columns n0 .. n0 + R) and up to MR activation rows.
// Per step, lane l reads the 16 weight bytes at k = 16 l + 512 s of each of its R rows: the 32 lanes of one
// load cover 512 contiguous bytes of a row, four whole 128-byte lines. Each chunk is decoded once into
// floats; then for each activation row the 16 matching activations are dotted against the R decoded chunks.
// Partial sums stay in fp32 registers; one simd_sum per output at the end. Each row's weight and scale
// pointers are found once, before the K loop (no division by the block size inside it).
// Two ways to get the activations:
//   gemv_body         each lane loads its 16 activations of each row from device memory: no threadgroup
//                     memory, no barrier, so a simdgroup whose rows are all past N may simply return.
//                     Right for one activation row (M == 1) and for the grouped decode's few rows.
//   gemv_body_staged  the threadgroup stages each 512-column step of its MR activation rows once in
//                     threadgroup memory (two barriers per step) and every simdgroup reads it from there:
//                     x costs MR * sizeof(T) / (weight rows per threadgroup) bytes per weight byte instead
//                     of MR * sizeof(T) / R. Every thread of the threadgroup must call it.
#pragma once
#include <metal_stdlib>
#include "bias.h"
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

// Sixteen activations x[0 .. 16) as four vectors, from a 16-byte aligned x in 16-byte loads: four for float,
inline void load_x16_vecs(device const float* x, thread float4* v) {
  for (uint i = 0; i < 4; i++) {
    v[i] = *(device const float4*)(x + 4 * i);
  }
}

// two for half / bfloat.
template <typename T>
inline void load_x16_vecs(device const T* x, thread vec<T, 4>* v) {
  for (uint h = 0; h < 2; h++) {
    const uint4 u = *(device const uint4*)(x + 8 * h);
    v[2 * h] = as_type<vec<T, 4>>(u.xy);
    v[2 * h + 1] = as_type<vec<T, 4>>(u.zw);
  }
}

// Activations x[0 .. len) as four vectors, zeros past len. Vec: x is 16-byte aligned and len == 16.
template <typename T, bool Vec>
inline void load_x_vecs(device const T* x, uint len, thread vec<T, 4>* v) {
  if (Vec) {
    load_x16_vecs(x, v);
  } else {
    for (uint i = 0; i < 4; i++) {
      for (uint j = 0; j < 4; j++) {
        const uint k = 4 * i + j;
        v[i][j] = k < len ? x[k] : T(0.0f);
      }
    }
  }
}

// Activations as floats (exact for every T)
template <typename T, bool Vec>
inline Chunk16 load_x_chunk(device const T* x, uint len) {
  vec<T, 4> v[4];
  load_x_vecs<T, Vec>(x, len, v);
  Chunk16 c;
  for (uint i = 0; i < 4; i++) {
    c.q[i] = float4(v[i]);
  }
  return c;
}

// Block scales whose K extent is not a multiple of 16 can change inside a chunk: then each decoded weight
// is scaled (one fp32 rounding per product, well inside the accumulation error). Extents that are multiples
// of 16 (128 in every checkpoint format) scale the chunk's partial sum instead.
inline void scale_chunk_per_element(thread Chunk16& c, constant ScaleParams& sp, device const float* srow, uint k,
                                    uint len) {
  for (uint i = 0; i < 4; i++) {
    for (uint j = 0; j < 4; j++) {
      const uint kk = 4 * i + j;
      if (kk < len) {
        c.q[i][j] *= row_scale(sp, srow, k + kk);
      }
    }
  }
}

// A simdgroup's R weight rows, found once: rows past N are not live and read nothing.
template <uint R>
struct GemvWeightRows {
  device const uchar* w[R];
  device const float* s[R];  // scale_row of each row
  bool live[R];
};

template <uint R>
inline GemvWeightRows<R> gemv_weight_rows(device const uchar* w, device const float* scale, constant ScaleParams& sp,
                                          uint n0, uint N, uint K) {
  GemvWeightRows<R> rows;
  for (uint r = 0; r < R; r++) {
    rows.live[r] = n0 + r < N;
    rows.w[r] = w + ulong(rows.live[r] ? n0 + r : 0) * K;
    rows.s[r] = scale_row(sp, scale, n0 + r);
  }
  return rows;
}

// One step's weight chunks of this lane (columns k .. k + len of every row), decoded, and the factor each
// chunk's dot products take (its block scale when one block covers the chunk, else 1).
template <uint R>
struct GemvWeightStep {
  Chunk16 c[R];
  float s[R];
};

template <uint R, bool Vec>
inline GemvWeightStep<R> load_weight_step(thread const GemvWeightRows<R>& rows, constant ScaleParams& sp, uint k,
                                          uint len) {
  const bool block = sp.kind == kScalePerBlock;
  const bool chunk_in_one_block = block && sp.bk % kGemvChunk == 0;  // chunks start at multiples of 16
  GemvWeightStep<R> st;
  for (uint r = 0; r < R; r++) {
    st.s[r] = 1.0f;
    if (rows.live[r]) {
      st.c[r] = load_fp8_chunk<Vec>(rows.w[r] + k, len);
      if (chunk_in_one_block) {
        st.s[r] = row_scale(sp, rows.s[r], k);
      } else if (block) {
        scale_chunk_per_element(st.c[r], sp, rows.s[r], k, len);
      }
    } else {
      st.c[r] = zero_chunk();
    }
  }
  return st;
}

template <uint MR, uint R>
inline void gemv_fma(thread GemvAcc<MR, R>& acc, uint m, thread const GemvWeightStep<R>& st, thread const Chunk16& xc) {
  for (uint r = 0; r < R; r++) {
    acc.v[m][r] += dot16(st.c[r], xc) * st.s[r];
  }
}

template <typename T, uint MR, uint R, bool Vec>
inline void gemv_accumulate(thread GemvAcc<MR, R>& acc, device const T* x, uint nrows,
                            thread const GemvWeightRows<R>& rows, constant ScaleParams& sp, uint K, uint lane) {
  for (uint k = lane * kGemvChunk; k < K; k += kGemvStep) {
    const uint len = min(kGemvChunk, K - k);  // 16 except in the last chunk of a K that is not a multiple of 16
    const GemvWeightStep<R> st = load_weight_step<R, Vec>(rows, sp, k, len);
    for (uint m = 0; m < MR; m++) {
      if (m < nrows) {
        const Chunk16 xc = load_x_chunk<T, Vec>(x + ulong(m) * K + k, len);
        gemv_fma(acc, m, st, xc);
      }
    }
  }
}

// Staged activations of one step: chunk c (columns 16 c .. 16 c + 16 of the step) of row m is the four
// vectors xs[(4 m + i) * 32 + c], so the 32 lanes reading their chunks touch consecutive vectors.
constant constexpr uint kGemvStagedVecs = 4 * 32;  // vectors per staged row

template <typename T, bool Vec>
inline void stage_x_step(threadgroup vec<T, 4>* xs, device const T* x, uint nrows, uint K, uint kb, uint tid,
                         uint nthreads) {
  for (uint i = tid; i < nrows * 32; i += nthreads) {
    const uint m = i / 32, c = i % 32, k = kb + c * kGemvChunk;
    if (k < K) {
      vec<T, 4> v[4];
      load_x_vecs<T, Vec>(x + ulong(m) * K + k, min(kGemvChunk, K - k), v);
      for (uint j = 0; j < 4; j++) {
        xs[m * kGemvStagedVecs + j * 32 + c] = v[j];
      }
    }
  }
}

template <typename T>
inline Chunk16 staged_x_chunk(threadgroup const vec<T, 4>* xs, uint m, uint lane) {
  Chunk16 c;
  for (uint j = 0; j < 4; j++) {
    c.q[j] = float4(xs[m * kGemvStagedVecs + j * 32 + lane]);
  }
  return c;
}

// The K loop runs the same steps in every lane of the threadgroup (lanes past K skip the work, not the
// barriers). xs: MR * kGemvStagedVecs vectors.
template <typename T, uint MR, uint R, bool Vec>
inline void gemv_accumulate_staged(thread GemvAcc<MR, R>& acc, device const T* x, uint nrows,
                                   threadgroup vec<T, 4>* xs, thread const GemvWeightRows<R>& rows,
                                   constant ScaleParams& sp, uint K, uint tid, uint nthreads, uint lane) {
  for (uint kb = 0; kb < K; kb += kGemvStep) {
    stage_x_step<T, Vec>(xs, x, nrows, K, kb, tid, nthreads);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const uint k = kb + lane * kGemvChunk;
    if (k < K) {
      const GemvWeightStep<R> st = load_weight_step<R, Vec>(rows, sp, k, min(kGemvChunk, K - k));
      for (uint m = 0; m < MR; m++) {
        if (m < nrows) {
          const Chunk16 xc = staged_x_chunk<T>(xs, m, lane);
          gemv_fma(acc, m, st, xc);
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the next step overwrites xs
  }
}

template <uint MR, uint R>
inline GemvAcc<MR, R> zero_acc() {
  GemvAcc<MR, R> acc;
  for (uint m = 0; m < MR; m++) {
    for (uint r = 0; r < R; r++) {
      acc.v[m][r] = 0.0f;
    }
  }
  return acc;
}

// out[m, n0 + r] = T(sum * scale + bias) for m < nrows, n0 + r < N; one simd_sum per output, reached by
// every lane (nrows is the same for the whole simdgroup).
template <typename T, uint MR, uint R>
inline void gemv_store(thread const GemvAcc<MR, R>& acc, uint nrows, thread const GemvWeightRows<R>& rows,
                       constant ScaleParams& sp, BiasRef bias, device T* out, uint n0, uint N, uint lane) {
  for (uint m = 0; m < MR; m++) {
    if (m >= nrows) {
      break;
    }
    for (uint r = 0; r < R; r++) {
      const float sum = simd_sum(acc.v[m][r]);
      const uint n = n0 + r;
      if (lane == (m * R + r) % 32 && n < N) {  // spread the stores over the lanes
        const float v = sp.kind == kScalePerBlock ? sum : sum * row_scale(sp, rows.s[r], 0);
        out[ulong(m) * N + n] = T(add_bias(bias, v, n));
      }
    }
  }
}

// The whole GEMV for one simdgroup, activations from device memory (see the top of this file). x and out
// point at the first of the nrows activation / output rows (row strides K and N).
template <typename T, uint MR, uint R>
inline void gemv_body(device const T* x, uint nrows, device const uchar* w, device const float* scale,
                      constant ScaleParams& sp, BiasRef bias, device T* out, uint n0, uint N, uint K, bool vec_loads,
                      uint lane) {
  const GemvWeightRows<R> rows = gemv_weight_rows<R>(w, scale, sp, n0, N, K);
  GemvAcc<MR, R> acc = zero_acc<MR, R>();
  if (vec_loads) {
    gemv_accumulate<T, MR, R, true>(acc, x, nrows, rows, sp, K, lane);
  } else {
    gemv_accumulate<T, MR, R, false>(acc, x, nrows, rows, sp, K, lane);
  }
  gemv_store<T, MR, R>(acc, nrows, rows, sp, bias, out, n0, N, lane);
}

// The same with the activations staged per threadgroup; nrows must be the same for the whole threadgroup.
template <typename T, uint MR, uint R>
inline void gemv_body_staged(device const T* x, uint nrows, threadgroup vec<T, 4>* xs, device const uchar* w,
                             device const float* scale, constant ScaleParams& sp, BiasRef bias, device T* out, uint n0,
                             uint N, uint K, bool vec_loads, uint tid, uint nthreads, uint lane) {
  const GemvWeightRows<R> rows = gemv_weight_rows<R>(w, scale, sp, n0, N, K);
  GemvAcc<MR, R> acc = zero_acc<MR, R>();
  if (vec_loads) {
    gemv_accumulate_staged<T, MR, R, true>(acc, x, nrows, xs, rows, sp, K, tid, nthreads, lane);
  } else {
    gemv_accumulate_staged<T, MR, R, false>(acc, x, nrows, xs, rows, sp, K, tid, nthreads, lane);
  }
  gemv_store<T, MR, R>(acc, nrows, rows, sp, bias, out, n0, N, lane);
}
