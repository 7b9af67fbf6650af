#include "metal/plan_w4.h"

#include <algorithm>

namespace lowbit::metal {

const char* w4_scale_variant(W4Scale s) {
  switch (s) {
    case W4Scale::F32: return "f32";
    case W4Scale::F16: return "f16";
    case W4Scale::BF16: return "bf16";
    case W4Scale::E4M3: return "e4m3";
    case W4Scale::E8M0: return "e8m0";
  }
  TORCH_CHECK(false, "torch_lowbit metal: no 4-bit kernel for scale encoding ", int(s));
}

const char* w4_offset_variant(W4Offset o) {
  switch (o) {
    case W4Offset::None: return "none";
    case W4Offset::ZeroPoint: return "zp";
    case W4Offset::Bias: return "bias";
  }
  TORCH_CHECK(false, "torch_lowbit metal: no 4-bit kernel for offset kind ", int(o));
}

std::string w4_kernel_name(const char* base, at::ScalarType dtype, const W4Weight& w) {
  const std::string variant = std::string(w4_scale_variant(w.scale_enc)) + "_" + w4_offset_variant(w.offset_kind());
  return kernel_name(base, dtype, variant.c_str());
}

W4Params w4_params(const W4Weight& w, int64_t M, uint32_t flags) {
  W4Params p{};
  p.M = checked_u32("M", M);
  p.N = checked_u32("N", w.N);
  p.K = checked_u32("K", w.K);
  p.G = checked_u32("ceil(K / group_size)", w.G);
  // a group spanning K is one group per row whatever its size, so the kernels' 32-bit group size holds it
  p.group = checked_u32("group_size", std::min(w.group, std::max<int64_t>(w.K, 1)));
  p.group_shift = kW4NoShift;
  if ((p.group & (p.group - 1)) == 0) {
    p.group_shift = 0;
    while ((1u << p.group_shift) != p.group) p.group_shift++;
  }
  const int64_t rb = w.row_bytes();
  p.flags = flags | (vector_access_ok(kW4CodesVecBytes, rb, {w.codes}) ? kW4CodesVec : 0u) |
            (vector_access_ok(kW4CodesWordBytes, rb, {w.codes}) ? kW4CodesWord : 0u) |
            (w.global_scale.defined() ? kW4HasGlobalScale : 0u);
  p.bias_dtype = kDtypeFloat;
  for (int i = 0; i < 16; i++) p.values[i] = w.format->values[i];
  return p;
}

void bind_w4_weight(Dispatch& d, const W4Weight& w) {
  d.buffer("codes", w.codes).buffer("scale", w.scale);
  d.buffer(w.offset.defined() ? "offset" : "offset (none: scale bound, unread)",
           w.offset.defined() ? w.offset : w.scale);
  d.buffer(w.global_scale.defined() ? "global_scale" : "global_scale (none: scale bound, unread)",
           w.global_scale.defined() ? w.global_scale : w.scale);
}

}  // namespace lowbit::metal
