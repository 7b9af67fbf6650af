"""Fp8Linear / Int8Linear and quantize_: outputs against float64 references of the dequantized weights,
construction, state_dict names and dtypes, loading, .to(), repr, and which layers quantize_ swaps."""
import math
import re

import pytest
import torch
import torch.nn as nn

import torch_lowbit
from conftest import Backend
from reference import (assert_matmul_close, fp8_bits_to_f64, ref_fp8_mm, ref_int8_mm, ref_int8_quantize,
                       ref_w4_mm)
from torch_lowbit.nn import Fp8Linear, Int8Linear, W4Linear

FP8 = torch.float8_e4m3fn
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def layer_backends():
    """The layers call torch.ops.lowbit.*, which dispatch on the device: cpu here, mps on a Mac."""
    marks = [] if torch.backends.mps.is_available() else [pytest.mark.skip(reason="needs an Apple GPU (mps device)")]
    return [pytest.param(Backend("cpu"), id="cpu"), pytest.param(Backend("mps"), id="mps", marks=marks)]


def _linear(K, N, bias=True, dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(K, N, bias=bias, dtype=dtype)
    with torch.no_grad():
        lin.weight[0, : min(K, 3)] *= 20  # an outlier row / block
    return lin


def _x(shape, dtype, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _bits(layer):
    return layer.weight.cpu().view(torch.uint8)


# ---------------------------------------------------------------------------------------------- Fp8Linear
@pytest.mark.parametrize("backend", layer_backends())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("granularity,block_size", [("tensor", None), ("channel", None), ("block", (32, 64)),
                                                    ("block", (128, 128))])
@pytest.mark.parametrize("x_shape", [(1, 300), (3, 300), (17, 300), (2, 3, 300)])
@pytest.mark.parametrize("bias", [True, False])
def test_fp8_linear_matches_reference(backend, dtype, granularity, block_size, x_shape, bias):
    lin = _linear(300, 70, bias, dtype)
    layer = Fp8Linear.from_float(lin, granularity, block_size or (128, 128)).to(backend.device)
    x = _x(x_shape, dtype)
    out = layer(backend.to(x))
    assert out.shape == (*x_shape[:-1], 70) and out.dtype == dtype and out.device == backend.device
    ref, absref = ref_fp8_mm(x, _bits(layer), layer.weight_scale.cpu(), None if lin.bias is None else lin.bias.detach(),
                             layer.block_size)
    assert_matmul_close(out, ref, absref)
    # and the layer is near the float layer it came from: fp8's 2^-4 relative error, averaged over K
    full = lin(x).double()
    assert (out.double().cpu() - full).abs().max() <= 0.1 * full.abs().max()


def test_fp8_linear_weights_are_quantize_fp8s():
    lin = _linear(129, 33, dtype=torch.float32)
    for g in ("tensor", "channel", "block"):
        layer = Fp8Linear.from_float(lin, g, (16, 32))
        q, s = torch_lowbit.quantize_fp8(lin.weight.detach(), g, (16, 32))
        assert torch.equal(_bits(layer), q.view(torch.uint8)) and torch.equal(layer.weight_scale, s)
        assert layer.granularity == g and layer.block_size == ((16, 32) if g == "block" else None)
    w = fp8_bits_to_f64(_bits(layer)) * layer.weight_scale.double().repeat_interleave(16, 0)[:33].repeat_interleave(
        32, 1)[:, :129]
    assert (w - lin.weight.double()).abs().max() <= lin.weight.double().abs().max() * 2.0 ** -4


def test_fp8_linear_constructor_buffers():
    layer = Fp8Linear(300, 70)
    assert layer.in_features == 300 and layer.out_features == 70 and layer.granularity == "channel"
    assert layer.weight.dtype == FP8 and layer.weight.shape == (70, 300)
    assert layer.weight_scale.dtype == torch.float32 and layer.weight_scale.shape == (70,)
    assert layer.bias.dtype == torch.bfloat16 and layer.bias.shape == (70,) and layer.input_scale is None
    assert Fp8Linear(300, 70, granularity="tensor").weight_scale.shape == (1,)
    blk = Fp8Linear(300, 70, bias=False, granularity="block", dtype=torch.float16)
    assert blk.block_size == (128, 128) and blk.weight_scale.shape == (1, 3) and blk.bias is None
    assert Fp8Linear(300, 70, granularity="block", block_size=[32, 64]).block_size == (32, 64)
    assert Fp8Linear(8, 4, dtype=torch.float32, device="meta").weight.device.type == "meta"
    assert Fp8Linear(8, 4, dtype=torch.float32).bias.dtype == torch.float32


@pytest.mark.parametrize("kwargs,match", [
    ({"granularity": "row"}, "granularity must be one of"),
    ({"block_size": (128, 128)}, "block_size is only used with granularity='block'"),
    ({"granularity": "block", "block_size": (0, 128)}, "block_size must be two positive"),
])
def test_fp8_linear_constructor_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Fp8Linear(16, 8, **kwargs)


def test_fp8_from_quantized_shares_the_weight_and_infers_granularity():
    q, s = torch_lowbit.quantize_fp8(torch.randn(70, 300), "channel")
    layer = Fp8Linear.from_quantized(q, s)
    assert layer.weight.data_ptr() == q.data_ptr() and layer.granularity == "channel" and layer.bias is None
    bits = q.view(torch.uint8)
    layer_u8 = Fp8Linear.from_quantized(bits, s.reshape(70, 1).bfloat16(), torch.zeros(70, dtype=torch.float16))
    assert layer_u8.weight.dtype == FP8 and layer_u8.weight.data_ptr() == q.data_ptr()
    assert layer_u8.weight_scale.dtype == torch.float32 and layer_u8.weight_scale.shape == (70, 1)
    assert layer_u8.bias.dtype == torch.float16
    x = torch.randn(2, 300)
    torch.testing.assert_close(layer_u8(x), layer(x), rtol=2 ** -7, atol=1e-5)  # bf16-rounded scales
    t = Fp8Linear.from_quantized(q, torch.tensor(0.01), input_scale=torch.tensor(0.5))  # ModelOpt: 0-d scales
    assert t.granularity == "tensor" and t.weight_scale.shape == () and t.input_scale.item() == 0.5
    b = Fp8Linear.from_quantized(q, torch.ones(3, 3), block_size=(32, 128))
    assert b.granularity == "block" and b.block_size == (32, 128)
    assert "block_size=(32, 128)" in repr(b)


@pytest.mark.parametrize("args,kwargs,match", [
    ((torch.zeros(4, 8, dtype=torch.int8), torch.ones(4)), {}, r"weight must be \[N, K\] float8_e4m3fn or uint8"),
    ((torch.zeros(2, 4, 8, dtype=torch.uint8), torch.ones(4)), {}, r"weight must be \[N, K\]"),
    ((torch.zeros(4, 8, dtype=torch.uint8), torch.ones(3)), {}, r"weight_scale of shape \[3\] fits no layout .* one element \(per tensor\), \[N\]"),
    ((torch.zeros(4, 8, dtype=torch.uint8), torch.ones(2, 2)), {}, "block scales need block_size"),
    ((torch.zeros(4, 8, dtype=torch.uint8), torch.ones(2, 2)), {"block_size": (2, 2)},
     r"weight_scale: with block_size \[2, 2\] the scale must have shape \[2, 4\]"),
    ((torch.zeros(4, 8, dtype=torch.uint8), torch.ones(4, dtype=torch.int32)), {}, "weight_scale must be a floating"),
    ((torch.zeros(4, 8, dtype=torch.uint8), torch.ones(4), torch.ones(5)), {}, r"bias must be \[N\] = \[4\]"),
    ((torch.zeros(4, 8, dtype=torch.uint8), torch.ones(4, device="meta")), {}, "weight_scale is on meta but weight"),
    ((torch.zeros(4, 8, dtype=torch.uint8), torch.ones(4)), {"input_scale": torch.ones(1, device="meta")},
     "input_scale is on meta"),
])
def test_fp8_from_quantized_bad_input(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Fp8Linear.from_quantized(*args, **kwargs)


def test_from_float_needs_a_linear():
    with pytest.raises(TypeError, match="linear must be an nn.Linear"):
        Fp8Linear.from_float(nn.Conv1d(3, 3, 1))
    with pytest.raises(TypeError, match="linear must be an nn.Linear"):
        Int8Linear.from_float(torch.zeros(3, 3))


# ---------------------------------------------------------------------------------------------- state_dict
@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_fp8_state_dict_names_dtypes_and_round_trip(granularity):
    layer = Fp8Linear.from_float(_linear(300, 70), granularity, (32, 64))
    sd = layer.state_dict()
    assert list(sd) == ["weight", "weight_scale", "bias"]
    assert sd["weight"].dtype == FP8 and sd["weight_scale"].dtype == torch.float32
    fresh = Fp8Linear(300, 70, granularity=granularity, block_size=(32, 64) if granularity == "block" else None)
    fresh.load_state_dict(sd)
    assert torch.equal(_bits(fresh), _bits(layer)) and torch.equal(fresh.weight_scale, layer.weight_scale)
    x = _x((3, 300), torch.bfloat16)
    assert torch.equal(fresh(x), layer(x))


def test_fp8_load_checkpoint_layouts():
    """ModelOpt (0-d scale, input_scale), compressed-tensors ([N, 1] bf16 scale, uint8-free), raw uint8 bits."""
    src = Fp8Linear.from_float(_linear(64, 16), "channel")
    layer = Fp8Linear(64, 16)
    layer.load_state_dict({"weight": src.weight, "weight_scale": src.weight_scale.reshape(16, 1).bfloat16(),
                           "bias": src.bias, "input_scale": torch.tensor(0.25)})
    assert layer.weight_scale.shape == (16,) and layer.weight_scale.dtype == torch.float32
    assert torch.equal(layer.weight_scale, src.weight_scale.bfloat16().float())
    assert layer.input_scale.item() == 0.25 and layer.input_scale.dtype == torch.float32
    assert list(layer.state_dict()) == ["weight", "weight_scale", "bias", "input_scale"]
    t = Fp8Linear(64, 16, bias=False, granularity="tensor")
    t.load_state_dict({"weight": _bits(src), "weight_scale": torch.tensor(0.5)})
    assert t.weight.dtype == FP8 and torch.equal(_bits(t), _bits(src)) and t.weight_scale.tolist() == [0.5]


def test_fp8_load_rejects_float_weights_and_wrong_shapes():
    layer = Fp8Linear(64, 16)
    sd = Fp8Linear.from_float(_linear(64, 16)).state_dict()
    with pytest.raises(RuntimeError, match="weight: expected float8_e4m3fn .* got torch.bfloat16"):
        layer.load_state_dict({**sd, "weight": torch.zeros(16, 64, dtype=torch.bfloat16)})
    with pytest.raises(RuntimeError, match="size mismatch for weight_scale"):
        layer.load_state_dict({**sd, "weight_scale": torch.ones(4, 4)})
    with pytest.raises(RuntimeError, match="Missing key.*weight_scale"):
        layer.load_state_dict({"weight": sd["weight"], "bias": sd["bias"]})


def test_fp8_load_with_assign_keeps_the_format():
    sd = Fp8Linear.from_float(_linear(64, 16)).state_dict()
    layer = Fp8Linear(64, 16, device="meta")
    layer.load_state_dict({**sd, "weight_scale": sd["weight_scale"].reshape(16, 1)}, assign=True)
    assert layer.weight.device.type == "cpu" and layer.weight.dtype == FP8 and layer.weight_scale.shape == (16,)


# ---------------------------------------------------------------------------------------------- .to()
def test_fp8_to_keeps_the_format_and_converts_the_bias():
    layer = Fp8Linear.from_float(_linear(64, 16), "tensor")
    layer.input_scale = torch.ones(1)
    for conv in (lambda m: m.half(), lambda m: m.to(torch.float32), lambda m: m.to("cpu", torch.bfloat16),
                 lambda m: m.double()):
        conv(layer)
        assert layer.weight.dtype == FP8 and layer.weight_scale.dtype == torch.float32
        assert layer.input_scale.dtype == torch.float32
    assert layer.bias.dtype == torch.float64
    assert list(layer._buffers) == ["weight", "weight_scale", "input_scale"] and list(layer._parameters) == ["bias"]
    layer.to("meta")
    assert all(t.device.type == "meta" for t in layer.state_dict().values())


def test_int8_to_keeps_the_format():
    layer = Int8Linear.from_float(_linear(64, 16))
    layer.half()
    assert layer.weight.dtype == torch.int8 and layer.weight_scale.dtype == torch.float32
    assert layer.bias.dtype == torch.float16
    x = _x((2, 64), torch.float16)
    assert layer(x).dtype == torch.float16


def test_fp8_layer_on_a_device_that_cannot_hold_fp8(monkeypatch):
    """What mps before torch 2.15 does, simulated on the CPU: uint8 bits inside, float8_e4m3fn outside."""
    lin = _linear(300, 70)
    ref_layer = Fp8Linear.from_float(lin, "block", (32, 64))
    x = _x((3, 300), torch.bfloat16)
    monkeypatch.setattr(torch_lowbit._storage, "_device_type_holds_fp8", lambda device_type: False)
    layer = Fp8Linear.from_float(lin, "block", (32, 64))
    assert layer.weight.dtype == torch.uint8 and "held as uint8 bits" in repr(layer)
    assert torch.equal(layer(x), ref_layer(x))
    sd = layer.state_dict()
    assert sd["weight"].dtype == FP8 and torch.equal(sd["weight"].view(torch.uint8), _bits(ref_layer))
    fresh = Fp8Linear(300, 70, granularity="block", block_size=(32, 64))
    assert fresh.weight.dtype == torch.uint8
    fresh.load_state_dict(ref_layer.state_dict())
    assert torch.equal(fresh.weight, _bits(ref_layer))
    assert Fp8Linear.from_quantized(ref_layer.weight, ref_layer.weight_scale, block_size=(32, 64)).weight.dtype == torch.uint8
    monkeypatch.undo()
    layer.to("cpu")  # back on a device that holds fp8: the same bytes as float8_e4m3fn
    assert layer.weight.dtype == FP8 and torch.equal(_bits(layer), _bits(ref_layer))


def test_fp8_extra_repr():
    r = repr(Fp8Linear.from_float(_linear(300, 70, bias=False), "channel"))
    assert r == "Fp8Linear(in_features=300, out_features=70, bias=False, granularity=channel)"
    assert "granularity=block, block_size=(128, 128)" in repr(Fp8Linear(8, 8, granularity="block"))


# ---------------------------------------------------------------------------------------------- Int8Linear
@pytest.mark.parametrize("backend", layer_backends())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("x_shape", [(1, 300), (3, 300), (17, 300), (2, 3, 300)])
@pytest.mark.parametrize("bias", [True, False])
def test_int8_linear_matches_reference(backend, dtype, x_shape, bias):
    lin = _linear(300, 70, bias, dtype)
    layer = Int8Linear.from_float(lin).to(backend.device)
    x = _x(x_shape, dtype)
    out = layer(backend.to(x))
    assert out.shape == (*x_shape[:-1], 70) and out.dtype == dtype and out.device == backend.device
    xq, xs, _ = ref_int8_quantize(x)
    b = None if lin.bias is None else lin.bias.detach()
    ref, acc = ref_int8_mm(xq, xs, layer.weight.cpu(), layer.weight_scale.cpu(), b)
    absref = acc.abs().double() * xs.double()[..., None] * layer.weight_scale.double() + (0 if b is None else
                                                                                          b.double().abs())
    assert_matmul_close(out, ref, absref, acc_rtol=1e-6)
    full = lin(x).double()
    assert (out.double().cpu() - full).abs().max() <= 0.1 * full.abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_linear_non_finite_rows_give_nan(dtype):
    # a float linear layer gives no finite number for a row holding NaN or inf; neither does Int8Linear
    layer = Int8Linear.from_float(_linear(64, 16, dtype=dtype))
    x = _x((4, 64), dtype)
    x[0, 5], x[2, 63], x[3, 0] = float("nan"), float("inf"), -float("inf")
    out = layer(x)
    assert out[[0, 2, 3]].isnan().all() and torch.isfinite(out[1]).all()


def test_int8_constructor_from_quantized_and_state_dict():
    layer = Int8Linear(300, 70)
    assert layer.weight.dtype == torch.int8 and layer.weight.shape == (70, 300)
    assert layer.weight_scale.shape == (70,) and layer.bias.dtype == torch.bfloat16
    assert layer.in_features == 300 and layer.out_features == 70
    src = Int8Linear.from_float(_linear(300, 70))
    wq, s = torch_lowbit.quantize_int8(_linear(300, 70).weight.detach())
    assert torch.equal(src.weight, wq) and torch.equal(src.weight_scale, s)
    sd = src.state_dict()
    assert list(sd) == ["weight", "weight_scale", "bias"] and sd["weight"].dtype == torch.int8
    layer.load_state_dict({**sd, "weight_scale": sd["weight_scale"].reshape(70, 1).half()})  # compressed-tensors
    assert layer.weight_scale.shape == (70,) and layer.weight_scale.dtype == torch.float32
    x = _x((3, 300), torch.bfloat16)
    torch.testing.assert_close(layer(x), src(x), rtol=2 ** -6, atol=1e-3)
    q = Int8Linear.from_quantized(wq, s.reshape(70, 1))
    assert q.weight.data_ptr() == wq.data_ptr() and q.weight_scale.shape == (70, 1) and q.bias is None
    assert torch.equal(q(x), Int8Linear.from_quantized(wq, s)(x))
    assert repr(q) == ("Int8Linear(in_features=300, out_features=70, bias=False, "
                       "activations=int8 per row (dynamic))")
    with pytest.raises(RuntimeError, match="weight: expected int8, got torch.float32"):
        layer.load_state_dict({**sd, "weight": torch.zeros(70, 300)})


@pytest.mark.parametrize("cls", [Fp8Linear, Int8Linear])
@pytest.mark.parametrize("shape", [(3, 12), (3, 65), (0,), (2, 3, 63)])
def test_forward_with_the_wrong_in_features_names_x(cls, shape):
    # Int8Linear's int8_mm used to report "xq's last dimension", a tensor the caller never passed
    layer = cls.from_float(_linear(64, 16))
    with pytest.raises(ValueError, match=re.escape(f"{cls.__name__}: x must be [..., in_features] = [..., 64], "
                                                   f"got shape {tuple(shape)}")):
        layer(torch.randn(shape, dtype=torch.bfloat16))


@pytest.mark.parametrize("args,match", [
    ((torch.zeros(4, 8, dtype=torch.uint8), torch.ones(4)), r"weight must be \[N, K\] int8"),
    ((torch.zeros(4, 8, dtype=torch.int8), torch.ones(3)), r"weight_scale must be \[N\] = \[4\]"),
    ((torch.zeros(4, 8, dtype=torch.int8), torch.ones(4, dtype=torch.int8)), "weight_scale must be a floating"),
    ((torch.zeros(4, 8, dtype=torch.int8), torch.ones(4), torch.ones(2)), r"bias must be \[N\] = \[4\]"),
])
def test_int8_from_quantized_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        Int8Linear.from_quantized(*args)


# ---------------------------------------------------------------------------------------------- W4Linear state_dict
# a state_dict of each 4-bit format (and option), from W4Linear.from_float: K = 70 (partial groups, odd bytes)
W4_SOURCES = {"nvfp4": ("nvfp4", None, {}), "mxfp4": ("mxfp4", None, {}), "int4": ("int4", 32, {}),
              "int4-zp": ("int4", 32, {"symmetric": False}), "uint4": ("uint4", 32, {})}


def _w4_source(name):
    fmt, gs, kw = W4_SOURCES[name]
    return W4Linear.from_float(_linear(70, 12, dtype=torch.float32), fmt, gs, **kw)


def _assert_runs_as_f64(layer, sd):
    """layer's output is the float64 product of the state_dict's tensors read by the layer's format."""
    x = _x((3, 70), torch.float32)
    ref, absref = ref_w4_mm(x, layer.format, sd["weight_packed"], sd["weight_scale"], layer.group_size,
                            sd.get("weight_offset"), sd.get("weight_scale_2"), sd.get("bias"))
    assert_matmul_close(layer(x), ref, absref, acc_rtol=1e-5)


def test_w4_load_takes_8bit_scale_encodings_as_their_bits():
    """nvfp4's E4M3 and mxfp4's E8M0 scales are loaded as bits, whichever 8-bit dtype holds them (a value copy
    turned uint8 bits 0x38 into the scale 56.0)."""
    for name, fmt in (("nvfp4", "nvfp4"), ("mxfp4", "mxfp4")):
        src = _w4_source(name).state_dict()
        as_bits = src["weight_scale"].view(torch.uint8)
        encodings = [as_bits, as_bits.view(torch.float8_e4m3fn) if fmt == "nvfp4" else
                     as_bits.view(getattr(torch, "float8_e8m0fnu", torch.uint8))]
        for scale_dtype in (None, torch.uint8) if fmt == "nvfp4" else (None,):
            for scale in encodings:
                layer = W4Linear(70, 12, dtype=torch.float32, format=fmt, group_size=16 if fmt == "nvfp4" else 32,
                                 scale_dtype=scale_dtype, global_scale="weight_scale_2" in src)
                layer.load_state_dict({**src, "weight_scale": scale})
                assert torch.equal(layer.weight_scale.view(torch.uint8), as_bits), (fmt, scale_dtype, scale.dtype)
                _assert_runs_as_f64(layer, {**src, "weight_scale": as_bits})


@pytest.mark.parametrize("source,target,key", [
    ("nvfp4", "int4", "weight_scale"), ("int4", "nvfp4", "weight_scale"), ("nvfp4", "mxfp4", "weight_scale"),
    ("int4", "mxfp4", "weight_scale"), ("int4-zp", "uint4", "weight_offset"), ("uint4", "int4", "weight_offset"),
    ("nvfp4", "int4", "weight_scale_2"), ("int4-zp", "nvfp4", "weight_offset")])
def test_w4_load_of_another_formats_state_dict_is_an_error_naming_the_key(source, target, key):
    """Scales, offsets and global scales of another format fail by key (not converted by value into numbers the
    layer's format reads differently), strict or not."""
    sd = _w4_source(source).state_dict()
    fmt, gs, kw = W4_SOURCES[target]
    layer = W4Linear(70, 12, dtype=torch.float32, format=fmt, group_size=gs or 16,
                     offset=target in ("int4-zp", "uint4") or fmt == "uint4")
    if key == "weight_scale" or target == "nvfp4":  # take only the key under test from the other format
        sd = {**_w4_source(target).state_dict(), key: sd[key]}
    for strict in (True, False):
        with pytest.raises(RuntimeError, match=rf"{key}: format '{fmt}' (stores|takes no)"):
            layer.load_state_dict(sd, strict=strict)


def test_w4_load_of_a_float_weight_is_an_error():
    sd = _w4_source("int4").state_dict()
    with pytest.raises(RuntimeError, match=r"weight_packed: expected uint8"):
        W4Linear(70, 12, group_size=32).load_state_dict({**sd, "weight_packed": torch.zeros(12, 35)})


@pytest.mark.parametrize("source", ["int4-zp", "uint4", "nvfp4"])
@pytest.mark.parametrize("strict", [True, False])
def test_w4_load_gives_a_layer_without_zero_points_or_global_scale_the_state_dicts(source, strict):
    """A layer built without the optional tensors a state_dict has adopts them (strict=False dropped them and ran
    another weight); a 0-d global scale loads into [1]."""
    src = _w4_source(source)
    sd = src.state_dict()
    if "weight_scale_2" in sd:
        sd["weight_scale_2"] = sd["weight_scale_2"].reshape(())
    layer = W4Linear(70, 12, dtype=torch.float32, format=src.format, group_size=src.group_size,
                     scale_dtype=src.weight_scale.dtype, offset=src.format == "uint4")  # uint4 has no layer without biases worth loading into
    if src.format == "uint4":
        layer.weight_offset = None
    keys = layer.load_state_dict(sd, strict=strict)
    assert not keys.missing_keys and not keys.unexpected_keys
    assert (layer.weight_offset is None) == (src.weight_offset is None)
    assert (layer.weight_scale_2 is None) == (src.weight_scale_2 is None)
    _assert_runs_as_f64(layer, sd)
    x = _x((3, 70), torch.float32)
    assert torch.equal(layer(x), src(x))


# ---------------------------------------------------------------------------------------------- quantize_
class Block(nn.Module):
    def __init__(self, d=32, h=48):
        super().__init__()
        self.attn = nn.ModuleDict({"q_proj": nn.Linear(d, d), "o_proj": nn.Linear(d, d, bias=False)})
        self.mlp = nn.Sequential(nn.Linear(d, h), nn.SiLU(), nn.Linear(h, d))
        self.mha = nn.MultiheadAttention(d, 4, batch_first=True)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        x = x + self.attn["o_proj"](self.attn["q_proj"](x))
        x = x + self.mha(x, x, x, need_weights=False)[0]
        return self.norm(x + self.mlp(x))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 32)
        self.layers = nn.ModuleList([Block(), Block()])
        self.lm_head = nn.Linear(32, 10, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.layers:
            x = b(x)
        return self.lm_head(x)


def _kinds(model):
    return {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, (nn.Linear, Fp8Linear, Int8Linear))}


@pytest.mark.parametrize("config,cls", [(torch_lowbit.Fp8WeightOnly(), Fp8Linear),
                                        (torch_lowbit.Int8Dynamic(), Int8Linear),
                                        (torch_lowbit.Fp8WeightOnly("block", (16, 16)), Fp8Linear)])
def test_quantize_swaps_linears_but_not_lm_head_or_mha_out_proj(config, cls):
    torch.manual_seed(0)
    model = Tiny().eval()
    tokens = torch.randint(0, 10, (2, 5))
    with torch.no_grad():
        before = model(tokens)
    assert torch_lowbit.quantize_(model, config) is model
    kinds = _kinds(model)
    assert kinds["lm_head"] == "Linear"
    assert kinds["layers.0.mha.out_proj"] == "NonDynamicallyQuantizableLinear"  # MHA reads its weight directly
    swapped = [n for n, k in kinds.items() if k == cls.__name__]
    assert sorted(swapped) == sorted(f"layers.{i}.{n}" for i in range(2)
                                     for n in ("attn.q_proj", "attn.o_proj", "mlp.0", "mlp.2"))
    if isinstance(config, torch_lowbit.Fp8WeightOnly):
        assert model.layers[0].mlp[0].granularity == config.granularity
    with torch.no_grad():
        after = model(tokens)
    assert (after - before).abs().max() < 0.1 * before.abs().max()


def test_quantize_filter_fn_gets_fqns_and_decides_alone():
    model = Tiny()
    seen = []

    def only_mlp_and_head(module, fqn):
        seen.append(fqn)
        assert isinstance(module, nn.Linear)
        return ".mlp." in fqn or fqn == "lm_head"
    torch_lowbit.quantize_(model, torch_lowbit.Int8Dynamic(), filter_fn=only_mlp_and_head)
    assert "layers.1.attn.q_proj" in seen and "lm_head" in seen
    kinds = _kinds(model)
    assert kinds["lm_head"] == "Int8Linear" and kinds["layers.0.mlp.2"] == "Int8Linear"
    assert kinds["layers.0.attn.q_proj"] == "Linear"


def test_quantize_tied_linear_stays_shared_and_root_linear():
    shared = nn.Linear(8, 8)
    model = nn.ModuleDict({"a": shared, "b": nn.Sequential(shared)})
    torch_lowbit.quantize_(model, torch_lowbit.Fp8WeightOnly())
    assert isinstance(model["a"], Fp8Linear) and model["a"] is model["b"][0]
    q = torch_lowbit.quantize_(nn.Linear(8, 4), torch_lowbit.Int8Dynamic())
    assert isinstance(q, Int8Linear)
    head = nn.Linear(8, 4)
    assert torch_lowbit.quantize_(head, torch_lowbit.Int8Dynamic(), filter_fn=lambda m, n: False) is head


@pytest.mark.parametrize("config", [torch_lowbit.Fp8WeightOnly(), torch_lowbit.Fp8WeightOnly("block", (16, 16)),
                                    torch_lowbit.Int8Dynamic()])
def test_quantize_a_meta_model_then_load_with_assign(config):
    """The big-model flow: build on meta, quantize_, then load_state_dict(assign=True) from a checkpoint."""
    torch.manual_seed(0)
    real = nn.Sequential(nn.Linear(64, 40), nn.Linear(40, 8, bias=False))
    torch_lowbit.quantize_(real, config)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 40), nn.Linear(40, 8, bias=False))
    torch_lowbit.quantize_(model, config)
    assert model[0].weight.device.type == "meta" and model[0].weight.dtype == real[0].weight.dtype
    model.load_state_dict(real.state_dict(), assign=True)
    x = _x((3, 64), torch.float32)
    assert torch.equal(model(x), real(x))


def test_quantize_bad_config():
    with pytest.raises(TypeError, match="config must be torch_lowbit.Fp8WeightOnly"):
        torch_lowbit.quantize_(Tiny(), "fp8")
    with pytest.raises(TypeError, match="config must be"):
        torch_lowbit.quantize_(Tiny(), torch_lowbit.Fp8WeightOnly)  # the class, not an instance
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        torch_lowbit.quantize_(torch.zeros(3), torch_lowbit.Int8Dynamic())
    with pytest.raises(TypeError, match="filter_fn must be callable"):
        torch_lowbit.quantize_(Tiny(), torch_lowbit.Int8Dynamic(), filter_fn="mlp")
    with pytest.raises(ValueError, match="Fp8WeightOnly.granularity must be one of"):
        torch_lowbit.Fp8WeightOnly("row")
    with pytest.raises(ValueError, match="Fp8WeightOnly.block_size must be two positive"):
        torch_lowbit.Fp8WeightOnly("block", (128,))
    assert torch_lowbit.Fp8WeightOnly("block", [64, 32]).block_size == (64, 32)


def test_torchao_names_are_aliases():
    from torch_lowbit.quantize import Float8WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig
    assert Float8WeightOnlyConfig() == torch_lowbit.Fp8WeightOnly("channel")
    assert Float8WeightOnlyConfig(weight_dtype=torch.float8_e4m3fn, set_inductor_config=False, version=2) == \
        torch_lowbit.Fp8WeightOnly()
    assert Int8DynamicActivationInt8WeightConfig() == torch_lowbit.Int8Dynamic()
    assert Int8DynamicActivationInt8WeightConfig(act_mapping_type="SYMMETRIC", weight_only_decode=False) == \
        torch_lowbit.Int8Dynamic()
    model = Tiny()
    torch_lowbit.quantize_(model, Float8WeightOnlyConfig())
    assert isinstance(model.layers[0].mlp[0], Fp8Linear) and model.layers[0].mlp[0].granularity == "channel"


@pytest.mark.parametrize("make,match", [
    (lambda c: c.Float8WeightOnlyConfig(weight_dtype=torch.float8_e5m2), "weight_dtype=torch.float8_e5m2 is not supp"),
    (lambda c: c.Int8DynamicActivationInt8WeightConfig(act_mapping_type="ASYMMETRIC"), "act_mapping_type='ASYMMETRIC'"),
    (lambda c: c.Int8DynamicActivationInt8WeightConfig(weight_only_decode=True), "weight_only_decode=True"),
    (lambda c: c.Int8DynamicActivationInt8WeightConfig(layout="SemiSparseLayout"), "layout='SemiSparseLayout'"),
    (lambda c: c.Int8DynamicActivationInt8WeightConfig(granularity="tensor"), "granularity='tensor'"),
])
def test_torchao_options_that_would_change_the_arithmetic_are_refused(make, match):
    import torch_lowbit.quantize as c
    with pytest.raises(ValueError, match=match):
        make(c)
    with pytest.raises(TypeError, match="unexpected keyword"):
        c.Float8WeightOnlyConfig(mm_config=None)


def test_a_new_config_is_one_dataclass_and_one_registered_handler(monkeypatch):
    import dataclasses
    from torch_lowbit import quantize as q
    monkeypatch.setattr(q, "_HANDLERS", dict(q._HANDLERS))

    @dataclasses.dataclass(frozen=True)
    class HalfPrecision:
        dtype: torch.dtype = torch.float16

    @q.register_quantize_module_handler(HalfPrecision)
    def _half(linear, config):
        return linear.to(config.dtype)
    model = Tiny()
    torch_lowbit.quantize_(model, HalfPrecision())
    assert model.layers[0].mlp[0].weight.dtype == torch.float16 and model.lm_head.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="already registered"):
        q.register_quantize_module_handler(torch_lowbit.Fp8WeightOnly)(_half)


def test_quantize_imports_no_layer():
    # the handlers live with the layers: quantize.py must not import torch_lowbit.nn (the old import cycle)
    import ast
    import inspect
    from torch_lowbit import quantize as q
    tree = ast.parse(inspect.getsource(q))
    imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not any(m == "nn" or m.startswith("nn.") for m in imported), imported


def test_quantize_keeps_odd_shapes():
    # every K and N works with every granularity (partial edge blocks), so no Linear is skipped for its shape
    model = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 1))
    torch_lowbit.quantize_(model, torch_lowbit.Fp8WeightOnly("block", (128, 128)))
    assert all(isinstance(m, Fp8Linear) for m in model)
    assert model[1].weight_scale.shape == (1, 1) and math.isfinite(model(torch.randn(2, 5)).sum().item())
