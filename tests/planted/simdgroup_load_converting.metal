// BUG: loads a float simdgroup matrix from a threadgroup half pointer. MSL has no converting simdgroup_load
// (the pointer's element type must be the matrix's): Apple's compiler rejects this kernel, and so must the
// emulator's build (tests/test_emulator.py compiles this file and expects the static_assert).
#include <metal_stdlib>
using namespace metal;

kernel void simdgroup_load_float_from_half(device float* out [[buffer(0)]], uint lane [[thread_index_in_simdgroup]]) {
  threadgroup half tile[64];
  tile[lane] = half(lane);
  tile[lane + 32] = half(lane);
  simdgroup_barrier(mem_flags::mem_threadgroup);
  simdgroup_float8x8 m;
  simdgroup_load(m, tile, 8);
  simdgroup_store(m, out, 8);
}
