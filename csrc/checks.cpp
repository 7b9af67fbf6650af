#include "checks.h"

#include <ATen/ops/arange.h>
#include <torch/version.h>

#include <c10/util/irange.h>

#include <algorithm>

namespace lowbit {
namespace {

bool is_float_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

// The float activations of a product (x [..., K], or grad_out [..., N] of a transposed one): dtype and rank.
void check_float_rows(const char* op, const char* name, const at::Tensor& t, const char* last) {
  TORCH_CHECK(is_float_dtype(t.scalar_type()), op, ": ", name, " must be bfloat16, float16 or float32, got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() >= 1, op, ": ", name, " must have at least one dimension [..., ", last, "]");
}

void check_device(const char* op, const char* name, const at::Tensor& t, const at::Tensor& ref, const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but ", ref_name, " is on ",
              ref.device(), "; all tensors must be on one device");
}

// A product's optional bias: [N] on the activations' device, float32, bfloat16 or float16, made contiguous in its own
// dtype (Metal kernels read it as it is).
std::optional<at::Tensor> checked_bias(const char* op, const std::optional<at::Tensor>& bias, int64_t N,
                                       const at::Tensor& ref, const char* ref_name) {
  if (!bias.has_value()) return std::nullopt;
  const at::Tensor& b = *bias;
  check_device(op, "bias", b, ref, ref_name);
  TORCH_CHECK(is_float_dtype(b.scalar_type()), op, ": bias must be float32, bfloat16 or float16, got ",
              b.scalar_type());
  TORCH_CHECK(b.dim() == 1 && b.size(0) == N, op, ": bias must be [N] = [", N, "], got ", b.sizes());
  return b.contiguous();
}

at::Tensor widen_scale(const char* op, const char* name, const at::Tensor& s) {
  TORCH_CHECK(is_float_dtype(s.scalar_type()), op, ": ", name, " must be float32, bfloat16 or float16, got ",
              s.scalar_type());
  return s.to(at::kFloat).contiguous();
}

// [lead..., K] -> ([M, K] contiguous, M, lead); works for K == 0, where reshape(-1, 0) is ambiguous
at::Tensor flatten_rows(const at::Tensor& x, int64_t* M) {
  const int64_t K = x.size(-1);
  int64_t m = 1;
  for (const auto i : c10::irange(x.dim() - 1)) m *= x.size(i);
  *M = m;
  return shaped(x, {m, K}).contiguous();
}

std::vector<int64_t> with_last(const at::Tensor& x, int64_t last) {
  std::vector<int64_t> s(x.sizes().begin(), x.sizes().end() - 1);
  s.push_back(last);
  return s;
}

}  // namespace

Fp8Weight check_fp8_weight(const char* op, const at::Tensor& weight, const at::Tensor& scale,
                           at::OptionalIntArrayRef block_size, bool grouped) {
  const int64_t wdim = grouped ? 3 : 2;
  TORCH_CHECK(weight.scalar_type() == at::kFloat8_e4m3fn || weight.scalar_type() == at::kByte, op,
              ": weight must be float8_e4m3fn or uint8 (fp8 e4m3 bits), got ", weight.scalar_type());
  TORCH_CHECK(weight.dim() == wdim, op, ": weight must be ", grouped ? "[E, N, K]" : "[N, K]", ", got shape ",
              weight.sizes());
  TORCH_CHECK(weight.is_contiguous(), op, ": weight must be contiguous (rows of K bytes back to back), got strides ",
              weight.strides(), "; call .contiguous() once when loading it");
  check_device(op, "scale", scale, weight, "weight");

  Fp8Weight w;
  w.bits = weight.scalar_type() == at::kByte ? weight : weight.view(at::kByte);
  w.E = grouped ? weight.size(0) : 1;
  w.N = weight.size(wdim - 2);
  w.K = weight.size(wdim - 1);
  const int64_t E = w.E, N = w.N, K = w.K;
  const at::Tensor s = widen_scale(op, "scale", scale);
  const auto lead = grouped ? std::vector<int64_t>{E} : std::vector<int64_t>{};
  auto shape = [&](std::initializer_list<int64_t> tail) {
    std::vector<int64_t> v = lead;
    v.insert(v.end(), tail);
    return v;
  };
  auto same = [&](const std::vector<int64_t>& v) { return s.sizes().vec() == v; };

  if (block_size.has_value()) {
    const auto bs = *block_size;
    TORCH_CHECK(bs.size() == 2, op, ": block_size must be [block_n, block_k], got ", bs);
    TORCH_CHECK(bs[0] > 0 && bs[1] > 0, op, ": block_size entries must be positive, got ", bs);
    // A block longer than its dimension is one (partial) block: the same layout as a block of the whole
    // dimension, which keeps every later product of block sizes within the tensor's own sizes.
    const int64_t bn = std::min(bs[0], std::max<int64_t>(N, 1)), bk = std::min(bs[1], std::max<int64_t>(K, 1));
    ScaleLayout l{ScaleKind::Block, bn, bk, ceil_div(N, bn), ceil_div(K, bk)};
    const auto want = shape({l.nb, l.kb});
    TORCH_CHECK(same(want), op, ": with block_size ", bs, " scale must have shape ", at::IntArrayRef(want),
                " (ceil(N/block_n), ceil(K/block_k)), got ", s.sizes());
    w.layout = l;
    w.scale = s;
    return w;
  }
  const int64_t gdim = grouped ? 1 : 0;  // leading dims of the scale before the per-weight part
  if (grouped ? (same({E}) || (E == 1 && s.numel() == 1)) : s.numel() == 1) {
    w.layout = ScaleLayout{ScaleKind::Tensor};
    w.scale = shaped(s, shape({}).empty() ? std::vector<int64_t>{1} : shape({}));
  } else if (same(shape({N})) || same(shape({N, 1}))) {
    w.layout = ScaleLayout{ScaleKind::Channel};
    w.scale = shaped(s, shape({N}));
  } else {
    TORCH_CHECK(s.dim() != gdim + 2, op, ": scale of shape ", s.sizes(),
                " looks like block scales; pass block_size=[block_n, block_k]");
    TORCH_CHECK(false, op, ": scale must be ",
                grouped ? "[E] (per tensor), [E, N] (per channel) or [E, ceil(N/bn), ceil(K/bk)] with block_size"
                        : "one element (per tensor), [N] or [N, 1] (per channel) or [ceil(N/bn), ceil(K/bk)] with block_size",
                ", for weight of shape ", weight.sizes(), "; got ", s.sizes());
  }
  return w;
}

Fp8MmArgs check_fp8_mm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias, at::OptionalIntArrayRef block_size) {
  const char* op = "fp8_mm";
  check_float_rows(op, "x", x, "K");
  check_device(op, "weight", weight, x, "x");
  Fp8MmArgs a;
  a.w = check_fp8_weight(op, weight, scale, block_size, /*grouped=*/false);
  TORCH_CHECK(x.size(-1) == a.w.K, op, ": x's last dimension (", x.size(-1), ") must equal weight's K (", a.w.K,
              "); weight is [N, K] = ", weight.sizes());
  a.bias = checked_bias(op, bias, a.w.N, x, "x");
  a.x = flatten_rows(x, &a.M);
  a.out_shape = with_last(x, a.w.N);
  return a;
}

Fp8Weight check_fp8_dequantize(const at::Tensor& weight, const at::Tensor& scale, at::OptionalIntArrayRef block_size,
                               at::ScalarType dtype) {
  TORCH_CHECK(is_float_dtype(dtype), "fp8_dequantize: dtype must be bfloat16, float16 or float32, got ", dtype);
  return check_fp8_weight("fp8_dequantize", weight, scale, block_size, /*grouped=*/false);
}

namespace {

// The groups of a grouped product over E experts: offsets / expert_ids checked, and their values where
// validate_values (x: [T, ...], named xname in errors).
GroupRows check_group_rows(const char* op, const char* xname, const at::Tensor& x, const at::Tensor& offsets,
                           const std::optional<at::Tensor>& expert_ids, int64_t E, bool validate_values) {
  check_device(op, "offsets", offsets, x, xname);
  TORCH_CHECK(offsets.scalar_type() == at::kInt, op, ": offsets must be int32, got ", offsets.scalar_type());
  TORCH_CHECK(offsets.dim() == 1 && offsets.numel() >= 1, op, ": offsets must be [G + 1] with G >= 0, got shape ",
              offsets.sizes());
  GroupRows a;
  a.T = x.size(0);
  a.G = offsets.numel() - 1;
  a.offsets = offsets.contiguous();
  if (expert_ids.has_value()) {
    const at::Tensor& e = *expert_ids;
    check_device(op, "expert_ids", e, x, xname);
    TORCH_CHECK(e.scalar_type() == at::kInt, op, ": expert_ids must be int32, got ", e.scalar_type());
    TORCH_CHECK(e.dim() == 1 && e.numel() == a.G, op, ": expert_ids must be [G] = [", a.G,
                "] (one per group of offsets), got shape ", e.sizes());
    a.expert_ids = e.contiguous();
  } else {
    TORCH_CHECK(a.G <= E, op, ": without expert_ids, group g uses expert g, so G (", a.G,
                ") must not exceed the number of experts E (", E, ")");
    a.expert_ids = at::arange(a.G, x.options().dtype(at::kInt));
  }
  if (validate_values) {
    const at::Tensor off = a.offsets.cpu();
    const int32_t* o = off.data_ptr<int32_t>();
    TORCH_CHECK(o[0] == 0, op, ": offsets[0] must be 0, got ", o[0]);
    for (int64_t g = 0; g < a.G; g++)
      TORCH_CHECK(o[g + 1] >= o[g], op, ": offsets must be non-decreasing, but offsets[", g + 1, "] = ", o[g + 1],
                  " < offsets[", g, "] = ", o[g]);
    TORCH_CHECK(o[a.G] <= a.T, op, ": offsets[G] = ", o[a.G], " exceeds the number of rows of ", xname, " (T = ", a.T,
                ")");
    const at::Tensor ids = a.expert_ids.cpu();
    const int32_t* id = ids.data_ptr<int32_t>();
    for (int64_t g = 0; g < a.G; g++)
      TORCH_CHECK(id[g] >= -1 && id[g] < E, op, ": expert_ids[", g, "] = ", id[g], " is out of range [-1, E = ", E,
                  ")");
  }
  return a;
}

void check_grouped_rows_arg(const char* op, const char* xname, bool transposed, const at::Tensor& x) {
  TORCH_CHECK(is_float_dtype(x.scalar_type()), op, ": ", xname, " must be bfloat16, float16 or float32, got ",
              x.scalar_type());
  TORCH_CHECK(x.dim() == 2, op, ": ", xname, " must be ", transposed ? "[T, N]" : "[T, K]", ", got shape ", x.sizes());
}

// fp8_grouped_mm (x [T, K]) and its transposed product (grad_out [T, N]): the same groups, experts and offsets.
Fp8GroupedMmArgs check_grouped(const char* op, const char* xname, bool transposed, const at::Tensor& x,
                               const at::Tensor& weight, const at::Tensor& scale, const at::Tensor& offsets,
                               const std::optional<at::Tensor>& expert_ids, at::OptionalIntArrayRef block_size,
                               bool validate_values) {
  check_grouped_rows_arg(op, xname, transposed, x);
  check_device(op, "weight", weight, x, xname);
  Fp8GroupedMmArgs a;
  a.w = check_fp8_weight(op, weight, scale, block_size, /*grouped=*/true);
  const int64_t want = transposed ? a.w.N : a.w.K;
  TORCH_CHECK(x.size(1) == want, op, ": ", xname, "'s last dimension (", x.size(1), ") must equal weight's ",
              transposed ? "N" : "K", " (", want, "); weight is [E, N, K] = ", weight.sizes());
  static_cast<GroupRows&>(a) = check_group_rows(op, xname, x, offsets, expert_ids, a.w.E, validate_values);
  a.x = x.contiguous();
  return a;
}

// w_scale of an int8 weight [N, K]: [N] / [N, 1] per channel or one element per tensor -> fp32 [N] or [1], and
// `layout` saying which (one element is per tensor, also where N == 1).
at::Tensor int8_weight_scale(const char* op, const at::Tensor& w_scale, int64_t N, ScaleLayout& layout) {
  const at::Tensor ws = widen_scale(op, "w_scale", w_scale);
  layout = ScaleLayout{ws.numel() == 1 ? ScaleKind::Tensor : ScaleKind::Channel};
  if (ws.numel() == 1) return shaped(ws, {1});
  const bool per_channel = ws.dim() == 1 ? ws.size(0) == N : (ws.dim() == 2 && ws.size(0) == N && ws.size(1) == 1);
  TORCH_CHECK(per_channel, op, ": w_scale must be [N] or [N, 1] (per channel) or have one element (per tensor), N = ",
              N, ", got ", ws.sizes());
  return shaped(ws, {N});
}

}  // namespace

Fp8GroupedMmArgs check_fp8_grouped_mm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                                      const at::Tensor& offsets, const std::optional<at::Tensor>& expert_ids,
                                      at::OptionalIntArrayRef block_size, bool validate_values) {
  return check_grouped("fp8_grouped_mm", "x", false, x, weight, scale, offsets, expert_ids, block_size,
                       validate_values);
}

Fp8GroupedMmArgs check_fp8_grouped_mm_t(const at::Tensor& grad_out, const at::Tensor& weight, const at::Tensor& scale,
                                        const at::Tensor& offsets, const std::optional<at::Tensor>& expert_ids,
                                        at::OptionalIntArrayRef block_size, bool validate_values) {
  return check_grouped("fp8_grouped_mm_t", "grad_out", true, grad_out, weight, scale, offsets, expert_ids, block_size,
                       validate_values);
}

Fp8MmArgs check_fp8_mm_t(const at::Tensor& grad_out, const at::Tensor& weight, const at::Tensor& scale,
                         at::OptionalIntArrayRef block_size) {
  const char* op = "fp8_mm_t";
  check_float_rows(op, "grad_out", grad_out, "N");
  check_device(op, "weight", weight, grad_out, "grad_out");
  Fp8MmArgs a;
  a.w = check_fp8_weight(op, weight, scale, block_size, /*grouped=*/false);
  TORCH_CHECK(grad_out.size(-1) == a.w.N, op, ": grad_out's last dimension (", grad_out.size(-1),
              ") must equal weight's N (", a.w.N, "); weight is [N, K] = ", weight.sizes());
  a.x = flatten_rows(grad_out, &a.M);
  a.out_shape = with_last(grad_out, a.w.K);
  return a;
}

namespace {
// wq of int8_mm and of its transposed product: int8 [N, K], rows back to back.
void check_int8_weight(const char* op, const at::Tensor& wq) {
  TORCH_CHECK(wq.scalar_type() == at::kChar, op, ": wq must be int8, got ", wq.scalar_type());
  TORCH_CHECK(wq.dim() == 2, op, ": wq must be [N, K], got shape ", wq.sizes());
  TORCH_CHECK(wq.is_contiguous(), op, ": wq must be contiguous (rows of K bytes back to back), got strides ",
              wq.strides());
}
}  // namespace

Int8WeightMmTArgs check_int8_weight_mm_t(const at::Tensor& grad_out, const at::Tensor& wq, const at::Tensor& w_scale) {
  const char* op = "int8_weight_mm_t";
  check_float_rows(op, "grad_out", grad_out, "N");
  check_int8_weight(op, wq);
  check_device(op, "wq", wq, grad_out, "grad_out");
  check_device(op, "w_scale", w_scale, grad_out, "grad_out");
  Int8WeightMmTArgs a;
  a.wq = wq;
  a.N = wq.size(0);
  a.K = wq.size(1);
  TORCH_CHECK(grad_out.size(-1) == a.N, op, ": grad_out's last dimension (", grad_out.size(-1),
              ") must equal wq's N (", a.N, "); wq is [N, K] = ", wq.sizes());
  a.w_scale = int8_weight_scale(op, w_scale, a.N, a.w_layout);
  a.grad_out = flatten_rows(grad_out, &a.M);
  a.out_shape = with_last(grad_out, a.K);
  return a;
}

Int8QuantizeArgs check_int8_quantize(const at::Tensor& x) {
  check_float_rows("int8_quantize", "x", x, "K");
  Int8QuantizeArgs a;
  a.x = flatten_rows(x, &a.M);
  a.K = x.size(-1);
  a.q_shape = x.sizes().vec();
  a.scale_shape = std::vector<int64_t>(x.sizes().begin(), x.sizes().end() - 1);
  return a;
}

Int8MmArgs check_int8_mm(const at::Tensor& xq, const at::Tensor& x_scale, const at::Tensor& wq, const at::Tensor& w_scale,
                         const std::optional<at::Tensor>& bias, std::optional<at::ScalarType> out_dtype) {
  const char* op = "int8_mm";
  TORCH_CHECK(xq.scalar_type() == at::kChar, op, ": xq must be int8, got ", xq.scalar_type());
  TORCH_CHECK(xq.dim() >= 1, op, ": xq must have at least one dimension [..., K]");
  check_int8_weight(op, wq);
  check_device(op, "x_scale", x_scale, xq, "xq");
  check_device(op, "wq", wq, xq, "xq");
  check_device(op, "w_scale", w_scale, xq, "xq");
  Int8MmArgs a;
  a.wq = wq;
  a.N = wq.size(0);
  a.K = wq.size(1);
  TORCH_CHECK(xq.size(-1) == a.K, op, ": xq's last dimension (", xq.size(-1), ") must equal wq's K (", a.K,
              "); wq is [N, K] = ", wq.sizes());
  TORCH_CHECK(a.K <= kInt8MaxK, op, ": K = ", a.K, " exceeds ", kInt8MaxK,
              ", beyond which the int32 accumulator of xq @ wq^T can overflow");
  a.xq = flatten_rows(xq, &a.M);
  const std::vector<int64_t> lead(xq.sizes().begin(), xq.sizes().end() - 1);
  std::vector<int64_t> lead1 = lead;
  lead1.push_back(1);
  TORCH_CHECK(x_scale.sizes().vec() == lead || x_scale.sizes().vec() == lead1, op,
              ": x_scale must have xq's leading shape ", at::IntArrayRef(lead), " (one scale per row), got ",
              x_scale.sizes());
  a.x_scale = shaped(widen_scale(op, "x_scale", x_scale), {a.M});
  a.w_scale = int8_weight_scale(op, w_scale, a.N, a.w_layout);
  a.bias = checked_bias(op, bias, a.N, xq, "xq");
  a.out_dtype = out_dtype.value_or(at::kBFloat16);
  TORCH_CHECK(is_float_dtype(a.out_dtype), op, ": out_dtype must be bfloat16, float16 or float32, got ", a.out_dtype);
  a.out_shape = with_last(xq, a.N);
  return a;
}

at::Tensor shaped(const at::Tensor& t, at::IntArrayRef shape) { return t.sizes().equals(shape) ? t : t.reshape(shape); }

at::Tensor bias_as_float(const std::optional<at::Tensor>& bias) {
  return bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
}

}  // namespace lowbit

namespace lowbit {
namespace {

std::string w4_format_names() {
  std::string s;
  for (const W4Format& f : kW4Formats) s += (s.empty() ? "'" : ", '") + std::string(f.name) + "'";
  return s;
}

// The stored encoding of a 4-bit format's group scales, from the scale tensor's dtype; uint8 holds the bits of the
// format's byte encoding (e4m3 for nvfp4, e8m0 for mxfp4), as on devices that cannot hold float8 tensors.
W4Scale w4_scale_encoding(const char* op, const W4Format& f, const at::Tensor& scale) {
  const at::ScalarType t = scale.scalar_type();
  std::optional<W4Scale> enc;
  if (t == at::kFloat) enc = W4Scale::F32;
  else if (t == at::kHalf) enc = W4Scale::F16;
  else if (t == at::kBFloat16) enc = W4Scale::BF16;
  else if (t == at::kFloat8_e4m3fn) enc = W4Scale::E4M3;
#if defined(TORCH_VERSION_MAJOR) && (TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 7)
  else if (t == at::kFloat8_e8m0fnu) enc = W4Scale::E8M0;
#endif
  else if (t == at::kByte && (f.scales & w4_scale_bit(W4Scale::E4M3))) enc = W4Scale::E4M3;
  else if (t == at::kByte && (f.scales & w4_scale_bit(W4Scale::E8M0))) enc = W4Scale::E8M0;
  const char* want = (f.scales & w4_scale_bit(W4Scale::E4M3))   ? "float8_e4m3fn or uint8 (e4m3 bits)"
                     : (f.scales & w4_scale_bit(W4Scale::E8M0)) ? "uint8 (e8m0 bits) or float8_e8m0fnu"
                                                                 : "float32, float16 or bfloat16";
  TORCH_CHECK(enc.has_value() && (f.scales & w4_scale_bit(*enc)), op, ": scale of format '", f.name, "' must be ",
              want, ", got ", t);
  return *enc;
}

}  // namespace

W4Weight check_w4_weight(const char* op, const at::Tensor& codes, const at::Tensor& scale, const std::string& format,
                         int64_t group_size, int64_t K, const std::optional<at::Tensor>& offset,
                         const std::optional<at::Tensor>& global_scale, bool grouped) {
  W4Weight w;
  w.format = find_w4_format(format.c_str());
  TORCH_CHECK(w.format != nullptr, op, ": format must be one of ", w4_format_names(), ", got '", format, "'");
  const int64_t wdim = grouped ? 3 : 2;
  TORCH_CHECK(codes.scalar_type() == at::kByte, op, ": codes must be uint8 (two 4-bit codes per byte), got ",
              codes.scalar_type());
  TORCH_CHECK(codes.dim() == wdim, op, ": codes must be ", grouped ? "[E, N, ceil(K/2)]" : "[N, ceil(K/2)]",
              ", got shape ", codes.sizes());
  TORCH_CHECK(codes.is_contiguous(), op, ": codes must be contiguous (rows of ceil(K/2) bytes back to back), got "
              "strides ", codes.strides(), "; call .contiguous() once when loading it");
  TORCH_CHECK(K >= 0, op, ": K must be >= 0, got ", K);
  TORCH_CHECK(group_size >= 1, op, ": group_size must be >= 1, got ", group_size);
  check_device(op, "scale", scale, codes, "codes");
  w.E = grouped ? codes.size(0) : 1;
  w.N = codes.size(wdim - 2);
  w.K = K;
  TORCH_CHECK(codes.size(wdim - 1) == w.row_bytes(), op, ": codes rows must hold ceil(K/2) = ", w.row_bytes(),
              " bytes for K = ", K, ", got codes of shape ", codes.sizes());
  w.group = group_size;
  w.G = ceil_div(K, group_size);
  w.codes = codes;

  std::vector<int64_t> sshape;
  if (grouped) sshape.push_back(w.E);
  sshape.push_back(w.N);
  sshape.push_back(w.G);
  w.scale_enc = w4_scale_encoding(op, *w.format, scale);
  TORCH_CHECK(scale.sizes().vec() == sshape, op, ": scale must be ", grouped ? "[E, N, ceil(K/group_size)] = " :
              "[N, ceil(K/group_size)] = ", at::IntArrayRef(sshape), " for K = ", K, ", group_size = ", group_size,
              ", got ", scale.sizes());
  w.scale = scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kHalf ||
                    scale.scalar_type() == at::kBFloat16 || scale.scalar_type() == at::kByte
                ? scale.contiguous()
                : scale.contiguous().view(at::kByte);

  if (offset.has_value()) {
    const at::Tensor& o = *offset;
    check_device(op, "offset", o, codes, "codes");
    TORCH_CHECK(w.format->offset != W4Offset::None, op, ": format '", w.format->name, "' takes no offset");
    if (w.format->offset == W4Offset::ZeroPoint) {
      TORCH_CHECK(o.scalar_type() == at::kChar, op, ": offset of format '", w.format->name,
                  "' holds zero points and must be int8, got ", o.scalar_type());
    } else {
      TORCH_CHECK(o.scalar_type() == scale.scalar_type(), op, ": offset of format '", w.format->name,
                  "' holds biases and must have scale's dtype (", scale.scalar_type(), "), got ", o.scalar_type());
    }
    TORCH_CHECK(o.sizes().vec() == sshape, op, ": offset must have scale's shape ", at::IntArrayRef(sshape), ", got ",
                o.sizes());
    w.offset = o.contiguous();
  }
  if (global_scale.has_value()) {
    const at::Tensor& g = *global_scale;
    check_device(op, "global_scale", g, codes, "codes");
    TORCH_CHECK(w.format->global_scale, op, ": format '", w.format->name, "' takes no global_scale");
    TORCH_CHECK(g.numel() == w.E, op, ": global_scale must have ", grouped ? "one element per expert, [E] = [" : "one "
                "element, [", w.E, "], got shape ", g.sizes());
    w.global_scale = shaped(widen_scale(op, "global_scale", g), {w.E});
  }
  return w;
}

W4MmArgs check_w4_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const std::string& format,
                     int64_t group_size, const std::optional<at::Tensor>& offset,
                     const std::optional<at::Tensor>& global_scale, const std::optional<at::Tensor>& bias) {
  const char* op = "w4_mm";
  check_float_rows(op, "x", x, "K");
  check_device(op, "codes", codes, x, "x");
  W4MmArgs a;
  a.w = check_w4_weight(op, codes, scale, format, group_size, x.size(-1), offset, global_scale, /*grouped=*/false);
  a.bias = checked_bias(op, bias, a.w.N, x, "x");
  a.x = flatten_rows(x, &a.M);
  a.out_shape = with_last(x, a.w.N);
  return a;
}

W4Weight check_w4_dequantize(const at::Tensor& codes, const at::Tensor& scale, const std::string& format,
                             int64_t group_size, int64_t K, const std::optional<at::Tensor>& offset,
                             const std::optional<at::Tensor>& global_scale, at::ScalarType dtype) {
  TORCH_CHECK(is_float_dtype(dtype), "w4_dequantize: dtype must be bfloat16, float16 or float32, got ", dtype);
  return check_w4_weight("w4_dequantize", codes, scale, format, group_size, K, offset, global_scale, false);
}

W4MmArgs check_w4_mm_t(const at::Tensor& grad_out, const at::Tensor& codes, const at::Tensor& scale,
                       const std::string& format, int64_t group_size, int64_t K,
                       const std::optional<at::Tensor>& offset, const std::optional<at::Tensor>& global_scale) {
  const char* op = "w4_mm_t";
  check_float_rows(op, "grad_out", grad_out, "N");
  check_device(op, "codes", codes, grad_out, "grad_out");
  W4MmArgs a;
  a.w = check_w4_weight(op, codes, scale, format, group_size, K, offset, global_scale, false);
  TORCH_CHECK(grad_out.size(-1) == a.w.N, op, ": grad_out's last dimension (", grad_out.size(-1),
              ") must equal the weight's N (", a.w.N, "); codes are [N, ceil(K/2)] = ", codes.sizes());
  a.x = flatten_rows(grad_out, &a.M);
  a.out_shape = with_last(grad_out, K);
  return a;
}

W4GroupedMmArgs check_w4_grouped_mm(const char* op, bool transposed, const at::Tensor& x, const at::Tensor& codes,
                                    const at::Tensor& scale, const std::string& format, int64_t group_size, int64_t K,
                                    const at::Tensor& offsets, const std::optional<at::Tensor>& expert_ids,
                                    const std::optional<at::Tensor>& offset,
                                    const std::optional<at::Tensor>& global_scale, bool validate_values) {
  const char* xname = transposed ? "grad_out" : "x";
  check_grouped_rows_arg(op, xname, transposed, x);
  check_device(op, "codes", codes, x, xname);
  W4GroupedMmArgs a;
  a.w = check_w4_weight(op, codes, scale, format, group_size, transposed ? K : x.size(1), offset, global_scale,
                        /*grouped=*/true);
  if (transposed)
    TORCH_CHECK(x.size(1) == a.w.N, op, ": grad_out's last dimension (", x.size(1), ") must equal the weight's N (",
                a.w.N, "); codes are [E, N, ceil(K/2)] = ", codes.sizes());
  static_cast<GroupRows&>(a) = check_group_rows(op, xname, x, offsets, expert_ids, a.w.E, validate_values);
  a.x = x.contiguous();
  return a;
}

}  // namespace lowbit
