"""4-bit quantization (quantize_w4, W4Linear.from_float, the quantize_ configs): codes and scales as each writer
computes them (compressed-tensors itself for int4 / NVFP4 / MXFP4; an independent float32 reference of
mlx.core.quantize and of torchao's min/max rule for uint4), round-trip error bounds, the configs through quantize_,
and the torchao alias with its refusals."""
import copy

import numpy as np
import pytest
import torch
import torch.nn as nn

import torch_lowbit
from torch_lowbit.nn import W4Linear
from torch_lowbit.quantize_w4 import quantize_w4

from reference import W4_VALUES_F64, w4_codes_f64, w4_weight_f64

E2M1 = W4_VALUES_F64["nvfp4"]


def _weight(N, K, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    # magnitudes over five decades along K, so groups get very different scales; some exact zeros and ties
    w = torch.randn(N, K, generator=g) * torch.logspace(-3, 2, K)
    w[0, : min(K, 5)] = 0
    return w.to(dtype)


def _codes(q, K):
    return w4_codes_f64(q.weight_packed, K)


# ---------------------------------------------------------------------------------------------- the real writers
def _ct_quantize(w, scheme, group_size=None):
    """compressed-tensors' own qparams and quantized values for w (group-aligned K), as its lifecycle computes
    them."""
    from compressed_tensors.quantization import QuantizationArgs, preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    if scheme in ("W4A16", "W4A16_ASYM"):
        args = QuantizationArgs(num_bits=4, type="int", symmetric=scheme == "W4A16", strategy="group",
                                group_size=group_size)
    else:
        args = preset_name_to_scheme(scheme, ["Linear"]).weights
    N, K = w.shape
    g = w.view(N, K // args.group_size, args.group_size)
    gscale = generate_gparam(w.amin(), w.amax()) if scheme == "NVFP4A16" else None
    s, zp = calculate_qparams(g.amin(2), g.amax(2), args, global_scale=gscale)
    return s, zp, quantize(w, s, zp, args, global_scale=gscale), gscale


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("symmetric", [True, False], ids=["W4A16", "W4A16_ASYM"])
@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_w4__int4_matches_compressed_tensors(symmetric, group_size, dtype):
    # bf16 / fp16: compressed-tensors computes in the weight's dtype; the same codes need the same roundings
    w = _weight(16, 256, dtype=dtype)
    s, zp, q_ct, _ = _ct_quantize(w, "W4A16" if symmetric else "W4A16_ASYM", group_size)
    q = quantize_w4(w, "int4", group_size, symmetric)
    assert q.weight_scale.dtype == dtype and torch.equal(q.weight_scale, s)
    assert torch.equal(_codes(q, 256) - 8, q_ct.to(torch.int64))
    if symmetric:
        assert q.weight_offset is None
    else:
        assert q.weight_offset.dtype == torch.int8 and torch.equal(q.weight_offset, zp.to(torch.int8))


@pytest.mark.parametrize("scheme,fmt", [("NVFP4A16", "nvfp4"), ("MXFP4A16", "mxfp4")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_w4__fp4_matches_compressed_tensors(scheme, fmt, dtype):
    w = _weight(16, 192, seed=1, dtype=dtype)
    s, _, q_ct, gscale = _ct_quantize(w, scheme)
    q = quantize_w4(w, fmt)
    values = E2M1[_codes(q, 192)]
    assert torch.equal(values, q_ct.double())
    if fmt == "nvfp4":
        assert q.weight_scale.dtype == torch.float8_e4m3fn
        assert torch.equal(q.weight_scale.float(), s.float())
        # the layer multiplies by the reciprocal of the checkpoint's divisor, as the loaders do
        assert torch.equal(q.weight_scale_2, (1.0 / gscale).float())
    else:
        assert q.weight_scale.dtype == torch.uint8 and q.weight_scale_2 is None
        assert torch.equal(torch.pow(2.0, q.weight_scale.double() - 127), s.double())


# ---------------------------------------------------------------------------------------------- uint4 (float32 refs)
def _f32(x):
    return np.float32(x)


def _half_away(x):
    return float(np.sign(x) * np.floor(np.abs(np.float64(x)) + 0.5))


def _ref_mlx_group(g):
    """mlx.core.quantize (affine, 4 bits, its Metal kernel) of one group, float32 arithmetic: (codes, scale, bias)
    unrounded. The kernel's running max starts at 0."""
    lo, hi = _f32(g.min()), _f32(max(g.max(), 0))
    scale = max(_f32((hi - lo) / _f32(15)), _f32(1e-7))
    low_edge = abs(lo) > abs(hi)
    if not low_edge:
        scale = -scale
    edge = lo if low_edge else hi
    q0 = _half_away(_f32(edge / scale))
    bias = _f32(0)
    if q0 != 0:
        scale, bias = _f32(edge / _f32(q0)), edge
    codes = [int(min(max(_half_away(_f32(_f32(v - bias) / scale)), 0), 15)) for v in g]
    return codes, scale, bias


def _ref_minmax_group(g, dtype):
    """torchao's int4 min/max rule: s = (max - min) / 15 and b = min stored in dtype, codes from the stored s, b."""
    lo, hi = _f32(g.min()), _f32(g.max())
    s = float(torch.tensor(_f32((hi - lo) / _f32(15))).to(dtype).float())
    b = float(torch.tensor(lo).to(dtype).float())
    s_div = s if s != 0 else 1.0
    codes = [int(min(max(np.rint(_f32(_f32(v - _f32(b)) / _f32(s_div))), 0), 15)) for v in g]
    return codes, s, b


@pytest.mark.parametrize("rule", ["mlx", "minmax"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_w4__uint4_matches_the_float32_reference(rule, dtype):
    N, K, gs = 5, 100, 32  # a partial last group
    w = _weight(N, K, seed=2).clamp(-60000, 60000).to(dtype)
    w[1, 32:64] = (-1 - torch.rand(32, generator=torch.Generator().manual_seed(0))).to(dtype)  # all negative
    q = quantize_w4(w, "uint4", gs, rule=rule)
    assert q.weight_scale.dtype == dtype and q.weight_offset.dtype == dtype
    codes = _codes(q, K)
    wn = w.float().numpy()
    for n in range(N):
        for gi in range(-(-K // gs)):
            g = wn[n, gi * gs:(gi + 1) * gs]
            if rule == "mlx":
                c, s, b = _ref_mlx_group(g)
                s, b = float(torch.tensor(s).to(dtype).float()), float(torch.tensor(b).to(dtype).float())
            else:
                c, s, b = _ref_minmax_group(g, dtype)
            assert codes[n, gi * gs:(gi + 1) * gs].tolist() == c, (n, gi)
            assert float(q.weight_scale[n, gi]) == s and float(q.weight_offset[n, gi]) == b, (n, gi)


# ---------------------------------------------------------------------------------------------- round trip
def _step_bound(fmt, q, K, gs):
    """Largest round-to-nearest error each element may have: half a step of its group's grid (e2m1 steps grow
    with the magnitude: half the gap to the next value, 1 * s at the top, where 4 -> 6; uint4 (mlx): a step)."""
    w_deq = w4_weight_f64(fmt, q.weight_packed, q.weight_scale, gs, K, q.weight_offset, q.weight_scale_2)
    g = torch.arange(K) // gs
    if fmt in ("nvfp4", "mxfp4"):
        from reference import w4_scale_f64
        s = w4_scale_f64(fmt, q.weight_scale)[:, g]
        if q.weight_scale_2 is not None:
            s = s * q.weight_scale_2.double()
        return w_deq, 1.0 * s  # half of the widest gap (2, between 4 and 6)
    # mlx's rule makes the larger edge exact (s = edge / q0), so the other edge may need code 16: one step off
    return w_deq, (1.0 if fmt == "uint4" else 0.5) * q.weight_scale.double()[:, g].abs()


@pytest.mark.parametrize("fmt,symmetric,gs", [("int4", True, 32), ("int4", False, 64), ("nvfp4", True, 16),
                                              ("uint4", True, 64)])
@pytest.mark.parametrize("K", [1, 37, 128])
def test_quantize_w4__round_trip_error_is_within_half_a_step(fmt, symmetric, gs, K):
    w = torch.randn(9, K, generator=torch.Generator().manual_seed(K))
    q = quantize_w4(w, fmt, gs, symmetric)
    gs = min(gs, K)
    w_deq, bound = _step_bound(fmt, q, K, gs)
    # nvfp4's e4m3 scales are rounded, so the group max may land up to one e4m3 ulp past 6 * s: saturation error
    slack = 1 + (2 ** -3 if fmt == "nvfp4" else 1e-6)
    assert ((w_deq - w.double()).abs() <= bound * slack + 1e-12).all()


def test_quantize_w4__mxfp4_round_trip_within_half_a_step_plus_saturation():
    w = _weight(4, 64, seed=3)
    q = quantize_w4(w, "mxfp4")
    w_deq = w4_weight_f64("mxfp4", q.weight_packed, q.weight_scale, 32, 64)
    s = torch.pow(2.0, q.weight_scale.double() - 127)[:, torch.arange(64) // 32]
    # values past 6 * s (a group max under 1.75 * 2^e) saturate: at most 8 * s - 6 * s = 2 * s off
    assert ((w_deq - w.double()).abs() <= 2 * s).all()
    assert (w_deq.abs() <= 6 * s).all()


def test_quantize_w4__zero_groups_empty_weights_and_bad_input():
    w = torch.zeros(3, 40)
    w[1, 20:] = 1.0
    for fmt in ("int4", "nvfp4", "mxfp4", "uint4"):
        q = quantize_w4(w, fmt, 16)
        assert torch.equal(w4_weight_f64(fmt, q.weight_packed, q.weight_scale, 16, 40, q.weight_offset,
                                         q.weight_scale_2).float().isnan().any(), torch.tensor(False))
        assert (w4_weight_f64(fmt, q.weight_packed, q.weight_scale, 16, 40, q.weight_offset,
                              q.weight_scale_2)[0] == 0).all()
        e = quantize_w4(torch.zeros(0, 8), fmt)
        assert e.weight_packed.shape == (0, 4) and e.weight_scale.shape[0] == 0
        k0 = quantize_w4(torch.zeros(3, 0), fmt)
        assert k0.weight_packed.shape == (3, 0) and k0.weight_scale.shape == (3, 0)
    with pytest.raises(ValueError, match="format must be one of"):
        quantize_w4(w, "nf4")
    with pytest.raises(ValueError, match="group_size must be >= 1, got 0"):
        quantize_w4(w, "int4", 0)
    with pytest.raises(ValueError, match="symmetric=False .* is for format 'int4'"):
        quantize_w4(w, "nvfp4", symmetric=False)
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize_w4(torch.tensor([[1.0, float("inf")]]), "int4")
    with pytest.raises(ValueError, match="must be a floating-point \\[N, K\\] weight"):
        quantize_w4(torch.zeros(4, dtype=torch.int8), "int4")
    with pytest.raises(ValueError, match="scale_dtype must be None"):
        quantize_w4(w, "mxfp4", scale_dtype=torch.float32)
    with pytest.raises(ValueError, match="rule must be one of"):
        quantize_w4(w, "uint4", rule="hqq")


# ---------------------------------------------------------------------------------------------- layer and configs
@pytest.mark.parametrize("fmt,kw", [("int4", {}), ("int4", {"symmetric": False}), ("nvfp4", {}), ("mxfp4", {}),
                                    ("uint4", {"group_size": 32})])
def test_w4linear_from_float__runs_its_quantized_weight(fmt, kw):
    lin = nn.Linear(70, 9)
    layer = W4Linear.from_float(lin, fmt, **kw)
    q = quantize_w4(lin.weight, fmt, kw.get("group_size"), kw.get("symmetric", True))
    assert torch.equal(layer.weight_packed, q.weight_packed)
    assert torch.equal(layer.bias, lin.bias) and not layer.bias.requires_grad
    x = torch.randn(4, 70)
    w = w4_weight_f64(fmt, layer.weight_packed, layer.weight_scale, layer.group_size, 70, layer.weight_offset,
                      layer.weight_scale_2)
    ref = x.double() @ w.T + lin.bias.double()
    torch.testing.assert_close(layer(x).double(), ref, rtol=1e-5, atol=1e-5)


CONFIGS = [
    (torch_lowbit.Int4WeightOnly(), "int4", 128),
    (torch_lowbit.Int4WeightOnly(group_size=32, symmetric=False), "int4", 32),
    (torch_lowbit.Int4WeightOnly(group_size=None), "int4", None),
    (torch_lowbit.Nvfp4WeightOnly(), "nvfp4", 16),
    (torch_lowbit.Mxfp4WeightOnly(), "mxfp4", 32),
    (torch_lowbit.AffineWeightOnly(), "uint4", 64),
    (torch_lowbit.Int4WeightOnlyConfig(group_size=32), "uint4", 32),
]


@pytest.mark.parametrize("config,fmt,gs", CONFIGS, ids=lambda v: repr(v) if not isinstance(v, (str, int)) else None)
def test_quantize___w4_configs_convert_every_linear(config, fmt, gs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 40))
    model.add_module("lm_head", nn.Linear(40, 5))
    dense = copy.deepcopy(model)
    model, report = torch_lowbit.quantize_(model, config, return_report=True)
    assert isinstance(model[0], W4Linear) and isinstance(model[2], W4Linear) and isinstance(model.lm_head, nn.Linear)
    for i, K in ((0, 256), (2, 64)):
        layer = model[i]
        assert layer.format == fmt and layer.group_size == (K if gs is None else min(gs, K))
        assert report.converted[str(i)] == f"W4Linear({fmt}, group {layer.group_size})"
        want = quantize_w4(dense[i].weight, fmt, layer.group_size, getattr(config, "symmetric", True),
                           rule=getattr(config, "rule", "mlx"))
        assert torch.equal(layer.weight_packed, want.weight_packed)
    x = torch.randn(3, 256)
    rel = (model(x) - dense(x)).norm() / dense(x).norm()
    assert rel < 0.2


def test_int4_weight_only_config__alias_is_the_min_max_rule_and_refuses_other_arithmetic():
    assert torch_lowbit.Int4WeightOnlyConfig() == torch_lowbit.AffineWeightOnly(group_size=128, rule="minmax")
    assert torch_lowbit.Int4WeightOnlyConfig(64, int4_packing_format="tile_packed_to_4d", version=1).group_size == 64
    for kwargs, arg in [({"use_hqq": True}, "use_hqq"), ({"int4_choose_qparams_algorithm": "hqq"},
                                                          "int4_choose_qparams_algorithm"),
                        ({"zero_point_domain": "INT"}, "zero_point_domain"), ({"preserve_zero": True}, "preserve_zero"),
                        ({"int4_packing_format": "marlin_sparse"}, "int4_packing_format")]:
        with pytest.raises(ValueError, match=f"Int4WeightOnlyConfig: {arg}=.* is not supported by torch_lowbit"):
            torch_lowbit.Int4WeightOnlyConfig(**kwargs)
    with pytest.raises(ValueError, match="Int4WeightOnlyConfig: group_size must be an int >= 1, got 0"):
        torch_lowbit.Int4WeightOnlyConfig(group_size=0)
    with pytest.raises(ValueError, match="Int4WeightOnly: group_size must be an int >= 1 or None"):
        torch_lowbit.Int4WeightOnly(group_size=-1)
    with pytest.raises(ValueError, match="AffineWeightOnly: rule must be one of"):
        torch_lowbit.AffineWeightOnly(rule="awq")


def test_quantize_w4__e2m1_ties_go_to_the_even_code_as_the_writer():
    # a group with amax 4 has scale 2^0 (mxfp4): each midpoint between two e2m1 values lands exactly on a tie
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]  # the neighbour whose code is even (mantissa bit 0)
    row = torch.tensor(ties + [-t for t in ties] + [4.0] + [0.0] * 17)
    w = row.reshape(1, 32)
    q = quantize_w4(w, "mxfp4")
    assert int(q.weight_scale) == 127
    got = E2M1[_codes(q, 32)][0]
    assert got[:7].tolist() == want and got[7:14].tolist() == [-v for v in want]
    _, _, q_ct, _ = _ct_quantize(w, "MXFP4A16")
    assert torch.equal(got, q_ct[0].double())
