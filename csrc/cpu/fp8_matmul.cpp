#include "cpu/fp8_matmul.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <vector>

#include "cpu/fp8.h"

namespace lowbit::cpu {

template <typename T>
void fp8_matmul(const T* x, int64_t M, const uint8_t* w, const float* scale, const ScaleLayout& layout, int64_t N,
                int64_t K, const float* bias, T* out, int64_t ldo) {
  if (M == 0 || N == 0) return;
  // activations widened once; each weight row decoded once and reused for every row of x
  std::vector<float> xf(size_t(M * K));
  for (int64_t i = 0; i < M * K; i++) xf[i] = float(x[i]);
  const int64_t bk = layout.kind == ScaleKind::Block ? layout.bk : (K > 0 ? K : 1);
  at::parallel_for(0, N, 4, [&](int64_t n0, int64_t n1) {
    std::vector<float> wrow(static_cast<size_t>(K));
    for (int64_t n = n0; n < n1; n++) {
      const uint8_t* wr = w + n * K;
      for (int64_t k = 0; k < K; k++) wrow[k] = fp8_e4m3_to_float(wr[k]);
      for (int64_t m = 0; m < M; m++) {
        const float* xr = xf.data() + m * K;
        float acc = 0.f;
        for (int64_t k0 = 0; k0 < K; k0 += bk) {  // block scales multiply the partial sum of each K block
          const int64_t k1 = std::min(K, k0 + bk);
          float part = 0.f;
          for (int64_t k = k0; k < k1; k++) part += xr[k] * wrow[k];
          acc += layout.kind == ScaleKind::Block ? part * scale[(n / layout.bn) * layout.kb + k0 / layout.bk] : part;
        }
        if (layout.kind == ScaleKind::Tensor) acc *= scale[0];
        if (layout.kind == ScaleKind::Channel) acc *= scale[n];
        if (bias) acc += bias[n];
        out[m * ldo + n] = T(acc);
      }
    }
  });
}

template void fp8_matmul<float>(const float*, int64_t, const uint8_t*, const float*, const ScaleLayout&, int64_t,
                                int64_t, const float*, float*, int64_t);
template void fp8_matmul<c10::BFloat16>(const c10::BFloat16*, int64_t, const uint8_t*, const float*, const ScaleLayout&,
                                        int64_t, int64_t, const float*, c10::BFloat16*, int64_t);
template void fp8_matmul<c10::Half>(const c10::Half*, int64_t, const uint8_t*, const float*, const ScaleLayout&, int64_t,
                                    int64_t, const float*, c10::Half*, int64_t);

}  // namespace lowbit::cpu
