// w4_grouped_mm on Metal: validate, pick the decode or prefill kernel by the mean rows per group (on mps the
// offsets are not read), size the grid over the groups. The group handling (clamped offsets and ids, the prefill
// tile table) is fp8_grouped_mm's (plan_grouped.h); the weight is w4_mm's, per expert (plan_w4.h). Here also the
// launch code both 4-bit grouped plans share.
#include "metal/plan_grouped.h"
#include "metal/plan_w4.h"

#include <ATen/ops/empty.h>

namespace lowbit::metal {

// fp8_grouped_tiles lays rows out in tiles of the fp8 GEMM's height; the 4-bit tile kernels (the M5 one's
// kFp8GemmTile rows too) run one per tile
static_assert(kW4GemmTile == kFp8GemmTile, "the 4-bit grouped GEMMs run fp8_grouped_tiles' row tiles");

namespace {

// The shape classes by mean rows per group, prefill split by activation width (fp32 activations never go through
// the tensor units), and their kernels (plans.h KernelVariant: newer-GPU variants go before the portable line). On
// M5 the bf16 / fp16 prefill runs Metal 4's matmul2d on the tile table's 32-row tiles
// (metal/w4_grouped_mm_apple10.metal).
enum class W4GroupedClass { Decode, Prefill16, Prefill32 };
constexpr TileGeometry kPrefillGeometry{kW4GemmTile, kW4GemmTile, kW4GemmThreads, false};
constexpr KernelVariant<W4GroupedClass> kW4GroupedKernels[] = {
    {W4GroupedClass::Decode, "w4_grouped_gemv", kPortableDevice,
     {0, kW4GemvSimdgroups * kW4GemvCols, kW4GemvSimdgroups * 32, false}},
    {W4GroupedClass::Prefill16, "w4_grouped_gemm_mpp", kTensorOpsDevice,
     {kFp8GemmTile, kFp8MppBN, kFp8MppThreads, false}},
    {W4GroupedClass::Prefill16, "w4_grouped_gemm", kPortableDevice, kPrefillGeometry},
    {W4GroupedClass::Prefill32, "w4_grouped_gemm", kPortableDevice, kPrefillGeometry},
};

}  // namespace

W4GroupedParams w4_grouped_params(const W4GroupedMmArgs& a, uint32_t flags) {
  W4GroupedParams p{};
  p.w = w4_params(a.w, a.T, flags);
  p.T = checked_u32("T", a.T);
  p.E = checked_u32("E", a.w.E);
  p.G = checked_u32("G", a.G);
  return p;
}

void run_w4_grouped(Target t, const char* kernel_base, const char* x_name, const W4GroupedMmArgs& a,
                    const W4GroupedParams& p, const at::Tensor& out, bool decode, int64_t grid_x,
                    uint32_t threads) {
  Dispatch d(w4_kernel_name(kernel_base, a.x.scalar_type(), a.w));
  d.buffer(x_name, a.x);
  bind_w4_weight(d, a.w);
  bind_group_rows(t, d, a);
  d.buffer("out", out, Access::Write).value("params", p);
  grouped_grid(d, a, decode, grid_x, threads);
  t.run(d);
}

at::Tensor plan_w4_grouped_mm(Target t, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                              const std::string& format, int64_t group_size, const at::Tensor& offsets,
                              const std::optional<at::Tensor>& expert_ids, const std::optional<at::Tensor>& offset,
                              const std::optional<at::Tensor>& global_scale) {
  // host_visible (emulator): offsets and ids are checked here; on mps the kernels clamp them instead
  const W4GroupedMmArgs a = check_w4_grouped_mm("w4_grouped_mm", /*transposed=*/false, x, codes, scale, format,
                                                group_size, /*K=*/-1, offsets, expert_ids, offset, global_scale,
                                                /*validate_values=*/t.host_visible);
  const int64_t T = a.T, N = a.w.N, K = a.w.K, G = a.G;
  at::Tensor out = at::empty({T, N}, a.x.options());
  if (out.numel() == 0) return out;
  if (K == 0 || G == 0) return out.zero_();  // empty sums, or every row in no group

  // mean rows per group up to kW4GemvRows: one GEMV pass per group reads each chosen expert's codes once (MoE
  // decode); more rows per group: the tiled GEMM reuses each decoded weight tile for 32 rows
  const at::ScalarType dtype = a.x.scalar_type();
  const W4GroupedClass cls = T <= int64_t(kW4GemvRows) * G ? W4GroupedClass::Decode
                             : dtype == at::kFloat         ? W4GroupedClass::Prefill32
                                                           : W4GroupedClass::Prefill16;
  const KernelVariant<W4GroupedClass>& v = pick_variant(kW4GroupedKernels, cls, t.caps);
  const W4GroupedParams p = w4_grouped_params(a, (vector_access_ok(kW4XVecBytes, K, {a.x}) ? kW4XVec : 0u) |
                                                     w4_mpp_flags(v.needs, a.w, dtype));
  run_w4_grouped(t, v.base, "x", a, p, out, cls == W4GroupedClass::Decode, ceil_div(N, v.tile.bn), v.tile.threads);
  return out;
}

}  // namespace lowbit::metal
