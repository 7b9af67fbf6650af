"""Saving: ``save_quantized`` and ``model.save_pretrained`` on low-bit transformers models write a compressed-tensors
checkpoint that transformers (compressed-tensors' dequantizing reload) and torch_lowbit read back with the values
right; a save is atomic per directory (old or new checkpoint, never a mix, non-checkpoint files kept, links replaced,
no stray files), also when the process is killed, the disk is full or the target is read-only."""
import errno
import json
import os
import resource
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import hf_writers as W
import torch_lowbit
from hf_writers import transformers
from torch_lowbit import _atomic_dir
from torch_lowbit.nn import Fp8Experts, Fp8Linear, Int8Linear

IDS = torch.tensor([[3, 17, 42, 5, 88, 1, 0, 64, 23], [96, 2, 2, 50, 11, 7, 33, 8, 70]])
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


def _rel_err(out, ref):
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def _tensors(path):
    """Every tensor of the checkpoint at `path` (one file or shards), by name."""
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


def _snapshot(path):
    """File name -> bytes of a directory (recursively), to show it is untouched."""
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, path)] = fh.read()
    return out


def _strays(parent):
    return [n for n in os.listdir(parent) if "torch_lowbit-" in n]


def _dequantized_weight(m):
    if isinstance(m, Fp8Linear):
        return torch_lowbit.fp8_dequantize(m.weight, m.weight_scale, m.block_size, dtype=torch.float32)
    return m.weight.float() * m.weight_scale.reshape(-1, 1)


def _assert_transformers_reads_our_weights(model, path):
    """compressed-tensors' own reload dequantizes every quantized Linear to exactly our layer's weights."""
    theirs = W.ct_dequantized(str(path))
    n_checked = 0
    for n, m in model.named_modules():
        if isinstance(m, (Fp8Linear, Int8Linear)):
            assert torch.equal(theirs.get_submodule(n).weight, _dequantized_weight(m)), n
            n_checked += 1
    assert n_checked
    return theirs


# ------------------------------------------------------------------------------------------- save_pretrained
@pytest.fixture(scope="module")
def ct_llama(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ct-llama"))
    W.write_compressed_tensors(W.tiny_model("llama"), "llama", path, "fp8-channel")
    return path


def _quantized_by(how, ct_llama, tmp_path):
    if how == "quantize_":
        return torch_lowbit.quantize_(W.tiny_model("llama"), torch_lowbit.Fp8WeightOnly("block", (16, 32)))
    if how == "from_pretrained":
        return torch_lowbit.from_pretrained(ct_llama, dtype=torch.float32)
    if how == "load_quantized":
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(W.tiny_config("llama"), dtype=torch.float32)
        torch_lowbit.load_quantized(model, ct_llama, dtype=torch.float32)
        return model
    dense = tmp_path / "dense"
    W.tiny_model("llama").save_pretrained(dense)
    return transformers.AutoModelForCausalLM.from_pretrained(  # no wiring needed: the quantizer's postprocess_model
        dense, dtype=torch.float32, quantization_config=torch_lowbit.TorchLowbitConfig("int8"))


def test_quantize_on_a_plain_module_sets_no_save_pretrained():
    model = torch_lowbit.quantize_(nn.Sequential(nn.Linear(32, 16)), torch_lowbit.Fp8WeightOnly())
    assert "save_pretrained" not in vars(model)


@pytest.mark.parametrize("how", ["quantize_", "from_pretrained", "load_quantized", "TorchLowbitConfig"])
def test_save_pretrained_writes_the_save_quantized_checkpoint(ct_llama, tmp_path, how):
    model = _quantized_by(how, ct_llama, tmp_path)
    model.save_pretrained(tmp_path / "sp", max_shard_size="30KB")
    torch_lowbit.save_quantized(model, tmp_path / "sq", max_shard_size=30_000)
    assert sorted(os.listdir(tmp_path / "sp")) == sorted(os.listdir(tmp_path / "sq"))
    ours, theirs = _tensors(tmp_path / "sp"), _tensors(tmp_path / "sq")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    config = json.loads((tmp_path / "sp" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    reloaded = _assert_transformers_reads_our_weights(model, tmp_path / "sp")
    tol = 5e-2 if how == "TorchLowbitConfig" else 1e-6  # int8: we round activations per token, the reload does not
    assert _rel_err(_logits(reloaded), _logits(model)) <= tol
    assert torch.equal(_logits(torch_lowbit.from_pretrained(tmp_path / "sp", dtype=torch.float32)), _logits(model))


def test_push_to_hub_saves_the_compressed_tensors_checkpoint(ct_llama, tmp_path, monkeypatch):
    import transformers.utils.hub as hub

    model = _quantized_by("quantize_", ct_llama, tmp_path)
    uploaded = {}

    class Api:
        def create_repo(self, repo_id, **kwargs):
            return type("Repo", (), {"repo_id": f"me/{repo_id}"})()

    monkeypatch.setattr(hub, "hf_api", lambda: Api())
    monkeypatch.setattr(hub, "create_and_tag_model_card", lambda *a, **k: type("Card", (), {
        "save": lambda self, p: open(p, "w").write("card")})())
    monkeypatch.setattr(model, "_upload_modified_files", lambda folder, repo_id, **k: uploaded.update(
        repo_id=repo_id, files=_snapshot(folder), config=json.load(open(os.path.join(folder, "config.json")))))
    model.push_to_hub("tiny", commit_message="hi")
    assert uploaded["repo_id"] == "me/tiny" and "README.md" in uploaded["files"]
    assert uploaded["config"]["quantization_config"]["quant_method"] == "compressed-tensors"
    assert uploaded["files"]["model.safetensors"] == (_save_and_read(model, tmp_path / "ref"))


def _save_and_read(model, path):
    torch_lowbit.save_quantized(model, path)
    return (path / "model.safetensors").read_bytes()


def test_save_pretrained_refuses_what_it_cannot_write_naming_save_quantized(ct_llama, tmp_path):
    model = _quantized_by("quantize_", ct_llama, tmp_path)
    for kwargs in ({"variant": "v1"}, {"distributed_checkpoint": True}, {"save_original_format": False},
                   {"state_dict": {k: v.clone() for k, v in model.state_dict().items()}}):
        with pytest.raises(ValueError, match=f"{next(iter(kwargs))}.*torch_lowbit.save_quantized"):
            model.save_pretrained(tmp_path / "x", **kwargs)
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['max_shard_sise'\]"):
        model.save_pretrained(tmp_path / "x", max_shard_sise="1GB")
    assert not os.path.exists(tmp_path / "x")
    model.save_pretrained(tmp_path / "x", state_dict=model.state_dict())  # what Trainer passes
    model.save_pretrained(tmp_path / "y", is_main_process=False)
    assert os.path.isdir(tmp_path / "x") and not os.path.exists(tmp_path / "y")
    with pytest.raises(TypeError, match="enable_save_pretrained: expected a transformers PreTrainedModel"):
        torch_lowbit.enable_save_pretrained(nn.Linear(2, 2))


def test_transformers_own_save_pretrained_on_a_torch_lowbit_config_model_refuses(tmp_path):
    model = _quantized_by("TorchLowbitConfig", None, tmp_path)
    with pytest.raises(ValueError, match="not serializable"):
        transformers.PreTrainedModel.save_pretrained(model, tmp_path / "x")
    assert not os.path.exists(tmp_path / "x")



@pytest.mark.parametrize("how", ["quantize_", "from_pretrained", "load_quantized", "TorchLowbitConfig"])
def test_model_dequantize_gives_a_dense_model_that_saves_and_reloads_as_one(ct_llama, tmp_path, how):
    model = _quantized_by(how, ct_llama, tmp_path)
    low_bit = {n: _dequantized_weight(m) for n, m in model.named_modules() if isinstance(m, (Fp8Linear, Int8Linear))}
    assert low_bit
    want = _logits(torch_lowbit.dequantize_model(model, dtype=torch.float32))
    assert model.dequantize(dtype="float32") is model  # transformers' dtype spelling
    for n, w in low_bit.items():
        assert type(model.get_submodule(n)) is nn.Linear and torch.equal(model.get_submodule(n).weight, w), n
    assert torch.equal(_logits(model), want)
    assert not model.is_quantized and getattr(model, "hf_quantizer", None) is None
    assert "quantization_config" not in model.config.to_dict()
    assert "save_pretrained" not in vars(model) and "dequantize" not in vars(model)
    model.save_pretrained(tmp_path / "dense")  # transformers' own save, of a dense model
    assert "quantization_config" not in json.loads((tmp_path / "dense" / "config.json").read_text())
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dense", dtype=torch.float32)
    assert all(type(again.get_submodule(n)) is nn.Linear for n in low_bit)
    assert torch.equal(_logits(again), want)


def test_the_quantizers_own_dequantize_leaves_a_model_that_saves_and_counts_as_a_dense_one(ct_llama, tmp_path):
    # transformers' HfQuantizer.dequantize, called directly (model.dequantize() reaches the model's own first)
    model = _quantized_by("TorchLowbitConfig", ct_llama, tmp_path)
    count = model.num_parameters()
    model.hf_quantizer.dequantize(model, dtype=torch.float32)
    assert not {"save_pretrained", "dequantize", "num_parameters"} & set(vars(model))
    assert model.num_parameters() == count  # the dense weights are parameters now, counted by transformers alone
    model.save_pretrained(tmp_path / "dense")
    assert "quantization_config" not in json.loads((tmp_path / "dense" / "config.json").read_text())


def test_tokenizer_saved_first_is_kept(ct_llama, tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = Tokenizer(WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    model = _quantized_by("quantize_", ct_llama, tmp_path)
    tokenizer.save_pretrained(tmp_path / "d")
    (tmp_path / "d" / "README.md").write_text("my notes")
    model.save_pretrained(tmp_path / "d")
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "d")("hello world")["input_ids"] == [1, 2]
    assert (tmp_path / "d" / "README.md").read_text() == "my notes"


# ------------------------------------------------------------------------- MoE: what transformers' mapping expects
def _fp8_experts_model(arch):
    config = torch_lowbit.TorchLowbitConfig("fp8", "channel")
    model = torch_lowbit.quantize_(W.tiny_model(arch), config.quantize_config())
    for name, m in list(model.named_modules()):
        if hasattr(m, "gate_up_proj"):
            model.set_submodule(name, Fp8Experts.from_float(m.gate_up_proj.detach(), m.down_proj.detach(), "channel"))
    return model


def _dense_experts_int8_model(arch):  # experts left dense, as quantize_ leaves them today for INT8
    return torch_lowbit.quantize_(W.tiny_model(arch), torch_lowbit.Int8Dynamic(),
                                  filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and "expert" not in fqn
                                  and fqn != "lm_head" and not fqn.endswith(".gate"))


def _expert_weights(model, layer):
    """(gate_up [E, 2I, H], down [E, H, I]) in fp32: dequantized for Fp8Experts (per-channel scales)."""
    e = model.model.layers[layer].mlp.experts
    if isinstance(e, Fp8Experts):
        return (e.gate_up.float() * e.gate_up_scale[:, :, None], e.down.float() * e.down_scale[:, :, None])
    return e.gate_up_proj.detach(), e.down_proj.detach()


MOE_CASES = [(a, k) for a in ("qwen3_moe", "mixtral") for k in ("fp8-experts", "dense-experts-int8")]


@pytest.mark.parametrize("arch,kind", MOE_CASES, ids=["-".join(c) for c in MOE_CASES])
def test_moe_checkpoint_of_save_quantized_loads_in_transformers(tmp_path, arch, kind):
    model = (_fp8_experts_model if kind == "fp8-experts" else _dense_experts_int8_model)(arch)
    torch_lowbit.save_quantized(model, tmp_path)
    theirs = _assert_transformers_reads_our_weights(model, tmp_path)
    for layer in range(W.LAYERS):
        for got, want in zip(_expert_weights(theirs, layer), _expert_weights(model, layer)):
            assert torch.equal(got, want), layer
    if kind == "fp8-experts":
        assert _rel_err(_logits(theirs), _logits(model)) <= 1e-6
    assert torch.equal(_logits(torch_lowbit.from_pretrained(tmp_path, dtype=torch.float32)), _logits(model))


def _warned_save_then_transformers(model, path, warning):
    """model.save_pretrained(path) warns `warning`; torch_lowbit reads it back with the same logits; transformers'
    load of it, or None where transformers fails loudly (its conversion report)."""
    with pytest.warns(UserWarning, match=warning):
        model.save_pretrained(path)
    assert torch.equal(_logits(torch_lowbit.from_pretrained(path, dtype=torch.float32)), _logits(model))
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except RuntimeError as e:
        assert "conversion" in str(e)
        return None


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_int8_experts_checkpoint_warns_and_never_loads_wrong_in_transformers(tmp_path, arch):
    """transformers cannot read INT8 experts in compressed-tensors' int-quantized layout (nor llmcompressor's own):
    the save says so, and transformers' load fails loudly or, once it learns the layout, gives our weights."""
    model = torch_lowbit.quantize_(W.tiny_model(arch), torch_lowbit.Int8Dynamic())
    assert isinstance(model.model.layers[0].mlp.experts, torch_lowbit.nn.Int8Experts)
    theirs = _warned_save_then_transformers(model, tmp_path, "INT8 MoE experts .* transformers .* refuses to load")
    for layer in range(W.LAYERS if theirs is not None else 0):
        e = model.model.layers[layer].mlp.experts
        t = theirs.model.layers[layer].mlp.experts
        assert torch.equal(t.gate_up_proj, e.gate_up.float() * e.gate_up_scale[:, :, None])
        assert torch.equal(t.down_proj, e.down.float() * e.down_scale[:, :, None])


def test_fp8_block_experts_checkpoint_warns_and_never_loads_wrong_in_transformers(tmp_path):
    """FP8 experts with scales per block (Qwen3-30B-A3B-FP8, DeepSeek-V3) go out in compressed-tensors' layout, as
    llmcompressor writes them, which transformers fails to dequantize on load: the save says so; torch_lowbit reads
    it back, and transformers' load fails loudly or, once it expands the block scales, gives our weights."""
    from reference import expand_scale

    model = torch_lowbit.quantize_(W.tiny_model("qwen3_moe"), torch_lowbit.Fp8WeightOnly("block", (16, 32)))
    assert model.model.layers[0].mlp.experts.block_size == (16, 32)
    theirs = _warned_save_then_transformers(model, tmp_path,
                                            r"FP8 MoE experts with scales per block .* transformers .* fails to load")
    for layer in range(W.LAYERS if theirs is not None else 0):
        e, t = model.model.layers[layer].mlp.experts, theirs.model.layers[layer].mlp.experts
        for got, w, scale in ((t.gate_up_proj, e.gate_up, e.gate_up_scale), (t.down_proj, e.down, e.down_scale)):
            want = torch.stack([w[i].double() * expand_scale(scale[i], *w.shape[1:], (16, 32)) for i in range(len(w))])
            assert torch.equal(got.double(), want.float().double())


_OLD_STACK_CHECK = textwrap.dedent("""
    import sys, torch, transformers, compressed_tensors
    from safetensors.torch import load_file
    assert (transformers.__version__[:4], compressed_tensors.__version__[:4]) == ("5.17", "0.19"), \\
        (transformers.__version__, compressed_tensors.__version__)
    for path, kind in zip(sys.argv[1::2], sys.argv[2::2]):
        ref = load_file(path + "/reference.safetensors")
        cfg = transformers.CompressedTensorsConfig(dequantize=True)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=cfg)
        params = dict(model.named_parameters())
        for k, want in ref.items():
            got = params[k].detach()
            # 5.17 dequantizes fp8 experts through bf16: the reference rounded the same way
            if kind == "fp8-experts" and ".experts." in k:
                want = want.to(torch.bfloat16).float()
            assert torch.equal(got, want), (path, k, (got - want).abs().max())
        print("ok", path)
""")


@pytest.mark.skipif(os.environ.get("TORCH_LOWBIT_CI") != "1", reason="slow (installs transformers 5.17 into a "
                    "temporary directory): runs with TORCH_LOWBIT_CI=1")
def test_moe_checkpoint_of_save_quantized_loads_in_transformers_5_17(tmp_path):
    target = tmp_path / "site"
    # transformers 5.17 needs huggingface-hub < 2 (and its httpx); everything else, torch included, is the system's
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
           "transformers==5.17.*", "compressed-tensors==0.19.*", "huggingface-hub>=1.5,<2", "httpx", "httpcore"]
    try:
        done = subprocess.run(pip, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.skip("the package index did not serve transformers 5.17 / compressed-tensors 0.19 within 120 s")
    if done.returncode != 0:
        pytest.skip(f"the package index cannot serve transformers 5.17 / compressed-tensors 0.19: "
                    f"{done.stderr.strip()[-300:]}")
    args = []
    for arch, kind in MOE_CASES:
        model = (_fp8_experts_model if kind == "fp8-experts" else _dense_experts_int8_model)(arch)
        path = tmp_path / f"{arch}-{kind}"
        torch_lowbit.save_quantized(model, path)
        reference = {f"model.layers.{i}.mlp.experts.{p}": w.contiguous() for i in range(W.LAYERS)
                     for p, w in zip(("gate_up_proj", "down_proj"), _expert_weights(model, i))}
        reference.update({f"{n}.weight": _dequantized_weight(m) for n, m in model.named_modules()
                          if isinstance(m, (Fp8Linear, Int8Linear))})
        from safetensors.torch import save_file
        save_file(reference, str(path / "reference.safetensors"))
        args += [str(path), kind]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), REPO])}
    run = subprocess.run([sys.executable, "-c", _OLD_STACK_CHECK, *args], capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("ok ") == len(MOE_CASES)


# ---------------------------------------------------------------------------------------- atomic per directory
def _small(config=None, seed=0):
    """A plain torch model (no transformers: quick in a subprocess) with three Fp8Linear."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 80), nn.ReLU(), nn.Linear(80, 32))
    return torch_lowbit.quantize_(model, config or torch_lowbit.Fp8WeightOnly("channel"), filter_fn=lambda m, f: True)


def test_one_file_save_over_a_sharded_one_leaves_only_the_new_checkpoint(tmp_path):
    old, new = _small(seed=0), _small(seed=1)
    torch_lowbit.save_quantized(old, tmp_path, max_shard_size=4000)
    assert "model.safetensors.index.json" in os.listdir(tmp_path)
    files = torch_lowbit.save_quantized(new, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    assert files == [str(tmp_path / "model.safetensors")]
    sd = _tensors(tmp_path)
    assert torch.equal(sd["4.weight"].float(), new[4].weight.float())
    torch_lowbit.save_quantized(old, tmp_path, max_shard_size="4kb")  # and back: no model.safetensors left over
    assert "model.safetensors" not in os.listdir(tmp_path) and _strays(tmp_path.parent) == []


@pytest.mark.parametrize("exchange", ["atomic exchange", "two renames"])
def test_save_keeps_other_files_and_replaces_links_without_writing_through(tmp_path, monkeypatch, exchange):
    if exchange == "two renames":
        monkeypatch.setattr(_atomic_dir, "_exchange", None)
    target, outside = tmp_path / "model", tmp_path / "outside"
    outside.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        (outside / name).write_text(f"outside {name}")
    torch_lowbit.save_quantized(_small(seed=0), target, max_shard_size=4000)
    os.remove(target / "config.json")
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        os.symlink(outside / name, target / name)
    (target / "README.md").write_text("notes")
    (target / "runs").mkdir()
    (target / "runs" / "log.txt").write_text("log")
    torch_lowbit.save_quantized(_small(seed=1), target)
    assert _snapshot(outside) == {n: f"outside {n}".encode() for n in os.listdir(outside)}  # nothing written through
    assert sorted(os.listdir(target)) == ["README.md", "config.json", "model.safetensors", "runs", "tokenizer.json"]
    assert not os.path.islink(target / "config.json") and "quantization_config" in json.loads(
        (target / "config.json").read_text())
    assert os.path.islink(target / "tokenizer.json")  # not a checkpoint file: carried as the link it was
    assert (target / "README.md").read_text() == "notes" and (target / "runs" / "log.txt").read_text() == "log"
    assert _strays(tmp_path) == []


def test_a_target_that_is_a_symlink_keeps_pointing_at_the_new_checkpoint(tmp_path):
    real, link = tmp_path / "real", tmp_path / "link"
    torch_lowbit.save_quantized(_small(seed=0), real, max_shard_size=4000)
    os.symlink(real, link)
    torch_lowbit.save_quantized(_small(seed=1), link)
    assert os.path.islink(link) and os.path.realpath(link) == str(real)
    assert sorted(os.listdir(real)) == ["config.json", "model.safetensors"]
    assert _strays(tmp_path) == []
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    with pytest.raises(NotADirectoryError, match="dangling.*is a symlink to .*nowhere"):
        torch_lowbit.save_quantized(_small(), tmp_path / "dangling")
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        torch_lowbit.save_quantized(_small(), tmp_path / "file")


def test_a_save_that_raises_leaves_the_old_checkpoint_and_no_temporary_directory(tmp_path, monkeypatch):
    import safetensors.torch

    target = tmp_path / "model"
    torch_lowbit.save_quantized(_small(seed=0), target, max_shard_size=4000)
    before = _snapshot(target)
    written = []

    def failing_save_file(tensors, filename, metadata=None):
        if written:
            raise OSError(errno.EIO, "disk gone")
        written.append(filename)
        real_save_file(tensors, filename, metadata=metadata)

    real_save_file = safetensors.torch.save_file
    monkeypatch.setattr(safetensors.torch, "save_file", failing_save_file)
    with pytest.raises(OSError, match="disk gone"):
        torch_lowbit.save_quantized(_small(seed=1), target, max_shard_size=4000)
    assert _snapshot(target) == before and _strays(tmp_path) == []


# ------------------------------------------------------------------------------------------------ validation
@pytest.mark.parametrize("size,nbytes", [("2GB", 2 * 10 ** 9), ("500MB", 500 * 10 ** 6), ("4KB", 4000), ("4kB", 4000),
                                         ("4KiB", 4096), ("32Kb", 4000), ("4000", 4000), (" 3.5 KB", 3500)])
def test_max_shard_size_takes_transformers_spellings(tmp_path, size, nbytes):
    spelled = torch_lowbit.save_quantized(_small(), tmp_path / "spelled", max_shard_size=size)
    in_bytes = torch_lowbit.save_quantized(_small(), tmp_path / "bytes", max_shard_size=nbytes)
    assert [os.path.basename(f) for f in spelled] == [os.path.basename(f) for f in in_bytes]
    assert (len(spelled) == 1) == (nbytes > 10 ** 6)


@pytest.mark.parametrize("size", ["2 gigs", "GB", "-1", 0, -5, 1.5, True, None, "1e9"])
def test_max_shard_size_garbage_is_an_error_naming_it(tmp_path, size):
    with pytest.raises((ValueError, TypeError), match="max_shard_size"):
        torch_lowbit.save_quantized(_small(), tmp_path / "x", max_shard_size=size)
    assert not os.path.exists(tmp_path / "x")


def test_saving_tensors_on_meta_names_them(tmp_path):
    model = _small()
    model.extra = nn.Linear(4, 4, device="meta")
    with pytest.raises(ValueError, match=r"meta device.*extra\.weight, extra\.bias"):
        torch_lowbit.save_quantized(model, tmp_path / "x")
    assert not os.path.exists(tmp_path / "x") and _strays(tmp_path) == []


def test_per_tensor_expert_scales_viewing_one_tensor_are_written(tmp_path):
    torch.manual_seed(0)
    E, I, H = 3, 16, 8
    experts = Fp8Experts.from_float(torch.randn(E, 2 * I, H), torch.randn(E, H, I), "tensor")
    model = nn.ModuleDict({"experts": experts, "proj": Fp8Linear.from_float(nn.Linear(H, H))})
    torch_lowbit.save_quantized(model, tmp_path)
    sd = _tensors(tmp_path)
    for e in range(E):
        assert torch.equal(sd[f"experts.{e}.down_proj.weight_scale"], experts.down_scale[e].reshape(1))
        assert torch.equal(sd[f"experts.{e}.up_proj.weight"].float(), experts.gate_up[e, I:].float())


def test_save_quantized_reports_progress_in_bytes(tmp_path, monkeypatch):
    import torch_lowbit._progress as progress

    seen = []

    class Recording(progress.Progress):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            seen.append(self)

    model = _small()  # quantize_ shows progress of its own
    monkeypatch.setattr(progress, "Progress", Recording)
    torch_lowbit.save_quantized(model, tmp_path, max_shard_size=4000)
    total = sum(t.numel() * t.element_size() for t in _tensors(tmp_path).values())
    assert [(p.what, p.total, p.done) for p in seen] == [("save_quantized", total, total)]


# ------------------------------------------------------------------------------------------------------ faults
_KILLED_SAVE = textwrap.dedent("""
    import os, signal, sys
    import torch
    from torch import nn
    import torch_lowbit, torch_lowbit.hf as hf, safetensors.torch
    from torch_lowbit import _atomic_dir
    target, point, count = sys.argv[1], sys.argv[2], int(sys.argv[3])

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    def after(fn, n):  # run fn, and die once it has run n times
        calls = []
        def wrapped(*a, **k):
            out = fn(*a, **k)
            calls.append(1)
            if len(calls) == n:
                die()
            return out
        return wrapped

    def before(fn):
        def wrapped(*a, **k):
            die()
        return wrapped

    if point == "shard":
        safetensors.torch.save_file = after(safetensors.torch.save_file, count)
    elif point == "config":
        hf._write_config = after(hf._write_config, 1)
    elif point == "swap":
        _atomic_dir._swap_in = before(_atomic_dir._swap_in)
    elif point == "remove-old":
        _atomic_dir._swap_in = after(_atomic_dir._swap_in, 1)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 80), nn.ReLU(), nn.Linear(80, 32))
    torch_lowbit.quantize_(model, torch_lowbit.Fp8WeightOnly("channel"), filter_fn=lambda m, f: True)
    torch_lowbit.save_quantized(model, target, max_shard_size=4000)
""")


def _run(script, *args, preexec_fn=None):
    env = {**os.environ, "PYTHONPATH": REPO, "TORCH_LOWBIT_PROGRESS": "0"}
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=120, preexec_fn=preexec_fn)


@pytest.mark.parametrize("point,count", [("shard", 1), ("shard", 3), ("config", 1), ("swap", 1),
                                         ("remove-old", 1)])
def test_a_save_killed_midway_leaves_the_old_or_the_new_checkpoint(tmp_path, point, count):
    target = tmp_path / "model"
    torch_lowbit.save_quantized(_small(seed=0), target)
    (target / "README.md").write_text("notes")
    old = _snapshot(target)
    run = _run(_KILLED_SAVE, target, point, count)
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    after = _snapshot(target)
    if point == "remove-old":  # killed after the swap: the new checkpoint, complete
        index = json.loads(after["model.safetensors.index.json"])
        assert sorted(after) == sorted(["README.md", "config.json", "model.safetensors.index.json",
                                        *set(index["weight_map"].values())])
        assert torch.equal(_tensors(target)["4.weight"].float(), _small(seed=1)[4].weight.float())
    else:
        assert after == old
        assert torch.equal(_tensors(target)["4.weight"].float(), _small(seed=0)[4].weight.float())
    # the killed process's temporary directory is beside the target, never in it; the next save removes it
    assert all(n.startswith(".model.torch_lowbit-") for n in _strays(tmp_path))
    torch_lowbit.save_quantized(_small(seed=2), target)
    assert _strays(tmp_path) == []


_SAVE = textwrap.dedent("""
    import signal, sys, torch
    from torch import nn
    import torch_lowbit
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # over RLIMIT_FSIZE, a write fails with EFBIG instead
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 32))
    torch_lowbit.quantize_(model, torch_lowbit.Fp8WeightOnly("channel"), filter_fn=lambda m, f: True)
    try:
        torch_lowbit.save_quantized(model, sys.argv[1])
    except Exception as e:  # safetensors reports a failed write as its own SafetensorError, with the OS's words
        print("error:", e)
        sys.exit(3)
""")


@pytest.fixture
def tmpfs(tmp_path):
    """A 256 KiB tmpfs (root in a container that allows mount), else None."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        yield None
        return
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.parametrize("how", ["small tmpfs", "file-size limit"])
def test_a_full_disk_leaves_the_old_checkpoint_and_no_stray_files(tmp_path, tmpfs, how):
    if how == "small tmpfs" and tmpfs is None:
        pytest.skip("mounting a tmpfs needs root in a container that allows it: the file-size limit case runs")
    tmpfs = tmpfs if how == "small tmpfs" else None
    base = tmpfs or tmp_path / "disk"
    target = base / "model"
    torch_lowbit.save_quantized(_small(seed=0), target)
    old = _snapshot(target)
    if tmpfs is not None:  # the old checkpoint, a filler and the new one (~140 KB) do not fit in 256 KiB
        (base / "filler").write_bytes(b"\0" * (150 * 1024))
        run, want = _run(_SAVE, target), os.strerror(errno.ENOSPC)
    else:  # a file-size limit makes the shard write fail as a full disk does (EFBIG)
        def limit_file_size(limit=64 * 1024):
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        run, want = _run(_SAVE, target, preexec_fn=limit_file_size), os.strerror(errno.EFBIG)
    assert run.returncode == 3 and want in run.stdout, (run.stdout, run.stderr[-2000:])
    assert _snapshot(target) == old
    assert sorted(os.listdir(base)) == sorted(["model"] + (["filler"] if tmpfs is not None else []))


def test_a_read_only_target_is_an_error_and_stays_intact(tmp_path, tmpfs):
    if tmpfs is None and os.geteuid() == 0:
        pytest.skip("root ignores file modes and this container cannot mount a read-only filesystem")
    base = tmpfs or tmp_path / "ro"
    base.mkdir(exist_ok=True)
    target = base / "model"
    torch_lowbit.save_quantized(_small(seed=0), target)
    old = _snapshot(target)
    if tmpfs is not None:
        assert subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], capture_output=True).returncode == 0
    else:
        os.chmod(target, 0o555)
        os.chmod(base, 0o555)
    try:
        with pytest.raises(OSError) as e:
            torch_lowbit.save_quantized(_small(seed=1), target)
        assert e.value.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
        assert _snapshot(target) == old and sorted(os.listdir(base)) == ["model"]
    finally:
        if tmpfs is None:
            os.chmod(base, 0o755)
            os.chmod(target, 0o755)


# ---------------------------------------------------------------------------------------------- 4-bit (W4Linear)
def _w4_model(layout, seed=0):
    """The tiny Llama with every Linear but lm_head a W4Linear of random codes. layout(name, K) -> (format,
    group_size, zero points?)."""
    from torch_lowbit.nn.w4_linear import W4Linear

    g = torch.Generator().manual_seed(seed)
    model = W.tiny_model("llama")
    for name, m in list(model.named_modules()):
        if type(m) is not nn.Linear or name == "lm_head":
            continue
        N, K = m.out_features, m.in_features
        fmt, group, zp = layout(name, K)
        G = -(-K // group)
        codes = torch.randint(0, 256, (N, (K + 1) // 2), generator=g, dtype=torch.uint8)
        if fmt == "nvfp4":
            scale = (torch.rand(N, G, generator=g) * 0.05 + 0.01).to(torch.float8_e4m3fn)
            extra = {"weight_scale_2": torch.tensor([1 / 3.0])}
        else:
            scale = torch.rand(N, G, generator=g) * K ** -0.5 / 4 + 0.01
            extra = {"weight_offset": torch.randint(-8, 8, (N, G), generator=g, dtype=torch.int8)} if zp else {}
        model.set_submodule(name, W4Linear.from_quantized(codes, scale, format=fmt, group_size=group,
                                                          in_features=K, bias=None, **extra))
    return model


def _int4_one_group(name, K):  # group 16, q_proj per channel, zero points on the MLPs
    return "int4", (K if name.endswith("q_proj") else 16), ".mlp." in name


def test_save_quantized_int4_writes_one_pack_quantized_group_transformers_reads(tmp_path):
    from torch_lowbit.nn.w4_linear import W4Linear

    model = _w4_model(_int4_one_group)
    torch_lowbit.save_quantized(model, tmp_path)
    with open(tmp_path / "config.json") as f:
        qc = json.load(f)["quantization_config"]
    (group,) = qc["config_groups"].values()  # per-channel layers written in the model's group size: one group
    assert qc["format"] == "pack-quantized" and group["targets"] == ["Linear"]
    assert group["weights"]["strategy"] == "group" and group["weights"]["group_size"] == 16
    assert group["weights"]["symmetric"] is False and qc["ignore"] == ["lm_head"]
    sd = _tensors(tmp_path)
    q = "model.layers.0.self_attn.q_proj"
    assert sd[f"{q}.weight_packed"].dtype == torch.int32 and sd[f"{q}.weight_scale"].shape == (W.H, W.H // 16)
    assert torch.equal(sd[f"{q}.weight_zero_point"], torch.full((W.H // 8, W.H // 16), 0x88888888 - 2 ** 32,
                                                                 dtype=torch.int32))  # zero points 0, stored + 8
    again = torch_lowbit.from_pretrained(tmp_path, dtype=torch.float32, device="cpu")
    for name, m in model.named_modules():
        if isinstance(m, W4Linear):
            assert torch.equal(again.get_submodule(name).dequantize(torch.float32), m.dequantize(torch.float32))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
    assert _rel_err(_logits(theirs), _logits(model)) <= 1e-5
    assert torch.equal(_logits(again), _logits(model))


def test_save_quantized_int4_of_two_group_sizes_writes_a_group_each(tmp_path):
    model = _w4_model(lambda name, K: ("int4", 8 if ".mlp." in name else 16, False))
    torch_lowbit.save_quantized(model, tmp_path)
    with open(tmp_path / "config.json") as f:
        groups = json.load(f)["quantization_config"]["config_groups"]
    sizes = {g["weights"]["group_size"]: g["targets"] for g in groups.values()}
    assert sorted(sizes) == [8, 16] and all(".mlp." in t for t in sizes[8])
    assert all(g["weights"]["symmetric"] for g in groups.values())
    assert torch.equal(_logits(torch_lowbit.from_pretrained(tmp_path, dtype=torch.float32, device="cpu")),
                       _logits(model))


def test_save_quantized_nvfp4_writes_the_divisor_compressed_tensors_reads(tmp_path):
    model = _w4_model(lambda name, K: ("nvfp4", 16, False))
    torch_lowbit.save_quantized(model, tmp_path)
    with open(tmp_path / "config.json") as f:
        qc = json.load(f)["quantization_config"]
    assert qc["format"] == "nvfp4-pack-quantized"
    sd = _tensors(tmp_path)
    gs = sd["model.layers.1.mlp.down_proj.weight_global_scale"]
    assert gs.dtype == torch.float32 and torch.equal((1.0 / gs.double()).float(), torch.tensor([1 / 3.0]))
    assert torch.equal(_logits(torch_lowbit.from_pretrained(tmp_path, dtype=torch.float32, device="cpu")),
                       _logits(model))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
    # compressed-tensors rounds scale / global_scale to bf16 when it decompresses: close, not the same
    assert _rel_err(_logits(theirs), _logits(model)) <= 2e-2


@pytest.mark.parametrize("layout,message", [
    (lambda name, K: ("uint4", 16, False), r"format 'uint4' \(MLX affine.*has no compressed-tensors form"),
    (lambda name, K: ("nvfp4", 8, False), r"nvfp4 W4Linear with group_size 8, which has no compressed-tensors form"),
])
def test_save_quantized_refuses_4bit_layouts_compressed_tensors_lacks(tmp_path, layout, message):
    from torch_lowbit.nn.w4_linear import W4Linear

    if layout("x", 48)[0] == "uint4":  # uint4's offsets are biases in the scale's dtype
        model = W.tiny_model("llama")
        model.model.layers[0].mlp.up_proj = W4Linear.from_quantized(
            torch.zeros(W.I, W.H // 2, dtype=torch.uint8), torch.ones(W.I, 3), format="uint4", group_size=16,
            in_features=W.H, weight_offset=torch.zeros(W.I, 3))
    else:
        model = _w4_model(layout)
    with pytest.raises(ValueError, match=message):
        torch_lowbit.save_quantized(model, tmp_path / "out")
    assert not os.path.exists(tmp_path / "out") and _strays(tmp_path) == []


def test_save_quantized_refuses_zero_points_compressed_tensors_cannot_store(tmp_path):
    model = _w4_model(lambda name, K: ("int4", 16, True))
    model.model.layers[1].mlp.down_proj.weight_offset[0, 0] = 9
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight_offset holds zero points "
                                         r"outside \[-8, 7\]"):
        torch_lowbit.save_quantized(model, tmp_path / "out")
