"""Activation schemes: what a checkpoint's FP8 activation quantization becomes.

The layer arithmetic (Fp8Linear running FP8 dynamic per-token / static per-tensor activations) against float64
references of the fake quantization; checkpoints written by compressed-tensors (dynamic per-token, and static
input scales calibrated by its own qparam rule) loaded with ``activations="checkpoint"`` against the writer's own
stack (transformers' reload running compressed-tensors' activation quantization), the W8A16 default and its note,
and the round trip save_quantized -> transformers / from_pretrained keeping the scheme and the input scales."""
import json
import math
import os

import numpy as np
import pytest
import torch
from torch import nn

import hf_writers as W
import torch_lowbit
from checkpoints import config_for, make_checkpoint
from hf_writers import transformers
from reference import assert_matmul_close, f32_to_fp8_bits_ref, fp8_bits_to_f64, fp8_weight_f64
from safetensors.torch import load_file
from tiny_models import TinyLM
from torch_lowbit import _ops
from torch_lowbit.formats import CheckpointError, load_quantized
from torch_lowbit.nn import Fp8Experts, Fp8Linear, Int8Linear

IDS = torch.tensor([[3, 17, 42, 5, 88, 1, 0, 64, 23], [96, 2, 2, 50, 11, 7, 33, 8, 70]])
NAN, INF = math.nan, math.inf


# ------------------------------------------------------------------------------------------ float64 references
def ref_fake_quantize(x, input_scale=None):
    """float64 [..., K] of e4m3(clamp(x / s, +-448)) * s in numpy: s = amax(|row|) / 448 (float32) or the static
    scale; x / s in float32; ties to even; a zero scale divides by 1. NaN where the ratio is NaN or where s is not
    finite and the code is 0 (0 * inf)."""
    x32 = x.float().numpy()
    if input_scale is None:
        with np.errstate(invalid="ignore"):
            amax = np.abs(x32).max(axis=-1, keepdims=True)
        s = (amax / np.float32(448)).astype(np.float32)
    else:
        s = np.float32(input_scale.item()) * np.ones(x32.shape[:-1] + (1,), np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.clip((x32 / np.where(s == 0, np.float32(1), s)).astype(np.float32), -448, 448)
    nan = np.isnan(ratio)
    codes = f32_to_fp8_bits_ref(np.where(nan, np.float32(0), ratio))
    with np.errstate(invalid="ignore"):
        out = fp8_bits_to_f64(torch.from_numpy(codes)).numpy() * s.astype(np.float64)
    return torch.from_numpy(np.where(nan, np.nan, out))


def _activations(dtype, K=37):
    """Rows: random normal (a K that is no multiple of anything), ties of e4m3 rounding (scale 1: amax 448),
    subnormal-range ties, a zero row, tiny values, a NaN row, an inf row, values past a static scale's range."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(K, generator=g) * 3, torch.randn(K, generator=g) * 1e-3]
    ties = torch.zeros(K)
    ties[:7] = torch.tensor([448, 1.0625, 1.1875, -1.0625, 2 ** -10, 3 * 2 ** -10, -5 * 2 ** -10])
    rows += [ties, torch.zeros(K), torch.full((K,), 1e-30), torch.randn(K, generator=g)]
    rows[-1][3] = NAN
    rows.append(torch.randn(K, generator=g))
    rows[-1][5] = INF
    rows.append(torch.randn(K, generator=g) * 1e4)
    return torch.stack(rows).reshape(2, 4, K).to(dtype)


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_fake_quantize_matches_the_float64_reference(dtype, static):
    x = _activations(dtype)
    scale = torch.tensor([0.0123]) if static else None
    out = _ops.fp8_fake_quantize(x, scale)
    ref = ref_fake_quantize(x, scale)
    assert out.dtype == torch.float32 and out.shape == x.shape
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    # q * s is one float32 product of exact factors: within half a float32 ulp of the float64 one
    torch.testing.assert_close(out.double(), ref, rtol=2 ** -24, atol=0, equal_nan=True)


def test_fp8_fake_quantize_rows_by_their_rule():
    x = _activations(torch.float32).reshape(8, -1)
    dyn = _ops.fp8_fake_quantize(x)
    assert dyn[2, :7].tolist() == [448, 1.0, 1.25, -1.0, 0.0, 2 ** -8, -2 ** -8]  # ties to the even code
    assert bool((dyn[3] == 0).all()) and bool(torch.isnan(dyn[5]).all()) and bool(torch.isnan(dyn[6]).all())
    static = _ops.fp8_fake_quantize(x, torch.tensor(0.01))
    assert static[6, 5].item() == pytest.approx(4.48) and bool(torch.isfinite(static[6]).all())  # inf saturates
    assert static[7].abs().max().item() == pytest.approx(4.48)


def _layer(granularity, bias, scheme, run, input_scale=0.0123):
    torch.manual_seed(1)
    lin = nn.Linear(37, 29, bias=bias)
    q = Fp8Linear.from_float(lin, granularity, block_size=(8, 16) if granularity == "block" else None)
    return Fp8Linear.from_quantized(q.weight, q.weight_scale, q.bias, block_size=q.block_size,
                                    input_scale=torch.tensor([input_scale]) if scheme == "static" else None,
                                    activation_scheme=scheme, quantize_activations=run)


@pytest.mark.parametrize("granularity", ["channel", "block"])
@pytest.mark.parametrize("scheme", ["dynamic", "static"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_linear_runs_the_scheme_like_the_float64_reference(dtype, scheme, granularity):
    layer = _layer(granularity, True, scheme, True)
    x = _activations(dtype)
    with torch.no_grad():
        out = layer(x)
    xq = ref_fake_quantize(x, layer.input_scale if scheme == "static" else None)
    w = fp8_weight_f64(layer.weight.view(torch.uint8), layer.weight_scale, layer.block_size)
    xz = torch.nan_to_num(xq, nan=0.0)
    ref, absref = xz @ w.T + layer.bias.double(), xz.abs() @ w.abs().T + layer.bias.double().abs()
    ref[torch.isnan(xq).any(-1)] = NAN  # a NaN activation makes its whole row NaN
    assert out.dtype == dtype
    assert_matmul_close(out, ref, absref, dtype=dtype)


def test_fp8_linear_default_is_weights_only_and_repr_names_the_scheme():
    layer = _layer("channel", False, "dynamic", False)
    x = torch.randn(3, 37)
    with torch.no_grad():
        w8a16 = layer(x)
        assert torch.equal(w8a16, _ops.fp8_mm(x, layer.weight, layer.weight_scale, None))
        assert "activations=x's dtype (checkpoint: fp8 dynamic per-token)" in repr(layer)
        layer.set_activation_scheme("dynamic", run=True)
        assert "activations=fp8 dynamic per-token" in repr(layer)
        assert not torch.equal(layer(x), w8a16)
    assert "activations" not in repr(_layer("channel", False, None, False))
    assert "fp8 static per-tensor (input_scale)" in repr(_layer("channel", False, "static", True))


def test_fp8_linear_scheme_errors_name_the_argument():
    layer = _layer("channel", False, None, False)
    with pytest.raises(ValueError, match="activation_scheme must be one of .*'token'"):
        layer.set_activation_scheme("token")
    with pytest.raises(ValueError, match="run=True needs an activation_scheme"):
        layer.set_activation_scheme(None, run=True)
    with pytest.raises(ValueError, match="'static' needs a one-element input_scale, got None"):
        layer.set_activation_scheme("static")
    layer.input_scale = torch.tensor([0.0])
    with pytest.raises(ValueError, match=r"input_scale must be a positive finite number .* got \[0.0\]"):
        layer.set_activation_scheme("static")


def test_fp8_linear_scheme_gradient_passes_straight_through():
    layer = _layer("channel", True, "dynamic", True)
    x = torch.randn(2, 5, 37, requires_grad=True)
    g = torch.randn(2, 5, 29)
    layer(x).backward(g)
    w = fp8_weight_f64(layer.weight.view(torch.uint8), layer.weight_scale)
    torch.testing.assert_close(x.grad.double(), g.double() @ w, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ real checkpoints
@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """scheme -> (directory, the writer's stack: transformers' reload running compressed-tensors' activation
    quantization, fp32), each written once."""
    cache = {}

    def get(scheme, arch="llama"):
        if (scheme, arch) not in cache:
            path = str(tmp_path_factory.mktemp(f"{arch}-{scheme}"))
            W.write_compressed_tensors(W.tiny_model(arch), arch, path, scheme)
            # MoE: transformers' reload of split experts is not needed (and not what these tests compare)
            stack = None if arch != "llama" else transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32).eval()
            cache[(scheme, arch)] = (path, stack)
        return cache[(scheme, arch)]
    return get


def _load(path, activations, arch="llama"):
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(W.tiny_config(arch), dtype=torch.float32)
    report = load_quantized(model, path, dtype=torch.float32, activations=activations)
    return model.eval(), report


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits.double()


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


SCHEMES = {"fp8-channel": ("dynamic", "FP8 dynamic per-token"),
           "fp8-tensor-static": ("static", "FP8 static per-tensor (input_scale)")}


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_checkpoint_activations_match_the_writers_stack(written, scheme):
    path, stack = written(scheme)
    layer_scheme, words = SCHEMES[scheme]
    model, report = _load(path, "checkpoint")
    up = model.model.layers[0].mlp.up_proj
    assert up.activation_scheme == layer_scheme and up.quantize_activations
    assert report.notes[0] == (f"running the checkpoint's {words} activations in 14 Fp8Linear modules "
                               f"(activations='checkpoint')")
    ref = _logits(stack)
    w8a16, _ = _load(path, "weights-only")
    gap = _rel(_logits(w8a16), ref)
    assert gap > 1e-2  # the activation quantization is visible in the logits ...
    assert _rel(_logits(model), ref) < 1e-5  # ... and reproduced to float rounding


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_weights_only_default_says_what_the_checkpoint_was_written_for(written, scheme):
    path, _ = written(scheme)
    layer_scheme, words = SCHEMES[scheme]
    model, report = _load(path, "weights-only")
    up = model.model.layers[0].mlp.up_proj
    assert up.activation_scheme == layer_scheme and not up.quantize_activations
    assert report.activations["model.layers.0.mlp.up_proj"] == {"dynamic": "fp8-dynamic-token",
                                                                 "static": "fp8-static-tensor"}[layer_scheme]
    assert (f"this checkpoint was written for {words} activations; running W8A16 (weights only) in 14 Fp8Linear "
            f"modules, which is closer to the unquantized model; pass activations='checkpoint' to run the "
            f"checkpoint's scheme") in report.notes
    assert _rel(_logits(model), _logits(W.ct_dequantized(path))) < 1e-5  # W8A16: the dequantized reload


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_save_quantized_keeps_the_scheme_and_input_scales(written, tmp_path, scheme):
    path, stack = written(scheme)
    model, _ = _load(path, "checkpoint")
    out = str(tmp_path / "saved")
    torch_lowbit.save_quantized(model, out)
    with open(os.path.join(path, "config.json")) as f:
        theirs = json.load(f)["quantization_config"]["config_groups"]["group_0"]["input_activations"]
    with open(os.path.join(out, "config.json")) as f:
        ours = json.load(f)["quantization_config"]["config_groups"]["group_0"]["input_activations"]
    assert {k: ours[k] for k in ("strategy", "dynamic", "type", "num_bits")} == \
           {k: theirs[k] for k in ("strategy", "dynamic", "type", "num_bits")}
    written_sd, saved_sd = load_file(os.path.join(path, "model.safetensors")), load_file(
        os.path.join(out, "model.safetensors"))
    scales = sorted(k for k in written_sd if k.endswith("input_scale"))
    assert scales == sorted(k for k in saved_sd if k.endswith("input_scale"))
    assert (len(scales) == 14) == (scheme == "fp8-tensor-static")
    assert all(torch.equal(written_sd[k].float(), saved_sd[k]) for k in scales)
    ref = _logits(stack)
    again = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert _rel(_logits(again), ref) < 1e-5  # transformers runs the same activation quantization
    ours_again = torch_lowbit.from_pretrained(out, "cpu", torch.float32, activations="checkpoint")
    assert _rel(_logits(ours_again), ref) < 1e-5


def test_from_pretrained_passes_activations_through(written):
    path, _ = written("fp8-channel")
    model, report = torch_lowbit.from_pretrained(path, "cpu", torch.float32, return_report=True,
                                                 activations="checkpoint")
    assert model.model.layers[1].self_attn.q_proj.quantize_activations
    assert "activations='checkpoint'" in report.notes[0]


def test_load_quantized_refuses_an_unknown_activations_option(written):
    path, _ = written("fp8-channel")
    with pytest.raises(ValueError, match=r"activations must be one of \('weights-only', 'checkpoint'\), got 'w8a8'"):
        _load(path, "w8a8")


def test_static_scheme_without_its_input_scale_names_the_tensor(written):
    path, _ = written("fp8-tensor-static")
    sd = load_file(os.path.join(path, "model.safetensors"))
    del sd["model.layers.1.mlp.down_proj.input_scale"]
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(W.tiny_config("llama"), dtype=torch.float32)
    with pytest.raises(CheckpointError, match=r"model.layers.1.mlp.down_proj.input_scale is missing"):
        load_quantized(model, sd, config=config)


def test_int8_static_input_scales_are_reported_unused(written):
    path, _ = written("int8-w8a8-static")
    model, report = _load(path, "checkpoint")
    assert isinstance(model.model.layers[0].mlp.up_proj, Int8Linear)
    assert ("the checkpoint's INT8 static per-tensor (input_scale) activations are not supported: 14 Int8Linear "
            "modules quantize activations per token at run time (dynamic INT8), static input scales unused"
            ) in report.notes


def test_moe_experts_run_weights_only_and_say_so(written):
    path, _ = written("fp8-channel", "qwen3_moe")
    model, report = _load(path, "checkpoint", "qwen3_moe")
    assert isinstance(model.model.layers[0].mlp.experts, Fp8Experts)
    assert ("the checkpoint was written for FP8 dynamic per-token activations; 2 Fp8Experts modules run W8A16 "
            "(weights only) whatever activations= says: Fp8Experts quantizes no activations") in report.notes


def test_save_quantized_keeps_the_experts_scheme_of_a_writers_moe_checkpoint(written, tmp_path):
    """compressed-tensors' FP8_DYNAMIC MoE checkpoint: the experts run W8A16 but keep the scheme, so a save writes
    the writer's config back (one group, dynamic per-token activations), not weight-only experts."""
    path, _ = written("fp8-channel", "qwen3_moe")
    model, _ = _load(path, "weights-only", "qwen3_moe")
    experts = model.model.layers[0].mlp.experts
    assert experts.activation_scheme == "dynamic" and "checkpoint activations fp8 dynamic" in repr(experts)
    torch_lowbit.save_quantized(model, tmp_path)
    ours = json.loads((tmp_path / "config.json").read_text())["quantization_config"]["config_groups"]
    theirs = json.loads(open(os.path.join(path, "config.json")).read())["quantization_config"]["config_groups"]
    assert [g["input_activations"]["strategy"] for g in ours.values()] == ["token"]
    assert [g["input_activations"]["dynamic"] for g in ours.values()] == [True]
    assert [g["input_activations"]["type"] for g in theirs.values()] == ["float"]


def _static_experts(E=3, H=16, I=8):
    torch.manual_seed(5)
    experts = Fp8Experts.from_float(torch.randn(E, 2 * I, H), torch.randn(E, H, I), "channel")
    return experts.set_activation_scheme("static", torch.rand(E, 3) + 0.05)


def test_static_experts_input_scales_round_trip_through_save_quantized(tmp_path):
    """Each expert projection's static input_scale is written as compressed-tensors stores it ((1,) fp32 under
    the expert's Linear) and read back into input_scale [E, 3] (gate, up, down)."""
    model = nn.Module()
    model.experts = _static_experts()
    model.proj = Fp8Linear.from_float(nn.Linear(16, 16))
    torch_lowbit.save_quantized(model, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    want = model.experts.input_scale
    for e in range(3):
        for column, p in enumerate(("gate_proj", "up_proj", "down_proj")):
            assert torch.equal(tensors[f"experts.{e}.{p}.input_scale"], want[e, column].reshape(1))
    groups = json.loads((tmp_path / "config.json").read_text())["quantization_config"]["config_groups"]
    acts = {m: g["input_activations"] for g in groups.values() for m in g["targets"]}
    assert acts["experts.1.up_proj"]["strategy"] == "tensor" and acts["experts.1.up_proj"]["dynamic"] is False
    assert acts["proj"] is None  # a weight-only layer beside them stays weight-only
    fresh = nn.Module()
    fresh.experts = Fp8Experts(3, 16, 8)
    fresh.proj = nn.Linear(16, 16)
    load_quantized(fresh, str(tmp_path))
    assert fresh.experts.activation_scheme == "static" and torch.equal(fresh.experts.input_scale, want)


@pytest.mark.parametrize("scheme, scale, match", [
    ("static", None, "input_scale goes with activation_scheme='static'"),
    ("dynamic", torch.ones(3, 3), "input_scale goes with activation_scheme='static'"),
    ("static", torch.ones(3, 2), r"input_scale must be \[E, 3\]"),
    ("static", torch.tensor([[1.0, 0.0, 1.0]] * 3), "positive finite"),
    ("per-group", None, "activation_scheme must be None, 'dynamic' or 'static'")])
def test_experts_scheme_errors_name_the_argument(scheme, scale, match):
    experts = Fp8Experts.from_float(torch.randn(3, 16, 16), torch.randn(3, 16, 8), "channel")
    with pytest.raises(ValueError, match=match):
        experts.set_activation_scheme(scheme, scale)


def test_modelopt_fp8_is_static_per_tensor_and_hf_fp8_dynamic_is_not_run():
    model = TinyLM()
    sd, _ = make_checkpoint(TinyLM(), "modelopt-tensor")
    report = load_quantized(model, sd, config=config_for("modelopt-tensor"), activations="checkpoint")
    up = model.model.layers[0].mlp.up_proj
    assert up.activation_scheme == "static" and up.quantize_activations and float(up.input_scale) == 0.5
    assert "FP8 static per-tensor (input_scale)" in report.notes[0]
    model = TinyLM()
    sd, _ = make_checkpoint(TinyLM(), "hf-fp8-block")
    report = load_quantized(model, sd, config=config_for("hf-fp8-block"), activations="checkpoint")
    assert model.model.layers[0].mlp.up_proj.activation_scheme is None
    assert any("FP8 dynamic per-token-group (1x32) activations;" in n and "run W8A16" in n and
               "torch_lowbit does not run this activation scheme" in n for n in report.notes)
