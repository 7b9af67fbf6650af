// fp8_grouped_mm on Metal: validate, pick the decode or prefill kernel, size the grid over the groups.
#include "metal/plans.h"

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

}  // namespace

std::string fp8_grouped_mm_kernel_name(int64_t T, int64_t G, at::ScalarType dtype) {
  return kernel_name(use_decode_kernel(T, G) ? "fp8_grouped_gemv" : "fp8_grouped_gemm", dtype);
}

at::Tensor plan_fp8_grouped_mm(Target t, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                               const at::Tensor& offsets, const std::optional<at::Tensor>& expert_ids,
                               at::OptionalIntArrayRef block_size) {
  // host_visible (emulator): offsets and ids are checked here; on mps the kernels clamp them instead
  const Fp8GroupedMmArgs a =
      check_fp8_grouped_mm(x, weight, scale, offsets, expert_ids, block_size, /*validate_values=*/t.host_visible);
  const int64_t T = a.T, N = a.w.N, K = a.w.K, E = a.w.E, G = a.G;
  at::Tensor out = at::empty({T, N}, a.x.options());
  if (out.numel() == 0) return out;
  if (K == 0 || G == 0) return out.zero_();  // empty sums, or every row in no group

  Fp8GroupedMmParams p{};
  p.T = checked_u32("T", T);
  p.N = checked_u32("N", N);
  p.K = checked_u32("K", K);
  p.E = checked_u32("E", E);
  p.G = checked_u32("G", G);
  p.flags = vector_access_ok(kFp8VecLoadBytes, K, {a.x, a.w.bits}) ? kFp8VecLoads : 0u;
  const ScaleLayout& l = a.w.layout;
  p.scale_stride = checked_u32("scale elements per expert",
                               l.kind == ScaleKind::Tensor ? 1 : l.kind == ScaleKind::Channel ? N : l.nb * l.kb);
  p.scale = scale_params(l);

  const bool decode = use_decode_kernel(T, G);
  Dispatch d(fp8_grouped_mm_kernel_name(T, G, a.x.scalar_type()));
  d.buffer("x", a.x).buffer("weight", a.w.bits).buffer("scale", a.w.scale);
  if (decode) {
    d.buffer("offsets", a.offsets);
  } else {
    // The tiles that exist, laid out on the device (the plan cannot read offsets on mps without a sync):
    // fp8_grouped_tiles writes the table, the GEMM's threadgroups look their tile up in it.
    at::Tensor tiles = at::empty({2 * (G + 3)}, a.offsets.options());
    Dispatch layout("fp8_grouped_tiles");
    layout.buffer("offsets", a.offsets).buffer("tiles", tiles, Access::Write).value("params", p);
    layout.grid({1, 1, 1}, {1, 1, 1});
    t.run(layout);
    d.buffer("tiles", tiles);
  }
  d.buffer("expert_ids", a.expert_ids).buffer("out", out, Access::Write).value("params", p);
  if (decode) {  // one grid slot per group, plus one for the rows in no group
    d.grid({checked_u32("grid x", ceil_div(N, kFp8GemvSimdgroups * kFp8GemvColsRows)), checked_u32("G + 1", G + 1), 1},
           {kFp8GemvSimdgroups * 32, 1, 1});
  } else {  // at most ceil(rows / 32) tiles per segment: G groups and the rows before and after them
    d.grid({checked_u32("grid x", ceil_div(N, kFp8GemmTile)), checked_u32("grid y", ceil_div(T, kFp8GemmTile) + G + 1), 1},
           {kFp8GemmThreads, 1, 1});
  }
  t.run(d);
  return out;
}

}  // namespace lowbit::metal
