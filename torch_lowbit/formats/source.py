"""Where checkpoint tensors come from: a directory or file of .safetensors (memory-mapped, read one tensor at a
time), or an in-memory state dict. Never unpickles: .bin / .pt files are refused."""
from __future__ import annotations

import glob
import json
import os
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

import torch


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is: the message names the tensor or file and what was expected."""


INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")

# safetensors' dtype names (safe_open(...).get_slice(k).get_dtype())
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def _refuse_pickle(path: str):
    raise CheckpointError(
        f"refusing to read {path!r}: it is a pickle file, and unpickling can run arbitrary code. torch_lowbit loads "
        f"only .safetensors checkpoints; convert it once in a trusted environment, e.g. "
        f"safetensors.torch.save_file(torch.load(path, weights_only=True), 'model.safetensors')")


def _read_json(path: str) -> Optional[dict]:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


class Source:
    """Read-only view of the tensors of a checkpoint: names, dtypes and shapes without loading, then tensors one
    at a time on CPU."""
    config: Optional[dict] = None           # config.json (a directory only)
    modelopt_config: Optional[dict] = None  # hf_quant_config.json (a directory only)
    description: str = "checkpoint"

    def keys(self) -> List[str]:
        raise NotImplementedError

    def __contains__(self, key: str) -> bool:
        raise NotImplementedError

    def dtype(self, key: str) -> torch.dtype:
        raise NotImplementedError

    def shape(self, key: str) -> Tuple[int, ...]:
        raise NotImplementedError

    def get(self, key: str) -> torch.Tensor:
        raise NotImplementedError

    def close(self):
        pass


class StateDictSource(Source):
    def __init__(self, state_dict: Mapping[str, torch.Tensor]):
        bad = [k for k, v in state_dict.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise CheckpointError(f"state dict entry {bad[0]!r} is a {type(state_dict[bad[0]]).__name__}, not a tensor")
        self._sd = state_dict
        self.description = "state dict"

    def keys(self):
        return list(self._sd.keys())

    def __contains__(self, key):
        return key in self._sd

    def dtype(self, key):
        return self._sd[key].dtype

    def shape(self, key):
        return tuple(self._sd[key].shape)

    def get(self, key):
        return self._sd[key]


class SafetensorsSource(Source):
    """One or many .safetensors files, opened with safe_open (memory-mapped); tensors are read on demand."""

    def __init__(self, files: Iterable[str], weight_map: Optional[Dict[str, str]] = None, description=""):
        from safetensors import safe_open

        self.description = description
        self._handles = {}
        self._where: Dict[str, str] = {}
        for f in files:
            h = safe_open(f, framework="pt", device="cpu")
            self._handles[f] = h
            for k in h.keys():
                self._where.setdefault(k, f)
        if weight_map is not None:
            # the index is the contract: every tensor it lists must be in the shard it names
            for k, f in weight_map.items():
                if k not in self._handles[f].keys():
                    raise CheckpointError(f"tensor {k!r} is listed in {INDEX_FILE} under shard "
                                          f"{os.path.basename(f)!r}, but that shard does not contain it")
                self._where[k] = f
        self._meta: Dict[str, Tuple[torch.dtype, Tuple[int, ...]]] = {}

    def keys(self):
        return list(self._where.keys())

    def __contains__(self, key):
        return key in self._where

    def _info(self, key):
        if key not in self._meta:
            sl = self._handles[self._where[key]].get_slice(key)
            name = sl.get_dtype()
            if name not in _ST_DTYPES:
                raise CheckpointError(f"tensor {key!r} has dtype {name}, which torch_lowbit does not read")
            self._meta[key] = (_ST_DTYPES[name], tuple(sl.get_shape()))
        return self._meta[key]

    def dtype(self, key):
        return self._info(key)[0]

    def shape(self, key):
        return self._info(key)[1]

    def get(self, key):
        return self._handles[self._where[key]].get_tensor(key)

    def close(self):
        self._handles.clear()


def _directory_source(path: str) -> SafetensorsSource:
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no 'weight_map' object")
        shards = {}
        for k, f in weight_map.items():
            shards.setdefault(f, []).append(k)
        for f, ks in sorted(shards.items()):
            if not os.path.isfile(os.path.join(path, f)):
                raise CheckpointError(f"shard {f!r} listed in {INDEX_FILE} is missing from {path} (it should hold "
                                      f"{len(ks)} tensors, e.g. {sorted(ks)[0]!r})")
            if f.endswith(PICKLE_SUFFIXES):
                _refuse_pickle(os.path.join(path, f))
        files = [os.path.join(path, f) for f in sorted(shards)]
        full_map = {k: os.path.join(path, f) for k, f in weight_map.items()}
        src = SafetensorsSource(files, full_map, description=path)
    else:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            pickles = sorted(f for f in os.listdir(path) if f.endswith(PICKLE_SUFFIXES))
            if pickles:
                _refuse_pickle(os.path.join(path, pickles[0]))
            raise CheckpointError(f"no .safetensors files in {path}")
        src = SafetensorsSource(files, description=path)
    src.config = _read_json(os.path.join(path, "config.json"))
    src.modelopt_config = _read_json(os.path.join(path, "hf_quant_config.json"))
    return src


def open_source(path_or_state_dict) -> Source:
    """A Source for a directory (config.json / hf_quant_config.json / index / shards), a single .safetensors
    file, or a state dict (a mapping of names to tensors)."""
    if isinstance(path_or_state_dict, Mapping):
        return StateDictSource(path_or_state_dict)
    path = os.fspath(path_or_state_dict)
    if os.path.isdir(path):
        return _directory_source(path)
    if path.endswith(PICKLE_SUFFIXES):
        _refuse_pickle(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    if os.path.basename(path) == INDEX_FILE:
        return _directory_source(os.path.dirname(path) or ".")
    if not path.endswith(".safetensors"):
        raise CheckpointError(f"{path!r} is not a .safetensors file or a checkpoint directory")
    return SafetensorsSource([path], description=path)
