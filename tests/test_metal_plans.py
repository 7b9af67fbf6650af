"""The Metal plans at real model sizes, without running a kernel: torch.ops.lowbit_dryrun runs each op's plan
on meta tensors (no memory) as on the mps device and records its dispatches (torch_lowbit.emulator.dry_run).
Every dispatch must cover its output with tight grids, fit Metal's launch limits (32-bit thread positions
per grid dimension, 1024 threads, 32 KiB threadgroup memory, 4 KiB setBytes) and carry the sizes exactly in
its 32-bit params. Shapes: Llama-3-70B (K = 8192, N = 28672, lm_head N = 128256), DeepSeek-V3 MoE (hidden
7168, expert intermediate 2048, 256 experts, top-8) and Qwen3-30B-A3B MoE (hidden 2048, expert intermediate
768, 128 experts, top-8), decode (M = 1, one token's top-8 rows) and prefill (M = 4096, T = 32768 rows), for the
forward ops and the backward passes' transposed products."""
import math
import struct

import pytest
import torch

import torch_lowbit
from torch_lowbit import _C
from torch_lowbit.emulator import device_caps, dry_run

META = torch.device("meta")
POSITIONS = 2 ** 32  # thread_position_in_grid is a 32-bit uint

# Output tile (rows of x, columns of out) each threadgroup of a kernel computes, by kernel name prefix: the
# kernels' geometry (metal/*.metal), written out here so a plan that sizes a grid wrongly fails.
TILES = {"fp8_gemm_mpp_": (64, 64), "int8_gemm_mpp_": (64, 64), "w4_gemm_mpp_": (64, 64),  # M5 (matmul2d),
         # before their prefixes
         "fp8_gemv_rows_": (8, 16), "fp8_gemv_": (1, 4), "fp8_gemm_": (32, 32), "int8_gemv_": (4, 4),
         "int8_gemm_": (32, 64)}
# the transposed products (out [M, K]): rows of grad_out, columns of out
for _op in ("fp8_mm_t_", "int8_weight_mm_t_"):
    TILES.update({_op + "gemv_rows_": (8, 128), _op + "gemv_": (1, 128), _op + "gemm_": (32, 32)})
# 4-bit: w4_mm (rows of x, columns of out), w4_mm_t (rows of grad_out, columns of out [M, K])
TILES.update({"w4_gemv_rows_": (8, 4), "w4_gemv_": (1, 4), "w4_gemm_": (32, 32), "w4_mm_t_gemm_": (32, 32)})


def tile_of(kernel):
    return next(v for k, v in TILES.items() if kernel.startswith(k))


def check_limits(r):
    threads = math.prod(r["threads"])
    assert 1 <= threads <= 1024 and r["threadgroup_memory"] <= 32768, r
    for groups, per in zip(r["grid"], r["threads"]):
        assert groups * per <= POSITIONS, r
    assert all(len(v) <= 4096 for v in r["values"].values())


def fp8_weight(N, K, E=None, block=True):
    lead = () if E is None else (E,)
    w = torch.empty(lead + (N, K), dtype=torch.float8_e4m3fn, device=META)
    s = torch.empty(lead + ((math.ceil(N / 128), math.ceil(K / 128)) if block else (N,)), device=META)
    return w, s, ([128, 128] if block else None)


def run(op, *args):
    with dry_run() as d:
        out = getattr(d.ops, op)(*args)
        recs = d.take()
    for r in recs:
        check_limits(r)
    return out, recs


def u32s(r, n):
    return struct.unpack_from(f"<{n}I", r["values"]["params"])


# ---------------------------------------------------------------------------------------------- dense
LLAMA_70B = [(8192, 28672), (28672, 8192), (8192, 8192), (8192, 128256)]  # (K, N): up/gate, down, o_proj, lm_head


@pytest.mark.parametrize("M", [1, 5, 4096])
@pytest.mark.parametrize("K,N", LLAMA_70B)
def test_fp8_mm_grids_at_llama_70b_sizes(M, K, N):
    w, s, block = fp8_weight(N, K)
    out, recs = run("fp8_mm", torch.empty(M, K, dtype=torch.bfloat16, device=META), w, s, None, block)
    assert out.shape == (M, N) and len(recs) == 1
    r = recs[0]
    rows, cols = tile_of(r["kernel"])
    assert r["kernel"].endswith("_bfloat")
    assert r["grid"] == (math.ceil(N / cols), math.ceil(M / rows), 1)
    assert u32s(r, 4) == (M, N, K, 1)  # M, N, K, flags = vector loads (K % 16 == 0, offsets 0)
    assert r["buffers"]["weight"]["nbytes"] == N * K


@pytest.mark.parametrize("M", [1, 8, 4096])
@pytest.mark.parametrize("K,N", LLAMA_70B)
def test_int8_grids_at_llama_70b_sizes(M, K, N):
    x = torch.empty(M, K, dtype=torch.bfloat16, device=META)
    (q, xs), recs = run("int8_quantize", x)
    assert q.shape == (M, K) and xs.shape == (M,)
    assert [(r["kernel"], r["grid"], r["threads"]) for r in recs] == [("int8_quantize_bfloat", (M, 1, 1), (256, 1, 1))]
    wq = torch.empty(N, K, dtype=torch.int8, device=META)
    out, recs = run("int8_mm", q, xs, wq, torch.empty(N, device=META), None, None)
    assert out.shape == (M, N) and len(recs) == 1
    r = recs[0]
    rows, cols = tile_of(r["kernel"])
    assert r["kernel"].endswith("_bfloat_k16")
    gemv = r["kernel"].startswith("int8_gemv_")
    assert r["grid"] == ((math.ceil(M / rows), math.ceil(N / cols), 1) if gemv else
                         (math.ceil(N / cols), math.ceil(M / rows), 1))
    assert u32s(r, 3) == (M, N, K)


@pytest.mark.parametrize("N,K", [(28672, 8192), (128256, 8192)])
def test_fp8_dequantize_grid_at_llama_70b_sizes(N, K):
    w, s, block = fp8_weight(N, K)
    out, (r,) = run("fp8_dequantize", w, s, block, torch.bfloat16)
    assert out.shape == (N, K)
    assert r["grid"] == (math.ceil(K / 4 / 64), math.ceil(N / 4), 1) and r["threads"] == (64, 4, 1)


@pytest.mark.parametrize("M", [1, 5, 4096])
@pytest.mark.parametrize("K,N", LLAMA_70B)
@pytest.mark.parametrize("op", ["fp8_mm_t", "int8_weight_mm_t"])
def test_transposed_grids_at_llama_70b_sizes(op, M, K, N):
    # the backward product of the forward's [N, K] weight: grad_out [M, N] -> [M, K]
    go = torch.empty(M, N, dtype=torch.bfloat16, device=META)
    if op == "fp8_mm_t":
        w, s, block = fp8_weight(N, K)
        out, recs = run(op, go, w, s, block)
    else:
        out, recs = run(op, go, torch.empty(N, K, dtype=torch.int8, device=META), torch.empty(N, device=META))
    assert out.shape == (M, K) and len(recs) == 1
    r = recs[0]
    rows, cols = tile_of(r["kernel"])
    assert r["kernel"].startswith(op) and r["kernel"].endswith("_bfloat")
    assert r["grid"] == (math.ceil(K / cols), math.ceil(M / rows), 1)
    assert u32s(r, 4) == (M, N, K, 3)  # flags: 4-byte weight loads, vector loads of grad_out
    assert r["buffers"]["weight"]["nbytes"] == N * K


# ---------------------------------------------------------------------------------------------- 4-bit
W4_GROUP = {"nvfp4": 16, "int4": 128}


def w4_weight(fmt, N, K):
    """codes, scale, group_size, offset, global_scale on META: nvfp4 (e4m3 bits per 16, a global scale) or int4
    (bf16 scale and int8 zero point per 128)."""
    group = W4_GROUP[fmt]
    G = math.ceil(K / group)
    codes = torch.empty(N, (K + 1) // 2, dtype=torch.uint8, device=META)
    if fmt == "nvfp4":
        return codes, torch.empty(N, G, dtype=torch.uint8, device=META), group, None, torch.empty(1, device=META)
    return (codes, torch.empty(N, G, dtype=torch.bfloat16, device=META), group,
            torch.empty(N, G, dtype=torch.int8, device=META), None)


def w4_params(r):
    """M, N, K, G, group, group_shift, flags of a w4 dispatch's W4Params"""
    return u32s(r, 7)


# flags: 16-byte and 4-byte code loads, vector activation loads (1 | 2 | 4), and the global scale (16)
W4_FLAGS = {"nvfp4": 1 | 2 | 4 | 16, "int4": 1 | 2 | 4}
W4_PARAMS = {"nvfp4": (16, 4), "int4": (128, 7)}  # group, its log2
W4_VARIANT = {"nvfp4": "_e4m3_none", "int4": "_bf16_zp"}  # scale encoding, offset kind


@pytest.mark.parametrize("M", [1, 5, 4096])
@pytest.mark.parametrize("K,N", LLAMA_70B)
@pytest.mark.parametrize("fmt", ["nvfp4", "int4"])
def test_w4_mm_grids_at_llama_70b_sizes(fmt, M, K, N):
    codes, scale, group, offset, gs = w4_weight(fmt, N, K)
    out, recs = run("w4_mm", torch.empty(M, K, dtype=torch.bfloat16, device=META), codes, scale, fmt, group, offset,
                    gs, None)
    assert out.shape == (M, N) and len(recs) == 1
    r = recs[0]
    rows, cols = tile_of(r["kernel"])
    assert r["kernel"].endswith("_bfloat" + W4_VARIANT[fmt])
    assert r["grid"] == (math.ceil(N / cols), math.ceil(M / rows), 1)
    assert w4_params(r) == (M, N, K, math.ceil(K / group)) + W4_PARAMS[fmt] + (W4_FLAGS[fmt],)
    assert r["buffers"]["codes"]["nbytes"] == N * K // 2


@pytest.mark.parametrize("M", [1, 4096])
@pytest.mark.parametrize("K,N", LLAMA_70B)
@pytest.mark.parametrize("fmt", ["nvfp4", "int4"])
def test_w4_mm_t_grids_at_llama_70b_sizes(fmt, M, K, N):
    codes, scale, group, offset, gs = w4_weight(fmt, N, K)
    out, (r,) = run("w4_mm_t", torch.empty(M, N, dtype=torch.bfloat16, device=META), codes, scale, fmt, group, K,
                    offset, gs)
    assert out.shape == (M, K) and r["kernel"] == "w4_mm_t_gemm_bfloat" + W4_VARIANT[fmt]
    rows, cols = tile_of(r["kernel"])
    assert r["grid"] == (math.ceil(K / cols), math.ceil(M / rows), 1) and r["threads"] == (128, 1, 1)
    assert w4_params(r) == (M, N, K, math.ceil(K / group)) + W4_PARAMS[fmt] + (W4_FLAGS[fmt],)


@pytest.mark.parametrize("N,K", [(28672, 8192), (8192, 28672), (128256, 8192)])
def test_w4_dequantize_grid_at_llama_70b_sizes(N, K):
    codes, scale, group, offset, gs = w4_weight("nvfp4", N, K)
    out, (r,) = run("w4_dequantize", codes, scale, "nvfp4", group, K, offset, gs, torch.bfloat16)
    assert out.shape == (N, K) and r["kernel"] == "w4_dequantize_bfloat_e4m3_none"
    assert r["grid"] == (math.ceil(K / 8 / 64), math.ceil(N / 4), 1) and r["threads"] == (64, 4, 1)


@pytest.mark.parametrize("x_off,c_off,flags", [(0, 0, 7), (8, 0, 7), (4, 0, 3), (0, 4, 6), (0, 1, 4), (1, 3, 0)])
def test_w4_vector_loads_need_aligned_buffers(x_off, c_off, flags):
    M, N, K = 1, 32, 256
    x = view_at(x_off, (M, K), torch.bfloat16)  # 16-byte aligned at a multiple of 8 elements
    codes = view_at(c_off, (N, K // 2), torch.uint8)
    _, (r,) = run("w4_mm", x, codes, torch.empty(N, K // 32, device=META), "int4", 32, None, None, None)
    assert w4_params(r)[6] == flags


M5 = dict(apple_family=10, msl_version=400)


@pytest.mark.parametrize("M", [9, 4096])
@pytest.mark.parametrize("K,N", LLAMA_70B)
def test_m5_grids_at_llama_70b_sizes(M, K, N):
    """Under M5 caps the prefill GEMMs are the tensor-op kernels: 64 x 64 tiles of 128 threads, Morton-walked
    inside the same (N tiles, M tiles) grid, within Metal's limits (run() checks them)."""
    w, s, block = fp8_weight(N, K)
    x = torch.empty(M, K, dtype=torch.bfloat16, device=META)
    wq = torch.empty(N, K, dtype=torch.int8, device=META)
    with device_caps(**M5):
        _, fp8 = run("fp8_mm", x, w, s, None, block)
        _, i8 = run("int8_mm", torch.empty(M, K, dtype=torch.int8, device=META), torch.empty(M, device=META), wq,
                    torch.empty(N, device=META), None, None)
        w4 = {}
        for fmt in ("nvfp4", "int4"):
            codes, scale, group, offset, gs = w4_weight(fmt, N, K)
            w4[fmt] = run("w4_mm", x, codes, scale, fmt, group, offset, gs, None)[1]
    for (r,), name in ((fp8, "fp8_gemm_mpp_bfloat"), (i8, "int8_gemm_mpp_bfloat"),
                       (w4["nvfp4"], "w4_gemm_mpp_bfloat" + W4_VARIANT["nvfp4"]),
                       (w4["int4"], "w4_gemm_mpp_bfloat" + W4_VARIANT["int4"])):
        assert r["kernel"] == name and r["threads"] == (128, 1, 1)
        assert r["grid"] == (math.ceil(N / 64), math.ceil(M / 64), 1)
    assert u32s(i8[0], 3) == (M, N, K)
    # nvfp4 stages decoded weights (kW4MppScaled, 32); int4 folds its group scales
    assert w4_params(w4["nvfp4"][0])[6] == W4_FLAGS["nvfp4"] | 32 and w4_params(w4["int4"][0])[6] == W4_FLAGS["int4"]


# ---------------------------------------------------------------------------------------------- MoE
MOE = {  # hidden, expert intermediate, experts, top-k
    "deepseek_v3": (7168, 2048, 256, 8),
    "qwen3_30b_a3b": (2048, 768, 128, 8),
}


def grouped(model, proj, T):
    hidden, inter, E, _ = MOE[model]
    N, K = (2 * inter, hidden) if proj == "gate_up" else (hidden, inter)
    w, s, block = fp8_weight(N, K, E=E)
    x = torch.empty(T, K, dtype=torch.bfloat16, device=META)
    offsets = torch.empty(E + 1, dtype=torch.int32, device=META)
    ids = torch.empty(E, dtype=torch.int32, device=META)
    out, recs = run("fp8_grouped_mm", x, w, s, offsets, ids, block)
    assert out.shape == (T, N)
    return recs, N, K, E


@pytest.mark.parametrize("model", list(MOE))
@pytest.mark.parametrize("proj", ["gate_up", "down"])
def test_grouped_prefill_tiles_only_the_rows_that_exist(model, proj):
    T = 32768  # rows = tokens x top-k, sorted by expert
    recs, N, K, E = grouped(model, proj, T)
    layout, gemm = recs
    assert layout["kernel"] == "fp8_grouped_tiles" and layout["grid"] == (1, 1, 1) and layout["threads"] == (1, 1, 1)
    assert layout["buffers"]["tiles"]["shape"] == (2 * (E + 3),) and layout["buffers"]["tiles"]["access"] == "write"
    assert gemm["kernel"] == "fp8_grouped_gemm_bfloat" and gemm["binding"][3] == "tiles"
    # the tiles that can exist: ceil(rows / 32) per group, plus the rows before and after the groups
    assert gemm["grid"] == (math.ceil(N / 32), math.ceil(T / 32) + E + 1, 1)
    # (the T x G grid it replaces: (N / 32) * ceil(T / 32) * (G + 1), 33.7M threadgroups for DeepSeek's gate_up)
    assert math.prod(gemm["grid"]) < 1.3 * math.ceil(N / 32) * math.ceil(T / 32)
    assert u32s(gemm, 5) == (T, N, K, E, E)
    assert gemm["buffers"]["weight"]["nbytes"] == E * N * K  # > 2^32 for DeepSeek: 64-bit expert offsets


@pytest.mark.parametrize("model", list(MOE))
@pytest.mark.parametrize("proj", ["gate_up", "down"])
def test_m5_grouped_prefill_over_the_same_tile_table(model, proj):
    T = 32768
    with device_caps(**M5):
        recs, N, K, E = grouped(model, proj, T)
    layout, gemm = recs
    assert layout["kernel"] == "fp8_grouped_tiles"
    assert gemm["kernel"] == "fp8_grouped_gemm_mpp_bfloat" and gemm["threads"] == (128, 1, 1)
    assert gemm["grid"] == (math.ceil(N / 64), math.ceil(T / 32) + E + 1, 1)  # 32-row tiles of the table
    # the 4-bit experts (mxfp4, gpt-oss's format) over the same table
    codes, scale = torch.empty(E, N, K // 2, dtype=torch.uint8, device=META), \
        torch.empty(E, N, K // 32, dtype=torch.uint8, device=META)
    with device_caps(**M5):
        _, (_, w4) = run("w4_grouped_mm", torch.empty(T, K, dtype=torch.bfloat16, device=META), codes, scale, "mxfp4",
                         32, torch.empty(E + 1, dtype=torch.int32, device=META),
                         torch.empty(E, dtype=torch.int32, device=META), None, None)
    assert w4["kernel"] == "w4_grouped_gemm_mpp_bfloat_e8m0_none" and w4["threads"] == (128, 1, 1)
    assert w4["grid"] == gemm["grid"]


@pytest.mark.parametrize("model", list(MOE))
@pytest.mark.parametrize("proj", ["gate_up", "down"])
def test_grouped_decode_is_one_slot_per_group(model, proj):
    top_k = MOE[model][3]
    (layout, r), N, K, E = grouped(model, proj, top_k)  # one token: its top-k rows
    # the rows come from the same clamped table as prefill's (one rule for malformed offsets)
    assert layout["kernel"] == "fp8_grouped_tiles" and r["binding"][3:5] == ["tiles", "expert_ids"]
    assert r["kernel"] == "fp8_grouped_gemv_bfloat"
    assert r["grid"] == (math.ceil(N / 4), E + 1, 1) and r["threads"] == (64, 1, 1)


def grouped_t(model, proj, T):
    """fp8_grouped_mm_t for grouped()'s weights: grad_out [T, N] -> [T, K]"""
    hidden, inter, E, _ = MOE[model]
    N, K = (2 * inter, hidden) if proj == "gate_up" else (hidden, inter)
    w, s, block = fp8_weight(N, K, E=E)
    go = torch.empty(T, N, dtype=torch.bfloat16, device=META)
    out, recs = run("fp8_grouped_mm_t", go, w, s, torch.empty(E + 1, dtype=torch.int32, device=META),
                    torch.empty(E, dtype=torch.int32, device=META), block)
    assert out.shape == (T, K)
    return recs, N, K, E


@pytest.mark.parametrize("model", list(MOE))
@pytest.mark.parametrize("proj", ["gate_up", "down"])
def test_grouped_t_prefill_tiles_only_the_rows_that_exist(model, proj):
    T = 32768
    recs, N, K, E = grouped_t(model, proj, T)
    layout, gemm = recs
    assert layout["kernel"] == "fp8_grouped_tiles" and layout["buffers"]["tiles"]["shape"] == (2 * (E + 3),)
    assert gemm["kernel"] == "fp8_grouped_mm_t_gemm_bfloat" and gemm["binding"][3] == "tiles"
    assert gemm["grid"] == (math.ceil(K / 32), math.ceil(T / 32) + E + 1, 1) and gemm["threads"] == (128, 1, 1)
    assert u32s(gemm, 6) == (T, N, K, E, E, 3)
    assert gemm["buffers"]["weight"]["nbytes"] == E * N * K


@pytest.mark.parametrize("model", list(MOE))
@pytest.mark.parametrize("proj", ["gate_up", "down"])
def test_grouped_t_decode_is_one_slot_per_group(model, proj):
    (layout, r), N, K, E = grouped_t(model, proj, MOE[model][3])
    assert layout["kernel"] == "fp8_grouped_tiles" and r["binding"][3:5] == ["tiles", "expert_ids"]
    assert r["kernel"] == "fp8_grouped_mm_t_gemv_rows_bfloat"
    assert r["grid"] == (math.ceil(K / 128), E + 1, 1) and r["threads"] == (256, 1, 1)


# ---------------------------------------------------------------------------------------------- vector loads
def view_at(offset, shape, dtype):
    return torch.empty(math.prod(shape) + offset, dtype=dtype, device=META)[offset:].view(shape)


@pytest.mark.parametrize("x_off,w_off,vec", [(0, 0, True), (1, 0, False), (0, 3, False), (16, 32, True)])
def test_int8_vector_kernels_need_aligned_buffers(x_off, w_off, vec):
    M, N, K = 16, 64, 4096
    _, (r,) = run("int8_mm", view_at(x_off, (M, K), torch.int8), torch.empty(M, device=META),
                  view_at(w_off, (N, K), torch.int8), torch.empty(N, device=META), None, None)
    assert r["kernel"].endswith("_k16") == vec


@pytest.mark.parametrize("x_off,w_off,vec", [(0, 0, True), (2, 0, False), (4, 0, True), (0, 8, False)])
def test_fp8_vector_loads_need_aligned_buffers(x_off, w_off, vec):
    M, N, K = 2, 32, 256
    x = view_at(x_off, (M, K), torch.float32)  # 16-byte aligned at a multiple of 4 floats
    w = view_at(w_off, (N, K), torch.uint8)
    _, (r,) = run("fp8_mm", x, w, torch.empty(1, device=META), None, None)
    assert u32s(r, 4)[3] & 1 == vec


# ---------------------------------------------------------------------------------------------- limits
@pytest.mark.parametrize("grid,threads,tg,values,match", [
    ((2 ** 25 + 1, 1, 1), (128, 1, 1), 0, 16, r"k: grid dimension x has 33554433 threadgroups x 128 threads"),
    ((1, 1, 2 ** 32 - 1), (1, 1, 2), 0, 16, r"grid dimension z .* more than the 2\^32"),
    ((1, 1, 1), (32, 32, 2), 0, 16, r"k asks for 2048 threads per threadgroup; Metal allows 1 to 1024"),
    ((1, 1, 1), (0, 1, 1), 0, 16, r"asks for 0 threads per threadgroup"),
    ((1, 1, 1), (32, 1, 1), 32769, 16, r"k asks for 32769 bytes of threadgroup memory; Metal allows 32768"),
    ((1, 1, 1), (32, 1, 1), 0, 4097, r"k: value params has 4097 bytes; setBytes allows 4096"),
])
def test_plans_refuse_launches_past_metal_limits(grid, threads, tg, values, match):
    with pytest.raises(RuntimeError, match=match):
        _C._metal_check_launch_limits("k", list(grid), list(threads), tg, values)


def test_launch_at_the_limits_passes():
    _C._metal_check_launch_limits("k", [2 ** 25, 2 ** 22, 1], [128, 1024 // 128, 1], 32768, 4096)


@pytest.mark.parametrize("g_off,w_off,flags", [(0, 0, 3), (2, 0, 1), (4, 0, 3), (0, 2, 2), (0, 4, 3), (1, 1, 0)])
def test_transposed_vector_loads_need_aligned_buffers(g_off, w_off, flags):
    M, N, K = 40, 64, 256
    go = view_at(g_off, (M, N), torch.float32)  # 16-byte aligned at a multiple of 4 floats
    w = view_at(w_off, (N, K), torch.uint8)     # 4-byte weight loads at a multiple of 4 bytes
    _, (r,) = run("fp8_mm_t", go, w, torch.empty(1, device=META), None)
    assert u32s(r, 4)[3] == flags


# ---------------------------------------------------------------------------------------------- 4-bit MoE
W4_MOE = {  # hidden, expert intermediate, experts, top-k, format, group size
    "gpt_oss_120b": (2880, 2880, 128, 4, "mxfp4", 32),
    "deepseek_v3": (7168, 2048, 256, 8, "nvfp4", 16),
}
W4_MOE_VARIANT = {"mxfp4": "_e8m0_none", "nvfp4": "_e4m3_none"}


def w4_grouped(model, proj, T, transposed=False):
    """w4_grouped_mm (transposed: w4_grouped_mm_t, grad_out [T, N] -> [T, K]) at a model's expert shapes, one
    group per expert; nvfp4 with its per-expert global scale."""
    hidden, inter, E, _, fmt, group = W4_MOE[model]
    N, K = (2 * inter, hidden) if proj == "gate_up" else (hidden, inter)
    G = math.ceil(K / group)
    codes = torch.empty(E, N, (K + 1) // 2, dtype=torch.uint8, device=META)
    scale = torch.empty(E, N, G, dtype=torch.uint8, device=META)
    gs = torch.empty(E, device=META) if fmt == "nvfp4" else None
    offsets = torch.empty(E + 1, dtype=torch.int32, device=META)
    ids = torch.empty(E, dtype=torch.int32, device=META)
    if transposed:
        out, recs = run("w4_grouped_mm_t", torch.empty(T, N, dtype=torch.bfloat16, device=META), codes, scale, fmt,
                        group, K, offsets, ids, None, gs)
        assert out.shape == (T, K)
    else:
        out, recs = run("w4_grouped_mm", torch.empty(T, K, dtype=torch.bfloat16, device=META), codes, scale, fmt,
                        group, offsets, ids, None, gs)
        assert out.shape == (T, N)
    for r in recs[-1:]:
        assert r["buffers"]["codes"]["nbytes"] == E * N * ((K + 1) // 2)  # > 2^32 for DeepSeek: 64-bit offsets
        # W4Params (M = T, N, K, G), then the groups' T, E, G
        assert u32s(r, 4) == (T, N, K, G) and u32s(r, 27)[24:] == (T, E, E)
    return recs, N, K, E, fmt


@pytest.mark.parametrize("model", list(W4_MOE))
@pytest.mark.parametrize("proj", ["gate_up", "down"])
def test_w4_grouped_decode_is_one_slot_per_group(model, proj):
    top_k = W4_MOE[model][3]
    (layout, r), N, K, E, fmt = w4_grouped(model, proj, top_k)  # one token: its top-k rows
    assert layout["kernel"] == "fp8_grouped_tiles"
    assert r["kernel"] == "w4_grouped_gemv_bfloat" + W4_MOE_VARIANT[fmt]
    assert r["binding"][5:7] == ["tiles", "expert_ids"]
    assert r["grid"] == (math.ceil(N / 4), E + 1, 1) and r["threads"] == (64, 1, 1)


@pytest.mark.parametrize("model", list(W4_MOE))
@pytest.mark.parametrize("proj", ["gate_up", "down"])
@pytest.mark.parametrize("transposed", [False, True], ids=["mm", "mm_t"])
def test_w4_grouped_prefill_tiles_only_the_rows_that_exist(model, proj, transposed):
    T = 4096 * W4_MOE[model][3]  # a 4096-token prefill: rows = tokens x top-k, sorted by expert
    recs, N, K, E, fmt = w4_grouped(model, proj, T, transposed)
    layout, gemm = recs
    assert layout["kernel"] == "fp8_grouped_tiles" and layout["buffers"]["tiles"]["shape"] == (2 * (E + 3),)
    base = "w4_grouped_mm_t_gemm_bfloat" if transposed else "w4_grouped_gemm_bfloat"
    assert gemm["kernel"] == base + W4_MOE_VARIANT[fmt] and gemm["binding"][5:7] == ["tiles", "expert_ids"]
    cols = K if transposed else N
    assert gemm["grid"] == (math.ceil(cols / 32), math.ceil(T / 32) + E + 1, 1) and gemm["threads"] == (128, 1, 1)

