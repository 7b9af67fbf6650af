"""Property-based fuzzing of what a Hugging Face user hands the loader: garbage in config.json (its
quantization_config -- wrong types, huge / negative / bool numbers, bad regexes, deep nesting, unknown methods --
and the model fields), in the index file (names outside the directory, missing or wrong shards, non-strings), in
``from_pretrained``'s arguments and in ``TorchLowbitConfig``'s. Each case must either load and give the writer's
reference result (compressed-tensors' own dequantized reload), or raise ValueError / TypeError / CheckpointError /
FileNotFoundError whose message names the argument, file or field -- never another exception type, a silent wrong
result, or a read outside the checkpoint directory (an audit hook sees every file Python opens; the shards outside
hold other values, so a load through safetensors from there would give a wrong result).

Also from several threads at once: every thread's load equals the reference and nothing stays patched.

The example budget and the seed are fixed; ``TORCH_LOWBIT_FUZZ_EXAMPLES=N`` and ``TORCH_LOWBIT_FUZZ_SEED=S`` run a
longer or different campaign.
"""
import json
import os
import shutil
import sys
import tempfile
import threading

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_writers as W  # noqa: E402
from opened_files import opened_files  # noqa: E402
import torch_lowbit  # noqa: E402
from torch_lowbit.formats import CheckpointError  # noqa: E402

from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

EXAMPLES = int(os.environ.get("TORCH_LOWBIT_FUZZ_EXAMPLES", "40"))
SEED = int(os.environ.get("TORCH_LOWBIT_FUZZ_SEED", "0"))
ALLOWED = (ValueError, TypeError, CheckpointError, FileNotFoundError)
IDS = torch.tensor([[3, 17, 42, 5, 88, 1, 0, 64, 23]])
SCHEME = "fp8-channel-w8a16"

@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A compressed-tensors checkpoint, its reference logits, and an outside folder holding a valid checkpoint
    of another model (what an escape would read)."""
    root = tmp_path_factory.mktemp("fuzz-hf")
    ckpt = str(root / "ckpt")
    W.write_compressed_tensors(W.tiny_model("llama"), "llama", ckpt, SCHEME)
    outside = str(root / "outside")
    W.write_compressed_tensors(W.tiny_model("llama", seed=7), "llama", outside, SCHEME)
    with torch.no_grad():
        ref = W.ct_dequantized(ckpt)(IDS).logits
    return _World(ckpt=ckpt, outside=outside, ref=ref, root=str(root))


class _World(dict):
    def __repr__(self):  # hypothesis prints the fixtures of a falsifying example
        return f"<checkpoint {self['ckpt']}>"


# ------------------------------------------------------------------------------------------------ garbage
class Deep(str):
    """Stands for arrays nested `depth` deep: written into the JSON text as such (json.dumps and hypothesis' own
    printing would recurse on the real thing); as an argument, a string that says what it is."""

    def __new__(cls, depth):
        self = super().__new__(cls, f"<deep {depth}>")
        self.depth = depth
        return self

    @staticmethod
    def expand(text):
        for depth in (50, 5000, 100_000):
            text = text.replace(json.dumps(f"<deep {depth}>"), "[" * depth + "]" * depth)
        return text


SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.sampled_from([0, -1, 2 ** 63, 2 ** 63 - 1, 2 ** 64]),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8),
    st.sampled_from(["re:(", "re:.*", "re:[", "*", "[", "lm_head", "fp8", "float", "int", "tensor", "channel", "block",
                     "group", "token", "../outside", "/etc/passwd", "compressed-tensors", "torch_lowbit", "", "."]))
GARBAGE = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                        st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                       max_leaves=6) | st.sampled_from([Deep(50), Deep(5000), {"a": Deep(100_000)}])

QC_FIELDS = ["quant_method", "format", "ignore", "config_groups", "quantization_status", "kv_cache_scheme",
             "sparsity_config", "transform_config", "global_compression_ratio"]
WEIGHT_FIELDS = ["num_bits", "type", "strategy", "symmetric", "dynamic", "group_size", "block_structure",
                 "observer", "actorder"]
GROUP_FIELDS = ["targets", "weights", "input_activations", "output_activations", "format"]
MODEL_FIELDS = ["architectures", "model_type", "dtype", "vocab_size", "hidden_size", "num_hidden_layers",
                "quantization_config"]


@st.composite
def config_edits(draw):
    """(where in config.json, value): a field of the model, of the quantization_config, of its group, or of the
    group's weight arguments, set to garbage."""
    level = draw(st.sampled_from(["model", "qc", "group", "weights"]))
    field = draw(st.sampled_from({"model": MODEL_FIELDS, "qc": QC_FIELDS, "group": GROUP_FIELDS,
                                  "weights": WEIGHT_FIELDS}[level]))
    return level, field, draw(GARBAGE)


def _apply_config_edit(data, level, field, value):
    node = {"model": data, "qc": data["quantization_config"]}.get(level)
    if node is None:
        group = data["quantization_config"]["config_groups"]["group_0"]
        node = group if level == "group" else group["weights"]
    node[field] = value


INDEX_ENTRIES = st.one_of(st.sampled_from(["model.safetensors", "../outside/model.safetensors", "missing.safetensors",
                                           "/proc/self/environ", "", "model.bin", "config.json", "."]),
                          GARBAGE)


@st.composite
def index_edits(draw):
    """An index file: the real weight map with some entries pointed elsewhere, or garbage instead of it."""
    if draw(st.booleans()):
        return {"weight_map": draw(GARBAGE)}
    return {"weight_map": {}, "retarget": draw(st.lists(st.tuples(st.integers(0, 1000), INDEX_ENTRIES), max_size=3))}


DEVICES = st.one_of(st.sampled_from(["cpu", "meta", "cuda", "mps", "auto", "cpu:0", "cpu:1", "balanced", "",
                                     torch.device("cpu"), {"": "cpu"}, {"": "meta"}, {"lm_head": "cpu"}]), GARBAGE)
DTYPES = st.one_of(st.sampled_from([torch.float32, "float32", "auto", torch.float64, torch.float8_e4m3fn, torch.int8,
                                    "bfloat16", "torch.float16", "bf16", "float", torch.complex64]), GARBAGE)
ARG_STRATEGIES = {"dtype": DTYPES, "torch_dtype": DTYPES, "device": DEVICES, "device_map": DEVICES,
                  "revision": GARBAGE, "trust_remote_code": GARBAGE, "strict": st.booleans()}


@st.composite
def argument_edits(draw):
    names = draw(st.lists(st.sampled_from(sorted(ARG_STRATEGIES)), min_size=1, max_size=2, unique=True))
    return {n: draw(ARG_STRATEGIES[n]) for n in names}


CASES = st.one_of(st.tuples(st.just("config"), config_edits()), st.tuples(st.just("index"), index_edits()),
                  st.tuples(st.just("args"), argument_edits()))


# ------------------------------------------------------------------------------------------------ one case
def _prepare(world, kind, edit):
    tmp = tempfile.mkdtemp(dir=world["root"])
    path = os.path.join(tmp, "ckpt")
    shutil.copytree(world["ckpt"], path)
    os.symlink(world["outside"], os.path.join(tmp, "outside"))  # "../outside/..." from the checkpoint
    kwargs, names = {"dtype": torch.float32}, ["config.json"]
    if kind == "config":
        level, field, value = edit
        with open(os.path.join(path, "config.json")) as f:
            data = json.load(f)
        _apply_config_edit(data, level, field, value)
        with open(os.path.join(path, "config.json"), "w") as f:
            f.write(Deep.expand(json.dumps(data)))
        names += [field]
    elif kind == "index":
        from safetensors import safe_open
        with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
            keys = sorted(f.keys())
        weight_map = edit["weight_map"] if "retarget" not in edit else {k: "model.safetensors" for k in keys}
        for i, target in edit.get("retarget", []):
            weight_map[keys[i % len(keys)]] = target
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            f.write(Deep.expand(json.dumps({"weight_map": weight_map})))
        names += ["model.safetensors.index.json", "index", "shard", "checkpoint file", "weight_map"]
        names += [t for _, t in edit.get("retarget", []) if isinstance(t, str) and t]  # the entry's file
    else:
        kwargs.update(edit)
        names = list(edit)
    return tmp, path, kwargs, names


def _check(world, kind, edit):
    tmp, path, kwargs, names = _prepare(world, kind, edit)
    try:
        with opened_files() as opened:
            try:
                model = torch_lowbit.from_pretrained(path, **kwargs)
            except ALLOWED as e:
                msg = str(e)
                assert any(n in msg for n in names), f"{type(e).__name__} names none of {names}: {msg[:300]}"
                return
            finally:
                escaped = [f for f in opened if f.startswith(os.path.realpath(world["outside"]))]
                assert not escaped, f"read outside the checkpoint: {escaped}"
        with torch.no_grad():
            out = model.float().cpu()(IDS).logits
        err = ((out.double() - world["ref"].double()).abs().max() / world["ref"].double().abs().max()).item()
        # float32 as asked, or a lower precision the case asked for (dtype / torch_dtype strings, "auto")
        tol = 1e-6 if next(model.parameters()).dtype == torch.float32 else 2e-2
        assert err <= tol, f"loaded, but logits are off by {err:.3g} (tolerance {tol})"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@seed(SEED)
@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(case=CASES)
def test_from_pretrained_garbage_loads_right_or_is_refused_by_name(world, case):
    _check(world, *case)


TLC_ARGS = {"weights": st.one_of(st.sampled_from(["fp8", "int8", "int4"]), GARBAGE),
            "granularity": st.one_of(st.sampled_from(["tensor", "channel", "block", "Block"]), GARBAGE),
            "block_size": st.one_of(st.tuples(st.integers(-5, 2 ** 64), st.integers(-5, 2 ** 64)), GARBAGE),
            "modules_to_not_convert": st.one_of(st.lists(st.sampled_from(["lm_head", "re:(", "re:.*gate", "*", "["]),
                                                         max_size=3), GARBAGE),
            "quant_method": GARBAGE, "granularty": GARBAGE, "modules_to_not_conver": GARBAGE}


@seed(SEED)
@settings(max_examples=max(EXAMPLES * 5, 50), deadline=None, database=None)
@given(kwargs=st.fixed_dictionaries({}, optional=TLC_ARGS))
def test_torch_lowbit_config_garbage_is_refused_by_name_or_round_trips(kwargs):
    from transformers.quantizers import AutoQuantizationConfig

    try:
        config = torch_lowbit.TorchLowbitConfig(**kwargs)
    except ALLOWED as e:
        assert any(n in str(e) for n in kwargs), f"{type(e).__name__} names none of {sorted(kwargs)}: {e}"
        return
    assert config.weights in torch_lowbit.hf_quantizer.WEIGHTS and config.granularity in ("tensor", "channel", "block")
    names = config.modules_to_not_convert  # None: each library's default rule
    assert names is None or all(isinstance(n, str) for n in names)
    assert all(0 < b < 2 ** 63 for b in config.block_size)
    again = AutoQuantizationConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again.to_dict() == config.to_dict()


def test_threads_loading_at_once_each_give_the_reference(world):
    from torch.nn.modules.module import _global_parameter_registration_hooks

    results, errors = [None] * 4, []

    def load(i):
        try:
            results[i] = torch_lowbit.from_pretrained(world["ckpt"], dtype=torch.float32)
        except BaseException as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for model in results:
        with torch.no_grad():
            out = model(IDS).logits
        assert ((out - world["ref"]).abs().max() / world["ref"].abs().max()).item() <= 1e-6
    assert not _global_parameter_registration_hooks and torch.get_default_dtype() == torch.float32
