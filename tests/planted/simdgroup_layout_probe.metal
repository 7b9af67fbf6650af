// The 8x8 simdgroup_matrix lane layout the GEMM kernels rely on (frag_coord, metal/fp8_gemm.h): they fill the
// A and B fragments through thread_elements() at frag_coord and read the accumulator back the same way, never
// through simdgroup_load / simdgroup_store. Apple documents no layout, so tests/test_mps_fragment_layout.py runs
// this probe on the GPU (mps) against a CPU product, and in the emulator with the layout transposed, to show
// the probe fails where the assumed layout is wrong.
#include <metal_stdlib>
#include "fp8_gemm.h"
using namespace metal;

// c = a @ b for one 8x8 tile (row-major a, b, c), the fragments filled and read at (row fc.y, cols fc.x, fc.x + 1)
// as the GEMM does; c_stored: the accumulator written by simdgroup_store, whose layout Metal owns.
inline void probe(device const float* a, device const float* b, device float* c, device float* c_stored, uint2 fc) {
  simdgroup_float8x8 ma, mb;
  simdgroup_float8x8 mc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  const uint at = fc.y * 8 + fc.x;
  ma.thread_elements()[0] = a[at];
  ma.thread_elements()[1] = a[at + 1];
  mb.thread_elements()[0] = b[at];
  mb.thread_elements()[1] = b[at + 1];
  simdgroup_multiply_accumulate(mc, ma, mb, mc);
  c[at] = mc.thread_elements()[0];
  c[at + 1] = mc.thread_elements()[1];
  simdgroup_store(mc, c_stored, 8);
}

kernel void simdgroup_layout_probe(device const float* a [[buffer(0)]], device const float* b [[buffer(1)]],
                                   device float* c [[buffer(2)]], device float* c_stored [[buffer(3)]],
                                   uint lane [[thread_index_in_simdgroup]]) {
  probe(a, b, c, c_stored, frag_coord(lane));
}

// BUG: the layout transposed (row and column swapped), as a wrong assumption would be.
kernel void simdgroup_layout_probe_transposed(device const float* a [[buffer(0)]], device const float* b [[buffer(1)]],
                                              device float* c [[buffer(2)]], device float* c_stored [[buffer(3)]],
                                              uint lane [[thread_index_in_simdgroup]]) {
  const uint2 fc = frag_coord(lane);
  probe(a, b, c, c_stored, uint2(fc.y & ~1u, fc.x));
}
