"""w4_grouped_mm / w4_grouped_mm_t on the CPU against the float64 reference, each kernel set forced: the decode
case (a token's few experts, scheduled as (group, column range) items in one parallel loop), groups large enough
for the GEMM beside small ones, empty groups, expert -1, rows in no group, every format with zero points, biases
and per-expert global scales; bad group bounds and expert ids refused."""
import pytest
import torch

from reference import _grouped, assert_matmul_close, ref_w4_grouped_mm
from test_w4_cpu_kernels import FORMATS, random_w4, transposed_weight
from torch_lowbit.testing import cpu_isa, forced_cpu_isa, supported_cpu_isas

ops = torch.ops.lowbit
GROUP = {"nvfp4": 16, "mxfp4": 32, "int4": 128, "uint4": 64}


@pytest.fixture(params=supported_cpu_isas())
def isa(request):
    with forced_cpu_isa(request.param):
        assert cpu_isa() == request.param
        yield request.param


def random_experts(fmt, E, N, K, group, g, offset=True):
    """Stacked [E, ...] weights of random_w4, nvfp4 with a per-expert global scale [E]."""
    ws = [random_w4(fmt, N, K, group, g, offset=offset) for _ in range(E)]
    codes = torch.stack([w[0] for w in ws])
    scale = torch.stack([w[1] for w in ws])
    off = torch.stack([w[2] for w in ws]) if ws[0][2] is not None else None
    gs = torch.rand(E, generator=g) + 0.5 if fmt == "nvfp4" else None
    return codes, scale, off, gs


def check_grouped(x, fmt, group, w, offsets, ids):
    codes, scale, off, gs = w
    out = ops.w4_grouped_mm(x, codes, scale, fmt, group, offsets, ids, off, gs)
    ref, absref = ref_w4_grouped_mm(x, fmt, codes, scale, group, offsets, ids, off, gs)
    assert out.dtype == x.dtype and out.shape == ref.shape
    assert_matmul_close(out, ref, absref, acc_rtol=1e-5)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_one_token_many_experts(isa, fmt, dtype):
    # T = 1 routed to 8 of 40 experts: 8 groups of one row each (the token's copies), all in one parallel loop
    g = torch.Generator().manual_seed(len(fmt) + dtype.itemsize)
    E, N, K = 40, 200, 320 + 3
    w = random_experts(fmt, E, N, K, GROUP[fmt], g, offset=fmt in ("int4", "uint4"))
    x = torch.randn(1, K, generator=g).to(dtype).expand(8, K).contiguous()
    ids = torch.randperm(E, generator=g)[:8].to(torch.int32)
    out = check_grouped(x, fmt, GROUP[fmt], w, torch.arange(9, dtype=torch.int32), ids)
    assert not torch.equal(out[0], out[1])  # two experts, two results


@pytest.mark.parametrize("fmt", FORMATS)
def test_mixed_groups(isa, fmt):
    # empty groups, expert -1, groups of 1..7 rows (decode items) beside a GEMM-sized one, rows past offsets[G]
    g = torch.Generator().manual_seed(3 + len(fmt))
    E, N, K, T = 6, 67, 200, 31
    w = random_experts(fmt, E, N, K, GROUP[fmt], g)
    sizes = [3, 0, 1, 9, 2, 0, 5, 7]
    ids = torch.tensor([2, 0, 5, 1, -1, 3, 4, 2], dtype=torch.int32)
    offsets = torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist(), dtype=torch.int32)
    assert int(offsets[-1]) < T
    x = torch.randn(T, K, generator=g).to(torch.bfloat16)
    out = check_grouped(x, fmt, GROUP[fmt], w, offsets, ids)
    assert torch.equal(out[offsets[-1]:], torch.zeros_like(out[offsets[-1]:]))  # rows in no group
    assert torch.equal(out[13:15], torch.zeros_like(out[13:15]))  # expert -1's rows
    # without expert_ids group g uses expert g
    check_grouped(x, fmt, GROUP[fmt], w, offsets[:E + 1], None)


@pytest.mark.parametrize("fmt", ["nvfp4", "int4"])
def test_grouped_mm_t(isa, fmt):
    g = torch.Generator().manual_seed(9)
    E, N, K, T = 4, 48, 100, 12
    codes, scale, off, gs = w = random_experts(fmt, E, N, K, GROUP[fmt], g)
    offsets = torch.tensor([0, 1, 1, 10, 11], dtype=torch.int32)
    ids = torch.tensor([3, 0, 1, -1], dtype=torch.int32)
    go = torch.randn(T, N, generator=g).to(torch.bfloat16)
    out = ops.w4_grouped_mm_t(go, codes, scale, fmt, GROUP[fmt], K, offsets, ids, off, gs)

    def product(rows, e):
        # each group through w4_mm_t: a group of W4_GEMM_MIN_ROWS rows or more in its GEMM regime
        wt = transposed_weight(fmt, codes[e], scale[e], GROUP[fmt], K, None if off is None else off[e],
                               None if gs is None else gs[e:e + 1], rows.shape[0], rows.dtype)
        return rows.double() @ wt, rows.double().abs() @ wt.abs()
    ref, absref = _grouped(go, offsets, ids, K, product)
    assert_matmul_close(out, ref, absref, acc_rtol=1e-5)


def test_bad_groups_refused():
    g = torch.Generator().manual_seed(1)
    codes, scale, off, gs = random_experts("int4", 3, 8, 64, 32, g)
    x = torch.randn(5, 64)

    def call(offsets, ids):
        return ops.w4_grouped_mm(x, codes, scale, "int4", 32, torch.tensor(offsets, dtype=torch.int32),
                                 None if ids is None else torch.tensor(ids, dtype=torch.int32), off, None)
    for offsets, ids, match in [
        ([1, 3], [0], r"offsets\[0\] must be 0, got 1"),
        ([0, 3, 2], [0, 1], r"offsets must be non-decreasing, but offsets\[2\] = 2 < offsets\[1\] = 3"),
        ([0, 6], [0], r"offsets\[G\] = 6 exceeds the number of rows of x \(T = 5\)"),
        ([0, 2], [3], r"expert_ids\[0\] = 3 is out of range \[-1, E = 3\)"),
        ([0, 1], [-2], r"expert_ids\[0\] = -2 is out of range"),
        ([0, 1, 2], [0], r"expert_ids must be \[G\] = \[2\]"),
        ([0, 1, 2, 3, 4], None, r"G \(4\) must not exceed the number of experts E \(3\)"),
    ]:
        with pytest.raises(RuntimeError, match=match):
            call(offsets, ids)
    with pytest.raises(RuntimeError, match="offsets must be int32"):
        ops.w4_grouped_mm(x, codes, scale, "int4", 32, torch.tensor([0, 1]), None, off, None)


@pytest.mark.parametrize("fmt", ["nvfp4", "int4"])
def test_no_experts_every_group_minus_one(fmt):
    # E = 0 with every group's expert -1: zeros, no weight read (the GEMM-rows decision once read expert 0's global
    # scale from an empty tensor and crashed the process)
    group = 16 if fmt == "nvfp4" else 32
    x = torch.randn(3, 32).bfloat16()
    codes = torch.zeros(0, 8, 16, dtype=torch.uint8)
    scale = torch.zeros(0, 8, 32 // group, dtype=torch.uint8 if fmt == "nvfp4" else torch.float16)
    gs = torch.zeros(0) if fmt == "nvfp4" else None
    out = ops.w4_grouped_mm(x, codes, scale, fmt, group, torch.tensor([0, 3], dtype=torch.int32),
                            torch.tensor([-1], dtype=torch.int32), None, gs)
    assert out.shape == (3, 8) and (out == 0).all()
