// Planted-bug fixtures for tests/test_emulator.py: an fp8 x float GEMV, y[n] = scale[n] * sum_k dec(W[n, k]) * x[k],
// in a correct form and in copies with one known bug each. The emulator must pass the first and catch the rest.
// One simdgroup per row; lanes read 4 consecutive weight bytes each, so a SIMD load covers 128 contiguous bytes.
// Rows start anywhere (K is odd in the tests): the 4-byte loads are packed_uchar4, which needs no alignment.
#include <metal_stdlib>
using namespace metal;

inline float dec_fp8(uchar b) {  // e4m3fn, NaN codes never appear in the tests
  const ushort h = ushort(((b & 0x80) << 8) | ((b & 0x7F) << 7));
  return float(as_type<half>(h)) * 256.0f;
}

struct GemvArgs {
  uint N, K;
};

#define GEMV_PARAMS                                       \
  device const uchar* W [[buffer(0)]],                    \
  device const float* x [[buffer(1)]],                    \
  device const float* scale [[buffer(2)]],                \
  device float* y [[buffer(3)]],                          \
  constant GemvArgs& a [[buffer(4)]],                     \
  uint tgid [[threadgroup_position_in_grid]],             \
  uint tid [[thread_index_in_threadgroup]],               \
  uint ntid [[threads_per_threadgroup]],                  \
  uint sg [[simdgroup_index_in_threadgroup]],             \
  uint lane [[thread_index_in_simdgroup]],                \
  uint nsg [[simdgroups_per_threadgroup]]

inline float row_dot(device const uchar* w, device const float* x, uint K, uint lane) {
  const uint K4 = K & ~3u;
  float acc = 0.0f;
  for (uint k = lane * 4; k < K4; k += 128) {
    const uchar4 b = uchar4(*(device const packed_uchar4*)(w + k));
    acc += dec_fp8(b.x) * x[k] + dec_fp8(b.y) * x[k + 1] + dec_fp8(b.z) * x[k + 2] + dec_fp8(b.w) * x[k + 3];
  }
  for (uint k = K4 + lane; k < K; k += 32) acc += dec_fp8(w[k]) * x[k];
  return acc;
}

kernel void gemv_ok(GEMV_PARAMS) {
  const uint row = tgid * nsg + sg;
  if (row >= a.N) return;  // the whole simdgroup leaves together
  const float acc = simd_sum(row_dot(W + ulong(row) * a.K, x, a.K, lane));
  if (lane == 0) y[row] = acc * scale[row];
}

// BUG (wrong tail bound): the vector loop runs to K instead of K & ~3, reading up to 3 bytes past each row
// (past the buffer on the last row), and the scalar tail then counts those elements again.
kernel void gemv_bug_tail(GEMV_PARAMS) {
  const uint row = tgid * nsg + sg;
  if (row >= a.N) return;
  device const uchar* w = W + ulong(row) * a.K;
  float acc = 0.0f;
  for (uint k = lane * 4; k < a.K; k += 128) {
    const uchar4 b = uchar4(*(device const packed_uchar4*)(w + k));
    acc += dec_fp8(b.x) * x[k] + dec_fp8(b.y) * x[k + 1] + dec_fp8(b.z) * x[k + 2] + dec_fp8(b.w) * x[k + 3];
  }
  for (uint k = (a.K & ~3u) + lane; k < a.K; k += 32) acc += dec_fp8(w[k]) * x[k];
  acc = simd_sum(acc);
  if (lane == 0) y[row] = acc * scale[row];
}

// BUG (wrong lane reduction): the shuffle ladder starts at 8, so lanes 16..31 never reach lane 0.
kernel void gemv_bug_ladder(GEMV_PARAMS) {
  const uint row = tgid * nsg + sg;
  if (row >= a.N) return;
  float acc = row_dot(W + ulong(row) * a.K, x, a.K, lane);
  for (ushort off = 8; off > 0; off >>= 1) acc += simd_shuffle_down(acc, off);
  if (lane == 0) y[row] = acc * scale[row];
}

// The correct ladder (from 16): proves the shuffle itself is emulated right.
kernel void gemv_ok_ladder(GEMV_PARAMS) {
  const uint row = tgid * nsg + sg;
  if (row >= a.N) return;
  float acc = row_dot(W + ulong(row) * a.K, x, a.K, lane);
  for (ushort off = 16; off > 0; off >>= 1) acc += simd_shuffle_down(acc, off);
  if (lane == 0) y[row] = acc * scale[row];
}

// x staged through threadgroup memory, 128 values per tile. Rows past N still take part in every barrier.
constant constexpr uint TILE = 128;

inline float tile_dot(device const uchar* w, threadgroup const float* xs, uint k0, uint K, uint lane) {
  float acc = 0.0f;
  for (uint k = k0 + lane; k < min(k0 + TILE, K); k += 32) acc += dec_fp8(w[k]) * xs[k - k0];
  return acc;
}

kernel void gemv_tiled_ok(GEMV_PARAMS) {
  threadgroup float xs[TILE];
  const uint row = tgid * nsg + sg;
  const bool valid = row < a.N;
  device const uchar* w = W + ulong(valid ? row : 0) * a.K;
  float acc = 0.0f;
  for (uint k0 = 0; k0 < a.K; k0 += TILE) {
    for (uint i = tid; i < TILE; i += ntid) xs[i] = k0 + i < a.K ? x[k0 + i] : 0.0f;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (valid) acc += tile_dot(w, xs, k0, a.K, lane);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // xs is refilled by the next tile
  }
  acc = simd_sum(acc);
  if (valid && lane == 0) y[row] = acc * scale[row];
}

// BUG (missing barrier): no barrier between filling xs and reading it.
kernel void gemv_tiled_bug_no_barrier(GEMV_PARAMS) {
  threadgroup float xs[TILE];
  const uint row = tgid * nsg + sg;
  const bool valid = row < a.N;
  device const uchar* w = W + ulong(valid ? row : 0) * a.K;
  float acc = 0.0f;
  for (uint k0 = 0; k0 < a.K; k0 += TILE) {
    for (uint i = tid; i < TILE; i += ntid) xs[i] = k0 + i < a.K ? x[k0 + i] : 0.0f;
    if (valid) acc += tile_dot(w, xs, k0, a.K, lane);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  acc = simd_sum(acc);
  if (valid && lane == 0) y[row] = acc * scale[row];
}

// BUG (barrier not reached by all threads): rows past N return before the barriers.
kernel void gemv_tiled_bug_early_return(GEMV_PARAMS) {
  threadgroup float xs[TILE];
  const uint row = tgid * nsg + sg;
  if (row >= a.N) return;
  device const uchar* w = W + ulong(row) * a.K;
  float acc = 0.0f;
  for (uint k0 = 0; k0 < a.K; k0 += TILE) {
    for (uint i = tid; i < TILE; i += ntid) xs[i] = k0 + i < a.K ? x[k0 + i] : 0.0f;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    acc += tile_dot(w, xs, k0, a.K, lane);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  acc = simd_sum(acc);
  if (lane == 0) y[row] = acc * scale[row];
}

// Uncoalesced on purpose (for the traffic report, not a bug): one thread per row, so the 32 lanes of a SIMD
// load touch 32 different rows and use 4 bytes of each 128-byte line.
kernel void gemv_row_per_thread(device const uchar* W [[buffer(0)]], device const float* x [[buffer(1)]],
                                device const float* scale [[buffer(2)]], device float* y [[buffer(3)]],
                                constant GemvArgs& a [[buffer(4)]], uint row [[thread_position_in_grid]]) {
  if (row >= a.N) return;
  device const uchar* w = W + ulong(row) * a.K;
  float acc = 0.0f;
  for (uint k = 0; k + 4 <= a.K; k += 4) {
    const uchar4 b = uchar4(*(device const packed_uchar4*)(w + k));
    acc += dec_fp8(b.x) * x[k] + dec_fp8(b.y) * x[k + 1] + dec_fp8(b.z) * x[k + 2] + dec_fp8(b.w) * x[k + 3];
  }
  for (uint k = a.K & ~3u; k < a.K; k++) acc += dec_fp8(w[k]) * x[k];
  y[row] = acc * scale[row];
}
