"""from_pretrained as a transformers user calls it: the arguments people pass by habit (dtype strings and "auto",
torch_dtype, device_map, revision, trust_remote_code) work or fail at once naming the argument; no file outside the
checkpoint is read, config.json and generation_config.json included; several threads load at once without leaving
anything patched; TorchLowbitConfig and the loader validate what they are given; progress lines. The checkpoint
is a tiny Llama written by compressed-tensors, and the reference is compressed-tensors' own dequantized reload."""
import functools
import io
import json
import os
import shutil
import threading

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import hf_writers as W
from opened_files import opened_files
import torch_lowbit
from hf_writers import transformers
from torch_lowbit.formats import CheckpointError, load_quantized
from torch_lowbit.nn import Fp8Linear

IDS = torch.tensor([[3, 17, 42, 5, 88, 1, 0, 64, 23]])
HAS_MPS = torch.backends.mps.is_available()

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory, the writer's dequantized fp32 logits) of a compressed-tensors FP8 per-channel tiny Llama."""
    path = str(tmp_path_factory.mktemp("llama-ct-fp8-channel"))
    W.write_compressed_tensors(W.tiny_model("llama"), "llama", path, "fp8-channel-w8a16")
    with torch.no_grad():
        return path, W.ct_dequantized(path)(IDS).logits


def _copy(checkpoint, tmp_path, name="ckpt"):
    dst = tmp_path / name
    shutil.copytree(checkpoint[0], dst)
    return dst


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


def _rel_err(out, ref):
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def _edit_config(path, fn, name="config.json"):
    data = json.loads((path / name).read_text())
    fn(data)
    (path / name).write_text(json.dumps(data))


# ------------------------------------------------------------------------------------------------ arguments
@pytest.mark.parametrize("kwargs", [{"dtype": "float32"}, {"dtype": "torch.float32"}, {"torch_dtype": torch.float32},
                                    {"torch_dtype": "float32"}, {"dtype": "auto"},
                                    {"dtype": torch.float32, "torch_dtype": torch.float32}])
def test_dtype_spellings_of_transformers_load_the_writers_model(checkpoint, kwargs):
    model = torch_lowbit.from_pretrained(checkpoint[0], **kwargs)  # the writer saved the model in float32
    assert model.model.embed_tokens.weight.dtype == torch.float32 and model.config.dtype == torch.float32
    assert isinstance(model.model.layers[0].mlp.down_proj, Fp8Linear)
    assert _rel_err(_logits(model), checkpoint[1]) <= 1e-6


def test_dtype_string_equals_the_torch_dtype(checkpoint):
    by_name = torch_lowbit.from_pretrained(checkpoint[0], dtype="bfloat16")
    assert by_name.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(_logits(by_name), _logits(torch_lowbit.from_pretrained(checkpoint[0], dtype=torch.bfloat16)))


def test_dtype_auto_without_a_config_dtype_takes_the_checkpoints_float_tensors(checkpoint, tmp_path):
    path = _copy(checkpoint, tmp_path)
    _edit_config(path, lambda d: [d.pop(k, None) for k in ("dtype", "torch_dtype")])
    model = torch_lowbit.from_pretrained(path, dtype="auto")
    assert model.model.norm.weight.dtype == torch.float32  # the writer stored its dense tensors in float32


@pytest.mark.parametrize("kwargs", [{"device_map": "cpu"}, {"device_map": "auto"}, {"device_map": {"": "cpu"}},
                                    {"device": "cpu", "device_map": "cpu"}, {"device": torch.device("cpu")},
                                    {"revision": "main"}, {"trust_remote_code": False}])
def test_device_map_for_one_device_and_revision_work_as_in_transformers(checkpoint, kwargs):
    model = torch_lowbit.from_pretrained(checkpoint[0], dtype=torch.float32, **kwargs)
    named = kwargs.get("device", kwargs.get("device_map", "auto"))
    assert model.device == (torch_lowbit.hf.best_device() if named == "auto" else torch.device("cpu"))
    assert _rel_err(_logits(model.cpu()), checkpoint[1]) <= 1e-6


REFUSED = [  # (arguments, the error names them)
    ({"dtype": torch.float8_e4m3fn}, r"dtype=torch\.float8_e4m3fn is not supported.*bfloat16"),
    ({"dtype": torch.float64}, r"dtype=torch\.float64 is not supported"),
    ({"dtype": "float64"}, r"dtype='float64' is not supported"),
    ({"dtype": "bf16"}, r"dtype='bf16' is not supported"),
    ({"torch_dtype": torch.int8}, r"torch_dtype=torch\.int8 is not supported"),
    ({"dtype": torch.float16, "torch_dtype": torch.float32}, r"dtype=torch\.float16 and torch_dtype=torch\.float32 "
                                                             r"disagree"),
    ({"device": "meta"}, r"device='meta': torch_lowbit's ops run on 'cpu' and 'mps'"),
    ({"device": "cuda"}, r"device='cuda': torch_lowbit's ops run on 'cpu' and 'mps'"),
    ({"device": "gpu0"}, r"device='gpu0' is not a device"),
    ({"device_map": "balanced"}, r"device_map='balanced' is not a device"),
    ({"device_map": {"model.embed_tokens": "cpu", "lm_head": "cpu"}}, r"device_map=\{.*\} places modules on "
                                                                       r"different devices"),
    ({"device_map": "meta"}, r"device_map='meta': torch_lowbit's ops run on"),
    ({"device": "cpu", "device_map": {"": "meta"}}, r"device_map='meta'"),
    ({"trust_remote_code": True}, r"trust_remote_code=True is not supported"),
    ({"revision": 3}, r"revision must be a str"),
]
if not HAS_MPS:
    REFUSED += [({"device": "mps"}, r"device='mps', but this machine has no mps device"),
                ({"device_map": "mps"}, r"device_map='mps', but this machine has no mps device")]


@pytest.mark.parametrize("kwargs,match", REFUSED, ids=[str(r[0]) for r in REFUSED])
def test_unsupported_arguments_fail_at_once_naming_the_argument(checkpoint, monkeypatch, kwargs, match):
    monkeypatch.setattr(torch_lowbit.hf, "load_quantized", lambda *a, **k: pytest.fail("loading started"))
    with opened_files() as opened, pytest.raises((ValueError, TypeError), match=match):
        torch_lowbit.from_pretrained(checkpoint[0], **kwargs)
    assert not [f for f in opened if f.startswith(os.path.realpath(checkpoint[0]))]  # nothing was read


@pytest.mark.skipif(not HAS_MPS, reason="needs an Apple GPU")
@pytest.mark.parametrize("kwargs", [{"device": "mps"}, {"device_map": "mps"}, {"device_map": "auto"}])
def test_mps_device_spellings_load_on_the_gpu(checkpoint, kwargs):
    model = torch_lowbit.from_pretrained(checkpoint[0], dtype=torch.float32, **kwargs)
    assert model.device.type == "mps"
    assert _rel_err(_logits(model.cpu()), checkpoint[1]) <= 1e-5


@pytest.mark.parametrize("archs,match", [
    (["LlamaForSequenceClassification"], r"architectures names LlamaForSequenceClassification, which is not a "
                                         r"causal language model"),
    (["LlamaModel"], r"architectures names LlamaModel, which is not a causal"),
    (["NoSuchForCausalLM"], r"architectures \['NoSuchForCausalLM'\] names no model class of transformers"),
    (["__class__"], r"architectures \[.__class__.\] names no model class"),
    ("LlamaForCausalLM", r"architectures must be a list of class names"),
])
def test_architectures_that_name_no_causal_lm_fail_before_loading(checkpoint, tmp_path, monkeypatch, archs, match):
    path = _copy(checkpoint, tmp_path)
    _edit_config(path, lambda d: d.update(architectures=archs))
    monkeypatch.setattr(torch_lowbit.hf, "load_quantized", lambda *a, **k: pytest.fail("loading started"))
    with pytest.raises(CheckpointError, match=r"config\.json: " + match):
        torch_lowbit.from_pretrained(path)


def test_no_architectures_uses_the_causal_lm_of_the_model_type(checkpoint, tmp_path):
    path = _copy(checkpoint, tmp_path)
    _edit_config(path, lambda d: d.pop("architectures"))
    model = torch_lowbit.from_pretrained(path, dtype=torch.float32)
    assert type(model) is transformers.LlamaForCausalLM and _rel_err(_logits(model), checkpoint[1]) <= 1e-6


@pytest.mark.parametrize("typo", ["./no-such-checkpoint", "~/no-such-checkpoint-dir", "a/b/c",
                                  "{tmp}/missing/ckpt", "{tmp}/ckpt-typo", "{tmp}", "no such"])
def test_a_mistyped_local_path_says_no_such_directory(tmp_path, monkeypatch, typo):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "existing").mkdir()
    typo = typo.replace("{tmp}", str(tmp_path / "existing") if typo == "{tmp}" else str(tmp_path))
    if typo == str(tmp_path / "existing"):
        typo = "existing/ckpt"  # exists partly: its first part is a directory here
    with pytest.raises(FileNotFoundError, match=r"no such directory: .*nearest existing directory"):
        torch_lowbit.from_pretrained(typo)


def test_a_path_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="must be a checkpoint directory"):
        torch_lowbit.from_pretrained(tmp_path / "model.safetensors")
    with pytest.raises(TypeError, match="path must be a directory or a Hub repo id"):
        torch_lowbit.from_pretrained(42)


# ------------------------------------------------------------------------------------------------ confinement
@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
def test_config_files_linked_outside_are_refused_and_never_read(checkpoint, tmp_path, name):
    path = _copy(checkpoint, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    if not (path / name).exists():
        (path / name).write_text(json.dumps({"max_length": 7}))
    target = outside / name
    shutil.move(path / name, target)  # a valid file: only the rule keeps it out
    os.symlink(target, path / name)
    with opened_files() as opened, pytest.raises(CheckpointError, match=rf"config file '{name}' resolves to .*outside "
                                                                         rf"the checkpoint directory"):
        torch_lowbit.from_pretrained(path)
    assert os.path.realpath(target) not in opened


def test_hugging_face_cache_snapshot_loads_with_its_generation_config(checkpoint, tmp_path):
    repo = tmp_path / "models--org--tiny"
    blobs, snap = repo / "blobs", repo / "snapshots" / "0123abc"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    src = _copy(checkpoint, tmp_path, "src")
    (src / "generation_config.json").write_text(json.dumps({"max_length": 7, "do_sample": False}))
    for i, f in enumerate(sorted(os.listdir(src))):
        shutil.move(src / f, blobs / f"blob{i}")
        os.symlink(os.path.join("..", "..", "blobs", f"blob{i}"), snap / f)
    model = torch_lowbit.from_pretrained(snap, dtype=torch.float32)
    assert model.generation_config.max_length == 7
    assert _rel_err(_logits(model), checkpoint[1]) <= 1e-6


# ------------------------------------------------------------------------------------------------ threads
def test_six_threads_load_at_once_and_nothing_stays_patched(checkpoint):
    from torch.nn.modules.module import _global_parameter_registration_hooks

    want = _logits(torch_lowbit.from_pretrained(checkpoint[0], dtype=torch.bfloat16))
    register, default_dtype = nn.Module.register_parameter, torch.get_default_dtype()
    results, errors, meta_linears, stop = [None] * 6, [], [], threading.Event()
    start = threading.Barrier(7)

    def load(i):
        try:
            start.wait()
            results[i] = torch_lowbit.from_pretrained(checkpoint[0], dtype=torch.bfloat16)
        except BaseException as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    def build_linears():  # another part of the program, meanwhile
        start.wait()
        while not stop.is_set():
            lin = nn.Linear(4, 4)
            if lin.weight.is_meta or lin.weight.dtype != default_dtype:
                meta_linears.append((lin.weight.device, lin.weight.dtype))

    loaders = [threading.Thread(target=load, args=(i,)) for i in range(6)]
    builder = threading.Thread(target=build_linears)
    for t in loaders + [builder]:
        t.start()
    for t in loaders:
        t.join()
    stop.set()
    builder.join()
    assert not errors, errors
    assert meta_linears == []
    for model in results:
        assert torch.equal(_logits(model), want)
    assert nn.Module.register_parameter is register and not _global_parameter_registration_hooks
    assert torch.get_default_dtype() == default_dtype
    assert not nn.Linear(3, 2).weight.is_meta


def test_parameters_on_meta_nested_and_after_an_error_leaves_no_hook():
    from torch.nn.modules.module import _global_parameter_registration_hooks

    with pytest.raises(RuntimeError, match="boom"):
        with torch_lowbit.parameters_on_meta():
            with torch_lowbit.parameters_on_meta():
                assert nn.Linear(3, 2).weight.is_meta
            assert nn.Linear(3, 2).weight.is_meta  # still inside the outer one
            raise RuntimeError("boom")
    assert not _global_parameter_registration_hooks and not nn.Linear(3, 2).weight.is_meta


# ------------------------------------------------------------------------------------------------ validation
def test_torch_lowbit_config_takes_one_module_name_as_a_string(tmp_path):
    dense = W.tiny_model("llama")
    dense.save_pretrained(tmp_path)
    config = torch_lowbit.TorchLowbitConfig("fp8", modules_to_not_convert="lm_head")
    assert config.modules_to_not_convert == ["lm_head"]
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                              quantization_config=config)
    assert type(model.lm_head) is nn.Linear and isinstance(model.model.layers[0].self_attn.q_proj, Fp8Linear)


@pytest.mark.parametrize("kwargs,error,match", [
    ({"granularty": "block"}, TypeError, r"unexpected keyword arguments \['granularty'\]"),
    ({"modules_to_not_convert": ["re:("]}, ValueError, r"modules_to_not_convert holds 're:\(': not a valid regular "
                                                       r"expression"),
    ({"modules_to_not_convert": 3}, TypeError, r"modules_to_not_convert must be a list of module names, got int 3"),
    ({"modules_to_not_convert": ["lm_head", None]}, TypeError, r"modules_to_not_convert must be a list"),
    ({"granularity": "block", "block_size": (2 ** 63, 128)}, ValueError, r"TorchLowbitConfig\.block_size must be two "
                                                                         r"positive ints .* 2\*\*63 - 1"),
    ({"quant_method": "fp8"}, ValueError, r"quant_method must be 'torch_lowbit', got 'fp8'"),
])
def test_torch_lowbit_config_refuses_bad_arguments_by_name(kwargs, error, match):
    with pytest.raises(error, match=match):
        torch_lowbit.TorchLowbitConfig("fp8", **kwargs)


def test_torch_lowbit_config_survives_transformers_save_and_reload_of_its_dict():
    from transformers.quantizers import AutoQuantizationConfig

    config = torch_lowbit.TorchLowbitConfig("fp8", "block", (16, 32), modules_to_not_convert=["lm_head", "re:.*gate"])
    saved = json.loads(json.dumps(config.to_dict()))  # what config.json holds
    again = AutoQuantizationConfig.from_dict(saved)
    assert type(again) is type(config) and again.to_dict() == config.to_dict()


@pytest.mark.parametrize("weights,kwargs,error,match", [
    ("nvfp4", {"group_size": 32}, ValueError, r"group_size=32 does not apply to weights='nvfp4' \(its groups are 16\)"),
    ("fp8", {"group_size": 64}, ValueError, r"group_size=64 does not apply to weights='fp8'"),
    ("uint4", {"group_size": None}, ValueError, r"group_size must be a positive int for weights='uint4', got None"),
    ("int4", {"group_size": 0}, ValueError, r"group_size must be a positive int or None \(per channel\) for "
                                            r"weights='int4', got 0"),
    ("mxfp4", {"symmetric": False}, ValueError, r"symmetric=False \(zero points\) is for weights='int4', not "
                                                r"'mxfp4'"),
    ("int4", {"symmetric": "no"}, TypeError, r"symmetric must be a bool, got str 'no'"),
    ("int3", {}, ValueError, r"weights must be one of"),
])
def test_torch_lowbit_config_refuses_bad_4bit_arguments_by_name(weights, kwargs, error, match):
    with pytest.raises(error, match=match):
        torch_lowbit.TorchLowbitConfig(weights, **kwargs)


@pytest.mark.parametrize("weights,kwargs,group", [("int4", {}, 128), ("int4", {"group_size": None}, None),
                                                  ("uint4", {}, 64), ("nvfp4", {}, None),
                                                  ("int4", {"group_size": 16, "symmetric": False}, 16)])
def test_torch_lowbit_config_4bit_defaults_survive_transformers_reload_of_its_dict(weights, kwargs, group):
    from transformers.quantizers import AutoQuantizationConfig

    config = torch_lowbit.TorchLowbitConfig(weights, **kwargs)
    assert config.group_size == group and config.symmetric == kwargs.get("symmetric", True)
    again = AutoQuantizationConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again.to_dict() == config.to_dict()


@pytest.mark.skipif(not hasattr(torch_lowbit, "Int4WeightOnly"), reason="needs torch_lowbit.Int4WeightOnly (the "
                    "4-bit quantize_ configs)")
@pytest.mark.parametrize("weights,kwargs", [("int4", {"group_size": 16, "symmetric": False}), ("nvfp4", {})])
def test_torch_lowbit_config_quantizes_to_w4linear_and_save_pretrained_reads_back(tmp_path, weights, kwargs):
    from torch_lowbit.nn.w4_linear import W4Linear

    W.tiny_model("llama").save_pretrained(tmp_path / "dense")
    config = torch_lowbit.TorchLowbitConfig(weights, **kwargs)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dense", dtype=torch.float32,
                                                              quantization_config=config)
    assert isinstance(model.model.layers[0].mlp.down_proj, W4Linear) and type(model.lm_head) is nn.Linear
    assert model.model.layers[0].mlp.down_proj.format == weights
    want = torch_lowbit.quantize_(W.tiny_model("llama"), config.quantize_config())
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, want(IDS).logits)
    model.save_pretrained(tmp_path / "saved")
    again = torch_lowbit.from_pretrained(tmp_path / "saved", dtype=torch.float32, device="cpu")
    with torch.no_grad():
        assert torch.equal(again(IDS).logits, model(IDS).logits)


def _two_files_with_one_name(path):
    a, b = torch.ones(2), torch.full((2,), 2.0)
    save_file({"x": a, "only_a": a.clone()}, str(path / "a.safetensors"))
    save_file({"x": b}, str(path / "b.safetensors"))


def test_a_tensor_in_two_files_without_an_index_names_both_files(tmp_path):
    from torch_lowbit.formats.source import open_source
    _two_files_with_one_name(tmp_path)
    with pytest.raises(CheckpointError, match=r"tensor 'x' is in two checkpoint files, .*a\.safetensors and "
                                              r".*b\.safetensors, and no model\.safetensors\.index\.json says which"):
        open_source(str(tmp_path))


def test_an_index_decides_which_copy_and_one_that_disagrees_names_both_files(tmp_path):
    from torch_lowbit.formats.source import open_source
    _two_files_with_one_name(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"x": "b.safetensors", "only_a": "a.safetensors"}}))
    assert torch.equal(open_source(str(tmp_path)).get("x"), torch.full((2,), 2.0))
    index.write_text(json.dumps({"weight_map": {"x": "a.safetensors", "only_a": "b.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"'only_a' is listed in .* under shard 'b\.safetensors', but that shard "
                                              r"does not contain it \(it is in .*a\.safetensors\)"):
        open_source(str(tmp_path))


@pytest.mark.parametrize("edit,match", [
    (lambda qc: qc.update(ignore=["lm_head", "re:("]), r"quantization_config\.ignore holds 're:\(': not a valid "
                                                       r"regular expression"),
    (lambda qc: qc["config_groups"]["group_0"]["weights"].update(strategy="block", block_structure=[2 ** 63, 32]),
     r"weights\.block_structure must be two positive integers .*2\*\*63 - 1"),
])
def test_config_garbage_from_a_real_checkpoint_names_the_field(checkpoint, tmp_path, edit, match):
    path = _copy(checkpoint, tmp_path)
    _edit_config(path, lambda d: edit(d["quantization_config"]))
    for load in (torch_lowbit.from_pretrained, lambda p: load_quantized(W.tiny_model("llama"), p)):
        with pytest.raises(CheckpointError, match=match):
            load(path)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_a_deeply_nested_json_file_is_an_error_naming_it(checkpoint, tmp_path, name):
    path = _copy(checkpoint, tmp_path)
    (path / name).write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    for load in (torch_lowbit.from_pretrained, lambda p: load_quantized(W.tiny_model("llama"), p)):
        with pytest.raises(CheckpointError, match=rf"{name.replace('.', '[.]')} nests JSON arrays / objects too "
                                                  rf"deeply"):
            load(path)


# ------------------------------------------------------------------------------------------------ progress
def test_from_pretrained_reports_tensors_read(checkpoint, monkeypatch):
    from torch_lowbit._progress import Progress
    from torch_lowbit.formats.source import open_source

    lines = io.StringIO()
    # every update printed: the real interval (a line a second) would make a quick load silent
    monkeypatch.setattr(torch_lowbit.formats.load, "Progress",
                        functools.partial(Progress, stream=lines, interval=0.0, enabled=True))
    torch_lowbit.from_pretrained(checkpoint[0], dtype=torch.float32)
    total = len(open_source(checkpoint[0]).keys())
    out = lines.getvalue().splitlines()
    assert out[0].startswith(f"torch_lowbit loading: 1/{total} tensors")
    assert out[-1].startswith(f"torch_lowbit loading: {total}/{total} tensors")


def test_from_pretrained_is_silent_when_stderr_is_no_terminal(checkpoint, capsys, monkeypatch):
    monkeypatch.delenv("TORCH_LOWBIT_PROGRESS", raising=False)
    torch_lowbit.from_pretrained(checkpoint[0], dtype=torch.float32)
    assert "torch_lowbit loading" not in capsys.readouterr().err


def test_e2e_bench_announces_its_threads_and_prints_progress_on_stderr(capsys):
    from torch_lowbit.bench import __main__ as bench_main
    argv = ["--suite", "e2e", "--hidden", "136", "--intermediate", "200", "--layers", "1", "--heads", "2",
            "--kv-heads", "1", "--vocab", "97", "--tokens", "2", "--repeat", "1"]
    assert bench_main.main(argv) == 0
    out, err = capsys.readouterr()
    threads = torch.get_num_threads()
    assert err.splitlines()[0] == f"e2e: {threads} torch threads (torch default; --threads N to pin)"
    assert "e2e: loading with from_pretrained" in err and "e2e: timing generate" in err
    assert f"cpu, {threads} threads" in out and "e2e:" not in out.replace("e2e: LlamaForCausalLM", "")
    assert "TORCH_LOWBIT_PROGRESS" not in os.environ  # the bench's setting ends with it


# found by tests/test_fuzz_hf.py
def test_an_index_listing_no_tensors_names_the_index(checkpoint, tmp_path):
    path = _copy(checkpoint, tmp_path)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    with pytest.raises(CheckpointError, match=r"index\.json: 'weight_map' lists no tensors"):
        torch_lowbit.from_pretrained(path)


@pytest.mark.parametrize("field,value", [("vocab_size", None), ("hidden_size", -8), ("dtype", "<garbage>")])
def test_a_config_value_transformers_cannot_build_names_config_json(checkpoint, tmp_path, field, value):
    path = _copy(checkpoint, tmp_path)
    _edit_config(path, lambda d: d.update({field: value}))
    with pytest.raises(CheckpointError, match=r"config\.json: transformers cannot build"):
        torch_lowbit.from_pretrained(path, dtype=torch.float32)


# ------------------------------------------------------------------------------------------------ T5 encoders
def _tiny_t5():
    torch.manual_seed(0)
    return transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=50, d_model=32, d_ff=48, d_kv=8, num_layers=2, num_heads=4, feed_forward_proj="gated-gelu")).eval()


@pytest.mark.parametrize("how", ["quantize_", "TorchLowbitConfig"])
def test_t5_encoder_keeps_its_fp32_module_and_runs(how, tmp_path):
    # T5 (the text encoder of FLUX, SD3, Wan as UMT5) casts the FF's input to wo.weight's dtype: an fp8 wo would get
    # fp8 activations. transformers' quantizers leave _keep_in_fp32_modules ('wo') unconverted; so do these
    dense = _tiny_t5()
    ids = torch.tensor([[3, 17, 42, 5, 8, 1]])
    if how == "quantize_":
        model, report = torch_lowbit.quantize_(_tiny_t5(), torch_lowbit.Fp8WeightOnly(), return_report=True)
        assert report.skipped["encoder.block.0.layer.1.DenseReluDense.wo"] == (
            "kept in fp32 by the model (T5EncoderModel._keep_in_fp32_modules: 'wo')")
    else:
        dense.save_pretrained(tmp_path)
        model = transformers.T5EncoderModel.from_pretrained(
            tmp_path, dtype=torch.float32, quantization_config=torch_lowbit.TorchLowbitConfig("fp8"))
    ff = model.encoder.block[0].layer[1].DenseReluDense
    assert type(ff.wo) is nn.Linear and isinstance(ff.wi_0, Fp8Linear)
    assert isinstance(model.encoder.block[0].layer[0].SelfAttention.q, Fp8Linear)
    with torch.no_grad():
        got, want = model(ids).last_hidden_state, dense(ids).last_hidden_state
    assert float((got - want).abs().max()) <= 0.05 * float(want.abs().max())
