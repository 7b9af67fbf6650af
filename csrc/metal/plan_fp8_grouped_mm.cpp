// fp8_grouped_mm on Metal: validate, pick the decode or prefill kernel, size the grid over the groups.
#include "metal/plan_grouped.h"

#include <ATen/ops/empty.h>

namespace lowbit::metal {
namespace {

// ---- kernel choice ----
// On mps the plan cannot read offsets without a device sync, so it decides from the mean rows per group,
// T / G. Up to kFp8GemvRows (8) rows a group is one pass of the GEMV body (fp8_grouped_gemv): each selected
// expert's weights are read once, the MoE decode case (top-k experts for a few tokens). With more rows per
// group the 32 x 32 tiled GEMM (fp8_grouped_gemm) reuses each decoded weight tile for 32 rows. Both kernels
// are correct for any distribution of rows; the choice only affects speed.
constexpr int64_t kDecodeMaxMeanRowsPerGroup = kFp8GemvRows;

bool use_decode_kernel(int64_t T, int64_t G) { return T <= kDecodeMaxMeanRowsPerGroup * std::max<int64_t>(G, 1); }

// The shape classes: decode, and prefill split by activation width (fp32 never goes through the tensor units).
enum class Fp8GroupedClass { Decode, Prefill16, Prefill32 };

Fp8GroupedClass fp8_grouped_class(int64_t T, int64_t G, at::ScalarType dtype) {
  if (use_decode_kernel(T, G)) return Fp8GroupedClass::Decode;
  return dtype == at::kFloat ? Fp8GroupedClass::Prefill32 : Fp8GroupedClass::Prefill16;
}

// The kernels of each class (plans.h KernelVariant). Every prefill kernel takes the tile table's 32-row tiles;
// on M5 the bf16 / fp16 prefill runs Metal 4's matmul2d on 32 x 64 tiles (metal/fp8_grouped_mm_apple10.metal).
constexpr TileGeometry kDecodeGeometry{0, kFp8GemvSimdgroups * kFp8GemvColsRows, kFp8GemvSimdgroups * 32, true};
constexpr TileGeometry kPrefillGeometry{kFp8GemmTile, kFp8GemmTile, kFp8GemmThreads, true};
constexpr KernelVariant<Fp8GroupedClass> kFp8GroupedKernels[] = {
    {Fp8GroupedClass::Decode, "fp8_grouped_gemv", kPortableDevice, kDecodeGeometry},
    {Fp8GroupedClass::Prefill16, "fp8_grouped_gemm_mpp", kTensorOpsDevice,
     {kFp8GemmTile, kFp8MppBN, kFp8MppThreads, false}},
    {Fp8GroupedClass::Prefill16, "fp8_grouped_gemm", kPortableDevice, kPrefillGeometry},
    {Fp8GroupedClass::Prefill32, "fp8_grouped_gemm", kPortableDevice, kPrefillGeometry},
};

}  // namespace

Fp8GroupedMmParams grouped_params(const Fp8GroupedMmArgs& a, uint32_t flags) {
  Fp8GroupedMmParams p{};
  p.T = checked_u32("T", a.T);
  p.N = checked_u32("N", a.w.N);
  p.K = checked_u32("K", a.w.K);
  p.E = checked_u32("E", a.w.E);
  p.G = checked_u32("G", a.G);
  p.flags = flags;
  const ScaleLayout& l = a.w.layout;
  p.scale_stride = checked_u32("scale elements per expert",
                               l.kind == ScaleKind::Tensor ? 1 : l.kind == ScaleKind::Channel ? a.w.N : l.nb * l.kb);
  p.scale = scale_params(l);
  return p;
}

at::Tensor run_grouped_tiles(Target t, const GroupRows& rows) {
  // the table kernel reads only T and G of its params
  Fp8GroupedMmParams p{};
  p.T = checked_u32("T", rows.T);
  p.G = checked_u32("G", rows.G);
  at::Tensor tiles = at::empty({2 * (rows.G + 3)}, rows.offsets.options());
  Dispatch layout("fp8_grouped_tiles");
  layout.buffer("offsets", rows.offsets).buffer("tiles", tiles, Access::Write).value("params", p);
  layout.grid({1, 1, 1}, {1, 1, 1});
  t.run(layout);
  return tiles;
}

void bind_group_rows(Target t, Dispatch& d, const GroupRows& rows) {
  d.buffer("tiles", run_grouped_tiles(t, rows));
  d.buffer("expert_ids", rows.expert_ids);
}

void grouped_grid(Dispatch& d, const GroupRows& rows, bool decode, int64_t grid_x, uint32_t threads) {
  // prefill: at most ceil(rows / 32) tiles per segment -- G groups and the rows before and after them
  const int64_t grid_y = decode ? rows.G + 1 : ceil_div(rows.T, kFp8GemmTile) + rows.G + 1;
  d.grid({checked_u32("grid x", grid_x), checked_u32("grid y", grid_y), 1}, {threads, 1, 1});
}

void run_grouped(Target t, const std::string& kernel, const char* x_name, const Fp8GroupedMmArgs& a,
                 const Fp8GroupedMmParams& p, const at::Tensor& out, bool decode, int64_t grid_x, uint32_t threads) {
  Dispatch d(kernel);
  d.buffer(x_name, a.x).buffer("weight", a.w.bits).buffer("scale", a.w.scale);
  bind_group_rows(t, d, a);
  d.buffer("out", out, Access::Write).value("params", p);
  grouped_grid(d, a, decode, grid_x, threads);
  t.run(d);
}

std::string fp8_grouped_mm_kernel_name(int64_t T, int64_t G, at::ScalarType dtype, const DeviceCaps& device) {
  return kernel_name(pick_kernel(kFp8GroupedKernels, fp8_grouped_class(T, G, dtype), device), dtype);
}

at::Tensor plan_fp8_grouped_mm(Target t, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                               const at::Tensor& offsets, const std::optional<at::Tensor>& expert_ids,
                               at::OptionalIntArrayRef block_size) {
  // host_visible (emulator): offsets and ids are checked here; on mps the kernels clamp them instead
  const Fp8GroupedMmArgs a =
      check_fp8_grouped_mm(x, weight, scale, offsets, expert_ids, block_size, /*validate_values=*/t.host_visible);
  const int64_t T = a.T, N = a.w.N, K = a.w.K, G = a.G;
  at::Tensor out = at::empty({T, N}, a.x.options());
  if (out.numel() == 0) return out;
  if (K == 0 || G == 0) return out.zero_();  // empty sums, or every row in no group

  const Fp8GroupedMmParams p =
      grouped_params(a, vector_access_ok(kFp8VecLoadBytes, K, {a.x, a.w.bits}) ? kFp8VecLoads : 0u);

  const Fp8GroupedClass cls = fp8_grouped_class(T, G, a.x.scalar_type());
  const KernelVariant<Fp8GroupedClass>& v = pick_variant(kFp8GroupedKernels, cls, t, a.x.scalar_type());
  run_grouped(t, kernel_name(v.base, a.x.scalar_type()), "x", a, p, out, cls == Fp8GroupedClass::Decode,
              ceil_div(N, v.tile.bn), v.tile.threads);
  return out;
}

}  // namespace lowbit::metal
