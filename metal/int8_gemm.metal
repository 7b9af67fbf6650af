// int8_mm for larger M: a tiled GEMM on 8x8 simdgroup matrices. Apple GPUs before M5 have no integer
// MMA, so int8 is widened to half (every int8 value is exact in half) and multiplied with fp32
// accumulators: each product (|p| <= 2^14, -128 * -128 included) is exact in fp32, and so is every partial
// sum of at most 1024 products (|sum| <= 2^24). So the fp32 fragments sum K in chunks of 1024 and each
// chunk is flushed, exactly, into int32 per lane (|total| <= 131071 * 2^14 < 2^31, the op's K limit): the
// int32 sum is exact for every K, as design.md promises, and is rounded to fp32 once, in the epilogue.
// (M5 / Metal 4 has `matmul2d` int8 x int8 -> int32: a variant for it would sit next to this one and be
// picked by the plan's chooser behind a device-family check; see plan_int8_mm.cpp.)
//
// Threadgroup: 4 simdgroups (128 threads) compute a 32 (x rows) x 64 (weight rows = output columns) tile,
// K advancing 32 per step. Simdgroup s owns rows 16 (s / 2) .. +16 and columns 32 (s % 2) .. +32 of the
// tile: 2 x 4 accumulators of 8x8. Loading: thread t reads 16 bytes of weight row t / 2 and, for t < 64,
// 16 bytes of x row t / 2, and writes them widened to half into the padded tiles (row stride 40 halves,
// so rows start in different banks). Rows past M / N and K past its end load as zeros.
// Epilogue: fragment layouts are opaque, so the accumulators are stored to threadgroup memory (reusing
// the tiles) and each thread writes consecutive output elements through the fp32 dequant epilogue.
// Grid: (ceil(N / 64), ceil(M / 32)).
#include <metal_stdlib>
#include "int8.h"
#include "instantiate.h"
using namespace metal;

// tile sizes: params.h (shared with the plan's grid)
constant constexpr uint kGemmBM = kInt8GemmBM;
constant constexpr uint kGemmBN = kInt8GemmBN;
constant constexpr uint kGemmBK = kInt8GemmBK;
constant constexpr uint kGemmLd = kGemmBK + 8;  // padded tile row stride, in halves
constant constexpr uint kGemmThreads = kInt8GemmThreads;
constant constexpr uint kGemmExactK = 1024;  // K per fp32 chunk: every partial sum <= 2^24, exact

template <typename T, bool Aligned>
kernel void int8_gemm(
    device const uchar* xq [[buffer(0)]],
    device const float* x_scale [[buffer(1)]],
    device const uchar* wq [[buffer(2)]],
    device const float* w_scale [[buffer(3)]],
    device const uchar* bias [[buffer(4)]],
    device T* out [[buffer(5)]],
    constant Int8MmParams& p [[buffer(6)]],
    uint2 tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  // A tile [32][40] + B tile [64][40] halves (7680 bytes), then the fp32 C tile [32][64] (8192 bytes)
  // alignas(16): half4 stores (int8.h): MSL promises a float array only 4-byte alignment
  alignas(16) threadgroup float smem[kGemmBM * kGemmBN];
  threadgroup half* As = (threadgroup half*)smem;
  threadgroup half* Bs = As + kGemmBM * kGemmLd;

  const uint n0 = tg.x * kGemmBN;
  const uint m0 = tg.y * kGemmBM;
  const uint sm = (sg / 2) * 16;
  const uint sn = (sg % 2) * 32;
  const uint lr = tid / 2;         // tile row this thread loads
  const uint lk = (tid % 2) * 16;  // its 16-byte half of the 32-byte K step

  simdgroup_float8x8 acc[2][4];  // the current K chunk's sums
  int2 total[2][4];              // this lane's two elements of each fragment, summed over the chunks
  for (uint i = 0; i < 2; i++) {
    for (uint j = 0; j < 4; j++) {
      acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      total[i][j] = int2(0);
    }
  }
  for (uint kb = 0; kb < p.K; kb += kGemmBK) {
    const uint n = n0 + lr;
    const int4 wv = n < p.N ? load_i8x16<Aligned>(wq + ulong(n) * p.K, kb + lk, p.K) : int4(0);
    store_i8x16_as_half(Bs + lr * kGemmLd + lk, wv);
    if (tid < kGemmBM * 2) {
      const uint m = m0 + lr;
      const int4 xv = m < p.M ? load_i8x16<Aligned>(xq + ulong(m) * p.K, kb + lk, p.K) : int4(0);
      store_i8x16_as_half(As + lr * kGemmLd + lk, xv);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint kk = 0; kk < kGemmBK; kk += 8) {
      simdgroup_half8x8 a[2];
      simdgroup_half8x8 b[4];
      for (uint i = 0; i < 2; i++) {
        simdgroup_load(a[i], As + (sm + 8 * i) * kGemmLd + kk, kGemmLd);
      }
      for (uint j = 0; j < 4; j++) {
        // transposed: b[j][k][c] = W[sn + 8 j + c][kk + k]
        simdgroup_load(b[j], Bs + (sn + 8 * j) * kGemmLd + kk, kGemmLd, ulong2(0, 0), true);
      }
      for (uint i = 0; i < 2; i++) {
        for (uint j = 0; j < 4; j++) {
          simdgroup_multiply_accumulate(acc[i][j], a[i], b[j], acc[i][j]);
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const uint k_done = kb + kGemmBK;
    if (k_done % kGemmExactK == 0 || k_done >= p.K) {  // uniform: the whole threadgroup flushes together
      for (uint i = 0; i < 2; i++) {
        for (uint j = 0; j < 4; j++) {
          total[i][j] += int2(acc[i][j].thread_elements());
          acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        }
      }
    }
  }

  for (uint i = 0; i < 2; i++) {
    for (uint j = 0; j < 4; j++) {
      acc[i][j].thread_elements()[0] = float(total[i][j].x);  // the one rounding of the exact sum
      acc[i][j].thread_elements()[1] = float(total[i][j].y);
      simdgroup_store(acc[i][j], smem + (sm + 8 * i) * kGemmBN + sn + 8 * j, kGemmBN);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint e = tid; e < kGemmBM * kGemmBN; e += kGemmThreads) {
    const uint m = m0 + e / kGemmBN;
    const uint n = n0 + e % kGemmBN;
    if (m < p.M && n < p.N) {
      out[ulong(m) * p.N + n] = int8_dequant<T>(smem[e], x_scale[m], w_scale, bias, p, n);
    }
  }
}

LOWBIT_KERNEL(int8_gemm, int8_gemm, float, false)
LOWBIT_KERNEL(int8_gemm, int8_gemm, half, false)
LOWBIT_KERNEL(int8_gemm, int8_gemm, bfloat, false)
LOWBIT_KERNEL_VARIANT(int8_gemm, k16, int8_gemm, float, true)
LOWBIT_KERNEL_VARIANT(int8_gemm, k16, int8_gemm, half, true)
LOWBIT_KERNEL_VARIANT(int8_gemm, k16, int8_gemm, bfloat, true)
