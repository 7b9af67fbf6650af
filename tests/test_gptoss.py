"""gpt-oss's MXFP4 checkpoints: GptOssW4Experts against float64, and tiny checkpoints written by the published layout
(tests/gptoss_writer.py) loaded by torch_lowbit against transformers' own MXFP4 path (it dequantizes on CPU) reading
the same files."""
import math

import pytest
import torch

pytest.importorskip("transformers")
from transformers import GptOssForCausalLM  # noqa: E402

import torch_lowbit  # noqa: E402
from torch_lowbit.formats import CheckpointError, load_quantized  # noqa: E402
from torch_lowbit.nn.gptoss_experts import GptOssW4Experts  # noqa: E402

from gptoss_writer import MODULES_TO_NOT_CONVERT, e8m0_e2m1, tiny_config, to_blocks, write_gptoss_checkpoint  # noqa: E402
from reference import w4_weight_f64  # noqa: E402

QC = {"quant_method": "mxfp4", "modules_to_not_convert": MODULES_TO_NOT_CONVERT}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gptoss"))
    return path, write_gptoss_checkpoint(path)


@pytest.fixture(scope="module")
def reference(checkpoint):
    """transformers' MXFP4 path on CPU: it dequantizes the experts (to fp32 here) with its own decode."""
    return GptOssForCausalLM.from_pretrained(checkpoint[0], dtype=torch.float32).eval()


def _prompt():
    return torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(1))


# ------------------------------------------------------------------------------------------------ the experts layer
def _random_experts(E=4, H=64, I=64, seed=0, std=0.35):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for p, rows, cols in (("gate_up", 2 * I, H), ("down", H, I)):
        w = torch.randn(E, rows, cols, generator=g) * std
        parts = [e8m0_e2m1(w[e]) for e in range(E)]
        out[f"{p}_blocks"] = torch.stack([to_blocks(c) for c, _ in parts])
        out[f"{p}_scales"] = torch.stack([s for _, s in parts])
        out[f"{p}_bias"] = torch.randn(E, rows, generator=g) * 0.5
    return out


def _layer(t, dtype=torch.float32):
    return GptOssW4Experts.from_mxfp4(t["gate_up_blocks"], t["gate_up_scales"], t["gate_up_bias"].to(dtype),
                                      t["down_blocks"], t["down_scales"], t["down_bias"].to(dtype), dtype=dtype)


def _dense_f64(t, p):
    b, s = t[f"{p}_blocks"], t[f"{p}_scales"]
    E, rows, G, _ = b.shape
    return torch.stack([w4_weight_f64("mxfp4", b[e].reshape(rows, -1), s[e], 32, G * 32) for e in range(E)])


def _experts_f64(t, x, ids, weights, alpha=1.702, limit=7.0):
    """gpt-oss's experts in float64 from the dequantized weights: interleaved gate / up, clamped SwiGLU, biases."""
    gu_w, d_w = _dense_f64(t, "gate_up"), _dense_f64(t, "down")
    out = torch.zeros(x.shape[0], gu_w.shape[-1], dtype=torch.float64)
    clamped = 0
    for i in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[i, j])
            if e < 0:
                continue
            gu = gu_w[e] @ x[i].double() + t["gate_up_bias"][e].double()
            gate, up = gu[0::2], gu[1::2]
            clamped += int((gate > limit).sum() + (up.abs() > limit).sum())
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            h = (up + 1) * gate * torch.sigmoid(alpha * gate)
            out[i] += float(weights[i, j]) * (d_w[e] @ h + t["down_bias"][e].double())
    return out, clamped


def test_experts_layer_matches_float64_with_clamped_swiglu_and_biases():
    t = _random_experts()
    layer = _layer(t)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 64, generator=g)
    # expert 2 gets no token, token 3's second slot is skipped, token 5 routes twice to one expert
    ids = torch.tensor([[0, 1], [1, 3], [3, 0], [1, -1], [0, 3], [1, 1]])
    weights = torch.rand(6, 2, generator=g)
    got = layer(x, ids, weights)
    want, clamped = _experts_f64(t, x, ids, weights)
    assert clamped > 0, "the probe must reach the clamp"
    assert got.dtype == torch.float32 and got.shape == (6, 64)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_experts_layer_one_token_and_bf16():
    t = _random_experts(seed=1)
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(4))
    ids, weights = torch.tensor([[3, 0]]), torch.tensor([[0.7, 0.3]])
    want, _ = _experts_f64(t, x, ids, weights)
    torch.testing.assert_close(_layer(t)(x, ids, weights).double(), want, rtol=1e-5, atol=1e-5 * want.abs().max())
    # bf16: the products and the activation's input are rounded to bf16 once each, the rest is fp32
    got = _layer(t, torch.bfloat16)(x.bfloat16(), ids, weights.bfloat16())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=3e-2, atol=3e-2 * want.abs().max())


def test_from_mxfp4_refuses_bad_layouts_by_name():
    t = _random_experts()
    bad = dict(t, gate_up_blocks=t["gate_up_blocks"].reshape(4, 128, 4, 8))
    with pytest.raises(ValueError, match=r"gate_up_proj_blocks must be uint8 \[E, rows, cols/32, 16\]"):
        _layer(bad)
    bad = dict(t, down_scales=t["down_scales"][:, :, :1])
    with pytest.raises(ValueError, match=r"down_proj_scales must be uint8 E8M0 exponents \[4, 64, 2\]"):
        _layer(bad)
    bad = dict(t, down_bias=t["down_bias"][:3])
    with pytest.raises(ValueError, match=r"down_proj_bias must be a floating \[4, 64\]"):
        _layer(bad)


# ------------------------------------------------------------------------------------------------ checkpoints
def test_logits_and_greedy_tokens_match_transformers_mxfp4(checkpoint, reference):
    model, report = torch_lowbit.from_pretrained(checkpoint[0], dtype=torch.float32, device="cpu",
                                                 return_report=True)
    assert report.format == "gpt-oss-mxfp4"
    assert sorted(report.converted) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert report.unused_keys == [] and report.missing_keys == []
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, GptOssW4Experts)
    assert experts.gate_up_packed.dtype == torch.uint8 and experts.gate_up_scale.dtype == torch.uint8
    assert torch.equal(experts.gate_up_packed, checkpoint[1]["model.layers.0.mlp.experts.gate_up_proj_blocks"]
                       .reshape(4, 128, 32))
    ids = _prompt()
    with torch.no_grad():
        want, got = reference(ids).logits, model(ids).logits
    assert got.dtype == torch.float32
    err = (got - want).abs().max().item()
    assert err <= 1e-5 * want.abs().max().item(), err
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kw), reference.generate(ids, **kw))


class _DenseExpertWatch(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every floating tensor an op creates with at least `numel` elements (one expert's dense gate_up)."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.seen = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(o, torch.Tensor) and o.is_floating_point() and o.numel() >= self.numel:
                self.seen.append((str(func), tuple(o.shape)))
        return out


def _meta_model():
    with torch_lowbit.parameters_on_meta():
        return GptOssForCausalLM(tiny_config())


def test_load_creates_no_dense_expert_tensor(checkpoint):
    tensors = checkpoint[1]
    one_expert = 128 * 64  # 2I * H: larger than any other tensor of the tiny model
    assert all(v.numel() < one_expert for k, v in tensors.items() if "experts" not in k)
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    # the watch sees a dequantize (transformers' own: its planted positive)
    with _DenseExpertWatch(one_expert) as watch:
        convert_moe_packed_tensors(tensors["model.layers.0.mlp.experts.gate_up_proj_blocks"],
                                   tensors["model.layers.0.mlp.experts.gate_up_proj_scales"], dtype=torch.float32)
    assert watch.seen
    model = _meta_model()
    with _DenseExpertWatch(one_expert) as watch:
        load_quantized(model, checkpoint[0], dtype=torch.float32)
    assert watch.seen == []
    floats = [n for n, b in model.named_buffers() if b.is_floating_point() and b.numel() >= one_expert]
    assert floats == [] and not any(p.numel() >= one_expert for p in model.parameters())


@pytest.mark.parametrize("damage, message", [
    (lambda t: t.update({"model.layers.1.mlp.experts.down_proj_blocks":
                         t["model.layers.1.mlp.experts.down_proj_blocks"].reshape(4, 64, 4, 8)}),
     r"model\.layers\.1\.mlp\.experts\.down_proj_blocks has shape \[4, 64, 4, 8\], expected \[4, 64, 2, 16\]"),
    (lambda t: t.pop("model.layers.0.mlp.experts.gate_up_proj_scales"),
     r"model\.layers\.0\.mlp\.experts\.gate_up_proj_scales is missing"),
    (lambda t: t.update({"model.layers.0.mlp.experts.down_proj_scales":
                         t["model.layers.0.mlp.experts.down_proj_scales"][:, :, :1].contiguous()}),
     r"down_proj_scales must be uint8 E8M0 exponents \[4, 64, 2\]"),
])
def test_bad_checkpoints_are_refused_by_name(checkpoint, damage, message):
    tensors = dict(checkpoint[1])
    damage(tensors)
    with pytest.raises(CheckpointError, match=message):
        load_quantized(_meta_model(), tensors, config={"quantization_config": QC})


def test_experts_in_modules_to_not_convert_are_refused(checkpoint):
    qc = dict(QC, modules_to_not_convert=MODULES_TO_NOT_CONVERT + ["model.layers.1.mlp.experts"])
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts holds MXFP4 blocks but is in"):
        load_quantized(_meta_model(), dict(checkpoint[1]), config={"quantization_config": qc})


def test_e8m0_scales_decode_as_powers_of_two():
    # the writer's quantizer against the E2M1 / E8M0 definition, so a wrong writer cannot hide a wrong loader
    w = torch.tensor([[6.0, -0.5, 1.5, 3.0] + [0.0] * 28])
    codes, scales = e8m0_e2m1(w)
    assert scales.tolist() == [[127 + math.floor(math.log2(6.0)) - 2]]
    assert codes[0, :4].tolist() == [7, 9, 3, 5] and w4_weight_f64("mxfp4", to_blocks(codes).reshape(1, 16), scales,
                                                                   32, 32)[0, :4].tolist() == [6.0, -0.5, 1.5, 3.0]


# ------------------------------------------------------------------------------------------------ quantize_
def test_quantize_mxfp4_makes_gptoss_experts_matching_transformers_on_the_dequantized_weights():
    import copy

    from torch import nn

    torch.manual_seed(0)
    model = GptOssForCausalLM(tiny_config()).eval()
    for name, p in model.named_parameters():  # weights large enough to reach the SwiGLU clamp
        if ".experts." in name:
            p.data.normal_(0, 0.35 if name.endswith("proj") else 0.5)
    reference = copy.deepcopy(model)
    _, report = torch_lowbit.quantize_(model, torch_lowbit.Mxfp4WeightOnly(),
                                       lambda m, fqn: not isinstance(m, nn.Linear), return_report=True)
    assert sorted(report.converted) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    for i, layer in enumerate(model.model.layers):
        q, dense = layer.mlp.experts, reference.model.layers[i].mlp.experts
        assert isinstance(q, GptOssW4Experts) and q.format == "mxfp4" and (q.alpha, q.limit) == (1.702, 7.0)
        E = q.num_experts
        gu = torch.stack([w4_weight_f64("mxfp4", q.gate_up_packed[e], q.gate_up_scale[e], 32, 64) for e in range(E)])
        dn = torch.stack([w4_weight_f64("mxfp4", q.down_packed[e], q.down_scale[e], 32, 64) for e in range(E)])
        # the stored weights are the dense ones in their layout (transposed back, gate / up still interleaved),
        # rounded to MXFP4: a few percent off (a permuted layout would be ~140% off)
        for deq, w in ((gu, dense.gate_up_proj.detach().transpose(1, 2)), (dn, dense.down_proj.detach().transpose(1, 2))):
            assert (deq - w.double()).norm() <= 0.15 * w.double().norm()
        with torch.no_grad():  # the reference: transformers' own GptOssExperts on the dequantized weights
            dense.gate_up_proj.copy_(gu.transpose(1, 2).float())
            dense.down_proj.copy_(dn.transpose(1, 2).float())
    ids = _prompt()
    with torch.no_grad():
        want, got = reference(ids).logits, model(ids).logits
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_load_quantized_keeps_the_models_bias_dtype_and_dtype_overrides_it(checkpoint):
    with torch_lowbit.parameters_on_meta():
        model = GptOssForCausalLM(tiny_config()).to(torch.float16)
    load_quantized(model, checkpoint[0])
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_bias.dtype == torch.float16 and experts.gate_up_scale.dtype == torch.uint8
    assert torch.equal(experts.down_bias, checkpoint[1]["model.layers.0.mlp.experts.down_proj_bias"].to(torch.float16))
    model = _meta_model()
    load_quantized(model, checkpoint[0], dtype=torch.bfloat16)
    assert model.model.layers[1].mlp.experts.down_bias.dtype == torch.bfloat16


# ---- saving: gpt-oss's own layout back (save_quantized, save_pretrained)
@pytest.mark.parametrize("how", ["save_quantized", "save_pretrained"])
def test_save_writes_gptoss_layout_that_both_loaders_read_back(checkpoint, reference, tmp_path, how):
    # the experts go back as blocks / scales / biases under gpt-oss's names with quant_method mxfp4 (before: one
    # Linear per expert in compressed-tensors, which transformers loaded with random experts and no error)
    import json

    from safetensors.torch import load_file

    model = torch_lowbit.from_pretrained(checkpoint[0], dtype=torch.float32, device="cpu")
    out = str(tmp_path / "saved")
    if how == "save_quantized":
        torch_lowbit.save_quantized(model, out)
    else:
        model.save_pretrained(out)
    with open(f"{out}/config.json") as f:
        assert json.load(f)["quantization_config"] == QC
    saved, original = load_file(f"{out}/model.safetensors"), checkpoint[1]
    assert sorted(saved) == sorted(original)
    for k, v in original.items():  # codes and scales as read; the rest as loaded (fp32 of the stored bf16)
        assert saved[k].dtype == (v.dtype if v.dtype == torch.uint8 else torch.float32), k
        assert torch.equal(saved[k], v.to(saved[k].dtype)), k
    ids = _prompt()
    again = torch_lowbit.from_pretrained(out, dtype=torch.float32, device="cpu")
    theirs = GptOssForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        want = reference(ids).logits
        assert torch.equal(again(ids).logits, model(ids).logits)
        err = (theirs(ids).logits - want).abs().max().item()
    assert err <= 1e-5 * want.abs().max().item(), err
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(theirs.generate(ids, **kw), reference.generate(ids, **kw))


def test_save_refuses_gptoss_experts_beside_compressed_tensors_layers(tmp_path):
    # one config.json names one quantization method: refused by name, nothing written; keeping only the experts
    # low-bit (dequantize_model(experts="keep")) saves
    torch.manual_seed(0)
    model = GptOssForCausalLM(tiny_config()).eval()
    torch_lowbit.quantize_(model, torch_lowbit.Mxfp4WeightOnly())
    out = tmp_path / "saved"
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts holds gpt-oss's MXFP4 experts.*"
                                         r"model\.layers\.0\.self_attn\.\w+_proj is a torch_lowbit layer"):
        torch_lowbit.save_quantized(model, out)
    assert not out.exists()
    kept = torch_lowbit.dequantize_model(model, experts="keep")
    torch_lowbit.save_quantized(kept, out)
    again = torch_lowbit.from_pretrained(str(out), dtype=torch.float32, device="cpu")
    ids = _prompt()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, kept.float()(ids).logits)


def test_save_refuses_experts_with_biases_in_compressed_tensors_layout(tmp_path):
    # a W4Experts with biases (not gpt-oss's) has no per-expert Linear form: refused, never written without them
    from torch_lowbit.nn.w4_experts import W4Experts

    model = torch.nn.Module()
    model.experts = W4Experts(2, 64, 32, format="int4", group_size=32, bias=True)
    with pytest.raises(ValueError, match=r"experts is a W4Experts with expert biases"):
        torch_lowbit.save_quantized(model, tmp_path / "saved")
