// int8_quantize on the CPU: per-row absmax, scale = absmax / 127, q = round_half_even(x / scale).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "checks.h"
#include "cpu/dispatch.h"

namespace lowbit::cpu {
namespace {

std::tuple<at::Tensor, at::Tensor> int8_quantize(const at::Tensor& x) {
  const Int8QuantizeArgs a = check_int8_quantize(x);
  at::Tensor q = at::empty({a.M, a.K}, a.x.options().dtype(at::kChar));
  at::Tensor scale = at::empty({a.M}, a.x.options().dtype(at::kFloat));
  const int64_t K = a.K;
  LOWBIT_DISPATCH_FLOAT_TYPES(a.x.scalar_type(), "int8_quantize", [&] {
    const scalar_t* xp = a.x.data_ptr<scalar_t>();
    int8_t* qp = q.data_ptr<int8_t>();
    float* sp = scale.data_ptr<float>();
    at::parallel_for(0, a.M, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; m++) {
        const scalar_t* xr = xp + m * K;
        float amax = 0.f;
        for (int64_t k = 0; k < K; k++) amax = std::max(amax, std::fabs(float(xr[k])));
        const float s = amax / 127.f;
        sp[m] = s;
        for (int64_t k = 0; k < K; k++) {
          // fp32 division then round-half-even (the default rounding mode); a zero row stays zero
          const float r = s > 0.f ? std::nearbyint(float(xr[k]) / s) : 0.f;
          qp[m * K + k] = int8_t(std::min(127.f, std::max(-127.f, r)));
        }
      }
    });
  });
  return {q.view(a.q_shape), scale.view(a.scale_shape)};
}

}  // namespace
}  // namespace lowbit::cpu

TORCH_LIBRARY_IMPL(lowbit, CPU, m) {
  m.impl("int8_quantize", &lowbit::cpu::int8_quantize);
}
