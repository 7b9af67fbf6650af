#include "metal/plans.h"

namespace lowbit::metal {

at::Tensor plan_int8_mm(Target, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const std::optional<at::Tensor>&, std::optional<at::ScalarType>) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "int8_mm: no Metal kernel yet");
}

}  // namespace lowbit::metal
