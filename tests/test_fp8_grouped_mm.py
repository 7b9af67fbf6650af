"""fp8_grouped_mm: ragged groups (empty, expert -1, rows in no group, G < E, default ids), every granularity,
dtypes, the decode case of many one-row groups, empty sizes, bad input."""
import math

import pytest
import torch

from conftest import backends_for
from reference import assert_matmul_close, random_fp8_bits, ref_fp8_grouped_mm

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ACC_RTOL = 1e-5


def make_scale(layout, E, N, K, g):
    if layout == "tensor":
        return torch.rand(E, generator=g) + 0.5, None
    if layout == "channel":
        return torch.rand(E, N, generator=g) + 0.5, None
    bn, bk = (int(v) for v in layout[len("block_"):].split("x"))
    return torch.rand(E, math.ceil(N / bn), math.ceil(K / bk), generator=g) + 0.5, [bn, bk]


def check(backend, x, bits, scale, offsets, ids=None, block=None, as_fp8=False):
    w = bits.view(torch.float8_e4m3fn) if as_fp8 else bits
    out = backend.op("fp8_grouped_mm")(backend.to(x), backend.to(w), backend.to(scale), backend.to(offsets),
                                       backend.to(ids), block)
    assert out.shape == (x.shape[0], bits.shape[1]) and out.dtype == x.dtype and out.device == backend.device
    ref, absref = ref_fp8_grouped_mm(x, bits, scale, offsets, ids, block)
    assert_matmul_close(out, ref, absref, acc_rtol=ACC_RTOL)
    return out.cpu()


@pytest.mark.parametrize("backend", backends_for("fp8_grouped_mm"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["tensor", "channel", "block_16x32", "block_5x24"])
def test_ragged_groups(backend, dtype, layout):
    # T = 30 rows: groups of 3, 0 (empty), 12 (GEMM-sized), 1, 9 (expert -1), then rows 25.. in no group
    E, N, K = 5, 37, 70
    g = torch.Generator().manual_seed(len(layout))
    x = torch.randn(30, K, generator=g).to(dtype)
    bits = random_fp8_bits((E, N, K), g)
    scale, block = make_scale(layout, E, N, K, g)
    offsets = torch.tensor([0, 3, 3, 15, 16, 25], dtype=torch.int32)
    ids = torch.tensor([2, 0, 4, 2, -1], dtype=torch.int32)
    out = check(backend, x, bits, scale, offsets, ids, block)
    assert (out[16:] == 0).all()  # expert -1 and rows in no group


@pytest.mark.parametrize("backend", backends_for("fp8_grouped_mm"))
def test_default_expert_ids_and_fewer_groups_than_experts(backend):
    E, N, K = 6, 20, 33
    g = torch.Generator().manual_seed(1)
    x = torch.randn(11, K, generator=g)
    bits = random_fp8_bits((E, N, K), g)
    check(backend, x, bits, torch.rand(E, N, generator=g) + 0.5, torch.tensor([0, 4, 4, 11], dtype=torch.int32))


@pytest.mark.parametrize("backend", backends_for("fp8_grouped_mm"))
@pytest.mark.parametrize("G", [1, 8])
def test_decode_one_row_per_group(backend, G):
    E, N, K = 8, 96, 64
    g = torch.Generator().manual_seed(G)
    x = torch.randn(G, K, generator=g).to(torch.bfloat16)
    bits = random_fp8_bits((E, N, K), g)
    ids = torch.randperm(E, generator=g)[:G].to(torch.int32)
    check(backend, x, bits, torch.rand(E, N, generator=g) + 0.5, torch.arange(G + 1, dtype=torch.int32), ids)


@pytest.mark.parametrize("backend", backends_for("fp8_grouped_mm"))
def test_fp8_and_uint8_weights_identical(backend):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 40, generator=g)
    bits = random_fp8_bits((2, 9, 40), g)
    s = torch.rand(2, generator=g)
    off = torch.tensor([0, 2, 6], dtype=torch.int32)
    assert torch.equal(check(backend, x, bits, s, off), check(backend, x, bits, s, off, as_fp8=True))


@pytest.mark.parametrize("backend", backends_for("fp8_grouped_mm", emu_rev=False))
@pytest.mark.parametrize("T,E,N,K,offsets", [(0, 2, 4, 8, [0]), (0, 2, 4, 8, [0, 0, 0]), (3, 2, 0, 8, [0, 3]),
                                             (3, 2, 4, 0, [0, 1, 3]), (4, 2, 4, 8, [0])])
def test_empty(backend, T, E, N, K, offsets):
    out = backend.op("fp8_grouped_mm")(backend.to(torch.randn(T, K)), backend.to(torch.zeros(E, N, K, dtype=torch.uint8)),
                                       backend.to(torch.ones(E)), backend.to(torch.tensor(offsets, dtype=torch.int32)),
                                       None, None)
    assert out.shape == (T, N) and (out.cpu() == 0).all()


def _bad_cases():
    x = torch.randn(4, 8)
    w = torch.zeros(3, 5, 8, dtype=torch.uint8)
    s = torch.ones(3)
    off = torch.tensor([0, 2, 4], dtype=torch.int32)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return [
        (x.to(torch.int8), w, s, off, None, None, "x must be bfloat16, float16 or float32"),
        (x[None], w, s, off, None, None, r"x must be \[T, K\]"),
        (x, w[0], s, off, None, None, r"weight must be \[E, N, K\]"),
        (x, w.to(torch.int8), s, off, None, None, "weight must be float8_e4m3fn or uint8"),
        (x, torch.zeros(3, 8, 5, dtype=torch.uint8).transpose(1, 2), s, off, None, None, "weight must be contiguous"),
        (torch.randn(4, 7), w, s, off, None, None, "must equal weight's K"),
        (x, w, torch.ones(2), off, None, None, "scale must be"),
        (x, w, torch.ones(3, 5, 1, 1), off, None, None, "scale must be"),
        (x, w, torch.ones(3, 3, 2), off, None, None, "pass block_size"),
        (x, w, torch.ones(3, 3, 2), off, None, [2, 4, 1], "block_size must be"),
        (x, w, torch.ones(3, 2, 2), off, None, [2, 4], "scale must have shape"),
        (x, w, s, off.long(), None, None, "offsets must be int32"),
        (x, w, s, i32([[0, 2]]), None, None, r"offsets must be \[G \+ 1\]"),
        (x, w, s, i32([]), None, None, r"offsets must be \[G \+ 1\]"),
        (x, w, s, i32([1, 2, 4]), None, None, r"offsets\[0\] must be 0"),
        (x, w, s, i32([0, 3, 2]), None, None, "offsets must be non-decreasing"),
        (x, w, s, i32([0, 2, 5]), None, None, r"offsets\[G\] = 5 exceeds"),
        (x, w, s, i32([0, 1, 2, 3, 4]), None, None, "must not exceed the number of experts"),
        (x, w, s, off, i32([0, 3]), None, r"expert_ids\[1\] = 3 is out of range"),
        (x, w, s, off, i32([-2, 0]), None, r"expert_ids\[0\] = -2 is out of range"),
        (x, w, s, off, i32([0]), None, r"expert_ids must be \[G\]"),
        (x, w, s, off, torch.tensor([0, 1]), None, "expert_ids must be int32"),
    ]


@pytest.mark.parametrize("backend", backends_for("fp8_grouped_mm", emu_rev=False))
@pytest.mark.parametrize("x,w,scale,offsets,ids,block,match", _bad_cases())
def test_bad_input(backend, x, w, scale, offsets, ids, block, match):
    with pytest.raises((RuntimeError, ValueError), match=match):
        backend.op("fp8_grouped_mm")(backend.to(x), backend.to(w), backend.to(scale), backend.to(offsets),
                                     backend.to(ids), block)


@pytest.mark.parametrize("backend", backends_for("fp8_grouped_mm", emu_rev=False))
@pytest.mark.parametrize("which", ["weight", "scale", "offsets", "expert_ids"])
def test_devices_differ(backend, which):
    args = {"x": torch.randn(4, 8), "weight": torch.zeros(3, 5, 8, dtype=torch.uint8), "scale": torch.ones(3),
            "offsets": torch.tensor([0, 2, 4], dtype=torch.int32), "expert_ids": torch.tensor([0, 1], dtype=torch.int32)}
    args = {k: backend.to(v) for k, v in args.items()}
    args[which] = args[which].to("meta")
    with pytest.raises((RuntimeError, ValueError), match=f"{which} is on meta"):
        backend.op("fp8_grouped_mm")(args["x"], args["weight"], args["scale"], args["offsets"], args["expert_ids"],
                                     None)
