#include <cstdlib>
#include <cstring>
#include <limits>

#include "metal/limits.h"
#include "metal/plans.h"

namespace lowbit::metal {

const char* kernel_dtype_suffix(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float";
    case at::kHalf: return "half";
    case at::kBFloat16: return "bfloat";
    default: TORCH_CHECK(false, "torch_lowbit metal: no kernel variant for dtype ", t);
  }
}

std::string kernel_name(const char* base, at::ScalarType dtype, const char* variant) {
  std::string s = std::string(base) + "_" + kernel_dtype_suffix(dtype);
  if (variant != nullptr) s += std::string("_") + variant;
  return s;
}

uint32_t kernel_dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kDtypeFloat;
    case at::kHalf: return kDtypeHalf;
    case at::kBFloat16: return kDtypeBfloat;
    default: TORCH_CHECK(false, "torch_lowbit metal: kernels read bfloat16, float16 or float32 buffers, got ", t);
  }
}

ScaleParams scale_params(const ScaleLayout& l) {
  ScaleParams p{};
  p.kind = uint32_t(l.kind);
  p.bn = checked_u32("block_n", l.bn);
  p.bk = checked_u32("block_k", l.bk);
  p.kb = checked_u32("ceil(K / block_k)", l.kb);
  // the kernels' k / bk becomes a shift for power-of-two blocks (128 in every checkpoint format)
  p.bk_shift = kScaleBkNoShift;
  if (p.bk != 0 && (p.bk & (p.bk - 1)) == 0) {
    p.bk_shift = 0;
    while ((1u << p.bk_shift) != p.bk) p.bk_shift++;
  }
  return p;
}

bool tensor_ops_disabled() {
  const char* v = std::getenv("TORCH_LOWBIT_NO_MPP");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

uint32_t checked_u32(const char* what, int64_t v) {
  TORCH_CHECK(v >= 0 && v <= int64_t(std::numeric_limits<uint32_t>::max()), "torch_lowbit metal: ", what, " = ", v,
              " does not fit the kernels' 32-bit sizes");
  return uint32_t(v);
}

void grid_over_tiles(Dispatch& d, const TileGeometry& tile, int64_t rows, int64_t cols) {
  d.grid({checked_u32("grid x", ceil_div(cols, tile.bn)), checked_u32("grid y", ceil_div(rows, tile.bm)), 1},
         {tile.threads, 1, 1});
}

bool vector_access_ok(int64_t bytes, int64_t row_elems, std::initializer_list<at::Tensor> buffers) {
  for (const at::Tensor& t : buffers) {
    const int64_t es = int64_t(t.element_size());
    if ((t.storage_offset() * es) % bytes != 0 || (row_elems * es) % bytes != 0) return false;
  }
  return true;
}

void check_launch_limits(const Dispatch& d) {
  const char* const who = "torch_lowbit metal: kernel ";
  const uint64_t threads = uint64_t(d.threads.x) * d.threads.y * d.threads.z;
  TORCH_CHECK(threads >= 1 && threads <= kMaxThreadsPerThreadgroup, who, d.kernel, " asks for ", threads,
              " threads per threadgroup; Metal allows 1 to ", kMaxThreadsPerThreadgroup);
  uint64_t tg_bytes = 0;
  for (size_t b : d.threadgroup_memory) tg_bytes += b;
  TORCH_CHECK(tg_bytes <= kMaxThreadgroupMemoryBytes, who, d.kernel, " asks for ", tg_bytes,
              " bytes of threadgroup memory; Metal allows ", kMaxThreadgroupMemoryBytes);
  const uint32_t groups[3] = {d.threadgroups.x, d.threadgroups.y, d.threadgroups.z};
  const uint32_t per[3] = {d.threads.x, d.threads.y, d.threads.z};
  for (int i = 0; i < 3; i++) {
    TORCH_CHECK(uint64_t(groups[i]) * per[i] <= kMaxThreadsPerGridDim, who, d.kernel, ": grid dimension ", "xyz"[i],
                " has ", groups[i], " threadgroups x ", per[i], " threads = ", uint64_t(groups[i]) * per[i],
                " thread positions, more than the 2^32 a 32-bit thread_position_in_grid can index");
  }
  for (const Arg& a : d.args) {
    TORCH_CHECK(!a.is_value() || a.bytes.size() <= kMaxSetBytesBytes, who, d.kernel, ": value ", a.name, " has ",
                a.bytes.size(), " bytes; setBytes allows ", kMaxSetBytesBytes);
  }
}

void Target::run(const Dispatch& d) const {
  check_launch_limits(d);
  const uint64_t threads = uint64_t(d.threads.x) * d.threads.y * d.threads.z;
  TORCH_CHECK(fits(d.kernel, threads), "torch_lowbit metal: kernel ", d.kernel, " asks for ", threads,
              " threads per threadgroup; its pipeline allows ", launcher.max_threads_per_threadgroup(d.kernel),
              " (maxTotalThreadsPerThreadgroup) and the plan has no narrower variant");
  launcher.run(d);
}

bool empty_product(at::Tensor& out, const std::optional<at::Tensor>& bias, int64_t K) {
  if (out.numel() == 0) return true;
  if (K != 0) return false;
  if (bias) out.copy_(bias->expand(out.sizes()));
  else out.zero_();
  return true;
}

}  // namespace lowbit::metal
