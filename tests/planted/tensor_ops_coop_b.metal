// mm_half_coop (tensor_ops_coop.h) as kernel mm_half_coop_b: one of two files with the same matmul2d type.
#include <metal_stdlib>
#include "tensor_ops_coop.h"
using namespace metal;

kernel void mm_half_coop_b(device half* a [[buffer(0)]], device half* b [[buffer(1)]], device float* out [[buffer(2)]],
                           constant uint4& p [[buffer(3)]]) {
  mm_half_coop(a, b, out, p);
}
