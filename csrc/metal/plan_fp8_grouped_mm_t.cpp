// fp8_grouped_mm_t on Metal (fp8_grouped_mm's backward product): validate, pick the decode or prefill kernel by
// the mean rows per group (as fp8_grouped_mm does: on mps the offsets are not read), size the grid over the
// groups. The prefill kernel runs over fp8_grouped_tiles' table of the row tiles that exist.
#include <ATen/ops/empty.h>

#include "metal/plan_grouped.h"
#include "metal/plan_mm_t.h"

namespace lowbit::metal {
namespace {

// The kernels of each class (plans.h KernelVariant: newer-GPU variants go before the portable line). The decode
// class is the multi-row GEMV run once per group; the prefill class the tiled GEMM over the tile table.
constexpr KernelVariant<MmTKernel> kFp8GroupedMmTKernels[] = {
    {MmTKernel::GemvRows, "fp8_grouped_mm_t_gemv_rows", kPortableDevice, kMmTGemvRowsGeometry},
    {MmTKernel::Gemm, "fp8_grouped_mm_t_gemm", kPortableDevice, kMmTGemmGeometry},
};

}  // namespace

at::Tensor plan_fp8_grouped_mm_t(Target t, const at::Tensor& grad_out, const at::Tensor& weight,
                                 const at::Tensor& scale, const at::Tensor& offsets,
                                 const std::optional<at::Tensor>& expert_ids, at::OptionalIntArrayRef block_size) {
  const Fp8GroupedMmArgs a = check_fp8_grouped_mm_t(grad_out, weight, scale, offsets, expert_ids, block_size,
                                                    /*validate_values=*/t.host_visible);
  const int64_t T = a.T, N = a.w.N, K = a.w.K, G = a.G;
  at::Tensor out = at::empty({T, K}, a.x.options());
  if (out.numel() == 0) return out;
  if (N == 0 || G == 0) return out.zero_();  // empty sums, or every row in no group

  const Fp8GroupedMmParams p = grouped_params(a, mm_t_flags(a.x, N, a.w.bits, K));

  // mean rows per group: up to kMmTGemvRows, one GEMV pass per group (MoE decode)
  // (unless the GEMV's pipeline takes fewer than its 256 threads: the prefill kernel, 128, takes any rows)
  const MmTKernel cls = T <= int64_t(kMmTGemvRows) * G ? MmTKernel::GemvRows : MmTKernel::Gemm;
  const KernelVariant<MmTKernel>& v = pick_variant(kFp8GroupedMmTKernels, cls, MmTKernel::Gemm, t, a.x.scalar_type());
  run_grouped(t, kernel_name(v.base, a.x.scalar_type()), "grad_out", a, p, out, v.cls == MmTKernel::GemvRows,
              ceil_div(K, v.tile.bn), v.tile.threads);
  return out;
}

}  // namespace lowbit::metal
