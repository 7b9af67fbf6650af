// fp8_dequantize on the CPU: rows in parallel, each cut into runs of one scale for the vectorized decode.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>

#include "checks.h"
#include "cpu/arch/kernel_set.h"

namespace lowbit::cpu {
namespace {

// Runs of codes under one scale (a whole row, or one K block of it) through Fp8Kernels::dequantize_run.
void dequantize_rows(const Fp8Weight& w, void* out, DequantOut kind) {
  const uint8_t* bits = w.bits.data_ptr<uint8_t>();
  const float* s = w.scale.data_ptr<float>();
  const int64_t K = w.K, elem_size = element_size(kind);
  const Fp8Kernels& kern = kernel_set().fp8;
  at::parallel_for(0, w.N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
      const uint8_t* row = bits + n * K;
      uint8_t* o = static_cast<uint8_t*>(out) + n * K * elem_size;
      if (w.layout.kind != ScaleKind::Block) {
        kern.dequantize_run(row, K, w.layout.kind == ScaleKind::Tensor ? s[0] : s[n], o, kind);
        continue;
      }
      const float* srow = s + (n / w.layout.bn) * w.layout.kb;
      for (int64_t b = 0, k0 = 0; k0 < K; b++, k0 += w.layout.bk)
        kern.dequantize_run(row + k0, std::min(w.layout.bk, K - k0), srow[b], o + k0 * elem_size, kind);
    }
  });
}

at::Tensor fp8_dequantize(const at::Tensor& weight, const at::Tensor& scale, at::OptionalIntArrayRef block_size,
                          at::ScalarType dtype) {
  const Fp8Weight w = check_fp8_dequantize(weight, scale, block_size, dtype);
  at::Tensor out = at::empty({w.N, w.K}, weight.options().dtype(dtype));
  if (out.numel() == 0) return out;
  const DequantOut kind = dtype == at::kFloat ? DequantOut::F32 : dtype == at::kBFloat16 ? DequantOut::BF16
                                                                                      : DequantOut::F16;
  dequantize_rows(w, out.data_ptr(), kind);
  return out;
}

}  // namespace
}  // namespace lowbit::cpu

TORCH_LIBRARY_IMPL(lowbit, CPU, m) {
  m.impl("fp8_dequantize", &lowbit::cpu::fp8_dequantize);
}
