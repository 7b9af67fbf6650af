// Kernels that pin the emulator's guarantees (tests/test_emulator.py): poisoned outputs, divergence reports,
// thread order. Each is wrong on purpose except where the name says otherwise.
#include <metal_stdlib>
using namespace metal;

// Writes only the even elements: the odd ones must come back poisoned (all bits set), not zero.
kernel void write_even_only(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  if (i % 2 == 0) out[i] = float(i);
}

// Half the lanes of a simdgroup wait at one simd op, the other half at another.
kernel void divergent_simd(device float* out [[buffer(0)]], uint lane [[thread_index_in_simdgroup]],
                           uint i [[thread_position_in_grid]]) {
  float v = float(lane);
  if (lane < 16) v = simd_sum(v);
  else v = simd_max(v);
  out[i] = v;
}

// Threads of one threadgroup wait at two different barriers.
kernel void divergent_barrier(device float* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  if (tid < 32) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  } else {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[tid] = 1.0f;
}

// A race: every thread writes its index into one threadgroup slot, then all read it back. The value is
// whichever thread wrote last, so the two thread orders give different results.
kernel void racy_last_writer(device uint* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup uint slot[1];
  slot[0] = tid;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = slot[0];
}

// One element past the end (offset n): with n * 4 bytes not a multiple of 16 the store lands in the poisoned
// slack before the guard page, where it does not fault; the emulator must still report it.
kernel void write_one_past_end(device float* out [[buffer(0)]], constant uint& n [[buffer(1)]],
                               uint i [[thread_position_in_grid]]) {
  out[i + 1] = 1.0f;  // thread n - 1 writes out[n]
}

// One element before the start.
kernel void write_one_before_start(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  if (i == 0) {
    *(out - 1) = 1.0f;
  }
  out[i] = 2.0f;
}

// Copies [[buffer(1)]]: bound as nil (an empty tensor, on mps and in the emulator), it must be reported.
kernel void copy_buffer_1(device float* out [[buffer(0)]], device const float* in [[buffer(1)]],
                          uint i [[thread_position_in_grid]]) {
  out[i] = in[i];
}
