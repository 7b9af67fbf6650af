// The ops as kernels of one dispatch key: each call runs the op's plan through a fresh launcher L.
// The emulator registers PlannedOps<EmuLauncher, true> for lowbit_emu/CPU, the MPS backend
// PlannedOps<MpsLauncher, false> for lowbit/MPS, so both devices run literally the same plan code.
#pragma once
#include <torch/library.h>

#include "metal/plans.h"

namespace lowbit::metal {

// HostVisible: may the plans read small tensors (offsets, expert ids) on the host? Yes for the emulator
// (CPU tensors); no on mps, where it would sync the device: the kernels clamp instead.
template <class L, bool HostVisible>
struct PlannedOps {
  static at::Tensor fp8_mm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                           const std::optional<at::Tensor>& bias, at::OptionalIntArrayRef block_size) {
    L l;
    return plan_fp8_mm(Target{l, HostVisible, l.caps()}, x, weight, scale, bias, block_size);
  }
  static at::Tensor fp8_dequantize(const at::Tensor& weight, const at::Tensor& scale,
                                   at::OptionalIntArrayRef block_size, at::ScalarType dtype) {
    L l;
    return plan_fp8_dequantize(Target{l, HostVisible, l.caps()}, weight, scale, block_size, dtype);
  }
  static at::Tensor fp8_grouped_mm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                                   const at::Tensor& offsets, const std::optional<at::Tensor>& expert_ids,
                                   at::OptionalIntArrayRef block_size) {
    L l;
    return plan_fp8_grouped_mm(Target{l, HostVisible, l.caps()}, x, weight, scale, offsets, expert_ids, block_size);
  }
  static std::tuple<at::Tensor, at::Tensor> int8_quantize(const at::Tensor& x) {
    L l;
    return plan_int8_quantize(Target{l, HostVisible, l.caps()}, x);
  }
  static at::Tensor int8_mm(const at::Tensor& xq, const at::Tensor& x_scale, const at::Tensor& wq,
                            const at::Tensor& w_scale, const std::optional<at::Tensor>& bias,
                            std::optional<at::ScalarType> out_dtype) {
    L l;
    return plan_int8_mm(Target{l, HostVisible, l.caps()}, xq, x_scale, wq, w_scale, bias, out_dtype);
  }

  static at::Tensor fp8_mm_t(const at::Tensor& grad_out, const at::Tensor& weight, const at::Tensor& scale,
                             at::OptionalIntArrayRef block_size) {
    L l;
    return plan_fp8_mm_t(Target{l, HostVisible, l.caps()}, grad_out, weight, scale, block_size);
  }
  static at::Tensor fp8_grouped_mm_t(const at::Tensor& grad_out, const at::Tensor& weight, const at::Tensor& scale,
                                     const at::Tensor& offsets, const std::optional<at::Tensor>& expert_ids,
                                     at::OptionalIntArrayRef block_size) {
    L l;
    return plan_fp8_grouped_mm_t(Target{l, HostVisible, l.caps()}, grad_out, weight, scale, offsets, expert_ids,
                                 block_size);
  }
  static at::Tensor int8_weight_mm_t(const at::Tensor& grad_out, const at::Tensor& wq, const at::Tensor& w_scale) {
    L l;
    return plan_int8_weight_mm_t(Target{l, HostVisible, l.caps()}, grad_out, wq, w_scale);
  }

  static at::Tensor w4_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                          c10::string_view format, int64_t group_size, const std::optional<at::Tensor>& offset,
                          const std::optional<at::Tensor>& global_scale, const std::optional<at::Tensor>& bias) {
    L l;
    return plan_w4_mm(Target{l, HostVisible, l.caps()}, x, codes, scale, std::string(format), group_size, offset,
                      global_scale, bias);
  }
  static at::Tensor w4_dequantize(const at::Tensor& codes, const at::Tensor& scale, c10::string_view format,
                                  int64_t group_size, c10::SymInt K, const std::optional<at::Tensor>& offset,
                                  const std::optional<at::Tensor>& global_scale, at::ScalarType dtype) {
    L l;
    return plan_w4_dequantize(Target{l, HostVisible, l.caps()}, codes, scale, std::string(format), group_size,
                              K.expect_int(), offset, global_scale, dtype);
  }
  static at::Tensor w4_mm_t(const at::Tensor& grad_out, const at::Tensor& codes, const at::Tensor& scale,
                            c10::string_view format, int64_t group_size, c10::SymInt K,
                            const std::optional<at::Tensor>& offset, const std::optional<at::Tensor>& global_scale) {
    L l;
    return plan_w4_mm_t(Target{l, HostVisible, l.caps()}, grad_out, codes, scale, std::string(format), group_size,
                        K.expect_int(), offset, global_scale);
  }

  static at::Tensor w4_grouped_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                  c10::string_view format, int64_t group_size, const at::Tensor& offsets,
                                  const std::optional<at::Tensor>& expert_ids, const std::optional<at::Tensor>& offset,
                                  const std::optional<at::Tensor>& global_scale) {
    L l;
    return plan_w4_grouped_mm(Target{l, HostVisible, l.caps()}, x, codes, scale, std::string(format), group_size,
                              offsets, expert_ids, offset, global_scale);
  }
  static at::Tensor w4_grouped_mm_t(const at::Tensor& grad_out, const at::Tensor& codes, const at::Tensor& scale,
                                    c10::string_view format, int64_t group_size, c10::SymInt K,
                                    const at::Tensor& offsets, const std::optional<at::Tensor>& expert_ids,
                                    const std::optional<at::Tensor>& offset,
                                    const std::optional<at::Tensor>& global_scale) {
    L l;
    return plan_w4_grouped_mm_t(Target{l, HostVisible, l.caps()}, grad_out, codes, scale, std::string(format),
                                group_size, K.expect_int(), offsets, expert_ids, offset, global_scale);
  }

  static void register_all(torch::Library& m) {
    m.impl("fp8_mm", &fp8_mm);
    m.impl("fp8_dequantize", &fp8_dequantize);
    m.impl("fp8_grouped_mm", &fp8_grouped_mm);
    m.impl("int8_quantize", &int8_quantize);
    m.impl("int8_mm", &int8_mm);
    m.impl("fp8_mm_t", &fp8_mm_t);
    m.impl("fp8_grouped_mm_t", &fp8_grouped_mm_t);
    m.impl("int8_weight_mm_t", &int8_weight_mm_t);
    m.impl("w4_mm", &w4_mm);
    m.impl("w4_dequantize", &w4_dequantize);
    m.impl("w4_mm_t", &w4_mm_t);
    m.impl("w4_grouped_mm", &w4_grouped_mm);
    m.impl("w4_grouped_mm_t", &w4_grouped_mm_t);
  }
};

}  // namespace lowbit::metal
