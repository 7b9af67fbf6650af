"""TorchLowbitConfig in diffusers (torch_lowbit.diffusers_quantizer): from_pretrained of tiny FLUX / SD3 / Wan
transformers saved by diffusers quantizes them as they load (the diffusion skip rule), save_pretrained -> reload gives
the same model, a FluxPipeline runs on it; from_single_file of FLUX, SD3.5 and Wan2.1 (T2V, I2V) FP8 files written in
their published layouts (raw e4m3, ComfyUI scaled fp8, weight_scale) keeps the stored codes, matches diffusers' own
upcast load and (FLUX) peaks near the file size; bad files are refused naming the file and the tensor. A FLUX LoRA
saved by diffusers loads into a quantized transformer with pipe.load_lora_weights as into the dense one; fuse_lora
is refused by name."""
import copy
import json
import math
import os
import subprocess
import sys
import textwrap
from typing import Callable, NamedTuple, Tuple

import pytest
import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import torch_lowbit
from peak_memory import linux_only, peak_growth
from reference import layer_weight_f64
from torch_lowbit.formats import CheckpointError
from torch_lowbit.nn import Fp8Linear, W4Linear

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")
from torch_lowbit.peft import LowbitLoraLinear  # noqa: E402
from test_diffusion import (LAYER, MODEL_ERR, MODELS, _flux_inputs, _image, _rel, _sd3_inputs,  # noqa: E402
                            _wan_inputs, _with_transformer,  # noqa: E402
                            tiny_flux_pipeline)  # noqa: F401  (the fixture)

# 4-bit: each format, int4 with zero points and groups of 16 (the tiny models' rows are 32-96 codes)
W4_SCHEMES = {"int4": dict(group_size=16, symmetric=False), "nvfp4": {}, "mxfp4": {}, "uint4": dict(group_size=16)}
CONFIG = {"fp8": lambda: torch_lowbit.TorchLowbitConfig("fp8"), "int8": lambda: torch_lowbit.TorchLowbitConfig("int8"),
          **{w: (lambda w=w, kw=kw: torch_lowbit.TorchLowbitConfig(w, **kw)) for w, kw in W4_SCHEMES.items()}}
SCHEME_LAYER = {**LAYER, **dict.fromkeys(W4_SCHEMES, W4Linear)}
# as MODEL_ERR; 4-bit measured 0.3-4.5 % (mxfp4's power-of-two scales the most)
SCHEME_ERR = {**MODEL_ERR, **dict.fromkeys(W4_SCHEMES, 0.08)}


def _python(script: str, *args) -> str:
    """stdout of `script` run by a fresh Python (this torch_lowbit on its path); its stderr where it fails."""
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(torch_lowbit.__file__)))
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _load(cls, path, scheme, **kwargs):
    return cls.from_pretrained(path, torch_dtype=torch.float32, quantization_config=CONFIG[scheme](), **kwargs)


@pytest.fixture(scope="module")
def saved_dense(tmp_path_factory):
    """model -> (the dense model, the directory diffusers saved it to)."""
    out = {}
    for name, (build, _, _) in MODELS.items():
        torch.manual_seed(0)
        dense = build().eval()
        path = tmp_path_factory.mktemp(f"dense-{name}")
        dense.save_pretrained(path)
        out[name] = (dense, path)
    return out


def _run(model, inputs):
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


@pytest.mark.parametrize("scheme", CONFIG)
@pytest.mark.parametrize("model", MODELS)
def test_from_pretrained_quantizes_as_it_loads(saved_dense, model, scheme):
    _, inputs, kept = MODELS[model]
    dense, path = saved_dense[model]
    q = _load(type(dense), path, scheme)
    linears = [n for n, m in dense.named_modules() if isinstance(m, nn.Linear)]
    assert all(type(q.get_submodule(n)) is nn.Linear for n in kept)  # the diffusion rule: embedders, final layer
    assert all(type(q.get_submodule(n)) is SCHEME_LAYER[scheme] for n in set(linears) - set(kept))
    if scheme in W4_SCHEMES:
        assert {q.get_submodule(n).format for n in set(linears) - set(kept)} == {scheme}
    x = inputs(torch.Generator().manual_seed(1))
    y, y_dense = _run(q, x), _run(dense, x)
    assert 0 < _rel(y, y_dense) < SCHEME_ERR[scheme]
    # what quantize_ makes of the dense model: the same layers (the float32 glue around them may round differently
    # by 1 ulp, with the loaded tensors' memory alignment)
    after = torch_lowbit.quantize_(copy.deepcopy(dense), CONFIG[scheme]().quantize_config())
    _same_state(q, after)
    assert _rel(y, _run(after, x)) < 1e-6
    # each low-bit weight counts as the dense parameter it stands for (buffers: parameters() lists none of them)
    assert q.num_parameters() == after.num_parameters() == dense.num_parameters()
    if scheme != "int8":  # weight-only: the dense model on the dequantized weights, in float64
        ref = copy.deepcopy(dense).double()
        for name, layer in q.named_modules():
            if isinstance(layer, (Fp8Linear, W4Linear)):
                ref.get_submodule(name).weight.data = layer_weight_f64(layer)
        y_ref = _run(ref, {k: v.double() if v.is_floating_point() else v for k, v in x.items()})
        assert _rel(y, y_ref) < 1e-6


def _bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _same_state(a, b):
    """The same tensors (one-byte codes and scales compared as bits) under the same names, of the same layers."""
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(_bits(sa[k]), _bits(sb[k])), k
    for name, layer in a.named_modules():
        if isinstance(layer, W4Linear):
            other = b.get_submodule(name)
            assert (other.format, other.group_size) == (layer.format, layer.group_size), name


def _same_layers(a, b):
    """Each low-bit layer of `a` is one of `b`'s, under its name, with the same tensors."""
    for name, layer in a.named_modules():
        if isinstance(layer, tuple(SCHEME_LAYER.values())):
            other = b.get_submodule(name)
            assert type(other) is type(layer), name
            _same_state(layer, other)


@pytest.mark.parametrize("scheme", CONFIG)
@pytest.mark.parametrize("model", MODELS)
def test_save_pretrained_then_reload(saved_dense, model, scheme, tmp_path):
    _, inputs, _ = MODELS[model]
    dense, path = saved_dense[model]
    q = _load(type(dense), path, scheme)
    q.save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["quantization_config"]["quant_method"] == "torch_lowbit"
    with safe_open(str(tmp_path / "diffusion_pytorch_model.safetensors"), "pt") as f:
        to_q = "transformer_blocks.0.attn.to_q" if model != "wan" else "blocks.0.attn1.to_q"
        if scheme in W4_SCHEMES:  # the layer's own tensors, as stored
            assert f.get_slice(f"{to_q}.weight_packed").get_dtype() == "U8"
            assert f.get_slice(f"{to_q}.weight_scale").get_dtype() in {"int4": ("F32",), "uint4": ("F32",),
                                                                        "nvfp4": ("F8_E4M3",), "mxfp4": ("U8",)}[scheme]
        else:
            assert f.get_slice(f"{to_q}.weight").get_dtype() == {"fp8": "F8_E4M3", "int8": "I8"}[scheme]
            assert f.get_slice(f"{to_q}.weight_scale").get_dtype() == "F32"
    again = type(dense).from_pretrained(tmp_path, torch_dtype=torch.float32)  # the config says how
    assert any(isinstance(m, SCHEME_LAYER[scheme]) for m in again.modules())
    _same_state(q, again)
    x = inputs(torch.Generator().manual_seed(1))
    assert _rel(_run(again, x), _run(q, x)) < 1e-6


QUANTIZE_CONFIGS = {"fp8": torch_lowbit.Fp8WeightOnly(), "fp8-tensor": torch_lowbit.Fp8WeightOnly("tensor"),
                    "fp8-block": torch_lowbit.Fp8WeightOnly("block", (16, 32)), "int8": torch_lowbit.Int8Dynamic(),
                    "int4": torch_lowbit.Int4WeightOnly(16), "int4-channel": torch_lowbit.Int4WeightOnly(None),
                    "int4-zero-points": torch_lowbit.Int4WeightOnly(16, symmetric=False),
                    "uint4": torch_lowbit.AffineWeightOnly(16), "nvfp4": torch_lowbit.Nvfp4WeightOnly(),
                    "mxfp4": torch_lowbit.Mxfp4WeightOnly()}
# what config.json records for each 4-bit one: the loader takes the format and group size from it
SAVED_W4 = {"int4": ("int4", 16, True), "int4-channel": ("int4", None, True), "int4-zero-points": ("int4", 16, False),
            "uint4": ("uint4", 16, True), "nvfp4": ("nvfp4", None, True), "mxfp4": ("mxfp4", None, True)}


@pytest.mark.parametrize("config", QUANTIZE_CONFIGS)
@pytest.mark.parametrize("model", MODELS)
def test_save_pretrained_after_quantize__reloads_with_diffusers_from_pretrained(saved_dense, model, config, tmp_path):
    # the diffusers habit after torch_lowbit.quantize_(pipe.transformer, ...): save_pretrained, then from_pretrained;
    # config.json had no quantization config, and the reload took the fp8 codes as weights without their scales
    dense, _ = saved_dense[model]
    q = torch_lowbit.quantize_(copy.deepcopy(dense), QUANTIZE_CONFIGS[config])
    q.save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        saved = json.load(f)["quantization_config"]
    assert saved["quant_method"] == "torch_lowbit"
    if config in SAVED_W4:
        assert (saved["weights"], saved["group_size"], saved["symmetric"]) == SAVED_W4[config]
    again = type(dense).from_pretrained(tmp_path, torch_dtype=torch.float32)
    _same_state(q, again)
    x = MODELS[model][1](torch.Generator().manual_seed(1))
    assert _rel(_run(again, x), _run(q, x)) < 1e-6


def test_4bit_layers_with_the_same_tensors_reload_as_their_own_format(saved_dense, tmp_path):
    # int4 without zero points and uint4 without biases are the same bytes: the config says which
    dense, _ = saved_dense["flux"]
    x = MODELS["flux"][1](torch.Generator().manual_seed(1))
    for fmt in ("int4", "uint4"):
        q = copy.deepcopy(dense)
        for name, m in list(q.named_modules()):
            if isinstance(m, nn.Linear) and name.startswith("transformer_blocks"):
                w4 = W4Linear.from_float(m, fmt, 16)
                q.set_submodule(name, W4Linear.from_quantized(w4.weight_packed, w4.weight_scale, format=fmt,
                                                              group_size=16, in_features=m.in_features, bias=m.bias))
        assert q.transformer_blocks[0].attn.to_q.weight_offset is None
        torch_lowbit.quantize_(q, torch_lowbit.Int8Dynamic(), filter_fn=lambda m, n: "single" in n)
        q.save_pretrained(tmp_path / fmt)
        again = type(dense).from_pretrained(tmp_path / fmt, torch_dtype=torch.float32)
        assert again.transformer_blocks[0].attn.to_q.format == fmt
        assert isinstance(again.single_transformer_blocks[0].proj_out, torch_lowbit.nn.Int8Linear)
        _same_state(q, again)
        assert _rel(_run(again, x), _run(q, x)) < 1e-6


@pytest.mark.parametrize("edit,why", [
    (dict(weights="fp8", group_size=None),
     r"transformer_blocks\.0\.\S+\.weight_packed holds 4-bit codes, but config\.json's quantization_config says "
     r"weights='fp8'"),
    (dict(group_size=8), r"transformer_blocks\.0\.\S+\.weight_scale has shape \(\d+, 2\), expected \(\d+, 4\) for "
                         r"int4 weights \[\d+, 32\] in groups of 8")])
def test_a_saved_4bit_model_whose_config_disagrees_with_its_tensors_is_refused_naming_the_tensor(saved_dense, tmp_path,
                                                                                               edit, why):
    dense, _ = saved_dense["flux"]
    torch_lowbit.quantize_(copy.deepcopy(dense), torch_lowbit.Int4WeightOnly(16)).save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        config = json.load(f)
    config["quantization_config"].update(edit)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(CheckpointError, match=why):
        type(dense).from_pretrained(tmp_path, torch_dtype=torch.float32)


@pytest.mark.parametrize("second,why", [
    (torch_lowbit.Nvfp4WeightOnly(), r"single_transformer_blocks\.0\.\S+ is nvfp4, transformer_blocks\.0\.\S+ is "
                                     r"int4: one config\.json holds one 4-bit format"),
    (torch_lowbit.Int4WeightOnly(32), r"single_transformer_blocks\.0\.\S+ has groups of 32, transformer_blocks\.0\.\S+ "
                                      r"of 16 codes: one config\.json holds one group size")])
def test_save_pretrained_refuses_what_one_config_cannot_record_and_save_quantized_writes_it(saved_dense, tmp_path,
                                                                                          second, why):
    dense, _ = saved_dense["flux"]
    q = torch_lowbit.quantize_(copy.deepcopy(dense), torch_lowbit.Int4WeightOnly(16),
                               filter_fn=lambda m, n: n.startswith("transformer_blocks"))
    torch_lowbit.quantize_(q, second, filter_fn=lambda m, n: n.startswith("single_transformer_blocks"))
    with pytest.raises(ValueError, match=rf"save_pretrained: {why}; .*save_quantized"):
        q.save_pretrained(tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    # the way the message names: the top-level proj_out stays dense and each block's proj_out is 4-bit, so the
    # checkpoint must name the one it ignores alone
    torch_lowbit.save_quantized(q, tmp_path / "w4")
    with open(tmp_path / "w4" / "config.json") as f:
        assert "re:proj_out$" in json.load(f)["quantization_config"]["ignore"]
    fresh = type(dense).from_config(dense.config)
    torch_lowbit.load_quantized(fresh, tmp_path / "w4")
    x = MODELS["flux"][1](torch.Generator().manual_seed(1))
    assert isinstance(fresh.single_transformer_blocks[0].proj_out, W4Linear)
    assert type(fresh.proj_out) is nn.Linear and torch.equal(_run(fresh, x), _run(q, x))


def test_save_pretrained_refuses_layers_diffusers_cannot_rebuild(saved_dense, tmp_path):
    dense, _ = saved_dense["flux"]
    q = torch_lowbit.quantize_(copy.deepcopy(dense), torch_lowbit.Fp8WeightOnly())
    q.transformer_blocks[0].experts = torch_lowbit.nn.Fp8Experts(2, 32, 16)  # a module diffusers' loader never builds
    with pytest.raises(ValueError, match=r"save_pretrained: transformer_blocks\.0\.experts is a Fp8Experts, which "
                                         r"diffusers' from_pretrained cannot rebuild.*save_quantized"):
        q.save_pretrained(tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


@pytest.mark.parametrize("option,value,why", [("safe_serialization", False, "writes the low-bit layers as a pickle"),
                                               ("use_flashpack", True, "writes a FlashPack file")])
def test_save_pretrained_refuses_files_the_reload_cannot_read(saved_dense, tmp_path, option, value, why):
    dense, path = saved_dense["flux"]
    made = {"quantize_": lambda: torch_lowbit.quantize_(copy.deepcopy(dense), torch_lowbit.Int4WeightOnly(16)),
            "from_pretrained": lambda: _load(type(dense), path, "fp8")}
    for how, make in made.items():
        with pytest.raises(ValueError, match=rf"save_pretrained: {option}={value} {why}, which torch_lowbit does not "
                                             rf"read back"):
            make().save_pretrained(tmp_path / how, **{option: value})
        assert not (tmp_path / how).exists()


def test_a_pickled_saved_model_is_refused_naming_the_file(saved_dense, tmp_path):
    # what safe_serialization=False wrote before it was refused: diffusers had loaded its fp8 codes as plain weights,
    # the loader of this method failed on the file's header
    dense, _ = saved_dense["flux"]
    torch_lowbit.quantize_(copy.deepcopy(dense), torch_lowbit.Fp8WeightOnly()).save_pretrained(tmp_path)
    torch.save(load_file(str(tmp_path / "diffusion_pytorch_model.safetensors")),
               tmp_path / "diffusion_pytorch_model.bin")
    os.remove(tmp_path / "diffusion_pytorch_model.safetensors")
    with pytest.raises(CheckpointError, match=r"diffusion_pytorch_model\.bin: torch_lowbit reads the layers of a saved "
                                              r"model only from \.safetensors files"):
        type(dense).from_pretrained(tmp_path, torch_dtype=torch.float32)


@pytest.mark.parametrize("how", ["from_pretrained", "quantize_"])
@pytest.mark.parametrize("scheme", ["fp8", "int4"])
def test_dequantize_gives_the_dense_model_that_saves_and_reloads_dense(saved_dense, tmp_path, how, scheme):
    # diffusers' model.dequantize(): it asked for an issue with our quantizer, and said "quantize your model first"
    # after quantize_; a save_pretrained after it must write a dense model
    dense, path = saved_dense["flux"]
    if how == "from_pretrained":
        q = _load(type(dense), path, scheme)
    else:
        q = torch_lowbit.quantize_(copy.deepcopy(dense), CONFIG[scheme]().quantize_config())
        q.save_pretrained(tmp_path / "quantized")  # which records the config in the model's own
    expected = {n: layer_weight_f64(m).float() for n, m in q.named_modules()
                if isinstance(m, (Fp8Linear, W4Linear))}
    x = MODELS["flux"][1](torch.Generator().manual_seed(1))
    y = _run(q, x)
    assert q.dequantize() is q and not getattr(q, "is_quantized", False) and getattr(q, "hf_quantizer", None) is None
    assert expected and all(type(q.get_submodule(n)) is nn.Linear and torch.equal(q.get_submodule(n).weight, w)
                            for n, w in expected.items())
    assert _rel(_run(q, x), y) < 1e-6 and "quantization_config" not in q.config
    assert "save_pretrained" not in vars(q) and q.num_parameters() == dense.num_parameters()
    q.save_pretrained(tmp_path / "dense")
    with open(tmp_path / "dense" / "config.json") as f:
        assert "quantization_config" not in json.load(f)
    again = type(dense).from_pretrained(tmp_path / "dense", torch_dtype=torch.float32)
    assert not any(isinstance(m, (Fp8Linear, W4Linear)) for m in again.modules())
    _same_state(again, q)
    assert _rel(_run(again, x), _run(q, x)) < 1e-6  # float32 glue: 1 ulp apart with the loaded tensors' alignment


def test_per_block_fp8_from_torch_lowbit_config_saves_and_reloads(saved_dense, tmp_path):
    dense, path = saved_dense["sd3"]
    config = torch_lowbit.TorchLowbitConfig("fp8", granularity="block", block_size=(16, 32))
    q = type(dense).from_pretrained(path, torch_dtype=torch.float32, quantization_config=config)
    assert q.transformer_blocks[0].attn.to_q.block_size == (16, 32)
    q.save_pretrained(tmp_path)
    again = type(dense).from_pretrained(tmp_path, torch_dtype=torch.float32)
    _same_state(q, again)


@pytest.mark.parametrize("imports", ["diffusers, torch_lowbit", "torch_lowbit, diffusers"])
def test_reload_in_a_fresh_process(saved_dense, tmp_path, imports):
    """A user's reflex: save, then reload in a new Python that imports diffusers and torch_lowbit (no config made),
    in either order: the same layers, the same output."""
    dense, path = saved_dense["flux"]
    q = _load(type(dense), path, "fp8")
    q.save_pretrained(tmp_path / "saved")
    x = MODELS["flux"][1](torch.Generator().manual_seed(1))
    save_file({**{k: v.contiguous() for k, v in x.items()}, "expected": _run(q, x)}, str(tmp_path / "io.safetensors"))
    out = _python("""
        import sys, torch, IMPORTS
        from safetensors.torch import load_file, save_file
        io = load_file(sys.argv[2])
        expected = io.pop("expected")
        model = diffusers.FluxTransformer2DModel.from_pretrained(sys.argv[1], torch_dtype=torch.float32)
        assert isinstance(model.transformer_blocks[0].attn.to_q, torch_lowbit.nn.Fp8Linear)
        with torch.no_grad():
            y = model(**io, return_dict=False)[0]
        print(float((y - expected).abs().max() / expected.abs().max()))
        """.replace("IMPORTS", imports), tmp_path / "saved", tmp_path / "io.safetensors")
    assert float(out.split()[-1]) < 1e-6



@pytest.mark.parametrize("imports", ["diffusers, torch_lowbit", "torch_lowbit, diffusers"])
def test_without_transformers_both_import_in_either_order(imports):
    # registering TorchLowbitConfig needs transformers; where it is missing, a diffusers user's imports must not fail
    out = _python("""
        import sys
        sys.modules["transformers"] = None  # as if not installed
        import IMPORTS
        print("imported", "torch_lowbit.hf_quantizer" in sys.modules)
        """.replace("IMPORTS", imports))
    assert out.split()[-2:] == ["imported", "False"]

def test_modules_to_not_convert_replaces_the_diffusion_rule(saved_dense):
    dense, path = saved_dense["flux"]
    q = dense.from_pretrained(path, quantization_config=torch_lowbit.TorchLowbitConfig(
        "fp8", modules_to_not_convert=["single_transformer_blocks"]))
    assert isinstance(q.x_embedder, Fp8Linear) and isinstance(q.transformer_blocks[0].attn.to_q, Fp8Linear)
    assert type(q.single_transformer_blocks[0].proj_mlp) is nn.Linear


# ---- fuse_qkv_projections (diffusers' torch.compile recipes call it): the low-bit projections are joined as stored
FUSE_CONFIGS = {"fp8": torch_lowbit.Fp8WeightOnly(), "int8": torch_lowbit.Int8Dynamic(),
                "int4": torch_lowbit.Int4WeightOnly(32, symmetric=False)}


def _projection_calls_fail(model):
    """Make every projection joined into a fused layer (diffusers keeps them beside it) raise when called."""
    from torch_lowbit._diffusers_model import FUSED_PROJECTIONS

    for name, _ in list(model.named_modules()):
        parent, _, kind = name.rpartition(".")
        for source in FUSED_PROJECTIONS.get(kind, ()):
            model.get_submodule(f"{parent}.{source}").forward = \
                lambda *a, _n=f"{parent}.{source}", **k: pytest.fail(f"{_n} ran after fusing")


@pytest.mark.parametrize("config", FUSE_CONFIGS)
@pytest.mark.parametrize("model", MODELS)
def test_fuse_qkv_projections_joins_the_low_bit_projections(saved_dense, model, config):
    from torch_lowbit._diffusers_model import FUSED_PROJECTIONS
    dense, _ = saved_dense[model]
    q = torch_lowbit.quantize_(copy.deepcopy(dense), FUSE_CONFIGS[config])
    x = MODELS[model][1](torch.Generator().manual_seed(1))
    y = _run(q, x)
    q.fuse_qkv_projections()
    fused = {n: m for n, m in q.named_modules() if n.rpartition(".")[2] in FUSED_PROJECTIONS}
    assert fused and all(type(m) is LAYER_OF[config] for m in fused.values())
    for name, layer in fused.items():  # each is its projections' float64 weights stacked
        parent, _, kind = name.rpartition(".")
        parts = [q.get_submodule(f"{parent}.{p}") for p in FUSED_PROJECTIONS[kind]]
        assert torch.equal(layer_weight_f64(layer), torch.cat([layer_weight_f64(p) for p in parts]))
    unfused = copy.deepcopy(q)
    _projection_calls_fail(q)
    assert torch.equal(_run(q, x), y)  # the fused layers ran, and gave each projection's output as it was
    unfused.unfuse_qkv_projections()  # diffusers' own undo (SD3's keeps the fused layers, unused)
    assert torch.equal(_run(unfused, x), y)


LAYER_OF = {"fp8": Fp8Linear, "int8": torch_lowbit.nn.Int8Linear, "int4": torch_lowbit.nn.W4Linear}


def test_fuse_qkv_projections_on_a_model_loaded_quantized(saved_dense):
    dense, path = saved_dense["flux"]
    q = _load(type(dense), path, "fp8")
    x = MODELS["flux"][1](torch.Generator().manual_seed(1))
    y = _run(q, x)
    q.fuse_qkv_projections()
    assert isinstance(q.transformer_blocks[0].attn.to_qkv, Fp8Linear)
    _projection_calls_fail(q)
    assert torch.equal(_run(q, x), y)


def test_a_fused_quantized_model_saves_and_reloads_unfused(saved_dense, tmp_path):
    # diffusers writes the fused layers beside the projections; a reload builds the model unfused, and the fused
    # layers' tensors are unused keys, as for a dense fused model (the loader had failed on their missing module)
    dense, _ = saved_dense["flux"]
    q = torch_lowbit.quantize_(copy.deepcopy(dense), torch_lowbit.Fp8WeightOnly())
    x = MODELS["flux"][1](torch.Generator().manual_seed(1))
    y = _run(q, x)
    q.fuse_qkv_projections()
    q.save_pretrained(tmp_path)
    again = type(dense).from_pretrained(tmp_path, torch_dtype=torch.float32)
    assert not any(n.endswith("to_qkv") for n, _ in again.named_modules())
    _same_layers(again, q)
    assert _rel(_run(again, x), y) < 1e-6


def test_fuse_qkv_projections_refuses_projections_with_lora_adapters(saved_dense):
    dense, _ = saved_dense["flux"]
    q = torch_lowbit.quantize_(copy.deepcopy(dense), torch_lowbit.Fp8WeightOnly())
    q.add_adapter(peft.LoraConfig(r=4, target_modules=["to_q", "to_k", "to_v"]))
    with pytest.raises(ValueError, match=r"fuse_qkv_projections: transformer_blocks\.0\.attn\.to_q carries LoRA "
                                         r"adapters.*unload"):
        q.fuse_qkv_projections()
    assert not any(n.endswith("to_qkv") for n, _ in q.named_modules())
    assert not any(t.is_meta for t in q.parameters())


def test_fuse_qkv_projections_refuses_what_cannot_be_joined_and_leaves_the_model_unfused(saved_dense):
    dense, _ = saved_dense["flux"]
    q = torch_lowbit.quantize_(copy.deepcopy(dense), torch_lowbit.Nvfp4WeightOnly())  # a global scale per layer
    x = MODELS["flux"][1](torch.Generator().manual_seed(1))
    y = _run(q, x)
    with pytest.raises(ValueError, match=r"fuse_qkv_projections: .*weight_scale_2 differ.*left unfused.*"
                                         r"fuse the dense model first"):
        q.fuse_qkv_projections()
    assert not any(n.endswith(("to_qkv", "to_added_qkv")) for n, _ in q.named_modules())
    assert not any(t.is_meta for t in q.parameters()) and torch.equal(_run(q, x), y)
    # the way the message names: fuse, then quantize
    fused_first = copy.deepcopy(dense)
    fused_first.fuse_qkv_projections()
    torch_lowbit.quantize_(fused_first, torch_lowbit.Nvfp4WeightOnly())
    assert isinstance(fused_first.transformer_blocks[0].attn.to_qkv, torch_lowbit.nn.W4Linear)
    assert 0 < _rel(_run(fused_first, x), _run(dense, x)) < 0.2


@pytest.mark.parametrize("scheme", CONFIG)
def test_flux_pipeline_with_a_transformer_loaded_quantized(tiny_flux_pipeline, scheme, tmp_path):
    tiny_flux_pipeline.transformer.save_pretrained(tmp_path)
    transformer = diffusers.FluxTransformer2DModel.from_pretrained(tmp_path, quantization_config=CONFIG[scheme](),
                                                                   torch_dtype=torch.float32)
    pipe = _with_transformer(tiny_flux_pipeline, transformer)
    pipe.set_progress_bar_config(disable=True)
    img, ref = _image(pipe), _image(tiny_flux_pipeline)
    assert img.shape == (1, 3, 32, 32) and torch.isfinite(img).all()
    assert 0 < _rel(img, ref) < SCHEME_ERR[scheme]
    pipe.enable_model_cpu_offload(device="cpu")  # diffusers' hooks move the loaded-quantized model like any other
    try:  # measured up to 2.4e-7 apart (float32 rounding; a wrong layer would be ~1e-2 off)
        torch.testing.assert_close(_image(pipe), img, rtol=0, atol=1e-6)
    finally:
        pipe.remove_all_hooks()


# ------------------------------------------------------------------------------------------------ single files
# The original (published) single-file layouts of FLUX.1, SD3 / SD3.5 and Wan2.1, for tiny configs: [(key, shape,
# stored as fp8)]. What the FP8 repacks and ComfyUI keep; diffusers' own conversion maps them to its names.
H, MLP = 3072, 12288  # diffusers' FLUX conversion assumes FLUX.1's width
FLUX_CONFIG = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=128,
                   num_attention_heads=24, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=False,
                   axes_dims_rope=[16, 56, 56])
# SD3.5: the qk norms (ln_q / ln_k) and a dual-attention block (attn2, SD3.5 Medium); the last block's context
# half is "pre only" (no proj, no mlp, a 2-way modulation), as in every SD3 file
SD3_CONFIG = dict(sample_size=8, patch_size=1, in_channels=4, num_layers=2, attention_head_dim=8,
                  num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=64,
                  out_channels=4, pos_embed_max_size=8, dual_attention_layers=[0], qk_norm="rms_norm")
WAN_CONFIG = dict(patch_size=[1, 2, 2], num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
                  text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                  qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
WAN_I2V_CONFIG = dict(WAN_CONFIG, in_channels=36, image_dim=40, added_kv_proj_dim=24)


def _layout_builder():
    out = []

    def linear(name, n, k):
        out.extend([(f"{name}.weight", (n, k), True), (f"{name}.bias", (n,), False)])

    def tensor(name, *shape, fp8=False):
        out.append((name, shape, fp8))

    return out, linear, tensor


def flux_layout(double=1, single=1, in_channels=4, text_dim=32, pooled_dim=32, head_dim=128):
    """Black Forest Labs' FLUX.1 layout."""
    out, linear, tensor = _layout_builder()

    def qk_norm(prefix):
        for norm in ("query_norm", "key_norm"):
            tensor(f"{prefix}.{norm}.scale", head_dim)

    linear("img_in", H, in_channels)
    linear("time_in.in_layer", H, 256)
    linear("time_in.out_layer", H, H)
    linear("vector_in.in_layer", H, pooled_dim)
    linear("vector_in.out_layer", H, H)
    linear("txt_in", H, text_dim)
    for i in range(double):
        for s in ("img", "txt"):
            p = f"double_blocks.{i}.{s}"
            linear(f"{p}_mod.lin", 6 * H, H)
            linear(f"{p}_attn.qkv", 3 * H, H)
            qk_norm(f"{p}_attn.norm")
            linear(f"{p}_attn.proj", H, H)
            linear(f"{p}_mlp.0", MLP, H)
            linear(f"{p}_mlp.2", H, MLP)
    for i in range(single):
        p = f"single_blocks.{i}"
        linear(f"{p}.linear1", 3 * H + MLP, H)
        linear(f"{p}.linear2", H, H + MLP)
        qk_norm(f"{p}.norm")
        linear(f"{p}.modulation.lin", 3 * H, H)
    linear("final_layer.linear", in_channels, H)
    linear("final_layer.adaLN_modulation.1", 2 * H, H)
    return out


def sd3_layout(c=SD3_CONFIG):
    """Stability's SD3 / SD3.5 MMDiT layout (sd3_impls, ComfyUI); the patch embedding conv stored as fp8 too (not
    a linear weight: upcast)."""
    out, linear, tensor = _layout_builder()
    D, p, head_dim = c["num_attention_heads"] * c["attention_head_dim"], c["patch_size"], c["attention_head_dim"]
    tensor("pos_embed", 1, c["pos_embed_max_size"] ** 2, D)
    tensor("x_embedder.proj.weight", D, c["in_channels"], p, p, fp8=True)
    tensor("x_embedder.proj.bias", D)
    linear("t_embedder.mlp.0", D, 256)
    linear("t_embedder.mlp.2", D, D)
    linear("y_embedder.mlp.0", D, c["pooled_projection_dim"])
    linear("y_embedder.mlp.2", D, D)
    linear("context_embedder", c["caption_projection_dim"], c["joint_attention_dim"])
    for i in range(c["num_layers"]):
        for half in ("x_block", "context_block"):
            b = f"joint_blocks.{i}.{half}"
            pre_only = half == "context_block" and i == c["num_layers"] - 1
            dual = half == "x_block" and i in c["dual_attention_layers"]
            linear(f"{b}.adaLN_modulation.1", (2 if pre_only else 9 if dual else 6) * D, D)
            for attn in ("attn", "attn2") if dual else ("attn",):
                linear(f"{b}.{attn}.qkv", 3 * D, D)
                if c["qk_norm"]:
                    tensor(f"{b}.{attn}.ln_q.weight", head_dim)
                    tensor(f"{b}.{attn}.ln_k.weight", head_dim)
                if not pre_only:
                    linear(f"{b}.{attn}.proj", D, D)
            if not pre_only:
                linear(f"{b}.mlp.fc1", 4 * D, D)
                linear(f"{b}.mlp.fc2", D, 4 * D)
    linear("final_layer.linear", p * p * c["out_channels"], D)
    linear("final_layer.adaLN_modulation.1", 2 * D, D)
    return out


def wan_layout(c=WAN_CONFIG):
    """Wan-AI's Wan2.1 layout, text-to-video or (an ``image_dim``) image-to-video: the CLIP image embedder and each
    cross attention's ``k_img`` / ``v_img``; the patch embedding conv stored as fp8 too (upcast)."""
    out, linear, tensor = _layout_builder()
    D, image = c["num_attention_heads"] * c["attention_head_dim"], c.get("image_dim")
    if image:
        tensor("img_emb.proj.0.weight", image)
        tensor("img_emb.proj.0.bias", image)
        linear("img_emb.proj.1", image, image)
        linear("img_emb.proj.3", D, image)
        tensor("img_emb.proj.4.weight", D)
        tensor("img_emb.proj.4.bias", D)
    tensor("patch_embedding.weight", D, c["in_channels"], *c["patch_size"], fp8=True)
    tensor("patch_embedding.bias", D)
    linear("text_embedding.0", D, c["text_dim"])
    linear("text_embedding.2", D, D)
    linear("time_embedding.0", D, c["freq_dim"])
    linear("time_embedding.2", D, D)
    linear("time_projection.1", 6 * D, D)
    for i in range(c["num_layers"]):
        b = f"blocks.{i}"
        for attn in ("self_attn", "cross_attn"):
            for proj in "qkvo":
                linear(f"{b}.{attn}.{proj}", D, D)
            tensor(f"{b}.{attn}.norm_q.weight", D)
            tensor(f"{b}.{attn}.norm_k.weight", D)
        if image:
            linear(f"{b}.cross_attn.k_img", D, D)
            linear(f"{b}.cross_attn.v_img", D, D)
            tensor(f"{b}.cross_attn.norm_k_img.weight", D)
        tensor(f"{b}.norm3.weight", D)  # diffusers' norm2
        tensor(f"{b}.norm3.bias", D)
        linear(f"{b}.ffn.0", c["ffn_dim"], D)
        linear(f"{b}.ffn.2", D, c["ffn_dim"])
        tensor(f"{b}.modulation", 1, 6, D)
    linear("head.head", c["out_channels"] * math.prod(c["patch_size"]), D)
    tensor("head.modulation", 1, 2, D)
    return out


def _wan_i2v_inputs(g):
    """the tiny Wan's inputs with the image-to-video latent channels (36) and 5 CLIP image tokens (width 40)"""
    return dict(_wan_inputs(g), hidden_states=torch.randn(1, 36, 2, 8, 8, generator=g),
                encoder_hidden_states_image=torch.randn(1, 5, 40, generator=g))


class SingleFileModel(NamedTuple):
    cls: str
    config: dict
    layout: Callable
    inputs: Callable
    embedder: Tuple[str, str]  # (a linear weight of the file, its model module): kept bf16 in the weight_scale test


SINGLE = {
    "flux": SingleFileModel("FluxTransformer2DModel", FLUX_CONFIG, flux_layout,
                            lambda g: _flux_inputs(g, S=8, T=4), ("img_in.weight", "x_embedder")),
    "sd3": SingleFileModel("SD3Transformer2DModel", SD3_CONFIG, sd3_layout, _sd3_inputs,
                           ("context_embedder.weight", "context_embedder")),
    "wan": SingleFileModel("WanTransformer3DModel", WAN_CONFIG, wan_layout, _wan_inputs,
                           ("text_embedding.0.weight", "condition_embedder.text_embedder.linear_1")),
    "wan-i2v": SingleFileModel("WanTransformer3DModel", WAN_I2V_CONFIG, lambda: wan_layout(WAN_I2V_CONFIG),
                               _wan_i2v_inputs,
                               ("img_emb.proj.1.weight", "condition_embedder.image_embedder.ff.net.0.proj")),
}


def write_fp8(path, layout, fmt: str, seed: int = 0):
    """An FP8 single file of `layout`: each tensor it stores as fp8 float8_e4m3fn (random codes of |w| <= 0.234,
    never NaN), the others bf16. "raw": no scales (Kijai's e4m3fn repacks); "comfy": ComfyUI's scaled fp8 -- a
    ``scale_weight`` per fp8 tensor (powers of two and thirds below 1, [1] or 0-d), ``scale_input`` on some, the
    ``scaled_fp8`` marker."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i, (key, shape, fp8) in enumerate(layout):
        if fp8:
            n = torch.Size(shape).numel()
            words = torch.randint(-2 ** 62, 2 ** 62, ((n + 7) // 8,), dtype=torch.int64, generator=g)
            sd[key] = (words.view(torch.uint8)[:n] & 0xA7).view(torch.float8_e4m3fn).reshape(shape)  # exponent <= 4
            if fmt == "comfy":
                scale = torch.tensor(2.0 ** -(1 + i % 5) / (1 + 2 * (i % 2)))
                sd[key[:-len("weight")] + "scale_weight"] = scale if i % 3 else scale.reshape(1)
                if i % 4 == 0:
                    sd[key[:-len("weight")] + "scale_input"] = torch.tensor(1.0)
        else:
            sd[key] = (torch.randn(shape, generator=g) * 0.1).to(torch.bfloat16)
    if fmt == "comfy":
        sd["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    save_file(sd, str(path))
    return os.path.getsize(path)


@pytest.fixture(scope="module")
def single_config_dirs(tmp_path_factory):
    """model -> a directory holding the diffusers config of its files below (from_single_file's config=)."""
    out = {}
    for name, spec in SINGLE.items():
        out[name] = tmp_path_factory.mktemp(f"{name}-config")
        with open(out[name] / "config.json", "w") as f:
            json.dump(dict(spec.config, _class_name=spec.cls), f)
    return out


@pytest.fixture(scope="module")
def flux_config_dir(single_config_dirs):
    return single_config_dirs["flux"]


@pytest.fixture(scope="module")
def flux_files(tmp_path_factory, flux_config_dir):
    """Raw and ComfyUI-scaled FLUX FP8 files of one double and one single block (about 500 MB each), written once,
    and the directory holding their diffusers config."""
    root = tmp_path_factory.mktemp("flux-fp8")
    files = {fmt: root / f"flux-{fmt}.safetensors" for fmt in ("raw", "comfy")}
    for fmt, path in files.items():
        write_fp8(path, flux_layout(), fmt)
    return files, flux_config_dir


@pytest.fixture(scope="module")
def tiny_single_files(tmp_path_factory, single_config_dirs):
    """model -> (its raw and ComfyUI-scaled FP8 files, its config directory), for the models but FLUX: files of two
    blocks, under 1 MB each."""
    out = {}
    root = tmp_path_factory.mktemp("single-fp8")
    for name in [n for n in SINGLE if n != "flux"]:
        files = {fmt: root / f"{name}-{fmt}.safetensors" for fmt in ("raw", "comfy")}
        for fmt, path in files.items():
            write_fp8(path, SINGLE[name].layout(), fmt)
        out[name] = (files, single_config_dirs[name])
    return out


def _single_files(request, model):
    """(files, config directory) of `model`: FLUX's ~500 MB files are written only where a FLUX test runs."""
    if model == "flux":
        return request.getfixturevalue("flux_files")
    return request.getfixturevalue("tiny_single_files")[model]


def _dequantized(tensors, scale_key="scale_weight"):
    """An FP8 state dict as a dense float32 one, each fp8 tensor times its scale (independent of torch_lowbit),
    without the scale tensors: what diffusers' own upcast load computes with for a scaled file."""
    out = {}
    for k, t in tensors.items():
        if k.endswith((scale_key, "scale_input", "scaled_fp8")):
            continue
        if t.dtype == torch.float8_e4m3fn:
            scale = tensors.get(k[:-len("weight")] + scale_key)
            t = t.float() * (1.0 if scale is None else scale.float().reshape(-1, *[1] * (t.dim() - 1)))
        out[k] = t.float()  # rounded once
    return out


def _stored_rows(model: str, tensors, scale_key="scale_weight"):
    """diffusers' own conversion of `model`'s file run twice, on the fp8 codes as bytes and on each fp8 tensor's
    row scales (1 without one): {model tensor: (uint8 codes, fp32 scale per row)} for every fp8 tensor -- what
    the loaded layer must hold, found without torch_lowbit."""
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    convert = SINGLE_FILE_LOADABLE_CLASSES[SINGLE[model].cls]["checkpoint_mapping_fn"]
    fp8 = {k for k, t in tensors.items() if t.dtype == torch.float8_e4m3fn and not k.endswith("scaled_fp8")}
    rest = {k: t for k, t in tensors.items() if k not in fp8 and not k.endswith((scale_key, "scaled_fp8"))}
    codes = convert(config=SINGLE[model].config, checkpoint=dict(rest, **{k: tensors[k].view(torch.uint8)
                                                                           for k in fp8}))

    def row_scales(k):
        scale = tensors.get(k[:-len("weight")] + scale_key, torch.ones(1)).float().reshape(-1, 1)
        return scale.expand(tensors[k].shape[0], 1)

    scales = convert(config=SINGLE[model].config, checkpoint=dict(rest, **{k: row_scales(k) for k in fp8}))
    return {k: (v, scales[k].reshape(-1)) for k, v in codes.items() if v.dtype == torch.uint8}


def _load_single(model, source, config_dir, quantized=True):
    cls = getattr(diffusers, SINGLE[model].cls)
    kwargs = dict(quantization_config=CONFIG["fp8"]()) if quantized else {}
    return cls.from_single_file(source if isinstance(source, dict) else str(source), config=str(config_dir),
                                torch_dtype=torch.float32, **kwargs)


def _assert_holds_stored_rows(model, loaded, rows, dense=()):
    """Every linear layer of `loaded` (but those named `dense`) is an Fp8Linear holding its stored codes and scale
    (one value where its rows share one)."""
    linears = [n for n, m in loaded.named_modules() if isinstance(m, (nn.Linear, Fp8Linear)) and n not in dense]
    assert linears and all(isinstance(loaded.get_submodule(n), Fp8Linear) for n in linears), model
    assert {f"{n}.weight" for n in linears} <= set(rows)
    for name in linears:
        layer, (codes, scale) = loaded.get_submodule(name), rows[f"{name}.weight"]
        assert torch.equal(layer.weight.view(torch.uint8), codes), name
        assert torch.equal(layer.weight_scale, scale[:1] if bool((scale == scale[0]).all()) else scale), name


@pytest.mark.parametrize("fmt", ["raw", "comfy"])
@pytest.mark.parametrize("model", SINGLE)
def test_single_fp8_file_keeps_its_codes_and_matches_diffusers_upcast(request, model, fmt):
    """Each linear weight, renamed, split (qkv) or reordered (SD3's scale / shift swap) by diffusers' conversion, is
    an Fp8Linear of its stored rows and their scale; the fp8 patch-embedding convs (SD3, Wan) are upcast."""
    files, config_dir = _single_files(request, model)
    stored = load_file(str(files[fmt]))
    loaded = _load_single(model, files[fmt], config_dir)
    _assert_holds_stored_rows(model, loaded, _stored_rows(model, stored))
    x = SINGLE[model].inputs(torch.Generator().manual_seed(1))
    y = _run(loaded, x)
    del loaded
    if fmt == "raw":  # diffusers' own load of the same file, upcast (exact: raw e4m3 has no scales)
        ref = _load_single(model, files[fmt], config_dir, quantized=False)
    else:  # diffusers ignores ComfyUI's scales: its load of the file with each fp8 tensor times its scale
        ref = _load_single(model, _dequantized(stored), config_dir, quantized=False)
    del stored
    y_ref = _run(ref, x)
    assert torch.isfinite(y_ref).all() and _rel(y, y_ref) < 1e-5
    if fmt == "raw":  # the same file in diffusers' own names (no conversion runs): the same model
        linear = {f"{n}.weight" for n, m in ref.named_modules() if isinstance(m, nn.Linear)}
        own = {k: v.to(torch.float8_e4m3fn) if k in linear else v for k, v in ref.state_dict().items()}
        del ref
        loaded = _load_single(model, own, config_dir)
        assert all(isinstance(loaded.get_submodule(k[:-len(".weight")]), Fp8Linear) for k in linear)
        assert _rel(_run(loaded, x), y) < 1e-6


@pytest.mark.parametrize("model", SINGLE)
def test_single_fp8_state_dict_with_per_row_weight_scales(request, model):
    """``weight_scale`` layouts, here per row ([N]) on every other fp8 tensor: a weight split or reordered by
    diffusers' conversion keeps the scales of its own rows; a state dict (not a file) is read from the tensors
    given; an embedder stored in bf16 (as many FP8 files keep them) stays high precision, as the diffusion rule
    says."""
    files, config_dir = _single_files(request, model)
    key, embedder = SINGLE[model].embedder
    sd = load_file(str(files["raw"]))
    sd[key] = sd[key].to(torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    for i, k in enumerate([k for k, t in sd.items() if t.dtype == torch.float8_e4m3fn]):
        rows = sd[k].shape[0] if i % 2 else 1
        sd[k[:-len("weight")] + "weight_scale"] = 2.0 ** -torch.randint(0, 4, (rows,), generator=g).float()
    loaded = _load_single(model, dict(sd), config_dir)
    rows = _stored_rows(model, sd, "weight_scale")
    assert sum(s.numel() > 1 and not bool((s == s[0]).all()) for _, s in rows.values()) > 2  # rows of their own scale
    assert type(loaded.get_submodule(embedder)) is nn.Linear
    assert torch.equal(loaded.get_submodule(embedder).weight, sd[key].float())
    _assert_holds_stored_rows(model, loaded, rows, dense=(embedder,))
    x = SINGLE[model].inputs(torch.Generator().manual_seed(1))
    y = _run(loaded, x)
    del loaded
    ref = _load_single(model, _dequantized(sd, "weight_scale"), config_dir, quantized=False)
    assert _rel(y, _run(ref, x)) < 1e-5


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_single_fp8_file_under_an_int8_or_4bit_config_keeps_fp8_and_quantizes_its_dense_weights(request, weights):
    """The config decides only what the file holds dense: its fp8 weights stay as stored (Fp8Linear, no dense copy),
    a bf16 linear weight in it becomes the config's layer, as quantize_ makes it."""
    files, config_dir = _single_files(request, "wan")
    sd = load_file(str(files["raw"]))
    sd["blocks.0.ffn.0.weight"] = sd["blocks.0.ffn.0.weight"].to(torch.bfloat16)  # diffusers' ffn.net.0.proj
    config = torch_lowbit.TorchLowbitConfig(weights, **({"group_size": 16} if weights == "int4" else {}))
    loaded = diffusers.WanTransformer3DModel.from_single_file(dict(sd), config=str(config_dir),
                                                              torch_dtype=torch.float32, quantization_config=config)
    dense = "blocks.0.ffn.net.0.proj"
    _assert_holds_stored_rows("wan", loaded, _stored_rows("wan", sd), dense=(dense,))
    layer = loaded.get_submodule(dense)
    assert type(layer) is SCHEME_LAYER[weights]
    linear = nn.Linear(layer.in_features, layer.out_features)  # the file's weight and bias, as diffusers loads them
    linear.weight.data, linear.bias.data = sd["blocks.0.ffn.0.weight"].float(), sd["blocks.0.ffn.0.bias"].float()
    _same_state(torch_lowbit.quantize_(nn.Sequential(linear), config.quantize_config())[0], layer)


@pytest.mark.parametrize("model", ["sd3", "wan"])
def test_single_fp8_checkpoint_with_the_model_prefix_and_other_components(request, model, tmp_path):
    """A ComfyUI checkpoint: the transformer's tensors under ``model.diffusion_model.``, beside (SD3.5's all-in-one
    files) a scaled fp8 text encoder and a VAE that this load leaves alone: the same model as the bare file."""
    files, config_dir = _single_files(request, model)
    prefixed = lambda k: k if k == "scaled_fp8" else f"model.diffusion_model.{k}"  # noqa: E731
    sd = {prefixed(k): v for k, v in load_file(str(files["comfy"])).items()}
    if model == "sd3":
        sd["text_encoders.t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.q.weight"] = \
            torch.ones(8, 8).to(torch.float8_e4m3fn)
        sd["text_encoders.t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.q.scale_weight"] = torch.tensor(0.5)
        sd["first_stage_model.decoder.conv_in.weight"] = torch.ones(8, 4, 3, 3, dtype=torch.bfloat16)
    path = tmp_path / "checkpoint.safetensors"
    save_file(sd, str(path))
    loaded, bare = _load_single(model, path, config_dir), _load_single(model, files["comfy"], config_dir)
    got, want = loaded.state_dict(), bare.state_dict()
    assert {k: v.dtype for k, v in got.items()} == {k: v.dtype for k, v in want.items()}
    as_bytes = lambda v: v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v  # noqa: E731
    assert all(torch.equal(as_bytes(got[k]), as_bytes(want[k])) for k in want)
    x = SINGLE[model].inputs(torch.Generator().manual_seed(1))
    assert torch.equal(_run(loaded, x), _run(bare, x))


def _hub_cache(root, path, repo="someone/flux-fp8"):
    """A Hugging Face cache holding `path` as the Hub download of ``{repo}/{name}`` would (refs/main -> a snapshot,
    its file a link to the blob): (the link a user passes, the cache_dir)."""
    folder = root / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / ("0" * 40)
    os.makedirs(folder / "refs")
    os.makedirs(snapshot)
    (folder / "refs" / "main").write_text(snapshot.name)
    os.symlink(path, snapshot / path.name)
    return f"https://huggingface.co/{repo}/blob/main/{path.name}", root


@linux_only
@pytest.mark.parametrize("layout", ["raw", "comfy"])
def test_single_fp8_file_loads_within_its_size(flux_files, layout, tmp_path):
    """The peak resident growth of the load stays within 1.1x the file: fp8 weights are read as stored, one rows
    range at a time, never upcast, and diffusers' memory map of the file is never touched -- for a path, and
    (the comfy case) for a Hub link, read from the copy in the cache."""
    files, config_dir = flux_files
    size = os.path.getsize(files[layout])
    assert size >= 200e6
    name, cache_dir = (str(files[layout]), "") if layout == "raw" else _hub_cache(tmp_path / "hub", files[layout])
    load = ("model = diffusers.FluxTransformer2DModel.from_single_file(sys.argv[1], config=sys.argv[2], "
            "cache_dir=sys.argv[3] or None, local_files_only=True, "
            "quantization_config=torch_lowbit.TorchLowbitConfig('fp8'))")
    warmup = """
        import torch, diffusers, torch_lowbit
        from safetensors.torch import save_file
        save_file({"img_in.weight": torch.ones(2, 2).to(torch.float8_e4m3fn)}, "warmup.safetensors")
        try:  # refused (no FLUX layout): pays the imports and diffusers' single-file machinery
            diffusers.FluxTransformer2DModel.from_single_file("warmup.safetensors", config=sys.argv[2],
                                                              quantization_config=torch_lowbit.TorchLowbitConfig("fp8"))
        except torch_lowbit.formats.CheckpointError:
            pass"""
    growth, (held, not_bf16) = peak_growth(
        tmp_path, warmup=warmup, load=load,
        report=["sum(b.numel() for n, b in model.named_buffers() if n.endswith('.weight'))",
                "sum(p.dtype != torch.bfloat16 for p in model.parameters())"],  # the default dtype, norms included
        args=(name, config_dir, cache_dir))
    assert not_bf16 == 0
    assert held >= 0.95 * size  # the model holds the fp8 weights as stored
    assert growth <= 1.1 * size, f"loading peaked {growth / 1e6:.0f} MB above the baseline for a " \
                                 f"{size / 1e6:.0f} MB file ({growth / size:.2f}x)"


# ------------------------------------------------------------------------------------------------ bad files
def _single(path, config_dir):
    return diffusers.FluxTransformer2DModel.from_single_file(str(path), config=str(config_dir),
                                                             quantization_config=CONFIG["fp8"]())


def test_single_file_of_another_model_is_refused_naming_file_and_tensors(flux_config_dir, tmp_path):
    path = tmp_path / "unet.safetensors"
    save_file({"down.0.conv.weight": torch.ones(4, 4, 3, 3).to(torch.float8_e4m3fn), "down.0.conv.bias": torch.ones(4)},
              str(path))
    with pytest.raises(CheckpointError, match=rf"{path}: its tensors \('down.0.conv.bias', 'down.0.conv.weight'.* "
                                              r"match no layout diffusers converts to FluxTransformer2DModel"):
        _single(path, flux_config_dir)


def test_single_file_mixing_fp8_formats_is_refused_naming_the_tensor(flux_config_dir, tmp_path):
    path = tmp_path / "mixed.safetensors"
    save_file({"img_in.weight": torch.ones(H, 4).to(torch.float8_e4m3fn),
               "txt_in.weight": torch.ones(H, 32).to(torch.float8_e5m2)}, str(path))
    with pytest.raises(CheckpointError, match=rf"{path}: tensor 'txt_in.weight' is torch.float8_e5m2 beside "
                                              r"float8_e4m3fn tensors \(a mixed-dtype file\)"):
        _single(path, flux_config_dir)


@pytest.mark.parametrize("marker", [True, False])
def test_scaled_single_file_missing_a_scale_is_refused_naming_the_tensor(flux_config_dir, tmp_path, marker):
    """Refused before anything is read: one missing scale in a scaled file (one holding scales, or ComfyUI's marker)
    is never a silent scale of 1."""
    path = tmp_path / "comfy-missing.safetensors"
    codes = torch.ones(8, 4).to(torch.float8_e4m3fn)
    sd = {"img_in.weight": codes.clone(), "img_in.scale_weight": torch.tensor(0.5),
          "double_blocks.0.img_attn.qkv.weight": codes}
    if marker:
        sd = {"scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn), "double_blocks.0.img_attn.qkv.weight": codes}
    save_file(sd, str(path))
    with pytest.raises(CheckpointError, match=rf"{path}: tensor 'double_blocks.0.img_attn.qkv.weight' is "
                                              r"float8_e4m3fn but its scale "
                                              r"'double_blocks.0.img_attn.qkv.scale_weight' is missing"):
        _single(path, flux_config_dir)


def test_single_file_of_a_near_miss_is_refused_naming_the_missing_tensor(flux_config_dir, tmp_path):
    """A FLUX-like file lacking a tensor diffusers' conversion needs: the error names the file and that tensor."""
    path = tmp_path / "partial.safetensors"
    save_file({k: torch.zeros(1) for k, _, _ in flux_layout() if k != "vector_in.out_layer.weight"}, str(path))
    with pytest.raises(CheckpointError, match=rf"{path} has no tensor 'vector_in.out_layer.weight', which diffusers "
                                              r"needs to build FluxTransformer2DModel from it"):
        _single(path, flux_config_dir)


@pytest.mark.parametrize("model,missing,model_tensor", [
    ("sd3", "joint_blocks.1.x_block.mlp.fc1.weight", None),  # a conversion that pops each tensor it needs
    ("wan", "blocks.1.ffn.0.weight", "blocks.1.ffn.net.0.proj.weight"),  # one that renames what it finds
])
def test_near_miss_single_files_of_other_models_are_refused_naming_the_file(single_config_dirs, tmp_path, model,
                                                                           missing, model_tensor):
    path = tmp_path / f"{model}-partial.safetensors"
    write_fp8(path, [entry for entry in SINGLE[model].layout() if entry[0] != missing], "raw")
    match = (rf"{path} has no tensor '{missing}', which diffusers needs to build {SINGLE[model].cls}" if model_tensor is
             None else rf"{path}: diffusers' conversion of its tensors left these tensors of {SINGLE[model].cls} "
                       rf"without a value: {model_tensor}; the file lacks the tensors it maps to them")
    with pytest.raises(CheckpointError, match=match):
        _load_single(model, path, single_config_dirs[model])


def test_without_diffusers_the_config_still_works_with_transformers():
    out = _python("""
        import sys
        sys.modules["diffusers"] = None  # as if not installed
        import torch_lowbit
        config = torch_lowbit.TorchLowbitConfig("fp8")
        from transformers.quantizers import AutoQuantizationConfig
        assert type(AutoQuantizationConfig.from_dict(config.to_dict())) is type(config)
        assert "torch_lowbit.diffusers_quantizer" not in sys.modules
        print("ok")""")
    assert out.split()[-1] == "ok"


def test_quant_method_is_one_value_for_both_libraries():
    from diffusers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING as TF_CONFIGS

    config = torch_lowbit.TorchLowbitConfig("int8")
    method = config.quant_method
    assert method == "torch_lowbit" and method.value == "torch_lowbit" and str(method) == "torch_lowbit"
    assert json.loads(json.dumps(config.to_dict()))["quant_method"] == "torch_lowbit"
    assert AUTO_QUANTIZATION_CONFIG_MAPPING[method] is TF_CONFIGS[method] is type(config)
    assert AUTO_QUANTIZER_MAPPING["torch_lowbit"].__name__ == "TorchLowbitDiffusersQuantizer"


# ------------------------------------------------------------------------------------------------ LoRA
def _save_flux_lora(transformer, path, edit=None):
    """A LoRA of a trained adapter's size on `transformer`'s attention and MLP projections, saved by diffusers;
    edit(state_dict) changes it first."""
    from peft.utils import get_peft_model_state_dict
    trained = copy.deepcopy(transformer)
    trained.add_adapter(peft.LoraConfig(r=4, lora_alpha=4, init_lora_weights=False,
                                        target_modules=["to_q", "to_k", "to_v", "to_out.0", "proj_mlp"]))
    with torch.no_grad():  # a trained adapter's size of update
        for n, p in trained.named_parameters():
            if "lora_B" in n:
                p.mul_(8)
    state = get_peft_model_state_dict(trained)
    if edit is not None:
        edit(state)
    diffusers.FluxPipeline.save_lora_weights(path, transformer_lora_layers=state)


@pytest.mark.parametrize("scheme", CONFIG)
def test_flux_lora_loads_into_a_quantized_transformer_as_into_the_dense_one(tiny_flux_pipeline, scheme, tmp_path):
    # the diffusers habit: pipe.load_lora_weights(dir) of a LoRA trained on the dense transformer
    _save_flux_lora(tiny_flux_pipeline.transformer, tmp_path / "lora")
    dense = _with_transformer(tiny_flux_pipeline, copy.deepcopy(tiny_flux_pipeline.transformer))
    dense.load_lora_weights(tmp_path / "lora")
    tiny_flux_pipeline.transformer.save_pretrained(tmp_path / "transformer")
    quantized = _with_transformer(tiny_flux_pipeline, diffusers.FluxTransformer2DModel.from_pretrained(
        tmp_path / "transformer", quantization_config=CONFIG[scheme](), torch_dtype=torch.float32))
    quantized.load_lora_weights(tmp_path / "lora")
    wrapped = [n for n, m in quantized.transformer.named_modules() if isinstance(m, LowbitLoraLinear)]
    assert wrapped and len(wrapped) == len([n for n, m in dense.transformer.named_modules()
                                            if isinstance(m, peft.tuners.lora.LoraLayer)])
    inputs = _flux_inputs(torch.Generator().manual_seed(1))
    out, ref, base = (_run(p.transformer, inputs) for p in (quantized, dense, tiny_flux_pipeline))
    assert _rel(ref, base) > 3 * SCHEME_ERR[scheme]  # the adapter changes the output far more than quantizing does
    assert _rel(out, ref) < SCHEME_ERR[scheme]
    quantized.set_progress_bar_config(disable=True)
    assert torch.isfinite(_image(quantized)).all()
    with pytest.raises(ValueError, match="dequantize_model"):  # fuse_lora would re-quantize: refused by name
        quantized.fuse_lora()


def test_flux_lora_into_a_4bit_transformer_from_quantize_(tiny_flux_pipeline, tmp_path):
    # FluxPipeline.load_lora_weights looked up each target's dense `weight` in the state dict, which a 4-bit layer
    # holds as weight_packed: a KeyError. A LoRA made for fewer input features (Flux Control's) is zero-padded as
    # diffusers pads a dense target's; one made for more is refused by name.
    key = "single_transformer_blocks.0.attn.to_q.lora_A.weight"

    def narrow(state):
        state[key] = state[key][:, :20].clone()

    _save_flux_lora(tiny_flux_pipeline.transformer, tmp_path / "lora", narrow)
    dense = _with_transformer(tiny_flux_pipeline, copy.deepcopy(tiny_flux_pipeline.transformer))
    dense.load_lora_weights(tmp_path / "lora")
    transformer = torch_lowbit.quantize_(copy.deepcopy(tiny_flux_pipeline.transformer), torch_lowbit.Int4WeightOnly(16))
    quantized = _with_transformer(tiny_flux_pipeline, transformer)
    quantized.load_lora_weights(tmp_path / "lora")
    assert isinstance(transformer.single_transformer_blocks[0].attn.to_q, LowbitLoraLinear)
    inputs = _flux_inputs(torch.Generator().manual_seed(1))
    out, ref, base = (_run(p.transformer, inputs) for p in (quantized, dense, tiny_flux_pipeline))
    assert _rel(ref, base) > 3 * SCHEME_ERR["int4"] and _rel(out, ref) < SCHEME_ERR["int4"]

    def wide(state):
        state[key] = torch.cat([state[key], state[key][:, :8]], 1)

    _save_flux_lora(tiny_flux_pipeline.transformer, tmp_path / "wide", wide)
    fresh = _with_transformer(tiny_flux_pipeline, torch_lowbit.quantize_(
        copy.deepcopy(tiny_flux_pipeline.transformer), torch_lowbit.Int4WeightOnly(16)))
    with pytest.raises(ValueError, match=r"single_transformer_blocks\.0\.attn\.to_q\.lora_A takes 40 input features, "
                                         r"the 4-bit layer single_transformer_blocks\.0\.attn\.to_q has 32"):
        fresh.load_lora_weights(tmp_path / "wide")


@pytest.mark.parametrize("imports", ["torch_lowbit, diffusers", "diffusers, torch_lowbit",
                                     "diffusers; import diffusers.loaders.lora_pipeline; import torch_lowbit"])
def test_the_flux_lora_step_is_wrapped_once_in_any_import_order(imports):
    out = _python("""
        import IMPORTS
        from diffusers.loaders import lora_pipeline
        from torch_lowbit import _diffusers_lora
        _diffusers_lora.install(lora_pipeline)  # a second install changes nothing
        step = lora_pipeline.FluxLoraLoaderMixin._maybe_expand_lora_state_dict.__func__
        original = step._lowbit_original
        print(getattr(original, "_lowbit_original", None) is None, original.__module__)
        """.replace("IMPORTS", imports))
    assert out.split()[-2:] == ["True", "diffusers.loaders.lora_pipeline"]


# ------------------------------------------------------------------------------------------------ pipelines
@pytest.mark.parametrize("spelling,scheme", [("quant_backend", "fp8"), ("quant_mapping", "fp8"),
                                             ("quant_backend", "int4")])
def test_pipeline_quantization_config_quantizes_the_named_components(tiny_flux_pipeline, spelling, scheme, tmp_path):
    # diffusers' pipeline-level habit: DiffusionPipeline.from_pretrained(..., quantization_config=
    # PipelineQuantizationConfig(...)), with the backend by name or a config per component; the same keywords make
    # the transformers component's config (T5) and the diffusers one's
    tiny_flux_pipeline.save_pretrained(tmp_path)
    components = ["transformer", "text_encoder_2"]
    kwargs = {"weights": scheme, **W4_SCHEMES.get(scheme, {})}
    if spelling == "quant_backend":
        config = diffusers.PipelineQuantizationConfig(quant_backend="torch_lowbit", quant_kwargs=kwargs,
                                                      components_to_quantize=components)
    else:
        config = diffusers.PipelineQuantizationConfig(
            quant_mapping={c: torch_lowbit.TorchLowbitConfig(**kwargs) for c in components})
    pipe = diffusers.FluxPipeline.from_pretrained(tmp_path, quantization_config=config, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    layer = SCHEME_LAYER[scheme]
    assert isinstance(pipe.transformer.transformer_blocks[0].attn.to_q, layer)
    assert isinstance(pipe.text_encoder_2.encoder.block[0].layer[0].SelfAttention.q, layer)
    assert not any(isinstance(m, layer) for m in pipe.text_encoder.modules())  # not named: stays dense
    img, ref = _image(pipe), _image(tiny_flux_pipeline)
    assert 0 < _rel(img, ref) < SCHEME_ERR[scheme]


@pytest.mark.parametrize("scheme", ["fp8", "int4"])
def test_a_saved_quantized_pipeline_reloads_its_t5_low_bit_through_from_pretrained(tiny_flux_pipeline, scheme,
                                                                                   tmp_path):
    # diffusers hands a saved pipeline's T5 to transformers, which reads FP8 / INT8 back dense and fails on 4-bit
    # (its T5 initializer reads q.weight); torch_lowbit.from_pretrained of the subfolder reads it back as saved
    tiny_flux_pipeline.save_pretrained(tmp_path / "dense")
    config = diffusers.PipelineQuantizationConfig(
        quant_backend="torch_lowbit", quant_kwargs={"weights": scheme, **W4_SCHEMES.get(scheme, {})},
        components_to_quantize=["transformer", "text_encoder_2"])
    pipe = diffusers.FluxPipeline.from_pretrained(tmp_path / "dense", quantization_config=config,
                                                  torch_dtype=torch.float32)
    pipe.save_pretrained(tmp_path / "saved")
    encoder = torch_lowbit.from_pretrained(tmp_path / "saved" / "text_encoder_2", dtype=torch.float32, device="cpu")
    again = diffusers.FluxPipeline.from_pretrained(tmp_path / "saved", text_encoder_2=encoder,
                                                   torch_dtype=torch.float32)
    for p in (pipe, again):
        p.set_progress_bar_config(disable=True)
        assert isinstance(p.text_encoder_2.encoder.block[1].layer[0].SelfAttention.v, SCHEME_LAYER[scheme])
    ids = torch.tensor([[3, 4, 5, 6, 7, 2, 0, 0]])
    with torch.no_grad():
        assert torch.equal(again.text_encoder_2(ids).last_hidden_state, pipe.text_encoder_2(ids).last_hidden_state)
    # not bit for bit: the reloaded dense layers' weights lie at other alignments, which torch's fp32 GEMV rounds
    # differently
    assert _rel(_image(again), _image(pipe)) < 1e-6
