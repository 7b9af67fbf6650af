"""The Metal fp8 kernels on their shape classes: every kernel fp8_mm / fp8_grouped_mm picks (M = 1 GEMV,
small-M multi-row GEMV, tiled GEMM; grouped decode and prefill), K and N tails, aligned (vector) and unaligned
loads, every scale granularity with partial blocks, dtypes, bias, 3-D x, NaN codes; against float64 references.
The general op contract is in test_fp8_mm.py / test_fp8_grouped_mm.py; these cases aim at the kernels' edges."""
import contextlib
import math
import zlib

import pytest
import torch

import torch_lowbit
from conftest import backends_for
from reference import (assert_matmul_close, expand_scale, fp8_bits_to_f64, groups_as_on_mps, random_fp8_bits,
                       ref_fp8_grouped_mm, ref_fp8_grouped_mm_t, ref_fp8_mm)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SUFFIX = {torch.float32: "float", torch.float16: "half", torch.bfloat16: "bfloat"}


def _gen(*key):
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _scale(kind, N, K, g, E=None):
    """(scale, block_size) for a granularity; block shapes chosen to leave partial edge blocks."""
    lead = () if E is None else (E,)
    if kind == "tensor":
        return torch.rand(lead or (1,), generator=g) + 0.5, None
    if kind == "channel":
        return torch.rand(lead + (N,), generator=g) + 0.5, None
    if kind == "channel2d":
        return torch.rand(lead + (N, 1), generator=g) + 0.5, None
    bn, bk = {"block_odd": (3, 5), "block16": (8, 16), "block32": (16, 32), "block48": (5, 48)}[kind]
    return torch.rand(lead + (math.ceil(N / bn), math.ceil(K / bk)), generator=g) + 0.5, [bn, bk]


def _x(shape, dtype, g):
    return (torch.randn(shape, generator=g) * 2).to(dtype)


def _run_mm(backend, x, bits, scale, bias=None, block=None, as_fp8=False):
    w = bits.view(torch.float8_e4m3fn) if as_fp8 else bits
    out = backend.op("fp8_mm")(backend.to(x), backend.to(w), backend.to(scale), backend.to(bias), block)
    assert out.shape == x.shape[:-1] + (bits.shape[0],) and out.dtype == x.dtype and out.device == backend.device
    ref, absref = ref_fp8_mm(x, bits, scale, bias, block)
    assert_matmul_close(out.cpu(), ref, absref)
    return out.cpu()


# ---------------------------------------------------------------------------------------------- kernel choice
@pytest.mark.parametrize("dtype", DTYPES)
def test_plan_picks_kernel_per_m(dtype):
    pick = torch_lowbit._C._metal_fp8_mm_kernel
    s = SUFFIX[dtype]
    assert pick(1, dtype) == f"fp8_gemv_{s}"
    for M in (2, 5, 8):
        assert pick(M, dtype) == f"fp8_gemv_rows_{s}"
    for M in (9, 17, 64, 4096):
        assert pick(M, dtype) == f"fp8_gemm_{s}"


def test_plan_picks_grouped_kernel_by_rows_per_group():
    pick = torch_lowbit._C._metal_fp8_grouped_mm_kernel
    assert pick(8, 1, torch.bfloat16) == "fp8_grouped_gemv_bfloat"    # one token, top-8 of one expert's rows
    assert pick(64, 8, torch.float16) == "fp8_grouped_gemv_half"      # 8 rows per group on average
    assert pick(65, 8, torch.float16) == "fp8_grouped_gemm_half"
    assert pick(9, 1, torch.float32) == "fp8_grouped_gemm_float"
    assert pick(4096, 64, torch.bfloat16) == "fp8_grouped_gemm_bfloat"


# ---------------------------------------------------------------------------------------------- fp8_mm
# M around the thresholds: 1 (GEMV), 2 / 5 / 8 (multi-row GEMV), 9 / 17 / 64 / 70 (GEMM, edge tiles)
@pytest.mark.parametrize("backend", backends_for("fp8_mm"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 2, 5, 8, 9, 17, 64, 70])
@pytest.mark.parametrize("K", [96, 100])  # vector loads / byte loads
def test_mm_m_classes(backend, dtype, M, K):
    g = _gen("m", M, K)
    N = 33
    _run_mm(backend, _x((M, K), dtype, g), random_fp8_bits((N, K), g), torch.rand(N, generator=g) + 0.5)


# K = 528 / 1100: two / three 512-column GEMV steps, the last one partial (in the multi-row GEMV, lanes past K
# skip the work but not the barriers of the staged activations)
@pytest.mark.parametrize("backend", backends_for("fp8_mm"))
@pytest.mark.parametrize("M", [1, 3, 8, 17])
@pytest.mark.parametrize("K", [1, 15, 16, 17, 100, 255, 257, 528, 1100])
def test_mm_k_tails(backend, M, K):
    g = _gen("k", M, K)
    N = 7
    _run_mm(backend, _x((M, K), torch.bfloat16, g), random_fp8_bits((N, K), g), torch.rand(1, generator=g) + 0.5)


# N tails of every kernel's columns per threadgroup (4 for M = 1, 16 for the multi-row GEMV, 32 for the GEMM)
@pytest.mark.parametrize("backend", backends_for("fp8_mm"))
@pytest.mark.parametrize("M", [1, 3, 8, 17])
@pytest.mark.parametrize("N", [1, 7, 33, 65])
def test_mm_n_tails(backend, M, N):
    g = _gen("n", M, N)
    K = 64
    _run_mm(backend, _x((M, K), torch.float16, g), random_fp8_bits((N, K), g), torch.rand(N, generator=g) + 0.5)


# block16 / block32 scale whole GEMV chunks / GEMM segments; block_odd and block48 split them (per-element
# scaling in the GEMV, clamped segments in the GEMM); all leave partial edge blocks in N and K.
@pytest.mark.parametrize("backend", backends_for("fp8_mm"))
@pytest.mark.parametrize("kind", ["tensor", "channel", "channel2d", "block_odd", "block16", "block32", "block48"])
@pytest.mark.parametrize("M", [1, 4, 33])
@pytest.mark.parametrize("K", [100, 160])
def test_mm_scale_granularities(backend, kind, M, K):
    g = _gen("s", kind, M, K)
    N = 19
    scale, block = _scale(kind, N, K, g)
    _run_mm(backend, _x((M, K), torch.float32, g), random_fp8_bits((N, K), g), scale, None, block)


# Power-of-two K blocks (a shift in the kernels; 128 in every checkpoint format, 1 the smallest) and others,
# whole or split GEMV chunks, N blocks of every kind; partial edge blocks in N and K; K spans two GEMV steps.
@pytest.mark.parametrize("backend", backends_for("fp8_mm"))
@pytest.mark.parametrize("bn,bk", [(128, 128), (1, 64), (3, 256), (2, 1), (5, 96), (128, 48), (7, 100)])
@pytest.mark.parametrize("M", [1, 6, 33])
def test_mm_block_sizes(backend, bn, bk, M):
    g = _gen("bs", bn, bk, M)
    N, K = 37, 600
    scale = torch.rand(math.ceil(N / bn), math.ceil(K / bk), generator=g) + 0.5
    _run_mm(backend, _x((M, K), torch.float32, g), random_fp8_bits((N, K), g), scale, None, [bn, bk])


# The kernels read the bias in its own dtype: with fp32 activations (and output) a bias read as the wrong type
# or rounded to another one would show.
@pytest.mark.parametrize("backend", backends_for("fp8_mm"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias_dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 4, 17])
def test_mm_bias(backend, dtype, bias_dtype, M):
    g = _gen("b", M, str(bias_dtype))
    N, K = 33, 48
    bias = (torch.randn(N, generator=g) * 8).to(bias_dtype)
    _run_mm(backend, _x((M, K), dtype, g), random_fp8_bits((N, K), g), torch.rand(N, generator=g) + 0.5, bias)


@pytest.mark.parametrize("backend", backends_for("fp8_mm"))
@pytest.mark.parametrize("lead", [(1, 1), (2, 3), (3, 6)])  # M = 1 / 6 / 18 through a 3-D x
def test_mm_3d_x(backend, lead):
    g = _gen("3d", lead)
    N, K = 9, 40
    _run_mm(backend, _x(lead + (K,), torch.bfloat16, g), random_fp8_bits((N, K), g), torch.rand(N, generator=g) + 0.5)


@pytest.mark.parametrize("backend", backends_for("fp8_mm"))
@pytest.mark.parametrize("M", [1, 4, 20])
@pytest.mark.parametrize("K", [64, 70])
def test_mm_nan_codes_propagate(backend, M, K):
    g = _gen("nan", M, K)
    N = 12
    bits = random_fp8_bits((N, K), g)
    bits[3, 5] = 0x7F
    bits[8, K - 1] = 0xFF
    out = _run_mm(backend, _x((M, K), torch.bfloat16, g), bits, torch.rand(N, generator=g) + 0.5)
    assert torch.isnan(out[:, 3]).all() and torch.isnan(out[:, 8]).all()
    assert not torch.isnan(out[:, [0, 1, 2, 4, 5, 6, 7, 9, 10, 11]]).any()


@pytest.mark.parametrize("backend", backends_for("fp8_mm"))
@pytest.mark.parametrize("M", [1, 3, 12])
def test_mm_unaligned_x_start(backend, M):
    """K % 16 == 0 but x starts 2 bytes into its storage: the plan must fall back to byte-aligned loads."""
    g = _gen("off", M)
    N, K = 10, 64
    base = _x((M * K + 1,), torch.bfloat16, g)
    x = base[1:].view(M, K)
    assert x.storage_offset() == 1
    _run_mm(backend, x, random_fp8_bits((N, K), g), torch.rand(N, generator=g) + 0.5)


@pytest.mark.parametrize("backend", backends_for("fp8_mm", emu_rev=False))
@pytest.mark.parametrize("M", [1, 4, 40])
def test_mm_fp8_and_uint8_weights_agree(backend, M):
    g = _gen("u8", M)
    N, K = 11, 32
    bits = random_fp8_bits((N, K), g)
    x = _x((M, K), torch.bfloat16, g)
    s = torch.rand(N, generator=g) + 0.5
    a = _run_mm(backend, x, bits, s)
    b = _run_mm(backend, x, bits, s, as_fp8=True)
    assert torch.equal(a, b)


@pytest.mark.parametrize("backend", backends_for("fp8_mm", emu_rev=False))
@pytest.mark.parametrize("M,N,K", [(0, 5, 8), (3, 0, 8), (1, 5, 0), (20, 5, 0)])
def test_mm_empty_sizes(backend, M, N, K):
    x = torch.ones(M, K, dtype=torch.bfloat16)
    bias = torch.arange(N, dtype=torch.float32)
    out = backend.op("fp8_mm")(backend.to(x), backend.to(torch.zeros(N, K, dtype=torch.uint8)),
                               backend.to(torch.ones(1)), backend.to(bias), None).cpu()
    assert out.shape == (M, N)
    assert torch.equal(out, bias.to(torch.bfloat16).expand(M, N))  # K == 0: an empty sum plus bias


# ---------------------------------------------------------------------------------------------- fp8_dequantize
# K % 4 == 0 takes the 4-wide path (uchar4 load, 4-element store); block scales with bk % 4 != 0 change inside
# a group of 4; a weight starting 1 byte into its storage must fall back to the element-wise path.
@pytest.mark.parametrize("backend", backends_for("fp8_dequantize"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["tensor", "channel", "block_odd", "block16"])
@pytest.mark.parametrize("K,offset", [(64, 0), (36, 0), (64, 1)])
def test_dequantize_vector_path(backend, dtype, kind, K, offset):
    g = _gen("dq", kind, K, offset)
    N = 7
    bits = random_fp8_bits((N * K + offset,), g, allow_nan=True)[offset:].view(N, K)
    scale, block = _scale(kind, N, K, g)
    out = backend.op("fp8_dequantize")(backend.to(bits), backend.to(scale), block, dtype).cpu()
    ref = (fp8_bits_to_f64(bits) * expand_scale(scale, N, K, block)).to(dtype)
    torch.testing.assert_close(out, ref, rtol=2 * torch.finfo(dtype).eps, atol=0, equal_nan=True)


# ---------------------------------------------------------------------------------------------- fp8_grouped_mm
def _run_grouped(backend, x, bits, scale, offsets, ids=None, block=None):
    off = torch.tensor(offsets, dtype=torch.int32)
    eid = None if ids is None else torch.tensor(ids, dtype=torch.int32)
    out = backend.op("fp8_grouped_mm")(backend.to(x), backend.to(bits), backend.to(scale), backend.to(off),
                                       backend.to(eid), block)
    assert out.shape == (x.shape[0], bits.shape[1]) and out.dtype == x.dtype
    ref, absref = ref_fp8_grouped_mm(x, bits, scale, off, eid, block)
    assert_matmul_close(out.cpu(), ref, absref)
    return out.cpu()


# decode (T / G <= 8): one-row groups, an empty group, id -1, a group of 10 rows (two GEMV passes), rows in no
# group; prefill (T / G > 8): several 32-row tiles per group, a tiny group, id -1, rows in no group.
GROUPED_CASES = {
    "decode": dict(T=16, offsets=[0, 1, 1, 2, 4, 14], ids=[2, 0, -1, 3, 1]),
    "decode_default_ids": dict(T=5, offsets=[0, 2, 2, 3], ids=None),
    "prefill": dict(T=70, offsets=[0, 40, 41, 41, 60, 66], ids=[1, 3, 0, -1, 1]),
    # groups of exactly one 32-row tile, one row and none, between empty ones; 3 rows in no group at the end
    "prefill_whole_tiles": dict(T=100, offsets=[0, 0, 32, 32, 33, 65, 97], ids=[3, 0, 2, 1, 3, 2]),
}


@pytest.mark.parametrize("backend", backends_for("fp8_grouped_mm"))
@pytest.mark.parametrize("case", list(GROUPED_CASES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [64, 100])
def test_grouped_paths(backend, case, dtype, K):
    c = GROUPED_CASES[case]
    g = _gen("g", case, K)
    E, N = 4, 33
    bits = random_fp8_bits((E, N, K), g)
    out = _run_grouped(backend, _x((c["T"], K), dtype, g), bits, torch.rand(E, generator=g) + 0.5, c["offsets"],
                       c["ids"])
    T = c["T"]
    G = len(c["offsets"]) - 1
    expect = ("fp8_grouped_gemv_" if T <= 8 * G else "fp8_grouped_gemm_") + SUFFIX[dtype]
    assert torch_lowbit._C._metal_fp8_grouped_mm_kernel(T, G, dtype) == expect
    assert (out[c["offsets"][-1]:] == 0).all()  # rows in no group


@pytest.mark.parametrize("backend", backends_for("fp8_grouped_mm"))
@pytest.mark.parametrize("case", ["decode", "prefill"])
@pytest.mark.parametrize("kind", ["tensor", "channel", "block_odd", "block16", "block32"])
def test_grouped_scale_granularities(backend, case, kind):
    c = GROUPED_CASES[case]
    g = _gen("gs", case, kind)
    E, N, K = 4, 21, 80
    scale, block = _scale(kind, N, K, g, E=E)
    _run_grouped(backend, _x((c["T"], K), torch.float32, g), random_fp8_bits((E, N, K), g), scale, c["offsets"],
                 c["ids"], block)


@pytest.mark.parametrize("backend", backends_for("fp8_grouped_mm"))
@pytest.mark.parametrize("case", ["decode", "prefill"])
def test_grouped_nan_codes_stay_in_their_expert(backend, case):
    c = GROUPED_CASES[case]
    g = _gen("gnan", case)
    E, N, K = 4, 8, 48
    bits = random_fp8_bits((E, N, K), g)
    bits[1, 2, 7] = 0x7F
    _run_grouped(backend, _x((c["T"], K), torch.bfloat16, g), bits, torch.rand(E, generator=g) + 0.5, c["offsets"],
                 c["ids"])


@pytest.mark.parametrize("backend", backends_for("fp8_grouped_mm", emu_rev=False))
@pytest.mark.parametrize("offsets,ids", [([0], []), ([0, 0, 0], [0, 1]), ([0, 3], [-1])])
def test_grouped_nothing_to_compute(backend, offsets, ids):
    g = _gen("none", len(offsets))
    E, N, K, T = 2, 6, 32, 3
    out = _run_grouped(backend, _x((T, K), torch.bfloat16, g), random_fp8_bits((E, N, K), g), torch.ones(E), offsets,
                       ids)
    assert (out == 0).all()


@pytest.mark.parametrize("backend", backends_for("fp8_grouped_mm", emu_rev=False))
@pytest.mark.parametrize("offsets,ids,match", [
    ([1, 3], [0], r"offsets\[0\] must be 0"),
    ([0, 3, 2], [0, 1], "non-decreasing"),
    ([0, 2, 9], [0, 1], r"exceeds the number of rows of x \(T = 4\)"),
    ([0, 2, 4], [0, 2], r"expert_ids\[1\] = 2 is out of range"),
    ([0, 2, 4], [-2, 0], r"expert_ids\[0\] = -2 is out of range"),
])
def test_grouped_malformed_offsets_rejected(backend, offsets, ids, match):
    E, N, K, T = 2, 4, 16, 4
    with pytest.raises(RuntimeError, match=match):
        backend.op("fp8_grouped_mm")(backend.to(torch.ones(T, K)), backend.to(torch.zeros(E, N, K, dtype=torch.uint8)),
                                     backend.to(torch.ones(E)), backend.to(torch.tensor(offsets, dtype=torch.int32)),
                                     backend.to(torch.tensor(ids, dtype=torch.int32)), None)


# On mps the plan cannot read offsets / expert_ids without a device sync: every kernel, decode and prefill, reads
# its rows from the table fp8_grouped_tiles builds, offsets clamped to [0, T] and made non-decreasing (a running
# max), and takes ids outside [0, E) as -1. torch.ops.lowbit_emu_mps runs the plans that way in the emulator
# (guard pages after every buffer).
MALFORMED_GROUPS = [  # (offsets, ids) for T = 5 rows at most; past T clamps to T
    ([-3, 2, 2, 9], [0, 7, 1]),             # below 0, past T; a bad id on an empty and on a live group
    ([0, 2, 4], [1, -5]),
    ([0, 4, 2, 3, 5], [0, 1, 1, 0]),        # decreasing: groups 1 and 2 are empty, not overlapping group 0
    ([0, 3, 1, 2 ** 31 - 1, 0], [1, 0, 1, 0]),
    ([2, 1, 4], [0, 1]),                    # offsets[0] > 0: the rows before it are in no group
]


@pytest.mark.skipif(not torch_lowbit.emulator.available(), reason="the Metal emulator is not built in this install")
@pytest.mark.parametrize("offsets,ids", MALFORMED_GROUPS)
@pytest.mark.parametrize("op", ["fp8_grouped_mm", "fp8_grouped_mm_t"])
@pytest.mark.parametrize("T", [5, 40])  # decode and prefill kernels (the rows past 5 are in no group)
def test_grouped_kernels_clamp_malformed_values_like_on_mps(T, op, offsets, ids):
    run = getattr(torch.ops.lowbit_emu_mps, op)
    g = _gen("clamp", T, op)
    E, N, K = 2, 9, 48
    transposed = op.endswith("_t")
    x = _x((T, N if transposed else K), torch.bfloat16, g)
    bits = random_fp8_bits((E, N, K), g)
    s = torch.rand(E, generator=g) + 0.5
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    want = torch_lowbit._C._metal_fp8_grouped_mm_kernel(T, len(ids), torch.bfloat16)
    assert ("gemv" in want) == (T == 5)  # (fp8_grouped_mm_t switches at the same mean rows per group)
    ok_offsets, ok_ids = groups_as_on_mps(i32(offsets), i32(ids), T, E)
    ref, absref = (ref_fp8_grouped_mm_t if transposed else ref_fp8_grouped_mm)(x, bits, s, ok_offsets, ok_ids)
    for order in (contextlib.nullcontext(), torch_lowbit.emulator.reversed_thread_order()):
        with order:
            assert_matmul_close(run(x, bits, s, i32(offsets), i32(ids), None), ref, absref)
