#include "metal/plans.h"

namespace lowbit::metal {

std::tuple<at::Tensor, at::Tensor> plan_int8_quantize(Target, const at::Tensor&) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "int8_quantize: no Metal kernel yet");
}

}  // namespace lowbit::metal
