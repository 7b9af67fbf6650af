"""The address-space check (csrc/emu/msl_check.py): every metal/*.metal but the MSL 4.0 tensor-op files compiles
with clang as C++ for OpenCL against the project's metal_stdlib shim, a broad correct kernel passes, and planted mistakes that the emulator
would accept -- but Apple's compiler rejects -- fail with a message on the right line."""
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "csrc", "emu"))
import msl_check  # noqa: E402

pytestmark = pytest.mark.skipif(msl_check.clang_binary() is None, reason="clang is not installed")

METAL_FILES = msl_check.checked_files()  # all but the MSL 4.0 tensor-op files (msl_check.uses_tensor_ops)


@pytest.mark.parametrize("path", METAL_FILES, ids=os.path.basename)
def test_every_metal_file_passes(path):
    ok, out = msl_check.check(path)
    assert ok, out


# A correct kernel file using much of what kernels use; each planted mistake below edits one marked line.
GOOD = r"""
#include <metal_stdlib>
#include "params.h"
using namespace metal;

constant constexpr uint kTile = 64;
constant float kLut[4] = {0.0f, 0.5f, 1.0f, 2.0f};

struct Pair {
  float a, b;
  float sum() const thread { return a + b; }
  float sum() const device { return a + b; }
};

inline float accumulate(thread float* acc, device const float* p, uint i) {  // HELPER
  *acc += p[i];
  return *acc;
}

inline float4 widen(uchar4 b) { return float4(b) * 0.5f; }

template <typename T, uint BN>
kernel void tmpl(
    device const T* x [[buffer(0)]],
    device T* out [[buffer(1)]],
    device const Pair* pairs [[buffer(2)]],
    constant Fp8DequantizeParams& p [[buffer(3)]],
    device atomic_uint* counter [[buffer(4)]],
    device const uchar* bytes [[buffer(5)]],
    device Pair* pairs_out [[buffer(6)]],
    threadgroup float* dyn [[threadgroup(0)]],
    uint2 gid [[thread_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    ushort lane [[thread_index_in_simdgroup]]) {
  threadgroup float tile[kTile];
  threadgroup half mtile[64];
  tile[tid % kTile] = float(x[gid.x]);
  dyn[tid] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float acc = 0.0f;
  accumulate(&acc, (device const float*)pairs, 0);  // CALL
  const Pair q = pairs[gid.y];  // structs copy in and out of any address space
  pairs_out[gid.x] = q;
  acc += q.sum() + pairs[0].sum() + kLut[lane & 3] + p.scale.bn;  // METHOD
  const uchar4 b = *(device const packed_uchar4*)(bytes + 4 * gid.x);
  const float4 w = widen(b);
  const bool4 neg = w < float4(0.0f);
  const float4 s = select(w, -w, neg);
  acc += dot(s, float4(1.0f, 2.0f, float2(3.0f, 4.0f))) + fma(acc, 2.0f, 1.0f);
  acc += float(as_type<half>(ushort(b.x | (b.y << 8)))) + float(bfloat(acc)) + float(half(1.0h));
  acc = simd_sum(acc) + simd_shuffle_down(acc, ushort(1)) + clamp(acc, 0.0f, 1.0f) + rint(abs(acc));
  simdgroup_matrix<half, 8, 8> ma, mb;
  simdgroup_float8x8 mc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  simdgroup_load(ma, mtile, 8);
  simdgroup_load(mb, mtile, 8, ulong2(0, 0), true);
  simdgroup_multiply_accumulate(mc, ma, mb, mc);
  simdgroup_store(mc, (device float*)out, 8);
  acc += mc.thread_elements()[0];
  atomic_fetch_add_explicit(counter, 1u, memory_order_relaxed);
  if (all(gid < uint2(p.N, BN))) {
    out[gid.x] = T(min(acc, float(BN)));  // STORE
  }
}

template [[host_name("tmpl_float")]] [[kernel]] decltype(tmpl<float, 4>) tmpl<float, 4>;
template [[host_name("tmpl_bfloat")]] [[kernel]] decltype(tmpl<bfloat, 8>) tmpl<bfloat, 8>;

kernel void plain(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {  // PLAIN
  out[i] = float(i);
}
"""

PLANTED = {
    "device pointer to a thread pointer parameter": (
        "CALL", "accumulate(&acc, (device const float*)pairs, 0);",
        "accumulate((device float*)out, (device const float*)pairs, 0);",
        r"no matching function for call to 'accumulate'"),
    "threadgroup pointer to a device pointer parameter": (
        "CALL", "accumulate(&acc, (device const float*)pairs, 0);",
        "accumulate(&acc, tile, 0);", r"no matching function for call to 'accumulate'"),
    "pointer argument of a kernel without an address space": (
        "PLAIN", "kernel void plain(device float* out", "kernel void plain(float* out",
        r"pointer arguments to kernel functions must reside in"),
    "double": (
        "STORE", "out[gid.x] = T(min(acc, float(BN)));", "double d = acc; out[gid.x] = T(d);",
        r"use of type 'double' requires"),
    "std::": (
        "STORE", "out[gid.x] = T(min(acc, float(BN)));", "out[gid.x] = T(std::min(acc, 1.0f));",
        r"use of undeclared identifier 'std'"),
    "helper pointer parameter without an address space": (
        "HELPER", "inline float accumulate(thread float* acc,", "inline float accumulate(float* acc,",
        r"'acc' is a pointer or reference without an address space"),
    "member function without a device overload called on device memory": (
        "METHOD", "acc += q.sum() + pairs[0].sum()", "acc += q.sum() + pairs[0].get()",
        r"member function 'get' called on device memory"),
    "program-scope variable outside constant": (
        "HELPER", "inline float accumulate(", "float g_scale = 1.0f;\ninline float accumulate(",
        r"program scope variable must reside in constant address space"),
    "non-ASCII byte": (
        "PLAIN", "uint i [[thread_position_in_grid]]) {", "uint i [[thread_position_in_grid]]) {  // \u00b5s",
        r"non-ASCII byte"),
}


def write(tmp_path, text):
    (tmp_path / "params.h").write_text(open(os.path.join(ROOT, "metal", "params.h")).read())
    p = tmp_path / "k.metal"
    p.write_bytes(text.encode("utf-8"))
    return str(p)


def test_a_broad_correct_kernel_passes(tmp_path):
    ok, out = msl_check.check(write(tmp_path, GOOD))
    assert ok, out


@pytest.mark.parametrize("mistake", sorted(PLANTED))
def test_planted_mistake_fails_on_its_line(tmp_path, mistake):
    _, old, new, message = PLANTED[mistake]
    if mistake == "member function without a device overload called on device memory":
        base = GOOD.replace("  float sum() const device { return a + b; }",
                            "  float sum() const device { return a + b; }\n  float get() const { return a; }")
    else:
        base = GOOD
    assert old in base
    text = base.replace(old, new, 1)
    ok, out = msl_check.check(write(tmp_path, text))
    assert not ok
    line = next(i for i, s in enumerate(text.splitlines(), 1) if new.splitlines()[0] in s)
    assert re.search(message, out), out
    assert re.search(rf"k\.metal:{line}:\d+: error", out), out
