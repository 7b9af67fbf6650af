// A tiled simdgroup-matrix sum (tests/test_emulator.py): out[s] = sum over steps of the 8x8 tile x[step], in each
// of the threadgroup's 2 simdgroups s. Each step all 64 threads stage the tile into threadgroup memory (one
// element each, the two simdgroups each half of it), then every simdgroup reads the whole tile into an MMA.
#include <metal_stdlib>
using namespace metal;

template <bool BarrierAfterMma>
inline void mma_tile_sum(device const float* x, device float* out, constant uint& steps, uint tid, uint sg) {
  threadgroup float xs[64];
  simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  const simdgroup_float8x8 identity = simdgroup_float8x8(1.0f);
  for (uint s = 0; s < steps; s++) {
    xs[tid] = x[s * 64 + tid];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    simdgroup_float8x8 a;
    simdgroup_load(a, xs, 8);
    simdgroup_multiply_accumulate(acc, a, identity, acc);
    if (BarrierAfterMma) {
      threadgroup_barrier(mem_flags::mem_threadgroup);  // the next step overwrites xs
    }
  }
  simdgroup_store(acc, out + sg * 64, 8);
}

kernel void mma_tiles_ok(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                         constant uint& steps [[buffer(2)]], uint tid [[thread_index_in_threadgroup]],
                         uint sg [[simdgroup_index_in_threadgroup]]) {
  mma_tile_sum<true>(x, out, steps, tid, sg);
}

// BUG (missing barrier): the next step's staging may overwrite the tile while the other simdgroup still reads
// it. Lockstep rounds hide it (every simdgroup's loads happen before the MMA collective all of them reach in
// the same round); the reverse order, which runs one simdgroup ahead to its next barrier, shows it.
kernel void mma_tiles_bug_no_barrier(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                                     constant uint& steps [[buffer(2)]], uint tid [[thread_index_in_threadgroup]],
                                     uint sg [[simdgroup_index_in_threadgroup]]) {
  mma_tile_sum<false>(x, out, steps, tid, sg);
}
