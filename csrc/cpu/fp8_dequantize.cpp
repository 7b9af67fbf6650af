// fp8_dequantize on the CPU: rows in parallel, table decode, scale by layout.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "checks.h"
#include "cpu/dispatch.h"
#include "cpu/fp8.h"

namespace lowbit::cpu {
namespace {

template <typename T>
void dequantize_rows(const Fp8Weight& w, T* out) {
  const uint8_t* bits = w.bits.data_ptr<uint8_t>();
  const float* s = w.scale.data_ptr<float>();
  const int64_t K = w.K;
  at::parallel_for(0, w.N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
      const uint8_t* row = bits + n * K;
      T* o = out + n * K;
      switch (w.layout.kind) {
        case ScaleKind::Tensor:
        case ScaleKind::Channel: {
          const float sc = w.layout.kind == ScaleKind::Tensor ? s[0] : s[n];
          for (int64_t k = 0; k < K; k++) o[k] = T(fp8_e4m3_to_float(row[k]) * sc);
          break;
        }
        case ScaleKind::Block: {
          const float* srow = s + (n / w.layout.bn) * w.layout.kb;
          for (int64_t k = 0; k < K; k++) o[k] = T(fp8_e4m3_to_float(row[k]) * srow[k / w.layout.bk]);
          break;
        }
      }
    }
  });
}

at::Tensor fp8_dequantize(const at::Tensor& weight, const at::Tensor& scale, at::OptionalIntArrayRef block_size,
                          at::ScalarType dtype) {
  const Fp8Weight w = check_fp8_dequantize(weight, scale, block_size, dtype);
  at::Tensor out = at::empty({w.N, w.K}, weight.options().dtype(dtype));
  if (out.numel() == 0) return out;
  LOWBIT_DISPATCH_FLOAT_TYPES(dtype, "fp8_dequantize",
                                  [&] { dequantize_rows<scalar_t>(w, out.data_ptr<scalar_t>()); });
  return out;
}

}  // namespace
}  // namespace lowbit::cpu

TORCH_LIBRARY_IMPL(lowbit, CPU, m) {
  m.impl("fp8_dequantize", &lowbit::cpu::fp8_dequantize);
}
