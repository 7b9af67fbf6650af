"""Checkpoint formats: detection, loading into torch_lowbit layers (vs the float64 model with the dequantized
weights), ignore lists, the report, and every error path."""
import json
import re
import os

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import torch_lowbit.nn as tlnn
from checkpoints import FORMAT_OF, SPECS, config_for, make_checkpoint, write_dir
from reference import fp8_bits_to_f64
from tiny_models import TinyLM, linear_names
from torch_lowbit.formats import CheckpointError, detect_format, load_quantized
from torch_lowbit.formats.detect import matches

pytestmark = pytest.mark.skipif(not hasattr(tlnn, "Fp8Linear"),
                                reason="torch_lowbit.nn.Fp8Linear / Int8Linear have not landed in this tree yet")

IDS = torch.tensor([[3, 17, 42, 5, 88, 1, 0, 64, 23], [96, 2, 2, 50, 11, 7, 33, 8, 70]])
QUANTIZED = {  # linear names each checkpoint quantizes (the tiny model's 2 layers)
    n for n in linear_names(TinyLM()) if not (n == "lm_head" or n.endswith("mlp.gate")
                                              or n == "model.layers.1.self_attn.o_proj")}


def _model(seed=1, meta=False, **kw):
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return TinyLM(**kw)
    return TinyLM(**kw)


def _source_model():
    return _model(seed=0)


def _assert_logits_close(model, ref, rtol):
    with torch.no_grad():
        out = model(IDS)
        want = ref(IDS)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    err = (out.double() - want).abs().max().item()
    assert err <= rtol * want.abs().max().item(), f"max error {err:.3g} vs max |logit| {want.abs().max().item():.3g}"


@pytest.mark.parametrize("spec", sorted(SPECS))
def test_directory_checkpoint_matches_float64_dequantized_model(tmp_path, spec):
    sd, ref = make_checkpoint(_source_model(), spec)
    write_dir(tmp_path, sd, spec)
    model = _model()
    report = load_quantized(model, tmp_path, dtype=torch.float32)
    assert report.format == FORMAT_OF[spec] == str(detect_format(tmp_path))
    assert set(report.converted) == QUANTIZED
    layer_type = tlnn.Int8Linear if spec == "ct-int8" else tlnn.Fp8Linear
    assert all(isinstance(model.get_submodule(n), layer_type) for n in QUANTIZED)
    assert type(model.lm_head) is nn.Linear and type(model.model.layers[1].self_attn.o_proj) is nn.Linear
    assert "lm_head" in report.high_precision
    assert report.missing_keys == [] and report.unused_keys == (["scaled_fp8"] if spec == "comfy" else [])
    # W8A8 rounds activations to int8 per token (about 0.4% each); everything else is fp32 arithmetic
    _assert_logits_close(model, ref, 5e-2 if spec == "ct-int8" else 2e-5)


@pytest.mark.parametrize("spec", ["hf-fp8-block", "ct-fp8-channel", "modelopt-tensor", "ct-int8", "comfy"])
def test_state_dict_with_config_on_a_meta_model(spec):
    sd, ref = make_checkpoint(_source_model(), spec)
    model = _model(meta=True)
    report = load_quantized(model, sd, config=config_for(spec), dtype=torch.float32)
    assert report.missing_keys == []
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    _assert_logits_close(model, ref, 5e-2 if spec == "ct-int8" else 2e-5)


def test_loaded_weights_and_scales_are_the_checkpoint_tensors_normalized():
    sd, _ = make_checkpoint(_source_model(), "ct-fp8-block")
    model = _model()
    load_quantized(model, sd, config=config_for("ct-fp8-block"), dtype=torch.float32)
    name = "model.layers.0.mlp.down_proj"  # [48, 80]: stored padded to [48, 96] with weight_shape_original
    layer = model.get_submodule(name)
    assert sd[f"{name}.weight"].shape == (48, 96)
    assert torch.equal(layer.weight.view(torch.uint8), sd[f"{name}.weight"].view(torch.uint8)[:, :80])
    assert layer.weight_scale.dtype == torch.float32  # bf16 in the checkpoint, widened
    assert torch.equal(layer.weight_scale, sd[f"{name}.weight_scale"].float())
    assert tuple(layer.block_size) == (16, 32)
    # per-channel [N, 1] -> [N]
    sd, _ = make_checkpoint(_source_model(), "fbgemm")
    model = _model()
    load_quantized(model, sd, config=config_for("fbgemm"))
    q = model.model.layers[0].self_attn.q_proj
    assert q.weight_scale.shape == (48,) and torch.equal(q.weight_scale, sd["model.layers.0.self_attn.q_proj.weight_scale"][:, 0])
    assert q.bias is not None and torch.equal(q.bias.float(), sd["model.layers.0.self_attn.q_proj.bias"].float())


def test_modelopt_input_scale_reaches_the_layer():
    sd, _ = make_checkpoint(_source_model(), "modelopt-tensor")
    model = _model()
    load_quantized(model, sd, config=config_for("modelopt-tensor"))
    assert float(model.model.layers[0].mlp.up_proj.input_scale) == 0.5


def test_sharded_directory_and_bf16_model(tmp_path):
    sd, ref = make_checkpoint(_source_model(), "hf-fp8-block")
    write_dir(tmp_path, sd, "hf-fp8-block", shards=3)
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) == 3
    model = _model().to(torch.bfloat16)
    report = load_quantized(model, tmp_path)
    assert set(report.converted) == QUANTIZED and report.unused_keys == [] and report.missing_keys == []
    assert model.lm_head.weight.dtype == torch.bfloat16
    with torch.no_grad():
        out = model(IDS).double()
        want = ref(IDS)
    assert (out - want).abs().max() <= 0.1 * want.abs().max()  # bf16 activations throughout


def test_single_safetensors_file_without_config(tmp_path):
    sd, ref = make_checkpoint(_source_model(), "comfy")
    path = tmp_path / "flux-ish-fp8-scaled.safetensors"
    save_file(sd, str(path))
    model = _model()
    report = load_quantized(model, path, dtype=torch.float32)
    assert report.format == "diffusion-fp8" and report.details["kind"] == "ComfyUI scaled fp8"
    _assert_logits_close(model, ref, 2e-5)


def test_report_lists_unused_missing_and_high_precision():
    sd, _ = make_checkpoint(_source_model(), "hf-fp8-block")
    sd["model.layers.0.self_attn.k_proj.k_scale"] = torch.tensor(1.0)
    sd["some.other.tensor"] = torch.zeros(3)
    del sd["model.norm.weight"]
    model = _model()
    report = load_quantized(model, sd, config=config_for("hf-fp8-block"))
    assert report.unused_keys == ["model.layers.0.self_attn.k_proj.k_scale", "some.other.tensor"]
    assert report.missing_keys == ["model.norm.weight"]
    assert report.high_precision["lm_head"] == "in the ignore list"
    assert report.converted["model.layers.0.mlp.gate_proj"] == "Fp8Linear(block 16x32)"
    assert report.details["weight_block_size"] == (16, 32)
    assert "unused keys" in str(report)
    with pytest.raises(CheckpointError, match="strict load"):
        load_quantized(_model(), sd, config=config_for("hf-fp8-block"), strict=True)


def test_unquantized_linear_not_in_ignore_list_stays_high_precision():
    sd, _ = make_checkpoint(_source_model(), "hf-fp8-block")
    name = "model.layers.0.mlp.up_proj"
    sd[f"{name}.weight"] = torch.randn(80, 48).to(torch.bfloat16)
    del sd[f"{name}.weight_scale_inv"]
    model = _model()
    report = load_quantized(model, sd, config=config_for("hf-fp8-block"))
    assert report.high_precision[name] == "stored as torch.bfloat16"
    assert type(model.get_submodule(name)) is nn.Linear
    assert torch.equal(model.get_submodule(name).weight, sd[f"{name}.weight"].float())


def test_tied_embeddings_stay_tied():
    sd, _ = make_checkpoint(_source_model(), "hf-fp8-block")
    del sd["lm_head.weight"]
    model = _model(meta=True)
    model.lm_head.weight = model.model.embed_tokens.weight
    report = load_quantized(model, sd, config=config_for("hf-fp8-block"))
    assert report.missing_keys == []
    assert model.lm_head.weight is model.model.embed_tokens.weight and not model.lm_head.weight.is_meta


# ------------------------------------------------------------------------------------------ the registry
F8, F32, BF16, I8, I64 = torch.float8_e4m3fn, torch.float32, torch.bfloat16, torch.int8, torch.int64
# What each example stores for model.layers.0.mlp.down_proj (a [48, 80] weight), from the formats' published
# layouts (see the format modules' docstrings), written here by hand: the examples' writers must agree with it.
STORED = {
    "modelopt-tensor": {"weight": (F8, (48, 80)), "weight_scale": (F32, ()), "input_scale": (F32, ())},
    "modelopt-channel": {"weight": (F8, (48, 80)), "weight_scale": (F32, (48,))},
    "ct-fp8-tensor": {"weight": (F8, (48, 80)), "weight_scale": (BF16, (1,))},
    "ct-fp8-channel": {"weight": (F8, (48, 80)), "weight_scale": (BF16, (48, 1))},
    "ct-fp8-block": {"weight": (F8, (48, 96)), "weight_scale": (BF16, (3, 3)), "weight_shape_original": (I64, (2,))},
    "ct-int8": {"weight": (I8, (48, 80)), "weight_scale": (BF16, (48, 1))},
    "ct-naive": {"weight": (F8, (48, 80)), "weight_scale": (F32, (48, 1))},
    "hf-fp8-block": {"weight": (F8, (48, 80)), "weight_scale_inv": (F32, (3, 3))},
    "hf-fp8-tensor": {"weight": (F8, (48, 80)), "weight_scale_inv": (F32, (1,))},
    "fbgemm": {"weight": (F8, (48, 80)), "weight_scale": (F32, (48, 1)), "input_scale_ub": (F32, ())},
    "diffusion-raw": {"weight": (F8, (48, 80))},
    "comfy": {"weight": (F8, (48, 80)), "scale_weight": (F32, (1,)), "scale_input": (F32, ())},
}
CONFIG_OF = {  # (file, the field that identifies the format)
    "modelopt-tensor": ("hf_quant_config.json", ("quantization", "quant_algo"), "FP8"),
    "modelopt-channel": ("config.json", ("quantization_config", "quant_method"), "modelopt"),
    "ct-naive": ("config.json", ("quantization_config", "format"), "naive-quantized"),
    "ct-int8": ("config.json", ("quantization_config", "format"), "int-quantized"),
    "ct-fp8-block": ("config.json", ("quantization_config", "config_groups", "group_0", "weights", "block_structure"),
                     [16, 32]),
    "hf-fp8-block": ("config.json", ("quantization_config", "weight_block_size"), [16, 32]),
    "hf-fp8-tensor": ("config.json", ("quantization_config", "weight_block_size"), None),
    "fbgemm": ("config.json", ("quantization_config", "quant_method"), "fbgemm_fp8"),
}


def test_every_example_is_pinned_by_the_table():
    assert set(SPECS) == set(STORED)


@pytest.mark.parametrize("spec", sorted(STORED))
def test_examples_store_the_published_layout(tmp_path, spec):
    sd, ref = make_checkpoint(_source_model(), spec)
    prefix = "model.layers.0.mlp.down_proj."
    got = {k[len(prefix):]: (v.dtype, tuple(v.shape)) for k, v in sd.items() if k.startswith(prefix)}
    assert got == STORED[spec]
    # every built-in format's stored scale is a multiplier (HF's weight_scale_inv too): codes * scale = the weight
    codes = sd[prefix + "weight"][:48, :80]
    values = codes.double() if codes.dtype == I8 else fp8_bits_to_f64(codes.view(torch.uint8))
    skey = next((prefix + k for k in ("weight_scale", "weight_scale_inv", "scale_weight") if prefix + k in sd), None)
    if skey is not None:
        s = sd[skey].double()
        full = s[torch.arange(48) // 16][:, torch.arange(80) // 32] if s.dim() == 2 and s.shape[1] > 1 else \
            s.reshape(-1, 1).expand(48, 80)
        values = values * full
    assert torch.equal(values, ref.model.layers[0].mlp.down_proj.weight.detach())
    write_dir(tmp_path, sd, spec)
    if spec in CONFIG_OF:
        fname, path, want = CONFIG_OF[spec]
        v = json.loads((tmp_path / fname).read_text())
        for k in path:
            v = v[k]
        assert v == want
    if spec == "comfy":
        assert sd["scaled_fp8"].dtype == F8 and sd["scaled_fp8"].numel() == 0


def test_a_new_format_is_one_class_and_one_registration(tmp_path, monkeypatch):
    """A format with inverse scales (the stored tensor divides), claimed by its own quant_method: registered, it is
    detected, its example written by the generic helpers, and it loads like the built-in ones."""
    from torch_lowbit.formats import registry
    from torch_lowbit.formats.registry import CheckpointFormat, Example
    from torch_lowbit.granularity import PerChannel

    class InverseScales(CheckpointFormat):
        name = "toy-inverse"
        quant_methods = ("toy_inverse",)
        scale_key = "weight_inv_scale"
        scale_is_inverse = True

        def parse(self, qc, side, where):
            return self.make(ignore=registry.name_list(qc, "skip", where.qc))

        def examples(self):
            return {"toy-inverse": Example(PerChannel(), "N")}

        def example_config(self, example, keep):
            return {"quant_method": "toy_inverse", "skip": list(keep)}, None

    monkeypatch.setattr(registry, "_REGISTRY", list(registry._REGISTRY))
    registry.register_format(InverseScales())
    sd, ref = make_checkpoint(_source_model(), "toy-inverse")
    s = sd["model.layers.0.mlp.up_proj.weight_inv_scale"]
    assert s.min() > 1 / 0.061  # stored as 1 / multiplier (multipliers are 0.03 .. 0.06)
    write_dir(tmp_path, sd, "toy-inverse")
    model = _model()
    report = load_quantized(model, tmp_path, dtype=torch.float32)
    assert report.format == "toy-inverse" and set(report.converted) == QUANTIZED and report.unused_keys == []
    _assert_logits_close(model, ref, 2e-5)
    with pytest.raises(ValueError, match="clashes with the registered 'toy-inverse'"):
        registry.register_format(InverseScales())


# ------------------------------------------------------------------------------------------ detection
@pytest.mark.parametrize("spec", sorted(SPECS))
def test_detect_format_from_state_dict_and_config(spec):
    sd, _ = make_checkpoint(_source_model(), spec)
    assert detect_format(sd, config=config_for(spec)).name == FORMAT_OF[spec]


def test_detect_without_config_from_tensor_names():
    sd, _ = make_checkpoint(_source_model(), "hf-fp8-block")
    fmt = detect_format(sd)
    assert fmt.name == "fp8" and fmt.block_size == (128, 128)
    sd, _ = make_checkpoint(_source_model(), "diffusion-raw")
    fmt = detect_format(sd)
    assert fmt.name == "diffusion-fp8" and not fmt.scale_required and fmt.details["kind"] == "raw e4m3 (scale 1)"
    assert detect_format(sd, config={"quantization_config": {"quant_method": "fp8"}}).block_size == (128, 128)


@pytest.mark.parametrize("name,pattern,hit", [
    ("lm_head", "lm_head", True),
    ("model.layers.0.mlp.gate", "mlp.gate", True),
    ("model.layers.0.mlp.gate_proj", "mlp.gate", False),
    ("model.layers.0.mlp.gate_proj", "gate", False),
    ("model.layers.1.self_attn.q_proj", "model.layers.1", True),
    ("model.layers.10.self_attn.q_proj", "model.layers.1", False),
    ("model.layers.10.self_attn.q_proj", "model.layers.1.*", False),
    ("model.layers.1.self_attn.q_proj", "model.layers.1.*", True),
    ("model.layers.3.mlp.gate", "*.mlp.gate", True),
    ("model.layers.3.mlp.gate_proj", "*.mlp.gate", False),
    ("model.layers.3.mlp.gate", r"re:.*mlp\.gate$", True),
    ("model.layers.3.mlp.gate_proj", r"re:.*mlp\.gate$", False),
    ("model.layers.3.mlp.gate_proj", "re:model.layers.3", True),
])
def test_ignore_pattern_semantics(name, pattern, hit):
    assert matches(name, pattern) is hit


# ------------------------------------------------------------------------------------------ errors
def test_pickle_files_are_refused_without_reading_them(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"not even a pickle")
    with pytest.raises(CheckpointError, match=r"refusing to read .*pytorch_model\.bin.*pickle"):
        load_quantized(_model(), tmp_path)
    with pytest.raises(CheckpointError, match=r"refusing to read .*model\.pt"):
        load_quantized(_model(), tmp_path / "model.pt")


def test_unknown_quant_method():
    sd, _ = make_checkpoint(_source_model(), "hf-fp8-block")
    with pytest.raises(CheckpointError, match="unknown quant_method 'awq'"):
        load_quantized(_model(), sd, config={"quantization_config": {"quant_method": "awq", "bits": 4}})


def test_unsupported_compressed_tensors_format():
    sd, _ = make_checkpoint(_source_model(), "ct-fp8-channel")
    cfg = config_for("ct-fp8-channel")
    cfg["quantization_config"]["format"] = "marlin-24"
    with pytest.raises(CheckpointError, match="'marlin-24' is not supported"):
        load_quantized(_model(), sd, config=cfg)


@pytest.mark.parametrize("ct_format", ["pack-quantized", "nvfp4-pack-quantized"])
def test_8bit_weights_in_a_4bit_compressed_tensors_format_are_refused_by_name(ct_format):
    sd, _ = make_checkpoint(_source_model(), "ct-fp8-channel")
    cfg = config_for("ct-fp8-channel")
    cfg["quantization_config"]["format"] = ct_format
    with pytest.raises(CheckpointError, match=f"8-bit float weights in format '{ct_format}' are not supported"):
        load_quantized(_model(), sd, config=cfg)


def test_missing_scale_names_the_tensor():
    sd, _ = make_checkpoint(_source_model(), "hf-fp8-block")
    del sd["model.layers.1.mlp.down_proj.weight_scale_inv"]
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.down_proj\.weight_scale_inv is missing"):
        load_quantized(_model(), sd, config=config_for("hf-fp8-block"))


def test_weight_shape_mismatch_names_the_tensor():
    sd, _ = make_checkpoint(_source_model(), "ct-fp8-channel")
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight has shape \[48, 48\].*"
                                              r"expects \[64, 64\]"):
        load_quantized(_model(H=64), sd, config=config_for("ct-fp8-channel"))


def test_high_precision_shape_mismatch_names_the_tensor():
    sd, _ = make_checkpoint(_source_model(), "ct-fp8-channel")
    with pytest.raises(CheckpointError, match=r"model\.embed_tokens\.weight has shape \[97, 48\]"):
        load_quantized(_model(V=50), sd, config=config_for("ct-fp8-channel"))


def test_scale_shape_mismatch_names_the_tensor():
    sd, _ = make_checkpoint(_source_model(), "hf-fp8-block")
    sd["model.layers.0.mlp.up_proj.weight_scale_inv"] = torch.ones(3, 3)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.up_proj\.weight_scale_inv of shape \[3, 3\] "
                                              r"fits no layout .* or \[5, 2\] \(blocks of 16x32\)"):
        load_quantized(_model(), sd, config=config_for("hf-fp8-block"))


def test_sharded_index_with_a_missing_shard(tmp_path):
    sd, _ = make_checkpoint(_source_model(), "hf-fp8-block")
    write_dir(tmp_path, sd, "hf-fp8-block", shards=2)
    os.remove(tmp_path / "model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointError, match=r"shard 'model-00002-of-00002\.safetensors' .* is missing"):
        load_quantized(_model(), tmp_path)


def test_index_naming_a_tensor_its_shard_lacks(tmp_path):
    sd, _ = make_checkpoint(_source_model(), "hf-fp8-block")
    write_dir(tmp_path, sd, "hf-fp8-block", shards=2)
    index = tmp_path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["model.extra.weight"] = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"'model\.extra\.weight' is listed .* does not contain it"):
        load_quantized(_model(), tmp_path)


def test_quantized_weight_of_an_ignored_module_is_an_error():
    sd, _ = make_checkpoint(_source_model(), "hf-fp8-block")
    cfg = config_for("hf-fp8-block")
    cfg["quantization_config"]["modules_to_not_convert"] = ["lm_head", "mlp.gate", "self_attn"]
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight is .*ignore list"):
        load_quantized(_model(), sd, config=cfg)


def test_int8_weight_in_an_fp8_format_and_e5m2_are_errors():
    sd, _ = make_checkpoint(_source_model(), "hf-fp8-block")
    sd["model.layers.0.mlp.up_proj.weight"] = torch.zeros(80, 48, dtype=torch.int8)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.up_proj\.weight is int8"):
        load_quantized(_model(), sd, config=config_for("hf-fp8-block"))
    sd["model.layers.0.mlp.up_proj.weight"] = torch.zeros(80, 48, dtype=torch.float8_e5m2)
    with pytest.raises(CheckpointError, match=r"up_proj\.weight is torch\.float8_e5m2"):
        load_quantized(_model(), sd, config=config_for("hf-fp8-block"))


def test_not_a_quantized_checkpoint():
    sd = {k: v.to(torch.bfloat16) for k, v in _source_model().state_dict().items()}
    with pytest.raises(CheckpointError, match="no quantization config and no float8_e4m3fn tensors"):
        load_quantized(_model(), sd)


def test_modelopt_non_fp8_algorithm_is_refused():
    sd, _ = make_checkpoint(_source_model(), "modelopt-tensor")
    with pytest.raises(CheckpointError, match="ModelOpt quant_algo 'W4A16_AWQ' is not supported"):
        load_quantized(_model(), sd, config={"quantization": {"quant_algo": "W4A16_AWQ"}})


# ----------------------------------------------------------------------------------------- 4-bit checkpoints
# Small hand-written files of each 4-bit layout: codes packed here by plain arithmetic (word = sum of code << 4j),
# weights compared with the float64 formula of each writer. The real writers' files: test_w4_checkpoints.py.
W4_N, W4_K = 24, 70  # K: not a multiple of 8 (a padded word) nor of the group (a partial group)


class _TwoLinears(nn.Module):
    def __init__(self, N=W4_N, K=W4_K, vocab=None):
        super().__init__()
        self.emb = nn.Embedding(vocab, K) if vocab else None
        self.a = nn.Linear(K, N)
        self.b = nn.Linear(K, N, bias=False)


def _codes(N, K, seed):
    return torch.randint(0, 16, (N, K), generator=torch.Generator().manual_seed(seed))


def _words(codes, along_rows=False):
    """int32 words of eight 4-bit codes each along K (or along N: compressed-tensors' zero points)."""
    c = codes.t() if along_rows else codes
    R, C = c.shape
    padded = torch.zeros(R, -(-C // 8) * 8, dtype=torch.int64)
    padded[:, :C] = c
    w = (padded.view(R, -1, 8) << (4 * torch.arange(8))).sum(-1)
    w = torch.where(w >= 2 ** 31, w - 2 ** 32, w).to(torch.int32)
    return w.t().contiguous() if along_rows else w


def _ct_int4(N, K, group, asym, seed=0):
    """compressed-tensors pack-quantized tensors of one module and the float64 weight they mean."""
    G = -(-K // group)
    codes = _codes(N, K, seed)
    scale = torch.rand(N, G, generator=torch.Generator().manual_seed(seed + 1)) * 0.1 + 0.01
    zp = torch.randint(-8, 8, (N, G), generator=torch.Generator().manual_seed(seed + 2)) if asym else None
    t = {"weight_packed": _words(codes), "weight_scale": scale, "weight_shape": torch.tensor([N, K])}
    q = (codes - 8).double()
    if asym:
        t["weight_zero_point"] = _words(zp + 8, along_rows=True)
        q = q - zp.double().repeat_interleave(group, 1)[:, :K]
    return t, q * scale.double().repeat_interleave(group, 1)[:, :K]


def _fp4_bytes(codes):
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)


E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)


def _ct_fp4(fmt, N, K, seed=0):
    group = 16 if fmt == "nvfp4" else 32
    G = K // group
    codes = _codes(N, K, seed)
    g = torch.Generator().manual_seed(seed + 1)
    if fmt == "nvfp4":
        scale = (torch.rand(N, G, generator=g) * 4 + 0.1).to(torch.float8_e4m3fn)
        t = {"weight_packed": _fp4_bytes(codes), "weight_scale": scale, "weight_global_scale": torch.tensor([3.0])}
        s = scale.double() / 3.0
    else:
        bits = torch.randint(120, 131, (N, G), generator=g).to(torch.uint8)
        t = {"weight_packed": _fp4_bytes(codes), "weight_scale": bits}
        s = torch.pow(2.0, bits.double() - 127)
    return t, E2M1[codes] * s.repeat_interleave(group, 1)


def _ct_w4_config(ct_format, weights, ignore=()):
    return {"quantization_config": {"quant_method": "compressed-tensors", "format": ct_format,
                                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
                                    "ignore": list(ignore)}}


def _int4_args(group, asym):
    return {"num_bits": 4, "type": "int", "symmetric": not asym, "dynamic": False,
            "strategy": "group" if group else "channel", "group_size": group}


def _w4_state_dict(per_module, model):
    sd = {f"{m}.{k}": v for m, t in per_module.items() for k, v in t.items()}
    sd["a.bias"] = torch.randn(W4_N)
    return sd


@pytest.mark.parametrize("group,asym", [(32, False), (32, True), (None, False), (None, True), (16, True)])
def test_ct_pack_quantized_int4_loads_the_writers_weights_exactly(group, asym):
    ta, wa = _ct_int4(W4_N, W4_K, group or W4_K, asym, seed=0)
    tb, wb = _ct_int4(W4_N, W4_K, group or W4_K, asym, seed=5)
    model = _TwoLinears()
    sd = _w4_state_dict({"a": ta, "b": tb}, model)
    report = load_quantized(model, sd, config=_ct_w4_config("pack-quantized", _int4_args(group, asym)),
                            dtype=torch.float32, strict=True)
    assert report.format == "compressed-tensors" and set(report.converted) == {"a", "b"}
    for name, want in (("a", wa), ("b", wb)):
        layer = model.get_submodule(name)
        assert isinstance(layer, tlnn.W4Linear) and layer.format == "int4"
        assert (layer.weight_offset is not None) == asym and layer.weight_scale.dtype == torch.float32
        # (q - zp) is an integer: its product with an fp32 scale is the float64 value rounded once
        assert torch.equal(layer.dequantize(torch.float32), want.float())
    assert torch.equal(model.a.bias, sd["a.bias"])


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_ct_fp4_pack_quantized_loads_the_writers_weights(fmt):
    K = 64
    ta, wa = _ct_fp4(fmt, W4_N, K, seed=0)
    tb, wb = _ct_fp4(fmt, W4_N, K, seed=3)
    model = _TwoLinears(K=K)
    weights = {"num_bits": 4, "type": "float", "symmetric": True, "dynamic": False,
               "strategy": "tensor_group" if fmt == "nvfp4" else "group", "group_size": 16 if fmt == "nvfp4" else 32}
    load_quantized(model, _w4_state_dict({"a": ta, "b": tb}, model),
                   config=_ct_w4_config(f"{fmt}-pack-quantized", weights), dtype=torch.float32, strict=True)
    for name, want in (("a", wa), ("b", wb)):
        layer = model.get_submodule(name)
        assert isinstance(layer, tlnn.W4Linear) and layer.format == fmt
        got = layer.dequantize(torch.float32).double()
        if fmt == "mxfp4":
            assert torch.equal(got, want)
        else:  # e2m1 * s * fp32(1 / 3): within two fp32 roundings of e2m1 * (s / 3)
            assert torch.allclose(got, want, rtol=2 ** -22, atol=0)
            assert torch.equal(layer.weight_scale_2, torch.tensor([1 / 3.0]))


def _mlx_module(N, K, group, seed, mode="affine"):
    codes = _codes(N, K, seed)
    G = K // group
    g = torch.Generator().manual_seed(seed + 1)
    if mode == "affine":
        scales, biases = torch.rand(N, G, generator=g) * 0.1, torch.randn(N, G, generator=g) * 0.1
        t = {"weight": _words(codes).view(torch.uint32), "scales": scales, "biases": biases}
        return t, codes.double() * scales.double().repeat_interleave(group, 1) + biases.double().repeat_interleave(
            group, 1), codes.double() * scales.double().repeat_interleave(group, 1)
    bits = torch.randint(120, 131, (N, G), generator=g).to(torch.uint8)  # mxfp4: e8m0
    return ({"weight": _words(codes).view(torch.uint32), "scales": bits},
            E2M1[codes] * torch.pow(2.0, bits.double() - 127).repeat_interleave(group, 1), None)


def _assert_affine_close(got, want, product):
    """q * s + b in fp32: the product and the sum each rounded once (or one fused rounding)."""
    bound = 2 ** -24 * (product.abs() + want.abs()) * 1.0001
    assert bool(((got.double() - want).abs() <= bound).all()), float((got.double() - want).abs().max())


def test_mlx_affine_loads_linears_as_w4linear_and_the_embedding_dequantized():
    K, V = 64, 40
    ta, wa, pa = _mlx_module(W4_N, K, 32, 0)
    te, we, pe = _mlx_module(V, K, 32, 7)
    model = _TwoLinears(K=K, vocab=V)
    sd = {**{f"a.{k}": v for k, v in ta.items()}, **{f"emb.{k}": v for k, v in te.items()},
          "a.bias": torch.randn(W4_N), "b.weight": torch.randn(W4_N, K)}
    config = {"quantization": {"group_size": 32, "bits": 4, "b": False}}  # older mlx_lm: "quantization" only
    report = load_quantized(model, sd, config=config, dtype=torch.float32, strict=True)
    assert report.format == "mlx" == str(detect_format(sd, config=config))
    assert report.converted == {"a": "W4Linear(uint4, group 32, biases)"}
    assert report.high_precision == {"b": "in the ignore list"}
    assert isinstance(model.a, tlnn.W4Linear) and model.a.format == "uint4"
    _assert_affine_close(model.a.dequantize(torch.float32), wa, pa)
    assert type(model.emb) is nn.Embedding  # no matmul: dequantized once at load
    _assert_affine_close(model.emb.weight, we, pe)


def test_mlx_mxfp4_mode_and_per_module_overrides(tmp_path):
    K = 64
    ta, wa, _ = _mlx_module(W4_N, K, 32, 0, mode="mxfp4")
    tb, wb, pb = _mlx_module(W4_N, K, 32, 4, mode="affine")
    model = _TwoLinears(K=K)
    sd = {**{f"a.{k}": v for k, v in ta.items()}, **{f"b.{k}": v for k, v in tb.items()}, "a.bias": torch.randn(W4_N)}
    q = {"group_size": 32, "bits": 4, "mode": "mxfp4", "b": {"group_size": None, "bits": 4, "mode": "affine"}}
    save_file(sd, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"quantization": q, "quantization_config": q}))
    report = load_quantized(model, tmp_path, dtype=torch.float32, strict=True)
    assert report.converted == {"a": "W4Linear(mxfp4, group 32)", "b": "W4Linear(uint4, group 32, biases)"}
    assert torch.equal(model.a.dequantize(torch.float32).double(), wa)
    _assert_affine_close(model.b.dequantize(torch.float32), wb, pb)


def _int4_case(**over):
    ta, _ = _ct_int4(W4_N, W4_K, 32, True)
    tb, _ = _ct_int4(W4_N, W4_K, 32, True, seed=5)
    sd = _w4_state_dict({"a": ta, "b": tb}, None)
    args = {**_int4_args(32, True), **over}
    return sd, _ct_w4_config("pack-quantized", args)


def _bad_int4(edit, **over):
    sd, config = _int4_case(**over)
    edit(sd)
    return sd, config


W4_BAD_FILES = {
    "words per row": (lambda: _bad_int4(lambda sd: sd.update({"a.weight_packed": sd["a.weight_packed"][:, :8]})),
                      r"a\.weight_packed has 8 words per row, expected ceil\(70 / 8\) = 9"),
    "scale missing": (lambda: _bad_int4(lambda sd: sd.pop("b.weight_scale")),
                      r"its scale b\.weight_scale is missing"),
    "scale shape": (lambda: _bad_int4(lambda sd: sd.update({"a.weight_scale": sd["a.weight_scale"][:, :2]})),
                    r"a\.weight_scale has shape \[24, 2\], expected \[24, 3\]"),
    "zero points missing": (lambda: _bad_int4(lambda sd: sd.pop("a.weight_zero_point")),
                            r"a\.weight_zero_point is missing: the config says these weights are asymmetric"),
    "weight_shape": (lambda: _bad_int4(lambda sd: sd.update({"b.weight_shape": torch.tensor([24, 72])})),
                     r"b\.weight_shape = \[24, 72\] but the model's layer b expects \[24, 70\]"),
    "8-bit": (lambda: _int4_case(num_bits=8), r"8-bit int weights in format 'pack-quantized' are not supported"),
    "actorder group": (lambda: _int4_case(actorder="group"), r"actorder 'group' is not supported"),
    "tensor strategy": (lambda: _int4_case(strategy="tensor"), r"strategy 'tensor' is not supported for 4-bit"),
    "g_idx permuted": (lambda: _bad_int4(lambda sd: sd.update({"a.weight_g_idx": torch.arange(W4_K).flip(0) // 32})),
                       r"a\.weight_g_idx permutes the input features"),
}


@pytest.mark.parametrize("case", sorted(W4_BAD_FILES))
def test_bad_4bit_compressed_tensors_files_are_refused_by_name(case):
    make, message = W4_BAD_FILES[case]
    sd, config = make()
    with pytest.raises(CheckpointError, match=message):
        load_quantized(_TwoLinears(), sd, config=config)


def test_nvfp4_without_its_global_scale_is_refused_by_name():
    ta, _ = _ct_fp4("nvfp4", W4_N, 64)
    del ta["weight_global_scale"]
    weights = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}
    with pytest.raises(CheckpointError, match=r"a\.weight_global_scale is missing"):
        load_quantized(_TwoLinears(K=64), {f"a.{k}": v for k, v in ta.items()},
                       config=_ct_w4_config("nvfp4-pack-quantized", weights))


@pytest.mark.parametrize("quantization,message", [
    ({"group_size": 64, "bits": 8}, r"bits is 8: torch_lowbit reads 4-bit MLX weights only"),
    ({"group_size": 64, "bits": 2}, r"bits is 2: torch_lowbit reads 4-bit MLX weights only"),
    ({"group_size": 32, "bits": 8, "mode": "mxfp8"}, r"mode 'mxfp8' is not supported"),
    ({"group_size": 64, "bits": 4, "mode": "mxfp4"}, r"group_size must be 32 for mode 'mxfp4'"),
    ({"group_size": 32, "bits": 4, "a": {"bits": 6}}, r"quantization\.a\.bits is 6"),
])
def test_unsupported_mlx_quantization_is_refused_by_name(quantization, message):
    ta, _, _ = _mlx_module(W4_N, 64, 32, 0)
    with pytest.raises(CheckpointError, match=message):
        load_quantized(_TwoLinears(K=64), {f"a.{k}": v for k, v in ta.items()}, config={"quantization": quantization})


def test_mlx_affine_without_biases_is_refused_by_name():
    ta, _, _ = _mlx_module(W4_N, 64, 32, 0)
    del ta["biases"]
    with pytest.raises(CheckpointError, match=r"a\.biases is missing: MLX affine weights are q \* scale \+ bias"):
        load_quantized(_TwoLinears(K=64), {f"a.{k}": v for k, v in ta.items()},
                       config={"quantization": {"group_size": 32, "bits": 4}})


def test_modelopt_nvfp4_loads_weights_only_and_says_so(tmp_path):
    """ModelOpt's NVFP4 export: compressed-tensors' nvfp4 layout under the plain names, weight_scale_2 a multiplier."""
    K = 64
    model = _TwoLinears(K=K)
    sd, want = {"a.bias": torch.randn(W4_N)}, {}
    for name, seed in (("a", 0), ("b", 3)):
        t, w = _ct_fp4("nvfp4", W4_N, K, seed=seed)  # divisor 3.0: ModelOpt stores the multiplier 1/3 instead
        sd.update({f"{name}.weight": t["weight_packed"], f"{name}.weight_scale": t["weight_scale"],
                   f"{name}.weight_scale_2": torch.tensor(0.25), f"{name}.input_scale": torch.tensor(0.5)})
        want[name] = w * 3.0 * 0.25
    save_file(sd, str(tmp_path / "model.safetensors"))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                                                            "exclude_modules": ["lm_head"]}}))
    report = load_quantized(model, tmp_path, dtype=torch.float32, strict=True)
    assert report.format == "modelopt" and report.converted == {n: "W4Linear(nvfp4, group 16)" for n in "ab"}
    for name in "ab":
        layer = model.get_submodule(name)
        assert torch.equal(layer.weight_scale_2, torch.tensor([0.25]))
        assert torch.equal(layer.dequantize(torch.float32).double(), want[name])  # e2m1 * e4m3 * 2^-2: exact
    assert any("NVFP4 activations (W4A4)" in n and "run W4A16" in n for n in report.notes)


def test_modelopt_nvfp4_with_a_wrong_scale_shape_is_refused_by_name():
    t, _ = _ct_fp4("nvfp4", W4_N, 64)
    sd = {"a.weight": t["weight_packed"], "a.weight_scale": t["weight_scale"][:, :3],
          "a.weight_scale_2": torch.tensor(1.0)}
    with pytest.raises(CheckpointError, match=r"a\.weight_scale must be torch\.float8_e4m3fn of shape \[24, 4\]"):
        load_quantized(_TwoLinears(K=64), sd, config={"quantization": {"quant_algo": "NVFP4"}})


@pytest.mark.parametrize("asym,channel_gate_up", [(False, False), (True, False), (True, True)])
def test_4bit_moe_experts_stack_into_w4experts_computing_their_float64_weights(asym, channel_gate_up):
    """Per-expert pack-quantized gate / up / down (groups of 32: partial last groups at H = 48, I = 80) become one
    W4Experts, gate rows then up rows, whose forward matches the float64 SwiGLU of the weights they mean; gate / up
    per channel beside grouped down projections take the layer's group size, their scale repeated."""
    from torch_lowbit.nn.w4_experts import W4Experts

    model = TinyLM(moe=(4, 2))
    name = next(n for n, m in model.named_modules() if n.endswith("mlp.experts"))
    dense = model.get_submodule(name)
    E, I2, H = dense.gate_up_proj.shape
    I = I2 // 2
    sd, want = {}, {"gate_up_proj": torch.zeros(E, I2, H, dtype=torch.float64),
                    "down_proj": torch.zeros(E, H, I, dtype=torch.float64)}
    for e in range(E):
        for i, (proj, N, K, dst, rows) in enumerate((("gate_proj", I, H, "gate_up_proj", slice(0, I)),
                                                      ("up_proj", I, H, "gate_up_proj", slice(I, I2)),
                                                      ("down_proj", H, I, "down_proj", slice(0, H)))):
            t, w64 = _ct_int4(N, K, K if channel_gate_up and proj != "down_proj" else 32, asym, seed=10 * e + i)
            sd.update({f"{name}.{e}.{proj}.{k}": v for k, v in t.items()})
            want[dst][e, rows] = w64
    config = _ct_w4_config("pack-quantized", _int4_args(32, asym))
    if channel_gate_up:
        groups = config["quantization_config"]["config_groups"]
        groups["group_0"]["targets"] = ["re:.*down_proj$"]
        groups["group_1"] = {"targets": ["Linear"], "weights": _int4_args(None, asym)}
    report = load_quantized(model, sd, config=config)
    layer = model.get_submodule(name)
    assert isinstance(layer, W4Experts) and report.converted[name].startswith("W4Experts(E=4, int4, group 32")
    assert (layer.gate_up_offset is not None) == asym
    ref = type(dense)(E, H, I).double()
    with torch.no_grad():
        ref.gate_up_proj.copy_(want["gate_up_proj"])
        ref.down_proj.copy_(want["down_proj"])
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(3))
    ids = torch.tensor([[0, 3], [1, 2], [3, 3], [2, 0], [1, 1]])
    w = torch.rand(5, 2, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got, exp = layer(x, ids, w), ref(x.double(), ids, w.double())
    assert torch.allclose(got.double(), exp, rtol=1e-5, atol=1e-5 * float(exp.abs().max()))


def test_4bit_moe_expert_missing_is_refused_by_name():
    model = TinyLM(moe=(4, 2))
    experts = next(n for n, m in model.named_modules() if n.endswith("mlp.experts"))
    t, _ = _ct_int4(80, 48, 16, False)
    sd = {f"{experts}.0.gate_proj.{k}": v for k, v in t.items()}
    with pytest.raises(CheckpointError, match=rf"{re.escape(experts)}\.0\.up_proj holds no 4-bit weight while "
                                              rf"{re.escape(experts)}\.0\.gate_proj does"):
        load_quantized(model, sd, config=_ct_w4_config("pack-quantized", _int4_args(16, False)))


def test_packed_4bit_words_become_w4linear_bytes_without_a_copy():
    """Eight codes per 32-bit word are already W4Linear's byte layout: the layer holds the checkpoint's memory."""
    ta, _ = _ct_int4(W4_N, 64, 32, False)
    tm, _, _ = _mlx_module(W4_N, 64, 32, 0)
    model = _TwoLinears(K=64)
    load_quantized(model, {**{f"a.{k}": v for k, v in ta.items()}},
                   config=_ct_w4_config("pack-quantized", _int4_args(32, False)))
    assert model.a.weight_packed.data_ptr() == ta["weight_packed"].data_ptr()
    model = _TwoLinears(K=64)
    load_quantized(model, {f"b.{k}": v for k, v in tm.items()}, config={"quantization": {"group_size": 32, "bits": 4}})
    assert model.b.weight_packed.data_ptr() == tm["weight"].data_ptr()
