"""TorchLowbitConfig in diffusers (torch_lowbit.diffusers_quantizer): from_pretrained of tiny FLUX / SD3 / Wan
transformers saved by diffusers quantizes them as they load (the diffusion skip rule), save_pretrained -> reload gives
the same model, a FluxPipeline runs on it; from_single_file of FLUX FP8 files written in the published layouts (raw
e4m3, ComfyUI scaled fp8) keeps the stored codes, matches diffusers' own upcast load and peaks near the file size;
bad files are refused naming the file and the tensor."""
import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import torch_lowbit
from peak_memory import linux_only, peak_growth
from reference import fp8_weight_f64
from torch_lowbit.formats import CheckpointError
from torch_lowbit.nn import Fp8Linear

diffusers = pytest.importorskip("diffusers")
from test_diffusion import (LAYER, MODEL_ERR, MODELS, _flux_inputs, _image, _rel, _with_transformer,  # noqa: E402
                            tiny_flux_pipeline)  # noqa: F401  (the fixture)

CONFIG = {"fp8": lambda: torch_lowbit.TorchLowbitConfig("fp8"), "int8": lambda: torch_lowbit.TorchLowbitConfig("int8")}


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
    assert all(type(q.get_submodule(n)) is LAYER[scheme] for n in set(linears) - set(kept))
    x = inputs(torch.Generator().manual_seed(1))
    y, y_dense = _run(q, x), _run(dense, x)
    assert 0 < _rel(y, y_dense) < MODEL_ERR[scheme]
    # what quantize_ makes of the dense model: the same layers (the float32 glue around them may round differently
    # by 1 ulp, with the loaded tensors' memory alignment)
    after = torch_lowbit.quantize_(copy.deepcopy(dense), CONFIG[scheme]().quantize_config())
    assert all(torch.equal(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t,
                           u.view(torch.uint8) if u.dtype == torch.float8_e4m3fn else u)
               for t, u in zip(q.state_dict().values(), after.state_dict().values()))
    assert list(q.state_dict()) == list(after.state_dict()) and _rel(y, _run(after, x)) < 1e-6
    if scheme == "fp8":  # the dense model on the dequantized weights, in float64
        ref = copy.deepcopy(dense).double()
        for name, layer in q.named_modules():
            if isinstance(layer, Fp8Linear):
                ref.get_submodule(name).weight.data = fp8_weight_f64(layer.weight.view(torch.uint8), layer.weight_scale)
        y_ref = _run(ref, {k: v.double() if v.is_floating_point() else v for k, v in x.items()})
        assert _rel(y, y_ref) < 1e-6


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
        assert f.get_slice(f"{to_q}.weight").get_dtype() == {"fp8": "F8_E4M3", "int8": "I8"}[scheme]
        assert f.get_slice(f"{to_q}.weight_scale").get_dtype() == "F32"
    again = type(dense).from_pretrained(tmp_path, torch_dtype=torch.float32)  # the config says how
    for name, layer in q.named_modules():
        if isinstance(layer, LAYER[scheme]):
            other = again.get_submodule(name)
            assert type(other) is type(layer) and torch.equal(other.weight_scale, layer.weight_scale)
            assert torch.equal(other.weight.view(torch.uint8), layer.weight.view(torch.uint8))
    x = inputs(torch.Generator().manual_seed(1))
    assert _rel(_run(again, x), _run(q, x)) < 1e-6


def test_reload_in_a_fresh_process(saved_dense, tmp_path):
    """A user's reflex: save, then reload in a new Python that imports diffusers and torch_lowbit (no config made):
    the same layers, the same output."""
    dense, path = saved_dense["flux"]
    q = _load(type(dense), path, "fp8")
    q.save_pretrained(tmp_path / "saved")
    x = MODELS["flux"][1](torch.Generator().manual_seed(1))
    save_file({**{k: v.contiguous() for k, v in x.items()}, "expected": _run(q, x)}, str(tmp_path / "io.safetensors"))
    out = _python("""
        import sys, torch, diffusers, torch_lowbit
        from safetensors.torch import load_file, save_file
        io = load_file(sys.argv[2])
        expected = io.pop("expected")
        model = diffusers.FluxTransformer2DModel.from_pretrained(sys.argv[1], torch_dtype=torch.float32)
        assert isinstance(model.transformer_blocks[0].attn.to_q, torch_lowbit.nn.Fp8Linear)
        with torch.no_grad():
            y = model(**io, return_dict=False)[0]
        print(float((y - expected).abs().max() / expected.abs().max()))
        """, tmp_path / "saved", tmp_path / "io.safetensors")
    assert float(out.split()[-1]) < 1e-6


def test_modules_to_not_convert_replaces_the_diffusion_rule(saved_dense):
    dense, path = saved_dense["flux"]
    q = dense.from_pretrained(path, quantization_config=torch_lowbit.TorchLowbitConfig(
        "fp8", modules_to_not_convert=["single_transformer_blocks"]))
    assert isinstance(q.x_embedder, Fp8Linear) and isinstance(q.transformer_blocks[0].attn.to_q, Fp8Linear)
    assert type(q.single_transformer_blocks[0].proj_mlp) is nn.Linear


def test_4bit_weights_are_refused_by_name(saved_dense):
    dense, path = saved_dense["flux"]
    with pytest.raises(ValueError, match=r"TorchLowbitConfig\(weights='int4'\) in diffusers: .*"
                                         r"torch_lowbit\.quantize_\(model, torch_lowbit\.Int4WeightOnly"):
        dense.from_pretrained(path, quantization_config=torch_lowbit.TorchLowbitConfig("int4"))


@pytest.mark.parametrize("scheme", CONFIG)
def test_flux_pipeline_with_a_transformer_loaded_quantized(tiny_flux_pipeline, scheme, tmp_path):
    tiny_flux_pipeline.transformer.save_pretrained(tmp_path)
    transformer = diffusers.FluxTransformer2DModel.from_pretrained(tmp_path, quantization_config=CONFIG[scheme](),
                                                                   torch_dtype=torch.float32)
    pipe = _with_transformer(tiny_flux_pipeline, transformer)
    pipe.set_progress_bar_config(disable=True)
    img, ref = _image(pipe), _image(tiny_flux_pipeline)
    assert img.shape == (1, 3, 32, 32) and torch.isfinite(img).all()
    assert 0 < _rel(img, ref) < MODEL_ERR[scheme]
    pipe.enable_model_cpu_offload(device="cpu")  # diffusers' hooks move the loaded-quantized model like any other
    try:  # measured up to 2.4e-7 apart (float32 rounding; a wrong layer would be ~1e-2 off)
        torch.testing.assert_close(_image(pipe), img, rtol=0, atol=1e-6)
    finally:
        pipe.remove_all_hooks()


# ------------------------------------------------------------------------------------------------ single files
H, MLP = 3072, 12288  # diffusers' FLUX conversion assumes FLUX.1's width
FLUX_CONFIG = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=128,
                   num_attention_heads=24, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=False,
                   axes_dims_rope=[16, 56, 56])


def flux_layout(double=1, single=1, in_channels=4, text_dim=32, pooled_dim=32, head_dim=128):
    """[(key, shape, is a linear weight)] of Black Forest Labs' FLUX.1 file layout (what ComfyUI and the FP8
    repacks keep)."""
    out = []

    def linear(name, n, k):
        out.extend([(f"{name}.weight", (n, k), True), (f"{name}.bias", (n,), False)])

    def qk_norm(prefix):
        out.extend([(f"{prefix}.{norm}.scale", (head_dim,), False) for norm in ("query_norm", "key_norm")])

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


def write_flux_fp8(path, layout: str, seed: int = 0):
    """A FLUX FP8 file: every linear weight float8_e4m3fn (random codes of |w| <= 0.234, never NaN), biases and norm
    scales bf16. "raw": no scales (Kijai's e4m3fn repacks); "comfy": ComfyUI's scaled fp8 -- a ``scale_weight`` per
    weight (powers of two and thirds, [1] or 0-d), ``scale_input`` on some, the ``scaled_fp8`` marker."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i, (key, shape, is_weight) in enumerate(flux_layout()):
        if is_weight:
            n = torch.Size(shape).numel()
            words = torch.randint(-2 ** 62, 2 ** 62, ((n + 7) // 8,), dtype=torch.int64, generator=g)
            sd[key] = (words.view(torch.uint8)[:n] & 0xA7).view(torch.float8_e4m3fn).reshape(shape)  # exponent <= 4
            if layout == "comfy":
                scale = torch.tensor(2.0 ** -(i % 5) / (1 + 2 * (i % 2)))
                sd[key[:-len("weight")] + "scale_weight"] = scale if i % 3 else scale.reshape(1)
                if i % 4 == 0:
                    sd[key[:-len("weight")] + "scale_input"] = torch.tensor(1.0)
        else:
            sd[key] = (torch.randn(shape, generator=g) * 0.1).to(torch.bfloat16)
    if layout == "comfy":
        sd["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    save_file(sd, str(path))
    return os.path.getsize(path)


@pytest.fixture(scope="module")
def flux_config_dir(tmp_path_factory):
    """A directory holding the diffusers config of the FLUX files below (from_single_file's config=)."""
    config_dir = tmp_path_factory.mktemp("flux-config")
    with open(config_dir / "config.json", "w") as f:
        json.dump(dict(FLUX_CONFIG, _class_name="FluxTransformer2DModel"), f)
    return config_dir


@pytest.fixture(scope="module")
def flux_files(tmp_path_factory, flux_config_dir):
    """Raw and ComfyUI-scaled FLUX FP8 files of one double and one single block (about 500 MB each), written once,
    and the directory holding their diffusers config."""
    root = tmp_path_factory.mktemp("flux-fp8")
    config_dir = flux_config_dir
    files = {layout: root / f"flux-{layout}.safetensors" for layout in ("raw", "comfy")}
    for layout, path in files.items():
        write_flux_fp8(path, layout)
    return files, config_dir


def _dequantized(tensors, scale_key="scale_weight"):
    """A FLUX FP8 state dict as a dense float32 one, each fp8 weight times its scale (independent of torch_lowbit),
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


@pytest.mark.parametrize("layout", ["raw", "comfy"])
def test_single_fp8_file_keeps_its_codes_and_matches_diffusers_upcast(flux_files, layout):
    files, config_dir = flux_files
    model = diffusers.FluxTransformer2DModel.from_single_file(str(files[layout]), config=str(config_dir),
                                                              quantization_config=CONFIG["fp8"](),
                                                              torch_dtype=torch.float32)
    linears = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, Fp8Linear))]
    assert linears and all(isinstance(model.get_submodule(n), Fp8Linear) for n in linears)
    with safe_open(str(files[layout]), "pt") as f:  # a split weight holds the stored rows and the file's scale
        qkv = f.get_tensor("single_blocks.0.linear1.weight").view(torch.uint8)
        to_k = model.single_transformer_blocks[0].attn.to_k
        assert torch.equal(to_k.weight.view(torch.uint8), qkv[H:2 * H])
        want = f.get_tensor("single_blocks.0.linear1.scale_weight").reshape(1) if layout == "comfy" else torch.ones(1)
        assert torch.equal(to_k.weight_scale, want)
    x = _flux_inputs(torch.Generator().manual_seed(1), S=8, T=4)
    y = _run(model, x)
    del model
    if layout == "raw":  # diffusers' own load of the same file, upcast (exact: raw e4m3 has no scales)
        ref = diffusers.FluxTransformer2DModel.from_single_file(str(files[layout]), config=str(config_dir),
                                                                torch_dtype=torch.float32)
    else:  # diffusers ignores ComfyUI's scales: its load of the file with each weight times its scale
        ref = diffusers.FluxTransformer2DModel.from_single_file(_dequantized(load_file(str(files[layout]))),
                                                                config=str(config_dir), torch_dtype=torch.float32)
    y_ref = _run(ref, x)
    assert torch.isfinite(y_ref).all() and _rel(y, y_ref) < 1e-5
    if layout == "raw":  # the same file in diffusers' own names (no conversion runs): the same model
        linear = {f"{n}.weight" for n, m in ref.named_modules() if isinstance(m, nn.Linear)}
        own = {k: v.to(torch.float8_e4m3fn) if k in linear else v for k, v in ref.state_dict().items()}
        del ref
        model = diffusers.FluxTransformer2DModel.from_single_file(own, config=str(config_dir),
                                                                  quantization_config=CONFIG["fp8"](),
                                                                  torch_dtype=torch.float32)
        assert isinstance(model.single_transformer_blocks[0].attn.to_k, Fp8Linear)
        assert _rel(_run(model, x), y) < 1e-6


def test_single_fp8_state_dict_with_per_row_weight_scales(flux_files):
    """``weight_scale`` layouts, here per row ([N]) on every other weight: a weight split by diffusers' conversion
    keeps the scales of its own rows; a state dict (not a file) is read from the tensors given; an embedder stored
    in bf16 (as many FP8 files keep them) stays high precision, as the diffusion rule says."""
    files, config_dir = flux_files
    sd = load_file(str(files["raw"]))
    sd["img_in.weight"] = sd["img_in.weight"].to(torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    for i, k in enumerate([k for k, t in sd.items() if t.dtype == torch.float8_e4m3fn]):
        rows = sd[k].shape[0] if i % 2 else 1
        sd[k[:-len("weight")] + "weight_scale"] = 2.0 ** -torch.randint(0, 4, (rows,), generator=g).float()
    model = diffusers.FluxTransformer2DModel.from_single_file(sd, config=str(config_dir), torch_dtype=torch.float32,
                                                              quantization_config=CONFIG["fp8"]())
    split = {"double_blocks.0.img_attn.qkv": model.transformer_blocks[0].attn.to_k,
             "single_blocks.0.linear1": model.single_transformer_blocks[0].attn.to_k}
    for key, layer in split.items():
        scale = sd[f"{key}.weight_scale"]
        assert torch.equal(layer.weight_scale, scale[H:2 * H] if scale.numel() > 1 else scale)
        assert torch.equal(layer.weight.view(torch.uint8), sd[f"{key}.weight"].view(torch.uint8)[H:2 * H])
    assert any(layer.weight_scale.numel() == H for layer in split.values())
    assert type(model.x_embedder) is nn.Linear and torch.equal(model.x_embedder.weight, sd["img_in.weight"].float())
    x = _flux_inputs(torch.Generator().manual_seed(1), S=8, T=4)
    y = _run(model, x)
    del model
    ref = diffusers.FluxTransformer2DModel.from_single_file(_dequantized(sd, "weight_scale"), config=str(config_dir),
                                                            torch_dtype=torch.float32)
    assert _rel(y, _run(ref, x)) < 1e-5


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
