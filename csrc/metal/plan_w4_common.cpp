#include "metal/plan_w4.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>

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

bool w4_scaled_exact(const W4Weight& w, at::ScalarType dtype) {
  if (w.scale_enc != W4Scale::E4M3 || w.offset_kind() != W4Offset::None) return false;
  if (dtype != at::kHalf && dtype != at::kBFloat16) return false;
  constexpr size_t kFormats = sizeof(kW4Formats) / sizeof(kW4Formats[0]);
  // [format][0: half, 1: bfloat], worked out once: 16 values x 256 scale bytes
  static const auto exact = [] {
    std::array<std::array<bool, 2>, kFormats> t{};
    for (size_t f = 0; f < kFormats; f++)
      for (int h = 0; h < 2; h++) {
        bool ok = true;
        for (float v : kW4Formats[f].values)
          for (int b = 0; b < 256 && ok; b++) {
            const uint8_t byte = uint8_t(b);
            const float s = w4_scale_to_float(W4Scale::E4M3, &byte, 0);
            if (s != s) continue;  // a NaN scale decodes to NaN in any dtype
            const double d = double(v) * double(s);
            const float p = float(d);
            if (double(p) != d) ok = false;
            if (p == 0.f || !ok) continue;
            const float a = std::fabs(p);
            ok = h == 0 ? a >= 6.103515625e-05f && a <= 65504.f && float(c10::Half(p)) == p
                        : a >= std::numeric_limits<float>::min() && float(c10::BFloat16(p)) == p;
          }
        t[f][size_t(h)] = ok;
      }
    return t;
  }();
  return exact[size_t(w.format - kW4Formats)][dtype == at::kBFloat16 ? 1 : 0];
}

uint32_t w4_mpp_flags(const DeviceCaps& kernel_needs, const W4Weight& w, at::ScalarType dtype) {
  return uses_tensor_ops(kernel_needs) && w4_scaled_exact(w, dtype) ? kW4MppScaled : 0u;
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
