// int8_mm on the CPU: exact int32 accumulation, then acc * x_scale[m] * w_scale[n] + bias in fp32.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "checks.h"
#include "cpu/dispatch.h"

namespace lowbit::cpu {
namespace {

at::Tensor int8_mm(const at::Tensor& xq, const at::Tensor& x_scale, const at::Tensor& wq, const at::Tensor& w_scale,
                   const std::optional<at::Tensor>& bias, std::optional<at::ScalarType> out_dtype) {
  const Int8MmArgs a = check_int8_mm(xq, x_scale, wq, w_scale, bias, out_dtype);
  at::Tensor out = at::empty({a.M, a.N}, a.xq.options().dtype(a.out_dtype));
  const int64_t M = a.M, N = a.N, K = a.K;
  const int8_t* x = a.xq.data_ptr<int8_t>();
  const int8_t* w = a.wq.data_ptr<int8_t>();
  const float* xs = a.x_scale.data_ptr<float>();
  const float* ws = a.w_scale.data_ptr<float>();
  const bool per_tensor = a.w_scale.numel() == 1 && N != 1;
  const float* b = a.bias ? a.bias->data_ptr<float>() : nullptr;
  LOWBIT_DISPATCH_FLOAT_TYPES(a.out_dtype, "int8_mm", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, N, 4, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; n++) {
        const int8_t* wr = w + n * K;
        const float wsn = per_tensor ? ws[0] : ws[n];
        for (int64_t m = 0; m < M; m++) {
          const int8_t* xr = x + m * K;
          int32_t acc = 0;
          for (int64_t k = 0; k < K; k++) acc += int32_t(xr[k]) * int32_t(wr[k]);
          float v = float(acc) * xs[m] * wsn;
          if (b) v += b[n];
          o[m * N + n] = scalar_t(v);
        }
      }
    });
  });
  return out.view(a.out_shape);
}

}  // namespace
}  // namespace lowbit::cpu

TORCH_LIBRARY_IMPL(lowbit, CPU, m) {
  m.impl("int8_mm", &lowbit::cpu::int8_mm);
}
