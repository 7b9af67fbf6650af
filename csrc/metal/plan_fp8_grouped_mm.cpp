#include "metal/plans.h"

namespace lowbit::metal {

at::Tensor plan_fp8_grouped_mm(Target, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const std::optional<at::Tensor>&, at::OptionalIntArrayRef) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "fp8_grouped_mm: no Metal kernel yet");
}

}  // namespace lowbit::metal
