"""Where checkpoint tensors come from: a directory or file of .safetensors (memory-mapped, read one tensor at a
time), or an in-memory state dict. Never unpickles: .bin / .pt files are refused."""
from __future__ import annotations

import glob
import json
import os
import stat
import struct
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
    "U32": torch.uint32,  # MLX packs eight 4-bit codes per uint32
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def _refuse_pickle(path: str):
    raise CheckpointError(
        f"refusing to read {path!r}: it is a pickle file, and unpickling can run arbitrary code. torch_lowbit loads "
        f"only .safetensors checkpoints; convert it once in a trusted environment, e.g. "
        f"safetensors.torch.save_file(torch.load(path, weights_only=True), 'model.safetensors')")


def _regular_file(path: str, what: str) -> bool:
    """True for a regular file, False when nothing is there; an error for anything else (a FIFO would block the
    reader forever, a device or directory is never a checkpoint file)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise CheckpointError(f"{what} {path!r} cannot be read: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode)
                else "a device or socket")
        raise CheckpointError(f"{what} {path!r} is {kind}, not a regular file: refusing to open it")
    return True


def _read_json(path: str, what: str) -> Optional[dict]:
    """The JSON object in ``path`` (None if there is no such file), or an error naming the file."""
    if not _regular_file(path, what):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except RecursionError:
        raise CheckpointError(f"{path} nests JSON arrays / objects too deeply to be a config") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got a JSON {type(data).__name__}")
    return data


class _Confinement:
    """The folders a checkpoint directory may read from: the directory itself (resolved) and, for a Hugging Face
    cache snapshot (``models--org--name/snapshots/<rev>/`` whose files link into ``../../blobs/``), that blobs
    folder. Anything an index or a symlink points at elsewhere is refused."""

    def __init__(self, directory: str):
        self.directory = directory
        self.root = os.path.realpath(directory)
        self.roots = [self.root]
        parent = os.path.dirname(self.root)
        if os.path.basename(parent) == "snapshots":
            blobs = os.path.join(os.path.dirname(parent), "blobs")
            if os.path.isdir(blobs):
                self.roots.append(os.path.realpath(blobs))

    def resolve(self, name: str, what: str) -> str:
        """The path of ``name`` (relative to the directory) after checking that it stays inside."""
        if not isinstance(name, str) or name == "" or os.path.isabs(name) or "\0" in name:
            raise CheckpointError(f"{what} {name!r} must be a file name relative to the checkpoint directory "
                                  f"{self.directory}")
        path = os.path.join(self.directory, name)
        real = os.path.realpath(path)
        if not any(os.path.commonpath([real, r]) == r for r in self.roots):
            raise CheckpointError(f"{what} {name!r} resolves to {real}, outside the checkpoint directory "
                                  f"{self.root}: refusing to open it")
        return path


class Source:
    """Read-only view of the tensors of a checkpoint: names, dtypes and shapes without loading, then tensors one
    at a time on CPU. ``count_reads(progress)``: each distinct tensor read is one unit of that Progress."""
    description: str = "checkpoint"
    _progress = None

    def count_reads(self, progress):
        self._progress, self._read = progress, set()

    def _count(self, key: str):
        if self._progress is not None and key not in self._read:
            self._read.add(key)
            self._progress.update()

    def read_config(self, name: str) -> Optional[dict]:
        """A JSON file beside the tensors (config.json, a format's side config), None if absent or not a
        directory."""
        return None

    def config_path(self, name: str) -> Optional[str]:
        return None

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

    def get_rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` (along dim 0) of tensor `key`, as a tensor of their own; a file source reads only
        those bytes."""
        return self.get(key)[start:stop].clone()

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
        self._count(key)
        return self._sd[key]


def _data_offsets(path: str) -> Dict[str, Tuple[int, int]]:
    """Absolute byte range of each tensor of a .safetensors file (an 8-byte little-endian header length, a JSON
    header with ``data_offsets`` relative to the end of the header, then the data). safe_open has validated the
    header already; sizes are checked against dtype and shape when a tensor is read."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: (8 + n + int(v["data_offsets"][0]), 8 + n + int(v["data_offsets"][1]))
            for k, v in header.items() if k != "__metadata__"}


class SafetensorsSource(Source):
    """One or many .safetensors files, opened with safe_open for their names, dtypes and shapes; tensors are read
    on demand. By default each tensor is read (pread) into memory of its own, so what is loaded does not depend on
    the file afterwards; with ``mmap=True`` tensors are views of safe_open's mapping (no copy, but truncating the
    file kills the process with SIGBUS and rewriting it changes the weights)."""

    def __init__(self, files: Iterable[str], weight_map: Optional[Dict[str, str]] = None, description="",
                 mmap: bool = False, confinement: Optional[_Confinement] = None):
        from safetensors import safe_open

        self.description = description
        self._mmap = mmap
        self._confinement = confinement
        self._configs: Dict[str, Optional[dict]] = {}
        self._handles = {}
        self._where: Dict[str, str] = {}
        for f in files:
            _regular_file(f, "checkpoint file")
            try:
                h = safe_open(f, framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types for a malformed header
                raise CheckpointError(f"{f} is not a valid .safetensors file: {e}") from None
            self._handles[f] = h
            for k in h.keys():
                if k in self._where and (weight_map is None or k not in weight_map):
                    # which copy is meant only an index can say: never the first file found
                    raise CheckpointError(f"tensor {k!r} is in two checkpoint files, {self._where[k]} and {f}, and "
                                          f"no {INDEX_FILE} says which one to load")
                self._where.setdefault(k, f)
        if weight_map is not None:
            # the index is the contract: every tensor it lists must be in the shard it names
            for k, f in weight_map.items():
                if k not in self._handles[f].keys():
                    others = [o for o, h in self._handles.items() if o != f and k in h.keys()]
                    held = f" (it is in {others[0]})" if others else ""
                    raise CheckpointError(f"tensor {k!r} is listed in {INDEX_FILE} under shard "
                                          f"{os.path.basename(f)!r}, but that shard does not contain it{held}")
                self._where[k] = f
        self._meta: Dict[str, Tuple[torch.dtype, Tuple[int, ...]]] = {}
        self._offsets: Dict[str, Dict[str, Tuple[int, int]]] = {}

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
        path = self._where[key]
        self._count(key)
        if self._mmap:
            return self._handles[path].get_tensor(key)
        shape = self._info(key)[1]
        return self._pread(key, 0, shape[0] if shape else 1)

    def get_rows(self, key, start, stop):
        shape = self._info(key)[1]
        if not shape or not 0 <= start <= stop <= shape[0]:
            raise IndexError(f"get_rows: rows {start}:{stop} of tensor {key!r} of shape {list(shape)}")
        self._count(key)
        if self._mmap:
            return self._handles[self._where[key]].get_slice(key)[start:stop]
        return self._pread(key, start, stop)

    def _pread(self, key, row_start, row_stop):
        """Rows row_start:row_stop of `key` (all of a 0-d tensor) read (pread) into memory of our own."""
        path = self._where[key]
        dtype, shape = self._info(key)
        if path not in self._offsets:
            self._offsets[path] = _data_offsets(path)
        start, end = self._offsets[path][key]
        numel = torch.Size(shape).numel()
        if end - start != numel * dtype.itemsize:
            raise CheckpointError(f"{path}: tensor {key!r} ({dtype}, {list(shape)}) spans {end - start} bytes, "
                                  f"expected {numel * dtype.itemsize}")
        row_bytes = (numel // shape[0] if shape and shape[0] else 0) * dtype.itemsize
        t = torch.empty(((row_stop - row_start),) + tuple(shape[1:]) if shape else (), dtype=dtype)
        buf = t.reshape(-1).view(torch.uint8)
        # one read into memory of our own: faster than faulting the mapping in and copying it, and owned
        with open(path, "rb") as f:
            f.seek(start + row_start * row_bytes)
            got = f.readinto(memoryview(buf.numpy()))
        if got != buf.numel():
            raise CheckpointError(f"{path} ended {buf.numel() - got} bytes early while reading tensor {key!r}: the "
                                  f"file changed or is truncated")
        return t

    def read_config(self, name):
        if self._confinement is None:
            return None
        if name not in self._configs:
            path = self._confinement.resolve(name, "config file")
            self._configs[name] = _read_json(path, "config file")
        return self._configs[name]

    def config_path(self, name):
        return None if self._confinement is None else os.path.join(self._confinement.directory, name)

    def close(self):
        self._handles.clear()


def _directory_source(path: str, mmap: bool) -> SafetensorsSource:
    where = _Confinement(path)
    index = where.resolve(INDEX_FILE, "index")
    if _regular_file(index, "index"):
        data = _read_json(index, "index")
        weight_map = data.get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: 'weight_map' must be an object mapping tensor names to shard files, got "
                                  f"{type(weight_map).__name__}")
        if not weight_map:
            raise CheckpointError(f"{index}: 'weight_map' lists no tensors (an index names the shard of each)")
        shards = {}
        for k, f in weight_map.items():
            if not isinstance(f, str):
                raise CheckpointError(f"{index}: weight_map[{k!r}] must be a shard file name, got "
                                      f"{type(f).__name__} {f!r}")
            shards.setdefault(f, []).append(k)
        resolved = {}
        for f, ks in sorted(shards.items()):
            if f.endswith(PICKLE_SUFFIXES):
                _refuse_pickle(os.path.join(path, f))
            resolved[f] = where.resolve(f, f"shard listed in {INDEX_FILE} for {sorted(ks)[0]!r}:")
            if not _regular_file(resolved[f], "shard"):
                raise CheckpointError(f"shard {f!r} listed in {INDEX_FILE} is missing from {path} (it should hold "
                                      f"{len(ks)} tensors, e.g. {sorted(ks)[0]!r})")
        files = [resolved[f] for f in sorted(shards)]
        full_map = {k: resolved[f] for k, f in weight_map.items()}
        return SafetensorsSource(files, full_map, description=path, mmap=mmap, confinement=where)
    files = [where.resolve(os.path.basename(f), "checkpoint file")
             for f in sorted(glob.glob(os.path.join(glob.escape(path), "*.safetensors")))]
    if not files:
        pickles = sorted(f for f in os.listdir(path) if f.endswith(PICKLE_SUFFIXES))
        if pickles:
            _refuse_pickle(os.path.join(path, pickles[0]))
        raise CheckpointError(f"no .safetensors files in {path}")
    return SafetensorsSource(files, description=path, mmap=mmap, confinement=where)


def open_source(path_or_state_dict, mmap: bool = False) -> Source:
    """A Source for a directory (config.json / side configs / index / shards), a single .safetensors file, or a
    state dict (a mapping of names to tensors, used as it is). ``mmap``: keep file tensors memory-mapped instead
    of copying each one as it is read."""
    if isinstance(path_or_state_dict, Mapping):
        return StateDictSource(path_or_state_dict)
    path = os.fspath(path_or_state_dict)
    if os.path.isdir(path):
        return _directory_source(path, mmap)
    if path.endswith(PICKLE_SUFFIXES):
        _refuse_pickle(path)
    if not _regular_file(path, "checkpoint"):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    if os.path.basename(path) == INDEX_FILE:
        return _directory_source(os.path.dirname(path) or ".", mmap)
    if not path.endswith(".safetensors"):
        raise CheckpointError(f"{path!r} is not a .safetensors file or a checkpoint directory")
    return SafetensorsSource([path], description=path, mmap=mmap)
