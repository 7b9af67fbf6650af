#include <limits>

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

ScaleParams scale_params(const ScaleLayout& l) {
  ScaleParams p{};
  p.kind = uint32_t(l.kind);
  p.bn = checked_u32("block_n", l.bn);
  p.bk = checked_u32("block_k", l.bk);
  p.kb = checked_u32("ceil(K / block_k)", l.kb);
  return p;
}

uint32_t checked_u32(const char* what, int64_t v) {
  TORCH_CHECK(v >= 0 && v <= int64_t(std::numeric_limits<uint32_t>::max()), "torch_lowbit metal: ", what, " = ", v,
              " does not fit the kernels' 32-bit sizes");
  return uint32_t(v);
}

}  // namespace lowbit::metal
