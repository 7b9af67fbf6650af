// int8_mm's activation pack as a test hook: the layout its GEMMs (the AVX micro-kernels, the AMX brgemm) read.
#pragma once
#include <ATen/core/Tensor.h>

#include <tuple>

namespace lowbit::cpu {

// The rows of xq [M, K] (int8, contiguous) packed as int8_mm packs them (int8_mm.cpp, pack_strips): strips of W
// rows in groups of G = 2 (int16 pairs) or 4 (byte quads) consecutive k, K padded to Kr = a multiple of G, the last
// strip narrowed to the rows left (narrow_last, as the AMX GEMM packs) or zero-padded. Returns the packed
// elements (int16 for G = 2, int8 for G = 4) followed by Kr * W elements of -1 that the pack must not touch, and
// each row's sum.
std::tuple<at::Tensor, at::Tensor> int8_pack_strips(const at::Tensor& xq, int64_t W, int64_t G, bool narrow_last);

}  // namespace lowbit::cpu
