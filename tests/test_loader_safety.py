"""Loader safety: files outside the checkpoint directory are never opened (Hugging Face cache snapshots still
load), only regular files are read, a loaded model owns its memory, and malformed configs / indexes get errors
that name the file and the field."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

from checkpoints import make_checkpoint, write_dir
from tiny_models import TinyLM
from torch_lowbit.formats import CheckpointError, detect_format, load_quantized

SPEC = "hf-fp8-block"
IDS = torch.tensor([[3, 17, 42, 5, 88, 1]])
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)  # the repository root: its torch_lowbit is the one under test


def _model():
    torch.manual_seed(1)
    return TinyLM()


@pytest.fixture(scope="module")
def checkpoint():
    torch.manual_seed(0)
    return make_checkpoint(TinyLM(), SPEC)


def _logits(model):
    with torch.no_grad():
        return model(IDS)


def _retarget_index(path, fname):
    """Point every tensor of the first shard at ``fname`` in the index."""
    index = path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    first = sorted(set(data["weight_map"].values()))[0]
    data["weight_map"] = {k: (fname if v == first else v) for k, v in data["weight_map"].items()}
    index.write_text(json.dumps(data))
    return first


# ------------------------------------------------------------------------------------------ confinement
@pytest.mark.parametrize("target", ["../outside/x.safetensors", "ABS", "/proc/self/environ", "sub/../../x.safetensors"])
def test_index_entries_outside_the_directory_are_refused(tmp_path, checkpoint, target):
    sd, _ = checkpoint
    ckpt = tmp_path / "ckpt"
    write_dir(ckpt, sd, SPEC, shards=2)
    outside = tmp_path / "outside"
    outside.mkdir()
    first = ckpt / "model-00001-of-00002.safetensors"
    os.replace(first, outside / "x.safetensors")  # a valid shard, readable: only the rule keeps it out
    (tmp_path / "x.safetensors").write_bytes((outside / "x.safetensors").read_bytes())
    target = str(outside / "x.safetensors") if target == "ABS" else target
    _retarget_index(ckpt, target)
    with pytest.raises(CheckpointError, match=r"(outside the checkpoint directory|must be a file name relative)"):
        load_quantized(_model(), ckpt)


def test_a_symlink_out_of_the_directory_is_refused(tmp_path, checkpoint):
    sd, _ = checkpoint
    ckpt, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    write_dir(elsewhere, sd, SPEC)
    ckpt.mkdir()
    (ckpt / "config.json").write_bytes((elsewhere / "config.json").read_bytes())
    os.symlink(elsewhere / "model.safetensors", ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'model\.safetensors' resolves to .*elsewhere.* outside"):
        load_quantized(_model(), ckpt)
    os.remove(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").write_bytes((elsewhere / "model.safetensors").read_bytes())
    load_quantized(_model(), ckpt)
    os.remove(ckpt / "config.json")
    os.symlink(elsewhere / "config.json", ckpt / "config.json")
    with pytest.raises(CheckpointError, match=r"config file 'config\.json' resolves to .* outside"):
        detect_format(ckpt)


def test_hugging_face_cache_snapshot_with_symlinks_into_blobs(tmp_path, checkpoint):
    # models--org--name/snapshots/<rev>/<file> -> ../../blobs/<hash>, as huggingface_hub lays out its cache
    sd, ref = checkpoint
    flat = tmp_path / "flat"
    write_dir(flat, sd, SPEC, shards=2)
    repo = tmp_path / "hub" / "models--org--tiny"
    blobs, snap = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(os.listdir(flat))):
        (blobs / f"blob{i:02d}").write_bytes((flat / f).read_bytes())
        os.symlink(os.path.join("..", "..", "blobs", f"blob{i:02d}"), snap / f)
    model = _model()
    report = load_quantized(model, snap, dtype=torch.float32)
    assert report.format == "fp8" and report.missing_keys == [] and report.unused_keys == []
    want = _logits(ref)
    assert (_logits(model).double() - want).abs().max() <= 2e-5 * want.abs().max()
    # the blobs folder is allowed, nothing beyond it
    (repo / "secret.safetensors").write_bytes((blobs / "blob01").read_bytes())
    os.remove(snap / "model-00001-of-00002.safetensors")
    os.symlink(os.path.join("..", "..", "secret.safetensors"), snap / "model-00001-of-00002.safetensors")
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        load_quantized(_model(), snap)


# ------------------------------------------------------------------------------------------ only regular files
def _run(code, timeout=120):
    """Run code in a fresh interpreter (a regression must fail the test, not hang or kill the test process)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


class _FifoWriter:
    """A shell process opening the FIFO for writing: that open returns only once a reader opens it, and closing it
    at once gives that reader EOF. So a loader that opens the FIFO gets unblocked (a regression fails the test
    instead of hanging CI: safetensors blocks in open() holding the GIL, where no thread could help), and
    ``opened`` tells whether anybody did."""

    def __init__(self, path):
        self._proc = subprocess.Popen(["sh", "-c", ': > "$0"', path])

    @property
    def opened(self):
        return self._proc.poll() is not None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "model.safetensors.index.json"])
def test_a_fifo_is_refused_not_waited_on(tmp_path, checkpoint, name):
    sd, _ = checkpoint
    write_dir(tmp_path, sd, SPEC)
    if (tmp_path / name).exists():
        os.remove(tmp_path / name)
    os.mkfifo(tmp_path / name)
    with _FifoWriter(str(tmp_path / name)) as writer:
        with pytest.raises(CheckpointError, match=f"{name}' is a FIFO, not a regular file"):
            load_quantized(_model(), tmp_path)
        assert not writer.opened


# ------------------------------------------------------------------------------------------ owned memory
def test_rewriting_the_file_after_loading_changes_nothing(tmp_path, checkpoint):
    sd, _ = checkpoint
    write_dir(tmp_path, sd, SPEC)
    model = _model()
    load_quantized(model, tmp_path, dtype=torch.float32)
    before = _logits(model)
    garbage = {k: (torch.full_like(v.view(torch.uint8), 0x7E).view(v.dtype) if v.dtype == torch.float8_e4m3fn
                   else torch.ones_like(v) * 3) for k, v in sd.items()}
    path = tmp_path / "model.safetensors"
    with open(path, "r+b") as f:  # in place, same inode and size: what a mapping would see
        data = bytearray(f.read())
        f.seek(0)
        save_file(garbage, str(tmp_path / "g.safetensors"))
        new = (tmp_path / "g.safetensors").read_bytes()
        assert len(new) == len(data)
        f.write(new)
    assert torch.equal(_logits(model), before)


def test_truncating_the_file_after_loading_does_not_kill_the_process(tmp_path, checkpoint):
    sd, _ = checkpoint
    write_dir(tmp_path, sd, SPEC)
    res = _run(f"""
        import os, torch, torch_lowbit
        from tiny_models import TinyLM
        from torch_lowbit.formats import load_quantized
        torch.manual_seed(1)
        model = TinyLM()
        load_quantized(model, {str(tmp_path)!r}, dtype=torch.float32)
        ids = torch.tensor([[3, 17, 42, 5, 88, 1]])
        before = model(ids)
        os.truncate(os.path.join({str(tmp_path)!r}, "model.safetensors"), 64)
        print("same" if torch.equal(model(ids), before) else "changed")
        """)
    assert res.returncode == 0, f"rc {res.returncode}: {res.stderr[-2000:]}"
    assert res.stdout.strip().endswith("same")


def test_a_file_truncated_while_loading_is_an_error_not_garbage(tmp_path):
    from torch_lowbit.formats.source import open_source
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3)}, str(path))
    src = open_source(path)
    assert torch.equal(src.get("b"), torch.ones(3))
    os.truncate(path, os.path.getsize(path) - 2000)
    with pytest.raises(CheckpointError, match=r"ended .* bytes early while reading tensor 'a'"):
        src.get("a")
    src.close()


def _mapped_from(t, path):
    """Does tensor t's memory lie in a mapping of the file at path (/proc/self/maps)?"""
    ptr, real = t.data_ptr(), os.path.realpath(path)
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= ptr < hi:
                return len(parts) == 6 and parts[5].strip() == real
    return False


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
def test_mmap_true_keeps_the_tensors_in_the_mapping(tmp_path, checkpoint):
    sd, _ = checkpoint
    write_dir(tmp_path, sd, SPEC)
    owned, mapped = _model(), _model()
    load_quantized(owned, tmp_path, dtype=torch.float32)
    load_quantized(mapped, tmp_path, dtype=torch.float32, mmap=True)
    name = "model.layers.0.mlp.up_proj"
    path = tmp_path / "model.safetensors"
    assert _mapped_from(mapped.get_submodule(name).weight, path)
    assert not _mapped_from(owned.get_submodule(name).weight, path)
    assert torch.equal(_logits(owned), _logits(mapped))


# ------------------------------------------------------------------------------------------ malformed inputs
def _edit_json(path, fn):
    data = json.loads(path.read_text()) if path.suffix == ".json" else {}
    out = fn(data)
    path.write_text(out if isinstance(out, str) else json.dumps(data if out is None else out))


def _set(*keys_value):
    *keys, value = keys_value

    def fn(d):
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value
    return fn


QC = "quantization_config"
MALFORMED = [  # (spec, file, edit, the error must match)
    (SPEC, "config.json", lambda d: "{not json", r"config\.json is not valid JSON: .* line 1, column 2"),
    (SPEC, "config.json", lambda d: [1, 2], r"config\.json must hold a JSON object, got a JSON list"),
    (SPEC, "config.json", _set(QC, "fp8"), r"config\.json\.quantization_config must be a dict, got str 'fp8'"),
    (SPEC, "config.json", _set(QC, "quant_method", 8), r"config\.json\.quantization_config\.quant_method must be a str"),
    (SPEC, "config.json", _set(QC, "weight_block_size", "128"), r"quantization_config\.weight_block_size must be two "
                                                                r"positive integers"),
    (SPEC, "config.json", _set(QC, "weight_block_size", [128, True]), r"weight_block_size must be two positive"),
    (SPEC, "config.json", _set(QC, "modules_to_not_convert", [1]), r"modules_to_not_convert must be a list of module "
                                                                    r"names, but it holds int 1"),
    (SPEC, "config.json", _set(QC, "modules_to_not_convert", {"a": 1}), r"modules_to_not_convert must be a list"),
    (SPEC, "config.json", _set(QC, "fmt", ["e4m3"]), r"quantization_config\.fmt must be a str, got list"),
    ("ct-fp8-block", "config.json", _set(QC, "config_groups", [1]), r"quantization_config\.config_groups must be a "
                                                                     r"dict, got list"),
    ("ct-fp8-block", "config.json", _set(QC, "config_groups", "group_0", 3), r"config_groups\.group_0 must be a dict"),
    ("ct-fp8-block", "config.json", _set(QC, "config_groups", "group_0", "weights", "strategy", 3),
     r"config_groups\.group_0\.weights\.strategy must be a str, got int 3"),
    ("ct-fp8-block", "config.json", _set(QC, "config_groups", "group_0", "weights", "block_structure", [0, 32]),
     r"weights\.block_structure must be two positive integers"),
    ("ct-fp8-block", "config.json", _set(QC, "config_groups", "group_0", "weights", "num_bits", "8"),
     r"weights\.num_bits must be an int, got str"),
    ("ct-fp8-block", "config.json", _set(QC, "ignore", "lm_head"), None),  # a single name is a valid ignore list
    ("ct-fp8-block", "config.json", _set(QC, "ignore", 5), r"quantization_config\.ignore must be a list"),
    ("fbgemm", "config.json", _set(QC, "activation_scale_ub", "big"), r"activation_scale_ub must be an int or float"),
    ("modelopt-tensor", "hf_quant_config.json", lambda d: "[", r"hf_quant_config\.json is not valid JSON"),
    ("modelopt-tensor", "hf_quant_config.json", _set("quantization", "exclude_modules", 7),
     r"hf_quant_config\.json\.quantization\.exclude_modules must be a list"),
    ("modelopt-tensor", "hf_quant_config.json", _set("quantization", "quant_algo", 1),
     r"hf_quant_config\.json\.quantization\.quant_algo must be a str"),
    (SPEC, "model.safetensors.index.json", lambda d: "{", r"index\.json is not valid JSON"),
    (SPEC, "model.safetensors.index.json", _set("weight_map", [1]), r"index\.json: 'weight_map' must be an object "
                                                                      r"mapping tensor names to shard files, got list"),
    (SPEC, "model.safetensors.index.json", lambda d: {"weight_map": {"a.weight": 3}},
     r"weight_map\['a\.weight'\] must be a shard file name, got int 3"),
    (SPEC, "model.safetensors.index.json", lambda d: {"weight_map": {"a.weight": ""}}, r"must be a file name relative"),
    (SPEC, "model-00001-of-00002.safetensors", lambda d: "garbage that is no header",
     r"model-00001-of-00002\.safetensors is not a valid \.safetensors file"),
]


@pytest.mark.parametrize("spec,fname,edit,match", MALFORMED, ids=[f"{m[1]}-{i}" for i, m in enumerate(MALFORMED)])
def test_malformed_files_name_the_file_and_the_field(tmp_path, spec, fname, edit, match):
    torch.manual_seed(0)
    sd, _ = make_checkpoint(TinyLM(), spec)
    write_dir(tmp_path, sd, spec, shards=2)
    _edit_json(tmp_path / fname, edit)
    if match is None:
        load_quantized(_model(), tmp_path)
        return
    with pytest.raises(CheckpointError, match=match):
        load_quantized(_model(), tmp_path)


@pytest.mark.parametrize("config,match", [
    ("fp8", r"config must be a JSON object \(dict\), got str"),
    ({"quantization_config": ["fp8"]}, r"config\.quantization_config must be a dict, got list"),
    ({"quantization_config": {"quant_method": None}}, r"config\.quantization_config has no 'quant_method'"),
    ({"quant_method": "fp8", "weight_block_size": [1, 2, 3]}, r"config\.weight_block_size must be two positive"),
    ({"quantization": {"quant_algo": "FP8", "exclude_modules": 3}}, r"config\.quantization\.exclude_modules must be"),
])
def test_malformed_config_argument(checkpoint, config, match):
    sd, _ = checkpoint
    with pytest.raises(CheckpointError, match=match):
        load_quantized(_model(), sd, config=config)
