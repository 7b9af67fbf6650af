// The 4-bit weight of the M5 tensor-op GEMM (mpp_gemm.h). What the tensor units multiply must be exact in T (the
// weights are the writer's fp32 arithmetic, design.md), and a code's value times its group's scale mostly is
// not (an int4 value times a bf16 scale has up to 12 significant bits). So the staged tile holds each code's
// unscaled weight (W4Offset*::unscaled: the value, or value - zero point; integers and E2M1 values, exact in half
// and bfloat), segments end at group ends, and a group's partial sums are multiplied by its scale as they fold,
// with a bias (w = v s + b) adding b times the row's sum of x over the group: sum_g (s_g sum x v + b_g X_g), the
// CPU bf16 GEMV's arithmetic (csrc/cpu/arch/w4_kernels.h), equal to the exact sum up to fp32 rounding. Where
// every value times every scale is exact in T (kW4MppScaled: nvfp4's E2M1 times E4M3 has at most 6 significant
// bits and is normal in half), the tile holds the decoded weights and segments run across groups. The global
// scale multiplies once in the epilogue. Where the sums' terms are infinite this arithmetic can differ in kind from
// the exact one: an infinite activation times a code of value 0 gives NaN where a bias made that weight nonzero
// (the exact sum: +-inf); an infinite scale gives NaN (the exact sum too, unless every term is infinite of one sign).
#pragma once
#include <metal_stdlib>
#include "mpp_gemm.h"
#include "w4.h"
using namespace metal;

template <typename T, typename S, typename O>
struct W4MppWeight {
  device const uchar* codes;
  device const uchar* scale;
  device const uchar* offset;
  constant W4Params* p;
  float gmul;
  // bias offsets: the tile rows' sums of x over the group being summed, [2][kFp8MppBM] by the group's parity (the
  // next group's first segment writes its half while a slower simdgroup may still fold the last group's)
  threadgroup float* xsums;

  bool scaled() const { return (p->flags & kW4MppScaled) != 0; }
  bool grouped() const { return !scaled() && p->G > 1; }
  threadgroup float* xsum(uint k) const { return xsums + (w4_group_of(*p, k) & 1u) * kFp8MppBM; }

  uint segment_end(uint k0, uint K) const {
    const uint k1 = min(k0 + kFp8MppBK, K);
    return grouped() ? min(k1, (w4_group_of(*p, k0) + 1) * p->group) : k1;
  }
  bool folds_after(uint k1, uint K) const { return k1 == K || (grouped() && k1 % p->group == 0); }

  // group i's scale (1 where the tile holds unscaled weights) and offset, and what the tile holds for value v
  W4Group terms(ulong i) const {
    return W4Group{scaled() ? S::load(scale, i) : 1.0f, O::template offset<S>(offset, i)};
  }
  float staged(float v, W4Group g) const { return scaled() ? O::apply(v, g) : O::unscaled(v, g.o); }

  void stage(threadgroup T* ws, device const T* x, uint rows, uint n0, uint k0, uint k1, uint tid) const {
    const uint len = k1 - k0, rb = (p->K + 1) / 2;
    if (p->group % 8 == 0 || p->G <= 1) {
      // a 32-bit word of codes per item (k0 and every group start are multiples of 8): one load of the codes and
      // one of the group's terms per 8 weights
      constexpr uint kWords = kFp8MppBK / 8;
      const bool word = (p->flags & kW4CodesWord) != 0;
      for (uint e = tid; e < kFp8MppBN * kWords; e += kFp8MppThreads) {
        const uint r = e / kWords, kk = (e % kWords) * 8, n = n0 + r;
        threadgroup T* dst = ws + r * kFp8MppBK + kk;
        uint codes8 = 0;
        W4Group g = W4Group{0.0f, 0.0f};
        if (n < p->N && kk < len) {
          codes8 = w4_load_word(codes + ulong(n) * rb, (k0 + kk) / 2, rb, word);
          g = terms(ulong(n) * p->G + w4_group_of(*p, k0 + kk));
        }
        for (uint j = 0; j < 8; j++) {
          dst[j] = n < p->N && kk + j < len ? T(staged(p->values[(codes8 >> (4 * j)) & 0xFu], g)) : T(0.0f);
        }
      }
    } else {  // groups that split a word: code by code
      for (uint e = tid; e < kFp8MppBN * kFp8MppBK; e += kFp8MppThreads) {
        const uint r = e / kFp8MppBK, kk = e % kFp8MppBK, n = n0 + r, k = k0 + kk;
        float v = 0.0f;
        if (n < p->N && kk < len) {
          v = staged(p->values[(codes[ulong(n) * rb + k / 2] >> (4 * (k & 1))) & 0xFu],
                     terms(ulong(n) * p->G + w4_group_of(*p, k)));
        }
        ws[e] = T(v);
      }
    }
    if (O::adds_x_sums() && !scaled() && tid < kFp8MppBM) {  // the row's sum of x over [k0, k1), joined to the group's
      float s = 0.0f;
      if (tid < rows) {
        for (uint k = k0; k < k1; k++) {
          s += float(x[ulong(tid) * p->K + k]);
        }
      }
      threadgroup float& d = xsum(k0)[tid];
      d = k0 % p->group == 0 ? s : d + s;
    }
  }

  float fold(float part, uint r, uint n, uint k0) const {
    if (scaled() || n >= p->N) {
      return part;
    }
    const ulong i = ulong(n) * p->G + w4_group_of(*p, k0);
    const float s = S::load(scale, i);
    // an infinite scale: NaN, as the exact sum nearly always is (its zero values and zero activations give 0 * inf)
    float v = isinf(s) ? as_type<float>(kFp8QuietNaN) : part * s;
    if (O::adds_x_sums()) {
      v += O::template offset<S>(offset, i) * xsum(k0)[r];
    }
    return v;
  }
  float finish(float acc, uint) const { return acc * gmul; }
};
