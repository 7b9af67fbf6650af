#include "cpu/w4_matmul.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <vector>

namespace lowbit::cpu {

W4Operand w4_operand(const W4Weight& w, int64_t e, const float* bias) {
  W4Operand op;
  const int64_t per = w.N * w.G;
  const int64_t scale_bytes = w.scale.element_size();
  op.codes = w.codes.data_ptr<uint8_t>() + e * w.N * w.row_bytes();
  op.scale = static_cast<const uint8_t*>(w.scale.data_ptr()) + e * per * scale_bytes;
  op.scale_enc = w.scale_enc;
  op.offset_kind = w.offset_kind();
  if (w.offset.defined())
    op.offset = static_cast<const uint8_t*>(w.offset.data_ptr()) + e * per * w.offset.element_size();
  op.values = w.format->values;
  op.N = w.N;
  op.K = w.K;
  op.group = w.group;
  op.G = w.G;
  if (w.global_scale.defined()) op.global = w.global_scale.cpu().data_ptr<float>()[e];
  op.bias = bias;
  return op;
}

void w4_decode_rows(const W4Operand& op, int64_t n0, int64_t n1, float* dst, int64_t ldd) {
  const int64_t rb = (op.K + 1) / 2;
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* c = op.codes + n * rb;
    float* d = dst + (n - n0) * ldd;
    for (int64_t g = 0; g < op.G; g++) {
      const int64_t i = n * op.G + g;
      const float s = w4_scale_to_float(op.scale_enc, op.scale, i);
      float zp = 0.f, b = 0.f;
      if (op.offset_kind == W4Offset::ZeroPoint) zp = float(static_cast<const int8_t*>(op.offset)[i]);
      if (op.offset_kind == W4Offset::Bias) b = w4_scale_to_float(op.scale_enc, op.offset, i);
      const int64_t k1 = std::min(op.K, (g + 1) * op.group);
      for (int64_t k = g * op.group; k < k1; k++) {
        const float v = op.values[(c[k >> 1] >> ((k & 1) * 4)) & 0xF];
        d[k] = op.offset_kind == W4Offset::Bias ? v * s + b : (v - zp) * s;
      }
    }
  }
}

namespace {

// Rows of the weight decoded per step of the product: enough that the fp32 GEMM runs long, small enough to stay
// in L2 at Llama sizes (64 x 4096 x 4 B = 1 MB).
constexpr int64_t kPanelRows = 64;

template <typename T>
at::Tensor as_float(const T* p, int64_t rows, int64_t cols) {
  const auto t = at::from_blob(const_cast<T*>(p), {rows, cols}, at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value));
  return t.to(at::kFloat).contiguous();
}

}  // namespace

template <typename T>
void w4_matmul(const T* x, int64_t M, const W4Operand& op, T* out, int64_t ldo) {
  const int64_t N = op.N, K = op.K;
  if (M == 0 || N == 0) return;
  const at::Tensor xf = as_float(x, M, K);
  const float* xp = xf.data_ptr<float>();
  at::parallel_for(0, ceil_div(N, kPanelRows), 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> panel(size_t(kPanelRows * std::max<int64_t>(K, 1)));
    for (int64_t p = p0; p < p1; p++) {
      const int64_t n0 = p * kPanelRows, n1 = std::min(N, n0 + kPanelRows);
      w4_decode_rows(op, n0, n1, panel.data(), K);
      for (int64_t n = n0; n < n1; n++) {
        const float* w = panel.data() + (n - n0) * K;
        for (int64_t m = 0; m < M; m++) {
          const float* xr = xp + m * K;
          float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
          int64_t k = 0;
          for (; k + 8 <= K; k += 8)
            for (int j = 0; j < 8; j++) acc[j] += xr[k + j] * w[k + j];
          for (int j = 0; k < K; k++, j++) acc[j] += xr[k] * w[k];
          const float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
          const float v = s * op.global;
          out[m * ldo + n] = T(op.bias ? v + op.bias[n] : v);
        }
      }
    }
  });
}

template <typename T>
void w4_matmul_t(const T* g, int64_t M, const W4Operand& op, T* out, int64_t ldo) {
  const int64_t N = op.N, K = op.K;
  if (M == 0 || K == 0) return;
  const at::Tensor gf = as_float(g, M, N);
  at::Tensor acc = at::zeros({M, K}, at::kFloat);
  at::Tensor panel = at::empty({kPanelRows, K}, at::kFloat);
  for (int64_t n0 = 0; n0 < N; n0 += kPanelRows) {
    const int64_t n1 = std::min(N, n0 + kPanelRows);
    float* pp = panel.data_ptr<float>();
    at::parallel_for(n0, n1, 1, [&](int64_t a, int64_t b) { w4_decode_rows(op, a, b, pp + (a - n0) * K, K); });
    acc.addmm_(gf.narrow(1, n0, n1 - n0), panel.narrow(0, 0, n1 - n0));
  }
  const float* ap = acc.data_ptr<float>();
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m++)
      for (int64_t k = 0; k < K; k++) out[m * ldo + k] = T(ap[m * K + k] * op.global);
  });
}

#define LOWBIT_W4_INSTANTIATE(T)                                                          \
  template void w4_matmul<T>(const T*, int64_t, const W4Operand&, T*, int64_t);          \
  template void w4_matmul_t<T>(const T*, int64_t, const W4Operand&, T*, int64_t);
LOWBIT_W4_INSTANTIATE(float)
LOWBIT_W4_INSTANTIATE(c10::BFloat16)
LOWBIT_W4_INSTANTIATE(c10::Half)
#undef LOWBIT_W4_INSTANTIATE

}  // namespace lowbit::cpu
