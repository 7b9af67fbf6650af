#include <ATen/ops/empty.h>

#include <algorithm>

#include "metal/plans.h"

namespace lowbit::metal {
namespace {

// One threadgroup per row. Up to this many threads stride over the row; short rows get fewer (a multiple
// of 32, so every simdgroup is full), so that no thread idles for K <= 256.
constexpr int64_t kQuantizeMaxThreads = 256;

// The kernels (plans.h KernelVariant: newer-GPU variants go before the portable line); the plan sizes the
// threadgroups to the row and the pipeline (no geometry)
constexpr KernelVariant<AnyShape> kInt8QuantizeKernels[] = {
    {AnyShape::All, "int8_quantize", kPortableDevice},
};

}  // namespace

std::tuple<at::Tensor, at::Tensor> plan_int8_quantize(Target t, const at::Tensor& x) {
  const Int8QuantizeArgs a = check_int8_quantize(x);
  at::Tensor q = at::empty({a.M, a.K}, a.x.options().dtype(at::kChar));
  at::Tensor scale = at::empty({a.M}, a.x.options().dtype(at::kFloat));
  // K == 0: every row is empty, so its absmax and scale are 0 (the kernel would take x and q as nil buffers)
  if (a.K == 0) scale.zero_();
  if (a.M > 0 && a.K > 0) {
    Int8QuantizeParams p{};
    p.M = checked_u32("M", a.M);
    p.K = checked_u32("K", a.K);
    Dispatch d(kernel_name(pick_kernel(kInt8QuantizeKernels, AnyShape::All, t.caps), a.x.scalar_type()));
    // the threads stride over the row: fewer where the pipeline takes fewer (whole simdgroups)
    const int64_t most = std::min<int64_t>(kQuantizeMaxThreads, t.launcher.max_threads_per_threadgroup(d.kernel) / 32 * 32);
    const uint32_t threads = uint32_t(std::clamp<int64_t>(ceil_div(a.K, 32) * 32, 32, std::max<int64_t>(most, 32)));
    d.buffer("x", a.x).buffer("q", q, Access::Write).buffer("scale", scale, Access::Write).value("params", p);
    d.grid({p.M, 1, 1}, {threads, 1, 1});
    t.run(d);
  }
  return {q.view(a.q_shape), scale.view(a.scale_shape)};
}

}  // namespace lowbit::metal
