// Every op schema of torch_lowbit, once. The same schemas are defined four times: `lowbit` (CPU and MPS
// kernels), `lowbit_emu` (the Metal kernels run by the MSL emulator on CPU tensors, for tests), `lowbit_emu_mps`
// (the same, with the plans as on mps: offsets and expert ids never read on the host, so the kernels' own
// clamping is what runs) and `lowbit_dryrun` (the Metal plans on meta tensors, recording their dispatches:
// csrc/metal/dry_run_launcher.h).
// Semantics: design.md, "The ops".
#include <torch/library.h>

namespace lowbit {

void define_ops(torch::Library& m) {
  m.def("fp8_mm(Tensor x, Tensor weight, Tensor scale, Tensor? bias=None, SymInt[]? block_size=None) -> Tensor");
  m.def("fp8_dequantize(Tensor weight, Tensor scale, SymInt[]? block_size=None, ScalarType dtype=bfloat16) -> Tensor");
  m.def("fp8_grouped_mm(Tensor x, Tensor weight, Tensor scale, Tensor offsets, Tensor? expert_ids=None, "
        "SymInt[]? block_size=None) -> Tensor");
  m.def("int8_quantize(Tensor x) -> (Tensor, Tensor)");
  // The transposed products of the backward passes: grad_out [..., N] @ (dec(W) * scale) -> [..., K].
  m.def("fp8_mm_t(Tensor grad_out, Tensor weight, Tensor scale, SymInt[]? block_size=None) -> Tensor");
  m.def("fp8_grouped_mm_t(Tensor grad_out, Tensor weight, Tensor scale, Tensor offsets, Tensor? expert_ids=None, "
        "SymInt[]? block_size=None) -> Tensor");
  m.def("int8_weight_mm_t(Tensor grad_out, Tensor wq, Tensor w_scale) -> Tensor");
  // 4-bit weights (csrc/w4_formats.h): codes [N, ceil(K/2)] uint8, scale [N, ceil(K/group_size)] as stored.
  m.def("w4_mm(Tensor x, Tensor codes, Tensor scale, str format, int group_size, Tensor? offset=None, "
        "Tensor? global_scale=None, Tensor? bias=None) -> Tensor");
  m.def("w4_dequantize(Tensor codes, Tensor scale, str format, int group_size, SymInt K, Tensor? offset=None, "
        "Tensor? global_scale=None, ScalarType dtype=bfloat16) -> Tensor");
  m.def("w4_mm_t(Tensor grad_out, Tensor codes, Tensor scale, str format, int group_size, SymInt K, "
        "Tensor? offset=None, Tensor? global_scale=None) -> Tensor");
  // Grouped (MoE): codes [E, N, ceil(K/2)], scale / offset [E, N, G], global_scale [E]; offsets / expert_ids as for
  // fp8_grouped_mm (offsets: the groups' row bounds; offset: the weight's zero points or biases).
  m.def("w4_grouped_mm(Tensor x, Tensor codes, Tensor scale, str format, int group_size, Tensor offsets, "
        "Tensor? expert_ids=None, Tensor? offset=None, Tensor? global_scale=None) -> Tensor");
  m.def("w4_grouped_mm_t(Tensor grad_out, Tensor codes, Tensor scale, str format, int group_size, SymInt K, "
        "Tensor offsets, Tensor? expert_ids=None, Tensor? offset=None, Tensor? global_scale=None) -> Tensor");
  m.def("int8_mm(Tensor xq, Tensor x_scale, Tensor wq, Tensor w_scale, Tensor? bias=None, ScalarType? out_dtype=None) -> Tensor");
}

}  // namespace lowbit

TORCH_LIBRARY(lowbit, m) { lowbit::define_ops(m); }
TORCH_LIBRARY(lowbit_emu, m) { lowbit::define_ops(m); }
TORCH_LIBRARY(lowbit_emu_mps, m) { lowbit::define_ops(m); }
TORCH_LIBRARY(lowbit_dryrun, m) { lowbit::define_ops(m); }
