"""One granularity type and one inference rule: PerTensor / PerChannel / PerBlock with their string aliases, and
infer_granularity agreeing with the ops' C++ check (check_fp8_weight) on every shape, accepted or refused."""
import math

import pytest
import torch

from torch_lowbit.granularity import (PerBlock, PerChannel, PerTensor, as_granularity, granularity_with_block_hint,
                                      infer_granularity)

ONE = 0x38  # e4m3 code of 1.0: the dequantized weight is the expanded scale itself


def _expand(g, scale, N, K):
    """float64 [N, K] multiplier of each weight element under granularity g (independent of the ops)."""
    s = scale.double()
    if isinstance(g, PerTensor):
        return s.reshape(1, 1).expand(N, K)
    if isinstance(g, PerChannel):
        return s.reshape(N, 1).expand(N, K)
    bn, bk = g.block_size
    return s[torch.arange(N) // bn][:, torch.arange(K) // bk]


def _cpp_dequantize(scale, N, K, block):
    """The C++ op's reading of the scale, or None when it refuses it."""
    w = torch.full((N, K), ONE, dtype=torch.uint8)
    try:
        return torch.ops.lowbit.fp8_dequantize(w, scale, block, torch.float32).double()
    except RuntimeError:
        return None


def _cpp_grouped(scale, E, N, K, block):
    """[E, N, K] of what fp8_grouped_mm multiplies each weight element by (x = identity rows per expert)."""
    w = torch.full((E, N, K), ONE, dtype=torch.uint8)
    x = torch.eye(K).repeat(E, 1)
    offsets = (torch.arange(E + 1) * K).to(torch.int32)
    try:
        out = torch.ops.lowbit.fp8_grouped_mm(x, w, scale, offsets, None, block)
    except RuntimeError:
        return None
    return out.double().reshape(E, K, N).transpose(1, 2)


def _candidate_shapes(N, K, block, lead=()):
    dims = {1, 2, N, K, N + 1}
    if block:
        dims |= {math.ceil(N / block[0]), math.ceil(K / block[1])}
    shapes = {lead, lead + (1,)}
    shapes |= {lead + (a,) for a in dims} | {lead + (a, b) for a in dims for b in dims}
    shapes |= {lead + (N, 1, 1), (1,), ()}
    return sorted(shapes, key=lambda s: (len(s), s))


BLOCKS = [None, (1, 1), (4, 8), (16, 16), (5, 3), (32, 2)]


@pytest.mark.parametrize("N,K", [(1, 1), (1, 5), (3, 1), (4, 8), (17, 9), (16, 32)])
@pytest.mark.parametrize("block", BLOCKS)
def test_inference_agrees_with_the_cpp_check(N, K, block):
    g = torch.Generator().manual_seed(N * 100 + K)
    checked = 0
    for shape in _candidate_shapes(N, K, block):
        scale = torch.rand(shape, generator=g) + 0.5
        got = _cpp_dequantize(scale, N, K, block)
        try:
            gran = infer_granularity(shape, N, K, block)
        except ValueError:
            assert got is None, f"C++ accepts scale {list(shape)} (N={N}, K={K}, block={block}), Python refuses"
            continue
        assert got is not None, f"Python reads scale {list(shape)} as {gran!r}, C++ refuses it"
        assert torch.equal(got, _expand(gran, scale, N, K)), f"scale {list(shape)} read differently: {gran!r}"
        checked += 1
    assert checked >= 1


@pytest.mark.parametrize("E,N,K", [(1, 1, 1), (1, 4, 8), (2, 1, 3), (3, 5, 7), (2, 16, 16)])
@pytest.mark.parametrize("block", [None, (1, 1), (4, 8), (16, 16)])
def test_grouped_inference_agrees_with_the_cpp_check(E, N, K, block):
    g = torch.Generator().manual_seed(E * 1000 + N * 10 + K)
    for shape in _candidate_shapes(N, K, block, lead=(E,)) + _candidate_shapes(N, K, block)[:6]:
        scale = torch.rand(shape, generator=g) + 0.5
        got = _cpp_grouped(scale, E, N, K, block)
        try:
            gran = infer_granularity(shape, N, K, block, experts=E)
        except ValueError:
            assert got is None, f"C++ accepts grouped scale {list(shape)} (E={E}, N={N}, K={K}, block={block})"
            continue
        assert got is not None, f"Python reads grouped scale {list(shape)} as {gran!r}, C++ refuses it"
        canon = scale.reshape(gran.scale_shape(N, K, experts=E))
        want = torch.stack([_expand(gran, canon[e], N, K) for e in range(E)])
        assert torch.equal(got, want), f"grouped scale {list(shape)} read differently: {gran!r}"


def test_block_hint_takes_the_block_only_when_the_shape_is_its_own():
    assert granularity_with_block_hint((3, 2), 40, 50, (16, 32)) == PerBlock(16, 32)
    assert granularity_with_block_hint((40, 1), 40, 50, (16, 32)) == PerChannel()
    assert granularity_with_block_hint((1,), 40, 50, (16, 32)) == PerTensor()
    assert granularity_with_block_hint((2, 3, 2), 40, 50, (16, 32), experts=2) == PerBlock(16, 32)
    with pytest.raises(ValueError, match=r"fits no layout .* \(per channel\) or \[3, 2\] \(blocks of 16x32\)$"):
        granularity_with_block_hint((3, 3), 40, 50, (16, 32))


def test_aliases_and_equality():
    assert as_granularity("tensor") == PerTensor() == "tensor"
    assert as_granularity("channel") == PerChannel() == "channel"
    assert as_granularity("block") == PerBlock(128, 128) and as_granularity("block", (16, 32)) == PerBlock(16, 32)
    assert PerBlock(16, 32) == "block" and PerBlock(16, 32) != PerBlock(32, 16) and PerTensor() != PerChannel()
    assert as_granularity("tensor", (3, 3)) == PerTensor()  # block_size is for the "block" alias only
    assert len({PerTensor(), "tensor", PerChannel()}) == 2
    assert PerBlock(16, 32).scale_shape(33, 64) == (3, 2) and PerBlock(16, 32).scale_shape(33, 64, experts=4) == (4, 3, 2)
    assert PerTensor().scale_shape(5, 6, experts=3) == (3,) and PerChannel().scale_shape(5, 6) == (5,)


@pytest.mark.parametrize("args,match", [
    (("row",), "granularity must be one of 'tensor', 'channel', 'block'"),
    ((3,), "granularity must be one of"),
    (("block", (0, 4)), "block_size must be two positive"),
    (("block", (4.5, 4)), "block_size must be two positive"),
    ((PerBlock(16, 16), (32, 32)), r"is PerBlock\(block_n=16, block_k=16\) but block_size is \(32, 32\)"),
])
def test_bad_granularity(args, match):
    with pytest.raises(ValueError, match=match):
        as_granularity(*args)


def test_per_block_validates_its_sizes():
    with pytest.raises(ValueError, match="must be two positive ints"):
        PerBlock(0, 16)
    with pytest.raises(ValueError, match="must be two positive ints"):
        PerBlock(True, 16)


@pytest.mark.parametrize("gran", [PerTensor(), PerChannel(), PerBlock(8, 16), "block"])
def test_every_user_takes_the_classes(gran):
    import torch_lowbit
    from torch_lowbit.nn import Fp8Experts, Fp8Linear
    w = torch.randn(20, 40)
    q, s = torch_lowbit.quantize_fp8(w, gran)
    want = as_granularity(gran)
    assert tuple(s.shape) == want.scale_shape(20, 40)
    layer = Fp8Linear.from_float(torch.nn.Linear(40, 20), gran)
    assert layer.granularity == want and layer.block_size == want.block_size
    experts = Fp8Experts.from_float(torch.randn(3, 16, 40), torch.randn(3, 40, 8), gran)
    assert experts.gate_up_granularity == want and tuple(experts.down_scale.shape) == want.scale_shape(40, 8, experts=3)
    assert torch_lowbit.Fp8WeightOnly(gran).granularity == want
