// Argument validation shared by every backend (CPU kernels, Metal plans for mps and the emulator).
// Each check_* names the op and the argument in its errors and returns the arguments normalised to what
// kernels take: uint8 weight bits, fp32 contiguous scales, 2-D contiguous activations.
#pragma once
#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <vector>

#include "w4_formats.h"

namespace lowbit {

// How a weight's scale applies. Block sizes and counts are 0 unless kind == Block.
enum class ScaleKind : int32_t { Tensor = 0, Channel = 1, Block = 2 };
struct ScaleLayout {
  ScaleKind kind = ScaleKind::Tensor;
  int64_t bn = 0, bk = 0;  // block size along N and along K
  int64_t nb = 0, kb = 0;  // number of blocks: ceil(N / bn), ceil(K / bk)
};

// An fp8 weight [N, K] (or stacked experts [E, N, K]) and its scale, validated.
struct Fp8Weight {
  at::Tensor bits;   // uint8, contiguous, [N, K] or [E, N, K]
  at::Tensor scale;  // float32, contiguous: [1] | [N] | [nb, kb]; grouped: [E] | [E, N] | [E, nb, kb]
  int64_t E = 1, N = 0, K = 0;
  ScaleLayout layout;
  // Expert e's [N, K] codes and its scales (e = 0 for an ungrouped weight).
  const uint8_t* expert_bits(int64_t e) const { return bits.data_ptr<uint8_t>() + e * N * K; }
  const float* expert_scale(int64_t e) const {
    return scale.data_ptr<float>() + e * (scale.numel() / (E > 0 ? E : 1));
  }
};

struct Fp8MmArgs {
  at::Tensor x;                    // [M, K], contiguous, x's own dtype (bf16 / fp16 / fp32)
  Fp8Weight w;
  std::optional<at::Tensor> bias;  // [N], contiguous, its own dtype (bf16 / fp16 / fp32)
  int64_t M = 0;
  std::vector<int64_t> out_shape;  // x.shape[:-1] + [N]
};

// The ragged groups of a grouped (MoE) product: group g owns rows offsets[g]:offsets[g + 1] of x and uses expert
// expert_ids[g] (-1: zero rows); rows in no group are zero.
struct GroupRows {
  at::Tensor offsets;              // int32 [G + 1], contiguous
  at::Tensor expert_ids;           // int32 [G], contiguous (arange(G) when not given)
  int64_t T = 0, G = 0;
};

struct Fp8GroupedMmArgs : GroupRows {
  at::Tensor x;                    // [T, K], contiguous
  Fp8Weight w;                     // E experts
};

struct Int8QuantizeArgs {
  at::Tensor x;                    // [M, K] contiguous, bf16 / fp16 / fp32
  int64_t M = 0, K = 0;
  std::vector<int64_t> q_shape, scale_shape;  // x.shape, x.shape[:-1]
};

struct Int8MmArgs {
  at::Tensor xq;                   // int8 [M, K] contiguous
  at::Tensor x_scale;              // float32 [M] contiguous
  at::Tensor wq;                   // int8 [N, K] contiguous
  at::Tensor w_scale;              // float32 [N] (per channel) or [1] (per tensor), contiguous
  ScaleLayout w_layout;            // Channel ([N]) or Tensor ([1]): how w_scale applies, as Fp8Weight::layout
  std::optional<at::Tensor> bias;  // [N], contiguous, its own dtype (bf16 / fp16 / fp32)
  int64_t M = 0, N = 0, K = 0;
  at::ScalarType out_dtype = at::kBFloat16;
  std::vector<int64_t> out_shape;
};

// fp8 weights given as float8_e4m3fn or as uint8 bits; scale per tensor / channel / block (design.md).
Fp8Weight check_fp8_weight(const char* op, const at::Tensor& weight, const at::Tensor& scale,
                           at::OptionalIntArrayRef block_size, bool grouped);

Fp8MmArgs check_fp8_mm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias, at::OptionalIntArrayRef block_size);

Fp8Weight check_fp8_dequantize(const at::Tensor& weight, const at::Tensor& scale, at::OptionalIntArrayRef block_size,
                               at::ScalarType dtype);

// validate_values: read offsets / expert_ids on the host and check their values (CPU and emulator). On mps
// that would be a device sync per call, so the kernels clamp instead.
Fp8GroupedMmArgs check_fp8_grouped_mm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                                      const at::Tensor& offsets, const std::optional<at::Tensor>& expert_ids,
                                      at::OptionalIntArrayRef block_size, bool validate_values);

Int8QuantizeArgs check_int8_quantize(const at::Tensor& x);

// The transposed products of the backward passes (grad_out [..., N] times the [N, K] weight, out [..., K]).
// fp8_mm_t: the result's x is grad_out [M, N] and out_shape its leading shape + [K]; bias is never set.
Fp8MmArgs check_fp8_mm_t(const at::Tensor& grad_out, const at::Tensor& weight, const at::Tensor& scale,
                         at::OptionalIntArrayRef block_size);

// fp8_grouped_mm_t: x is grad_out [T, N]; offsets / expert_ids as for fp8_grouped_mm.
Fp8GroupedMmArgs check_fp8_grouped_mm_t(const at::Tensor& grad_out, const at::Tensor& weight, const at::Tensor& scale,
                                        const at::Tensor& offsets, const std::optional<at::Tensor>& expert_ids,
                                        at::OptionalIntArrayRef block_size, bool validate_values);

struct Int8WeightMmTArgs {
  at::Tensor grad_out;             // [M, N] contiguous, bf16 / fp16 / fp32
  at::Tensor wq;                   // int8 [N, K] contiguous
  at::Tensor w_scale;              // float32 [N] or [1], contiguous
  ScaleLayout w_layout;            // Channel ([N]) or Tensor ([1]), as Int8MmArgs::w_layout
  int64_t M = 0, N = 0, K = 0;
  std::vector<int64_t> out_shape;  // grad_out.shape[:-1] + [K]
};
Int8WeightMmTArgs check_int8_weight_mm_t(const at::Tensor& grad_out, const at::Tensor& wq, const at::Tensor& w_scale);

Int8MmArgs check_int8_mm(const at::Tensor& xq, const at::Tensor& x_scale, const at::Tensor& wq, const at::Tensor& w_scale,
                         const std::optional<at::Tensor>& bias, std::optional<at::ScalarType> out_dtype);

// A 4-bit weight (w4_formats.h), validated: codes [N, ceil(K/2)] (or [E, N, ceil(K/2)]) with scales, offsets and
// the global scale in the format's layout.
struct W4Weight {
  const W4Format* format = nullptr;
  W4Scale scale_enc = W4Scale::F32;
  at::Tensor codes;         // uint8, contiguous
  at::Tensor scale;         // [N, G] (or [E, N, G]) contiguous, as stored: fp32 / fp16 / bf16, or uint8 bits
  at::Tensor offset;        // undefined, or [N, G] contiguous: int8 zero points, or biases in the scale's dtype
  at::Tensor global_scale;  // undefined, or float32 [1]
  int64_t E = 1, N = 0, K = 0;
  int64_t group = 0, G = 0;  // group_size and groups per row, ceil(K / group_size)
  int64_t row_bytes() const { return (K + 1) / 2; }
  W4Offset offset_kind() const { return offset.defined() ? format->offset : W4Offset::None; }
};

struct W4MmArgs {
  at::Tensor x;                    // [M, K] contiguous, x's own dtype (for w4_mm_t: grad_out [M, N])
  W4Weight w;
  std::optional<at::Tensor> bias;  // [N], contiguous, its own dtype
  int64_t M = 0;
  std::vector<int64_t> out_shape;  // x.shape[:-1] + [N] (w4_mm_t: + [K])
};

struct W4GroupedMmArgs : GroupRows {
  at::Tensor x;                    // [T, K] contiguous (w4_grouped_mm_t: grad_out [T, N])
  W4Weight w;                      // E experts; global_scale [E] where given
};

// K: the weight's K, from x for w4_mm (codes only hold ceil(K/2)), given for w4_dequantize and w4_mm_t.
W4Weight check_w4_weight(const char* op, const at::Tensor& codes, const at::Tensor& scale, const std::string& format,
                         int64_t group_size, int64_t K, const std::optional<at::Tensor>& offset,
                         const std::optional<at::Tensor>& global_scale, bool grouped);

W4MmArgs check_w4_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const std::string& format,
                     int64_t group_size, const std::optional<at::Tensor>& offset,
                     const std::optional<at::Tensor>& global_scale, const std::optional<at::Tensor>& bias);

W4Weight check_w4_dequantize(const at::Tensor& codes, const at::Tensor& scale, const std::string& format,
                             int64_t group_size, int64_t K, const std::optional<at::Tensor>& offset,
                             const std::optional<at::Tensor>& global_scale, at::ScalarType dtype);

W4MmArgs check_w4_mm_t(const at::Tensor& grad_out, const at::Tensor& codes, const at::Tensor& scale,
                       const std::string& format, int64_t group_size, int64_t K,
                       const std::optional<at::Tensor>& offset, const std::optional<at::Tensor>& global_scale);

// w4_grouped_mm (x [T, K]) and w4_grouped_mm_t (transposed: grad_out [T, N], K given); validate_values as for
// check_fp8_grouped_mm.
W4GroupedMmArgs check_w4_grouped_mm(const char* op, bool transposed, const at::Tensor& x, const at::Tensor& codes,
                                    const at::Tensor& scale, const std::string& format, int64_t group_size, int64_t K,
                                    const at::Tensor& offsets, const std::optional<at::Tensor>& expert_ids,
                                    const std::optional<at::Tensor>& offset,
                                    const std::optional<at::Tensor>& global_scale, bool validate_values);

// Worst case |xq . wq| = K * 2^14 (every value -128): past this K an int32 accumulator could overflow, so
// int8_mm refuses it on every backend rather than wrapping.
constexpr int64_t kInt8MaxK = ((int64_t(1) << 31) - 1) / (int64_t(1) << 14);

// A checked bias widened to fp32 for kernels that take it so (the CPU's); undefined when there is none.
at::Tensor bias_as_float(const std::optional<at::Tensor>& bias);

// t reshaped to `shape`, or t itself where it has that shape already: a view costs a TensorImpl and autograd's
// view metadata, which a batch-1 decode pays on every call of every op.
at::Tensor shaped(const at::Tensor& t, at::IntArrayRef shape);

// ceil(a / b) for a >= 0, b > 0; never overflows (a + b - 1 would for a block size near 2^63)
inline int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0); }

}  // namespace lowbit
