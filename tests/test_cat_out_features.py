"""QuantizedLinear.cat_out_features (what fusing attention's q / k / v projections makes of low-bit layers): the
joined layer's float64 weight is the layers' float64 weights stacked, its output is theirs side by side (the same
codes and scales per row: bit for bit), and what one layer cannot hold is refused naming what differs."""
import pytest
import torch
import torch.nn as nn

from reference import layer_weight_f64
from torch_lowbit.nn import Fp8Linear, Int8Linear, W4Linear

K = 72  # not a multiple of the 4-bit groups' 32: a partial last group
OUT = (32, 16, 48)


def _dense(seed=0, out=OUT, bias=True):
    torch.manual_seed(seed)
    return [nn.Linear(K, n, bias=bias) for n in out]


MAKERS = {
    "fp8-channel": lambda l: Fp8Linear.from_float(l),
    "fp8-tensor": lambda l: Fp8Linear.from_float(l, granularity="tensor"),
    "fp8-block": lambda l: Fp8Linear.from_float(l, granularity="block", block_size=(16, 32)),
    "int8": Int8Linear.from_float,
    "int4-asym": lambda l: W4Linear.from_float(l, "int4", 32, symmetric=False),
    "uint4-biases": lambda l: W4Linear.from_float(l, "uint4", 32),
    "mxfp4": lambda l: W4Linear.from_float(l, "mxfp4"),
}


@pytest.mark.parametrize("kind", MAKERS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_joined_layer_holds_the_stacked_weights_and_gives_the_outputs_side_by_side(kind, bias):
    parts = [MAKERS[kind](l) for l in _dense(bias=bias)]
    joined = type(parts[0]).cat_out_features(parts)
    assert type(joined) is type(parts[0]) and joined.out_features == sum(OUT) and joined.in_features == K
    assert torch.equal(layer_weight_f64(joined), torch.cat([layer_weight_f64(p) for p in parts]))
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(1))
    x[0, 3] = float("inf")  # the non-finite row stays in its own rows of the output
    with torch.no_grad():
        for xs in (x, x[1:].to(torch.bfloat16)):
            y, ys = joined(xs), torch.cat([p(xs) for p in parts], -1)
            assert torch.equal(y.isnan(), ys.isnan()) and torch.equal(y.nan_to_num(), ys.nan_to_num())
    if bias:
        assert torch.equal(joined.bias, torch.cat([p.bias for p in parts])) and not joined.bias.requires_grad


def test_equal_per_tensor_scales_stay_one_scale():
    parts = [Fp8Linear.from_float(l, granularity="tensor") for l in _dense()]
    for p in parts:
        p.weight_scale.fill_(0.01)
    joined = Fp8Linear.cat_out_features(parts)
    assert joined.weight_scale.numel() == 1 and float(joined.weight_scale) == pytest.approx(0.01)
    parts[1].weight_scale.fill_(0.02)
    assert tuple(Fp8Linear.cat_out_features(parts).weight_scale.shape) == (sum(OUT),)


def test_static_activation_scheme_joins_with_one_input_scale():
    parts = [Fp8Linear.from_float(l) for l in _dense()]
    for p in parts:
        p.input_scale = torch.tensor([0.5])
        p.set_activation_scheme("static", run=True)
    joined = Fp8Linear.cat_out_features(parts)
    assert joined.activation_scheme == "static" and joined.quantize_activations and float(joined.input_scale) == 0.5
    parts[2].input_scale = torch.tensor([0.25])
    with pytest.raises(ValueError, match=r"input_scale differ"):
        Fp8Linear.cat_out_features(parts)


@pytest.mark.parametrize("case, match", [
    ("classes", r"layers\[1\] is a Int8Linear, expected Fp8Linear"),
    ("in_features", r"in_features differ: \[72, 40, 72\]"),
    ("bias", r"some layers have a bias and some not"),
    ("block rows", r"layers\[1\] has 20 output features, not a multiple of its scale blocks' 16 rows"),
    ("block sizes", r"block_size differ"),
    ("formats", r"format differ: \['int4', 'uint4', 'int4'\]"),
    ("global scales", r"weight_scale_2 differ"),
    ("offsets", r"some layers have zero points and some not"),
    ("none", r"no layers"),
])
def test_what_one_layer_cannot_hold_is_refused_by_name(case, match):
    d = _dense()
    if case == "classes":
        parts = [Fp8Linear.from_float(d[0]), Int8Linear.from_float(d[1])]
    elif case == "in_features":
        parts = [Fp8Linear.from_float(d[0]), Fp8Linear.from_float(nn.Linear(40, 8)), Fp8Linear.from_float(d[2])]
    elif case == "bias":
        parts = [Int8Linear.from_float(d[0]), Int8Linear.from_float(nn.Linear(K, 8, bias=False))]
    elif case == "block rows":
        parts = [Fp8Linear.from_float(l, granularity="block", block_size=(16, 32)) for l in _dense(out=(16, 20, 8))]
    elif case == "block sizes":
        parts = [Fp8Linear.from_float(d[0], granularity="block", block_size=(16, 32)),
                 Fp8Linear.from_float(d[1], granularity="block", block_size=(16, 16))]
    elif case == "formats":
        parts = [W4Linear.from_float(l, f, 32) for l, f in zip(d, ("int4", "uint4", "int4"))]
    elif case == "global scales":  # nvfp4's per-tensor multiplier: one per layer, and theirs differ
        parts = [W4Linear.from_float(l, "nvfp4") for l in d]
    elif case == "offsets":
        parts = [W4Linear.from_float(d[0], "int4", 32, symmetric=False), W4Linear.from_float(d[1], "int4", 32)]
    else:
        parts = []
    cls = type(parts[0]) if parts else Fp8Linear
    with pytest.raises(ValueError, match=match):
        cls.cat_out_features(parts)
