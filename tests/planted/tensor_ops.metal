// Planted bugs for the emulator's model of Metal 4 tensor ops (csrc/emu/include/msl_tensor.h), checked by
// tests/test_emulator_tensor_ops.py. Each kernel computes one 64 x 64 tile of C = A B^T (A [M, K], B [N, K]) on
// matmul2d with 4 simdgroups; p.w selects a planted bug (0: none), so every bug has its correct twin.
#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;
using namespace mpp::tensor_ops;

constant constexpr int kTile = 64;
constant constexpr int kStep = 16;

// int8: operands straight from device memory, a cooperative int32 destination.
//   1 the epilogue assumes a lane layout (8x8 fragments in simdgroup_matrix order, dealt round-robin)
//   2 the destination is not zeroed    3 `multiply` mode inside the K loop    4 is_valid_element skipped
//   5 the last simdgroups skip the last run (divergence)    6 each simdgroup passes its own operand slice
//   7 the destination starts near INT_MAX, so the int32 sum overflows
//   8 (correct) the epilogue is the cooperative tensor's own store() into an output tensor
kernel void mm_int8(device char* a [[buffer(0)]], device char* b [[buffer(1)]], device int* out [[buffer(2)]],
                    constant uint4& p [[buffer(3)]], uint tid [[thread_index_in_threadgroup]],
                    uint sg [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]]) {
  const int M = int(p.x), N = int(p.y), K = int(p.z);
  const uint bug = p.w;
  auto A = tensor<device char, dextents<int32_t, 2>, tensor_inline>(a, dextents<int32_t, 2>(K, M));
  auto B = tensor<device char, dextents<int32_t, 2>, tensor_inline>(b, dextents<int32_t, 2>(K, N));
  constexpr auto acc_desc = matmul2d_descriptor(kTile, kTile, kStep, false, true, false,
                                                matmul2d_descriptor::mode::multiply_accumulate);
  constexpr auto mul_desc = matmul2d_descriptor(kTile, kTile, kStep, false, true, false,
                                                matmul2d_descriptor::mode::multiply);
  matmul2d<acc_desc, execution_simdgroups<4>> op;
  matmul2d<mul_desc, execution_simdgroups<4>> op_mul;
  auto c = op.get_destination_cooperative_tensor<decltype(A.slice(0, 0)), decltype(B.slice(0, 0)), int>();
  if (bug != 2) {
    for (uint16_t i = 0; i < c.get_capacity(); ++i) {
      if (c.is_valid_element(i)) {
        c[i] = bug == 7 ? 2147483000 : 0;
      }
    }
  }
  for (int k = 0; k < K; k += kStep) {
    auto ak = A.slice(bug == 6 ? k + int(sg) : k, 0);
    auto bk = B.slice(k, 0);
    if (bug == 3) {
      op_mul.run(ak, bk, c);
    } else if (bug == 5 && k + kStep >= K && sg >= 2) {
      continue;
    } else {
      op.run(ak, bk, c);
    }
  }
  if (bug == 8) {
    auto O = tensor<device int, dextents<int32_t, 2>, tensor_inline>(out, dextents<int32_t, 2>(N, M));
    c.store(O);  // elements past the extents (M, N < 64) are dropped
    return;
  }
  for (uint16_t i = 0; i < c.get_capacity(); ++i) {
    if (bug != 4 && !c.is_valid_element(i)) {
      continue;
    }
    int row, col;
    if (bug == 1) {
      const uint f = (uint(i) / 2) * 4 + sg;
      row = int(f / 8) * 8 + int(((lane >> 4) & 1) * 4 + ((lane >> 1) & 3));
      col = int(f % 8) * 8 + int(((lane >> 3) & 1) * 4 + (lane & 1) * 2) + int(i % 2);
    } else {
      const auto idx = c.get_multidimensional_index(i);
      row = idx[1];
      col = idx[0];
    }
    if (row < M && col < N) {
      out[row * N + col] = c[i];
    }
  }
}

// half operands staged in threadgroup memory, a float destination tensor in threadgroup memory.
//   1 no barrier between staging the operands and run    2 no barrier between run and overwriting the operands
//   3 the destination read right after the last run, before a barrier (the run before it is fenced)
kernel void mm_half_staged(device const half* a [[buffer(0)]], device const half* b [[buffer(1)]],
                           device float* out [[buffer(2)]], constant uint4& p [[buffer(3)]],
                           uint tid [[thread_index_in_threadgroup]]) {
  const int M = int(p.x), N = int(p.y), K = int(p.z);
  const uint bug = p.w;
  threadgroup half as[kTile * kStep];
  threadgroup half bs[kTile * kStep];
  threadgroup float cs[kTile * kTile];
  auto A = tensor<threadgroup half, dextents<int32_t, 2>, tensor_inline>(as, dextents<int32_t, 2>(kStep, kTile));
  auto B = tensor<threadgroup half, dextents<int32_t, 2>, tensor_inline>(bs, dextents<int32_t, 2>(kStep, kTile));
  auto C = tensor<threadgroup float, dextents<int32_t, 2>, tensor_inline>(cs, dextents<int32_t, 2>(kTile, kTile));
  constexpr auto desc = matmul2d_descriptor(kTile, kTile, kStep, false, true, false,
                                            matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<desc, execution_simdgroups<4>> op;
  for (uint e = tid; e < uint(kTile * kTile); e += 128) {
    cs[e] = 0.0f;
  }
  for (int k = 0; k < K; k += kStep) {
    for (uint e = tid; e < uint(kTile * kStep); e += 128) {
      const int r = int(e) / kStep, kk = k + int(e) % kStep;
      as[e] = r < M && kk < K ? a[r * K + kk] : half(0.0h);
      bs[e] = r < N && kk < K ? b[r * K + kk] : half(0.0h);
    }
    if (bug != 1) {
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    op.run(A, B, C);
    if (bug != 2 && !(bug == 3 && k + kStep >= K)) {
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
  }
  if (bug == 3) {
    for (uint e = tid; e < uint(kTile * kTile); e += 128) {
      const int r = int(e) / kTile, col = int(e) % kTile;
      if (r < M && col < N) {
        out[r * N + col] = cs[e];
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  } else {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint e = tid; e < uint(kTile * kTile); e += 128) {
      const int r = int(e) / kTile, col = int(e) % kTile;
      if (r < M && col < N) {
        out[r * N + col] = cs[e];
      }
    }
  }
}
