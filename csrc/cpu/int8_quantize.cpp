// int8_quantize on the CPU: per-row absmax, scale = absmax / 127, q = round_half_even(x / scale), one row at a
// time through Int8Kernels::quantize_row (vectorized where the CPU allows).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <type_traits>

#include "checks.h"
#include "cpu/dispatch.h"
#include "cpu/arch/kernel_set.h"
#include "cpu/parallel.h"
#include "cpu/workspace.h"

namespace lowbit::cpu {
namespace {

constexpr int64_t kGrainValues = 16384;

// A row as fp32: float rows as they are, bf16 / half rows widened (exactly) into `buf`.
inline const float* as_float(const float* x, int64_t, float*) { return x; }
template <typename T>
const float* as_float(const T* x, int64_t K, float* buf) {
  for (int64_t k = 0; k < K; k++) buf[k] = float(x[k]);
  return buf;
}

std::tuple<at::Tensor, at::Tensor> int8_quantize(const at::Tensor& x) {
  const Int8QuantizeArgs a = check_int8_quantize(x);
  at::Tensor q = at::empty({a.M, a.K}, a.x.options().dtype(at::kChar));
  at::Tensor scale = at::empty({a.M}, a.x.options().dtype(at::kFloat));
  const int64_t K = a.K;
  const Int8Kernels& kern = kernel_set().int8;
  LOWBIT_DISPATCH_FLOAT_TYPES(a.x.scalar_type(), "int8_quantize", [&] {
    const scalar_t* xp = a.x.data_ptr<scalar_t>();
    int8_t* qp = q.data_ptr<int8_t>();
    float* sp = scale.data_ptr<float>();
    // rows per task: at least kGrainValues values (K = 4096: 4 rows, so M = 64 keeps 16 threads busy)
    at::parallel_for(0, a.M, rows_grain(K, kGrainValues), [&](int64_t m0, int64_t m1) {
      float* row = std::is_same_v<scalar_t, float> ? nullptr : scratch<float>(Slot::Tile, size_t(K));
      for (int64_t m = m0; m < m1; m++) sp[m] = kern.quantize_row(as_float(xp + m * K, K, row), K, qp + m * K);
    });
  });
  return {shaped(q, a.q_shape), shaped(scale, a.scale_shape)};
}

}  // namespace
}  // namespace lowbit::cpu

TORCH_LIBRARY_IMPL(lowbit, CPU, m) {
  m.impl("int8_quantize", &lowbit::cpu::int8_quantize);
}
