// Kernels that each break one of Metal's rules (tests/test_emulator.py), with twins that keep it: the
// emulator must fault on the first kind and run the second. Every rule here is one a real Apple GPU enforces
// by returning wrong data, faulting or refusing the pipeline, and that a CPU would not notice by itself.
#include <metal_stdlib>
using namespace metal;

// A uint4 (16-byte) load at in + word + 4 i. BUG when word % 4 != 0, or when the buffer itself is bound at a
// byte offset that is not a multiple of 16 (a view at an odd storage offset): MSL needs 16-byte alignment.
kernel void uint4_load_at(device const uint* in [[buffer(0)]], device uint4* out [[buffer(1)]],
                          constant uint& word [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  out[i] = *(device const uint4*)(in + word + 4 * i);
}

// The same words through packed_uint4, which needs only 4-byte alignment: right at any word offset.
kernel void packed_uint4_load_at(device const uint* in [[buffer(0)]], device uint4* out [[buffer(1)]],
                                 constant uint& word [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  out[i] = uint4(*(device const packed_uint4*)(in + word + 4 * i));
}

// A threadgroup float4 store at a 4-byte offset into threadgroup memory. BUG: 16-byte alignment needed.
kernel void threadgroup_float4_store_misaligned(device float* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float buf[64];
  if (tid == 0) {
    *(threadgroup float4*)(buf + 1) = float4(1.0f);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = buf[tid % 4];
}

// BUG: float4 stores into a `float` threadgroup array, whose alignment MSL promises at 4 bytes only. Where the
// compiler happens to place it at 16 the stores work, so only the emulator's natural alignment shows it.
kernel void threadgroup_float_array_float4_stores(device float* out [[buffer(0)]],
                                                  uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float tile[128];
  *(threadgroup float4*)(tile + 4 * tid) = float4(float(tid));
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = tile[4 * tid + 3];
}

// The same stores into an array declared 16-byte aligned: correct.
kernel void threadgroup_aligned_float_array_float4_stores(device float* out [[buffer(0)]],
                                                          uint tid [[thread_index_in_threadgroup]]) {
  alignas(16) threadgroup float tile[128];
  *(threadgroup float4*)(tile + 4 * tid) = float4(float(tid));
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = tile[4 * tid + 3];
}

// BUG: 8448 floats (33 KiB) of threadgroup memory; Apple GPUs have 32 KiB per threadgroup.
kernel void threadgroup_array_33k(device float* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float big[8448];
  big[tid] = float(tid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = big[(tid + 1) % 32];
}

// 16 KiB of threadgroup array plus [[threadgroup(0)]] of the launch's size: past 32 KiB together is a BUG.
kernel void threadgroup_array_16k_plus_dynamic(device float* out [[buffer(0)]], threadgroup float* dyn [[threadgroup(0)]],
                                               uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float half_of_it[4096];
  half_of_it[tid] = float(tid);
  dyn[tid] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = half_of_it[(tid + 1) % 32] + dyn[tid];
}

// Writes its 32-bit grid position. Launched with more than 2^32 threads along x (a BUG of the launch, not of
// the kernel) the positions would wrap: the emulator refuses the launch.
kernel void grid_position(device uint* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  if (i < 64) {
    out[i] = i;
  }
}
