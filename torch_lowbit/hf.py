"""Hugging Face models in one call: ``from_pretrained`` (a quantized checkpoint -> a transformers model that runs on
the best device) and ``save_quantized`` (a model after ``quantize_`` -> a compressed-tensors checkpoint).

transformers is optional: only these functions need it, and say so when it is missing.
"""
from __future__ import annotations

import contextlib
import json
import os
import warnings
import threading
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from .formats.load import LoadReport, load_quantized
from .formats.source import CheckpointError, _Confinement, _read_json, _regular_file

_INSTALL_HINT = "pip install 'torch_lowbit[hf]' (or: pip install transformers)"


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"torch_lowbit.from_pretrained / save_quantized need transformers: {_INSTALL_HINT}") from e
    return transformers


_meta_lock = threading.Lock()
_meta_users = 0  # threads inside parameters_on_meta(); the hook is installed while there is any
_meta_hook = None
_meta_here = threading.local()  # .depth: how many parameters_on_meta() this thread is inside


def _parameter_on_meta(module, name, param):
    """nn.Module's global parameter-registration hook: the parameter as a meta tensor, in the threads inside
    parameters_on_meta() only (None: registered as it is)."""
    if getattr(_meta_here, "depth", 0) and param is not None and not param.is_meta:
        return type(param)(param.to("meta"), requires_grad=param.requires_grad)
    return None


@contextlib.contextmanager
def parameters_on_meta():
    """Build modules with their parameters on the meta device and their buffers real.

    Parameters cost nothing until a checkpoint fills them, while buffers that no checkpoint holds (rotary
    ``inv_freq``, computed in ``__init__``) keep the values the module computed. Each parameter is created as the
    module creates it, then replaced by a meta tensor as it is registered, so at most one parameter is ever
    allocated (and ``torch.empty`` pages are not touched). Thread-safe: only modules built by the thread inside
    the ``with`` get meta parameters (torch's parameter-registration hook, installed while any thread is inside
    and removed by the last one out); nothing of nn.Module is patched.
    """
    global _meta_users, _meta_hook
    from torch.nn.modules.module import register_module_parameter_registration_hook

    with _meta_lock:
        if _meta_users == 0:
            _meta_hook = register_module_parameter_registration_hook(_parameter_on_meta)
        _meta_users += 1
    _meta_here.depth = getattr(_meta_here, "depth", 0) + 1
    try:
        yield
    finally:
        _meta_here.depth -= 1
        with _meta_lock:
            _meta_users -= 1
            if _meta_users == 0:
                _meta_hook.remove()
                _meta_hook = None


def best_device() -> torch.device:
    """mps where an Apple GPU is available, else the CPU."""
    return torch.device("mps" if torch.backends.mps.is_available() else "cpu")


# what the ops take: activations (and the high-precision weights beside them) in these dtypes, on these devices
_ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_OP_DEVICES = ("cpu", "mps")
_CONFIG_FILE = "config.json"
_GENERATION_CONFIG_FILE = "generation_config.json"


def _spelled_dtype(value):
    """The torch.dtype transformers' spelling of one names ("bfloat16", "torch.float16"); any other value as it is."""
    if isinstance(value, str):
        dtype = getattr(torch, value.removeprefix("torch."), None)
        return dtype if isinstance(dtype, torch.dtype) else value
    return value


def _dtype_arg(value, name: str) -> Optional[torch.dtype]:
    """from_pretrained's dtype argument as transformers spells it (a torch.dtype, "bfloat16", "torch.float16"); None
    for "auto"."""
    if value == "auto":
        return None
    dtype = _spelled_dtype(value)
    if not isinstance(dtype, torch.dtype) or dtype not in _ACTIVATION_DTYPES:
        raise ValueError(f"from_pretrained: {name}={value!r} is not supported: the model's activations and "
                         f"high-precision weights must be torch.bfloat16, torch.float16 or torch.float32 (what the "
                         f"low-bit ops take), or 'auto' for config.json's dtype")
    return dtype


def _device_arg(value, name: str) -> torch.device:
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"from_pretrained: {name}={value!r} is not a device (expected 'cpu', 'mps' or "
                         f"a torch.device)") from None
    if device.type not in _OP_DEVICES:
        raise ValueError(f"from_pretrained: {name}={value!r}: torch_lowbit's ops run on 'cpu' and 'mps' "
                         f"(Apple GPUs) only")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"from_pretrained: {name}={value!r}, but this machine has no mps device "
                         f"(torch.backends.mps.is_available() is False); pass 'cpu', or leave {name} out for the "
                         f"best device available")
    return device


def _target_device(device, device_map) -> torch.device:
    """One device from ``device`` and transformers' ``device_map`` ("auto", a device, or {"": device}: the whole
    model on one device; a map that splits the model is refused)."""
    if device_map is None:
        return best_device() if device is None else _device_arg(device, "device")
    if isinstance(device_map, dict):
        if set(device_map) != {""}:
            raise ValueError(f"from_pretrained: device_map={device_map!r} places modules on different devices, "
                             f"which torch_lowbit does not do: pass device_map='auto' (the best device) or one "
                             f"device ('cpu', 'mps', or {{'': device}})")
        device_map = device_map[""]
    mapped = best_device() if device_map == "auto" else _device_arg(device_map, "device_map")
    if device is not None and _device_arg(device, "device") != mapped:
        raise ValueError(f"from_pretrained: device={device!r} and device_map={device_map!r} disagree: pass one")
    return mapped


def _looks_like_path(path: str) -> bool:
    """A string meant as a local path rather than a Hub repo id ("org/name")."""
    if path.startswith((".", "~", os.sep)) or (os.altsep and path.startswith(os.altsep)):
        return True
    parts = path.replace(os.altsep or os.sep, os.sep).split(os.sep)
    if len(parts) > 2 or (len(parts) == 2 and os.path.exists(parts[0])):
        return True  # deeper than org/name, or its first part exists here
    try:
        from huggingface_hub.utils import validate_repo_id
        validate_repo_id(path)
    except ImportError:
        return True
    except ValueError:  # HFValidationError: not a repo id, so a mistyped path
        return True
    return False


def _missing_dir_error(path: str) -> FileNotFoundError:
    full = os.path.abspath(os.path.expanduser(path))
    parent = full
    while parent != os.path.dirname(parent) and not os.path.isdir(parent):
        parent = os.path.dirname(parent)
    return FileNotFoundError(f"from_pretrained: no such directory: {path!r} ({full}; the nearest existing "
                             f"directory is {parent})")


def _local_dir(path, revision: Optional[str] = None) -> str:
    """The checkpoint directory: `path` itself, or a Hub repo id fetched (the json and safetensors files only)."""
    if not isinstance(path, (str, os.PathLike)) or isinstance(os.fspath(path), bytes):
        raise TypeError(f"from_pretrained: path must be a directory or a Hub repo id (str or os.PathLike), got "
                        f"{type(path).__name__} {path!r}")
    if revision is not None and not isinstance(revision, str):
        raise TypeError(f"from_pretrained: revision must be a str (a branch, tag or commit), got "
                        f"{type(revision).__name__} {revision!r}")
    path = os.fspath(path)
    local = os.path.expanduser(path)
    if os.path.isdir(local):
        return local  # revision= names a Hub revision: a local directory is what it is (as in transformers)
    if os.path.exists(local):
        raise ValueError(f"from_pretrained: path {path!r} must be a checkpoint directory (config.json + safetensors)")
    if _looks_like_path(path):
        raise _missing_dir_error(path)
    try:  # a Hub repo id: fetch only what loading reads (never pickles)
        from huggingface_hub import snapshot_download
    except ImportError:
        raise _missing_dir_error(path) from None
    return snapshot_download(path, revision=revision, allow_patterns=["*.json", "*.safetensors"])


def _read_confined_json(where, name: str) -> Optional[dict]:
    """A JSON file of the checkpoint directory, read once here after the confinement check (None if absent):
    transformers' readers then get the dict, never the file."""
    return _read_json(where.resolve(name, "config file"), "config file")


def _transformers_config(tf, data: dict, config_file: str):
    """The transformers config object of a config.json dict (what AutoConfig.from_pretrained builds from it)."""
    model_type = data.get("model_type")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise CheckpointError(f"{config_file}: model_type {model_type!r} is not a model type transformers "
                              f"{tf.__version__} knows")
    with _transformers_refusal(config_file, f"a {model_type} config"):
        return CONFIG_MAPPING[model_type].from_dict(data)


@contextlib.contextmanager
def _transformers_refusal(config_file: str, what: str):
    """transformers' own error for a config.json value it cannot use (its validation raises many types, and a
    bad size can fail deep inside a module's __init__), as a CheckpointError naming the file."""
    try:
        yield
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(f"{config_file}: transformers cannot build {what} from it: "
                              f"{type(e).__name__}: {first[:300]}") from e


# the encoders diffusion pipelines hold beside their transformer (FLUX's, SD3's T5 and CLIP, Wan's UMT5): a
# pipeline saved with one low-bit comes back low-bit through from_pretrained of its subfolder
_TEXT_ENCODERS = ("EncoderModel", "TextModel", "TextModelWithProjection")


def _model_class(tf, config, config_file: str = _CONFIG_FILE):
    """The transformers class config.json names (the first of ``architectures`` transformers has): a
    text-generating model, or a text encoder of a diffusion pipeline (``T5EncoderModel``, ``CLIPTextModel``: no
    head, nothing generated; heads such as ``...ForSequenceClassification`` are refused), else the causal-LM auto
    class; an error naming the field otherwise."""
    archs = getattr(config, "architectures", None)
    if not archs:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            raise CheckpointError(f"{config_file} names no architectures and model_type {config.model_type!r} has "
                                  f"no causal-LM class in transformers: torch_lowbit.from_pretrained builds "
                                  f"text-generating models")
        return tf.AutoModelForCausalLM
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise CheckpointError(f"{config_file}: architectures must be a list of class names, got {archs!r}")
    classes = [c for c in (getattr(tf, a, None) if a.isidentifier() else None for a in archs)
               if isinstance(c, type) and issubclass(c, tf.PreTrainedModel)]
    if not classes:
        raise CheckpointError(f"{config_file}: architectures {archs} names no model class of transformers "
                              f"{tf.__version__} (a newer transformers, or a model with remote code, which "
                              f"torch_lowbit does not run)")
    if not (classes[0].can_generate() or classes[0].__name__.endswith(_TEXT_ENCODERS)):
        raise CheckpointError(f"{config_file}: architectures names {classes[0].__name__}, which is not a causal "
                              f"language model (it cannot generate) nor a text encoder ({', '.join(_TEXT_ENCODERS)}): "
                              f"torch_lowbit.from_pretrained builds ...ForCausalLM classes and those")
    return classes[0]


def _auto_dtype(config, local: str, config_file: str) -> torch.dtype:
    """dtype="auto", as transformers resolves it: config.json's dtype, else the checkpoint's first floating-point
    tensor that is not quantized, else float32."""
    dtype = getattr(config, "dtype", None)
    if dtype is not None:
        try:
            return _dtype_arg(dtype, "dtype")
        except ValueError:
            raise ValueError(f"from_pretrained: dtype='auto' takes {config_file}'s dtype, {dtype!r}, which is not "
                             f"one the low-bit ops take: pass dtype=torch.bfloat16, torch.float16 or "
                             f"torch.float32") from None
    from .formats.registry import QUANTIZED_DTYPES, UNSUPPORTED_WEIGHT_DTYPES
    from .formats.source import open_source
    src = open_source(local, mmap=True)
    try:
        for key in sorted(src.keys()):
            d = src.dtype(key)
            if d.is_floating_point and d not in QUANTIZED_DTYPES and d not in UNSUPPORTED_WEIGHT_DTYPES:
                return d if d in _ACTIVATION_DTYPES else torch.float32
    finally:
        src.close()
    return torch.float32


def from_pretrained(path, device=None, dtype=None, *, strict: bool = False, return_report: bool = False,
                    torch_dtype=None, device_map=None, revision: Optional[str] = None,
                    trust_remote_code: bool = False, activations: str = "weights-only", tp_plan=None):
    """A quantized Hugging Face checkpoint as a ready transformers model.

    Reads ``config.json``, builds the transformers class it names (a text-generating model, or a diffusion
    pipeline's text encoder such as ``T5EncoderModel``) with parameters on the meta device and buffers
    real (``parameters_on_meta``: no dense weight is ever allocated), loads the checkpoint with
    :func:`torch_lowbit.load_quantized` (transformers' own key renaming for the architecture; quantized layers
    become Fp8Linear / Int8Linear / W4Linear / Fp8Experts / W4Experts), and moves it to `device` (default: mps if
    available, else cpu).
    Returns the model in eval mode, on which ``model.generate(...)`` runs (a text-generating one); with
    ``return_report=True``, ``(model, LoadReport)``.

    path: a checkpoint directory, or a Hugging Face Hub repo id (only its .json and .safetensors files are
    fetched; ``revision`` picks a branch, tag or commit). A path that does not exist is a FileNotFoundError.
    No file outside the directory is read (config.json and generation_config.json included: they are checked,
    then read here, before transformers sees them; a Hub cache snapshot may link into its blobs).
    dtype (or transformers' older name ``torch_dtype``): of the high-precision weights (embeddings, norms,
    lm_head) and of the activations: torch.bfloat16 (default), torch.float16 or torch.float32, a string naming
    one, or ``"auto"`` (config.json's dtype, as in transformers); what the model keeps in float32 in such a load
    stays float32, as transformers loads it (DeepSeek-V3's router gate and score-correction bias, T5's ``wo`` in
    float16). device: "cpu" or "mps"; ``device_map`` as in
    transformers, for one device: "auto" (the best one), a device, or ``{"": device}``. trust_remote_code=True is
    refused: torch_lowbit builds transformers' own classes and runs no code from a checkpoint. Arguments are
    checked before anything is read; safe to call from several threads at once.
    activations: ``"weights-only"`` (W8A16, the default) or ``"checkpoint"`` (the checkpoint's FP8 activation
    quantization), as in :func:`torch_lowbit.load_quantized`.
    tp_plan: ``"auto"`` (the architecture's own tensor-parallel plan, transformers' ``base_model_tp_plan``) or a dict
    of module patterns to styles that updates it: tensor parallelism over the ranks of the torch.distributed process
    group (gloo; initialized from torchrun's environment if needed). Each rank reads and keeps only its shard of
    each low-bit layer (column-wise: output rows; row-wise: input columns; experts: the intermediate size) and
    ``generate`` gives the same tokens on every rank. Sizes that do not split evenly over the ranks (heads, or N / K
    not a multiple of world x block) are refused before anything runs, naming the layer and the sizes. See
    :mod:`torch_lowbit.distributed`.
    """
    if trust_remote_code:
        raise ValueError("from_pretrained: trust_remote_code=True is not supported: torch_lowbit builds the model "
                         "classes of transformers itself and runs no code from a checkpoint")
    if dtype is not None and torch_dtype is not None and dtype != torch_dtype:
        raise ValueError(f"from_pretrained: dtype={dtype!r} and torch_dtype={torch_dtype!r} disagree: pass dtype "
                         f"(torch_dtype is transformers' older name for it)")
    dtype_name, dtype = ("torch_dtype", torch_dtype) if dtype is None and torch_dtype is not None else ("dtype", dtype)
    dtype = torch.bfloat16 if dtype is None else _dtype_arg(dtype, dtype_name)  # None now: "auto"
    device = _target_device(device, device_map)
    if tp_plan is not None:
        from .distributed.parallel import check_tp_plan, device_mesh

        check_tp_plan(tp_plan)
        device_mesh()  # a process group (torchrun's), before anything is read
    tf = _transformers()
    local = _local_dir(path, revision)
    where = _Confinement(local)
    config_file = os.path.join(local, _CONFIG_FILE)
    data = _read_confined_json(where, _CONFIG_FILE)
    if data is None:
        raise FileNotFoundError(f"from_pretrained: {local} has no {_CONFIG_FILE}: it is not a Hugging Face "
                                f"checkpoint directory")
    generation = _read_confined_json(where, _GENERATION_CONFIG_FILE)
    # the checkpoint's quantization goes into torch_lowbit layers: transformers must not see a pending quantizer
    data = dict(data)
    quantized = data.pop("quantization_config", None) is not None or _regular_file(
        where.resolve("hf_quant_config.json", "config file"), "config file")
    if not quantized:
        raise ValueError(f"from_pretrained: {local} has no quantization_config in config.json: it is not a quantized "
                         f"checkpoint (load it with transformers, then torch_lowbit.quantize_)")
    config = _transformers_config(tf, data, config_file)
    cls = _model_class(tf, config, config_file)
    if dtype is None:
        dtype = _auto_dtype(config, local, config_file)
    # built in torch's default dtype (parameters on meta cost nothing): transformers' dtype= would set the
    # process-wide default dtype while building, which other threads would see; load_quantized gives the
    # parameters `dtype`
    config.dtype = None
    with parameters_on_meta(), _transformers_refusal(config_file, cls.__name__):
        model = cls.from_config(config) if cls.__name__.startswith("AutoModel") else cls._from_config(config)
    model.config.dtype = dtype
    if tp_plan is None:
        report = load_quantized(model, local, device=device, dtype=dtype, strict=strict, activations=activations)
        model.to(device)
    else:
        from .distributed import load_parallel

        report = load_parallel(model, local, tp_plan, device=device, dtype=dtype, strict=strict,
                               activations=activations)
    _load_generation_config(tf, model, generation)
    model.eval()
    enable_save_pretrained(model)
    return (model, report) if return_report else model


def _load_generation_config(tf, model, data: Optional[dict]):
    if data is not None and getattr(model, "can_generate", lambda: 0)():
        model.generation_config = tf.GenerationConfig.from_dict(data)


# ------------------------------------------------------------------------------------------------- saving
# Fp8Linear.activation_scheme -> compressed-tensors' input_activations (strategy, dynamic)
_CT_INPUT_ACTIVATIONS = {"dynamic": ("token", True), "static": ("tensor", False)}


def _scheme_fp8(gran: str, block, activations=None) -> dict:
    w = {"num_bits": 8, "type": "float", "strategy": gran, "symmetric": True, "dynamic": False,
         "group_size": None, "block_structure": list(block) if block is not None else None}
    if activations is None:
        # W8A16: activations stay in their dtype (compressed-tensors' format for a weight-only scheme)
        return {"weights": w, "input_activations": None, "output_activations": None, "format": "naive-quantized"}
    strategy, dynamic = _CT_INPUT_ACTIVATIONS[activations]
    a = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": dynamic,
         "group_size": None, "block_structure": None}
    return {"weights": w, "input_activations": a, "output_activations": None, "format": "float-quantized"}


def _scheme_int8() -> dict:
    w = {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True, "dynamic": False,
         "group_size": None, "block_structure": None}
    a = {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True, "dynamic": True, "group_size": None,
         "block_structure": None}
    return {"weights": w, "input_activations": a, "output_activations": None, "format": "int-quantized"}


def _ct_scale(scale: torch.Tensor, N: int, gran: str) -> torch.Tensor:
    """compressed-tensors' scale layouts: (1,) per tensor, (N, 1) per channel, (nb, kb) per block; fp32."""
    s = scale.detach().to(torch.float32).cpu()
    if gran == "tensor":
        return s.reshape(1)
    if gran == "channel":
        return s.reshape(N, 1)
    return s.contiguous()


def _linear_tensors(name, layer) -> Tuple[Dict[str, torch.Tensor], tuple]:
    from .nn import Fp8Linear
    from ._storage import as_fp8_dtype

    if isinstance(layer, Fp8Linear):
        gran, block = layer.granularity.kind, layer.block_size
        out = {f"{name}.weight": as_fp8_dtype(layer.weight).cpu(),
               f"{name}.weight_scale": _ct_scale(layer.weight_scale, layer.out_features, gran)}
        if layer.activation_scheme == "static":  # compressed-tensors' static per-tensor input scale: (1,) fp32
            out[f"{name}.input_scale"] = layer.input_scale.detach().to(torch.float32).reshape(1).cpu()
        key = ("fp8", gran, block, layer.activation_scheme)
    else:
        out = {f"{name}.weight": layer.weight.detach().cpu(),
               f"{name}.weight_scale": _ct_scale(layer.weight_scale.expand(layer.out_features), layer.out_features,
                                                 "channel")}
        key = ("int8", "channel", None, None)
    if layer.bias is not None:
        out[f"{name}.bias"] = layer.bias.detach().cpu()
    return out, key


def _expert_scale(scale: torch.Tensor, e: int, rows: slice, block) -> Tuple[torch.Tensor, str]:
    """Expert e's scale for weight rows `rows` of a stacked projection, in compressed-tensors' layout."""
    s = scale[e].detach().to(torch.float32).cpu()
    n = rows.stop - rows.start
    if s.dim() == 0:
        return s.reshape(1), "tensor"
    if s.dim() == 1:
        return s[rows].reshape(n, 1).contiguous(), "channel"
    bn = block[0]
    if rows.start % bn:
        raise ValueError(f"save_quantized: a block of {bn} rows straddles the gate/up boundary at row {rows.start}: "
                         f"these experts' block scales cannot be written as separate gate and up weights")
    return s[rows.start // bn: -(-rows.stop // bn)].contiguous(), "block"


def _experts_tensors(name, layer) -> Tuple[Dict[str, torch.Tensor], Dict[str, tuple]]:
    """One Linear per projection and expert (model names), as checkpoints store MoE experts: fp8 (Fp8Experts, the
    layer's granularity) or int8 per channel (Int8Experts, the W8A8 int-quantized scheme)."""
    from ._storage import as_fp8_dtype
    from .nn import Int8Experts

    E, H, I = layer.num_experts, layer.hidden_size, layer.intermediate_size
    if isinstance(layer, Int8Experts):
        gu, dn, block = layer.gate_up.cpu(), layer.down.cpu(), None
    else:
        gu, dn, block = as_fp8_dtype(layer.gate_up).cpu(), as_fp8_dtype(layer.down).cpu(), layer.block_size
    kind = "int8" if isinstance(layer, Int8Experts) else "fp8"
    scheme = getattr(layer, "activation_scheme", None)  # Fp8Experts keep the checkpoint's FP8 activation scheme
    tensors, schemes = {}, {}
    for e in range(E):
        for proj, w, scale, rows in (("gate_proj", gu, layer.gate_up_scale, slice(0, I)),
                                     ("up_proj", gu, layer.gate_up_scale, slice(I, 2 * I)),
                                     ("down_proj", dn, layer.down_scale, slice(0, H))):
            module = f"{name}.{e}.{proj}"
            s, gran = _expert_scale(scale, e, rows, block)
            tensors[f"{module}.weight"] = w[e, rows].contiguous()
            tensors[f"{module}.weight_scale"] = s
            if scheme == "static":  # compressed-tensors' static per-tensor input scale: (1,) fp32
                column = ("gate_proj", "up_proj", "down_proj").index(proj)
                tensors[f"{module}.input_scale"] = layer.input_scale[e, column].detach().reshape(1).cpu().clone()
            schemes[module] = (kind, gran, block if gran == "block" else None, scheme)
    return tensors, schemes


def _dense_state_dict(model, skip) -> Dict[str, torch.Tensor]:
    """The model's other tensors, each storage once (tied weights: the first name, as transformers saves them)."""
    out, seen = {}, set()
    for key, t in model.state_dict().items():
        if t is None or any(key.startswith(p + ".") for p in skip):
            continue
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)) if not t.is_meta else None
        if ident is not None and ident in seen:
            continue
        seen.add(ident)
        out[key] = t.detach() if t.is_meta else t.detach().cpu()
    return out


_SIZE_UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
               "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def parse_size(value, what: str = "max_shard_size") -> int:
    """A size in bytes from an int or transformers' spellings: ``"2GB"`` (10^9), ``"500MiB"`` (2^20),
    ``"5Gb"`` (gigabits, as transformers reads a lower-case b), ``"1000"``."""
    import re

    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]*)\s*", value)
        unit = m.group(2) if m else ""
        factor = _SIZE_UNITS.get(unit.lower()) if m else None
        if factor is None:
            raise ValueError(f"{what}={value!r}: expected bytes as an int or a string like '2GB', '500MB', '4GiB'")
        bits = len(unit) >= 2 and unit.endswith("b") and not unit.lower().endswith("ib")
        size = int(float(m.group(1)) * factor / (8 if bits else 1))
    else:
        raise TypeError(f"{what} must be an int (bytes) or a string like '2GB', got {type(value).__name__} {value!r}")
    if size <= 0:
        raise ValueError(f"{what}={value!r}: must be a positive number of bytes")
    return size


def _checkpoint(model: nn.Module, caller: str):
    """What a save writes: (tensors under checkpoint names, config.json's quantization_config)."""
    from .formats import gpt_oss
    from .formats.hf_names import checkpoint_key_renaming
    from .formats.moe import is_experts_module
    from .nn import Fp8Experts, Fp8Linear, Int8Experts, Int8Linear
    from .nn.gptoss_experts import GptOssW4Experts
    from .nn.w4_experts import W4Experts
    from .nn.w4_linear import W4Linear

    split = next((n for n, m in model.named_modules() if (getattr(m, "_lowbit_tp", None) or (None, 0, 1))[2] > 1),
                 None)
    if split is not None:  # each rank holds a slice: its save would be a checkpoint that loads wrong
        raise ValueError(f"{caller}: this model is split over ranks by tensor parallelism ({split} holds one rank's "
                         f"slice): save the checkpoint from a model loaded without tp_plan")
    quantized: Dict[str, torch.Tensor] = {}
    schemes: Dict[str, tuple] = {}  # module (model names) -> (kind, granularity, block)
    w4_layers: Dict[str, nn.Module] = {}
    gptoss: Dict[str, nn.Module] = {}  # written in gpt-oss's own MXFP4 layout (formats/gpt_oss.py)
    dense_linears: List[str] = []
    dense_experts: List[str] = []
    experts: List[nn.Module] = []  # Fp8Experts / Int8Experts, in compressed-tensors' per-expert layout
    done: List[str] = []
    on_meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if on_meta:
        more = f" and {len(on_meta) - 8} more" if len(on_meta) > 8 else ""
        raise ValueError(f"{caller}: tensors still on the meta device (never loaded), nothing to write for "
                         f"them: {', '.join(on_meta[:8])}{more}; load or materialize them before saving")
    for name, mod in model.named_modules():
        if any(name.startswith(p + ".") for p in done):
            continue
        if isinstance(mod, GptOssW4Experts):  # its arithmetic (interleaved rows, biases, clamp) is gpt-oss's own
            gptoss[name] = mod
            done.append(name)
        elif isinstance(mod, W4Linear):  # written together: formats/ct_w4.py picks the config groups for all of them
            w4_layers[name] = mod
            done.append(name)
        elif isinstance(mod, (Fp8Linear, Int8Linear)):
            t, key = _linear_tensors(name, mod)
            quantized.update(t)
            schemes[name] = key
            done.append(name)
        elif isinstance(mod, W4Experts):  # one 4-bit Linear per expert and projection, with the W4Linear layers
            from .formats import ct_w4
            w4_layers.update(ct_w4.expert_weights(name, mod))
            done.append(name)
        elif isinstance(mod, (Fp8Experts, Int8Experts)):
            t, s = _experts_tensors(name, mod)
            quantized.update(t)
            schemes.update(s)
            experts.append(mod)
            done.append(name)
        elif type(mod) is nn.Linear:
            dense_linears.append(name)
        elif name and is_experts_module(mod):
            dense_experts.append(name)
    if w4_layers:
        from .formats import ct_w4
        t, s = ct_w4.model_tensors(w4_layers)
        quantized.update(t)
        schemes.update({name: ("w4",) + key for name, key in s.items()})
    if any(isinstance(m, Int8Experts) for m in experts):
        # compressed-tensors' own layout for INT8 experts (what llmcompressor writes): transformers 5.17 - 5.24
        # refuse it on load ("Concatenate ... Ckpt contains: 0"), loudly; torch_lowbit and vLLM read it
        warnings.warn(f"{caller}: INT8 MoE experts are written in compressed-tensors' int-quantized layout, which "
                      f"torch_lowbit.from_pretrained reads but transformers (5.17 to 5.24 at least) refuses to load; "
                      f"quantize the experts to FP8 (Fp8WeightOnly) for a checkpoint transformers loads too",
                      stacklevel=3)
    if any(isinstance(m, Fp8Experts) and m.block_size is not None for m in experts):
        # the layout llmcompressor writes too: transformers 5.24 - 5.25 fail on load (their dequantize multiplies
        # the stacked experts by block scales it does not expand), loudly
        warnings.warn(f"{caller}: FP8 MoE experts with scales per block are written in compressed-tensors' layout, "
                      f"which torch_lowbit.from_pretrained reads but transformers (5.24 and 5.25 at least) fails to "
                      f"load (\"We encountered some issues during automatic conversion of the weights\"); experts "
                      f"quantized from dense with scales per channel (Fp8WeightOnly('channel')) load in both",
                      stacklevel=3)
    if gptoss and schemes:  # config.json holds one quantization method
        other = sorted(schemes)[0]
        raise ValueError(f"{caller}: {sorted(gptoss)[0]} holds gpt-oss's MXFP4 experts, written in gpt-oss's own "
                         f"checkpoint layout (quant_method 'mxfp4'), and {other} is a torch_lowbit layer written as "
                         f"compressed-tensors; one checkpoint holds one quantization method: quantize only the "
                         f"experts (as gpt-oss ships them), or save torch_lowbit.dequantize_model(model, "
                         f"experts='keep')")
    if gptoss:
        quantized.update(gpt_oss.checkpoint_tensors(gptoss, caller))
    elif not schemes:
        raise ValueError(f"{caller}: the model holds no torch_lowbit layer (Fp8Linear, Int8Linear, W4Linear, "
                         f"Fp8Experts, Int8Experts, W4Experts); quantize it first with "
                         f"torch_lowbit.quantize_(model, ...)")
    dense = _dense_state_dict(model, done)
    rename = checkpoint_key_renaming(model)
    if rename is not None:
        from transformers.core_model_loading import revert_weight_conversion
        # Dense fused experts stay fused (renamed only): split into per-expert weights, transformers' loader would
        # run the compressed-tensors scheme's dequantize step on them (5.24: "Concatenate ... Ckpt contains: 0")
        # or not match them at all (5.17: experts left random). The fused layout loads as is in both.
        fused = {k: v for k, v in dense.items() if any(k.startswith(p + ".") for p in dense_experts)}
        rest = revert_weight_conversion(model, {k: v for k, v in dense.items() if k not in fused})
        dense = {**rest, **{rename(k): v for k, v in fused.items()}}
        quantized = {rename(k): v for k, v in quantized.items()}
    qconfig = (gpt_oss.quantization_config(dense_experts) if gptoss
               else _quantization_config(schemes, dense_linears))
    return {**dense, **quantized}, qconfig


def save_quantized(model: nn.Module, path, *, max_shard_size=4 * 2 ** 30) -> List[str]:
    """Write a model holding torch_lowbit layers (after ``quantize_`` or ``load_quantized``) as a compressed-tensors
    checkpoint: config.json with ``quantization_config`` (one config group per scheme: FP8 per tensor / channel /
    block weights with the activation scheme each Fp8Linear records -- W8A16, FP8 dynamic per-token, or FP8 static
    per-tensor with its ``input_scale`` -- INT8 W8A8 with dynamic per-token activations, and W4Linear's 4-bit weights:
int4 as ``pack-quantized`` (symmetric, or with zero points), nvfp4 as ``nvfp4-pack-quantized``, mxfp4 as
``mxfp4-pack-quantized``; MLX's uint4 with float biases has no compressed-tensors form and is refused), safetensors
shards of
    at most `max_shard_size` (bytes, or a string like ``"2GB"``), and ``model.safetensors.index.json`` when there
    are several. MoE experts (Fp8Experts, Int8Experts, W4Experts) are written one Linear per projection and expert;
    dense fused experts in the model's fused layout. A transformers model's tensors get the names its architecture's
    checkpoints use (transformers' conversion mapping, inverted, as ``save_pretrained`` does). compressed-tensors,
    transformers and :func:`torch_lowbit.load_quantized` read it back.

    The save is atomic per directory (``torch_lowbit._atomic_dir``): everything is written beside `path`, then
    swapped in, so `path` holds exactly the old or the new checkpoint, never a mix; files of the old directory that
    are not checkpoint files (tokenizer, README.md, ...) are kept; links are replaced, never written through.
    Returns the files written (under `path`)."""
    return _save(model, path, max_shard_size, "save_quantized")


def _save(model, path, max_shard_size, caller, config_updates=None) -> List[str]:
    from ._atomic_dir import atomic_directory

    max_shard_size = parse_size(max_shard_size)
    path = os.fspath(path)
    tensors, qconfig = _checkpoint(model, caller)
    with atomic_directory(path) as tmp:
        names = _write_shards(tensors, tmp, max_shard_size, caller)
        _write_config(model, tmp, qconfig, path, config_updates)
    return [os.path.join(path, n) for n in names]


def _owned(t: torch.Tensor, seen: set) -> torch.Tensor:
    """`t` as a tensor owning all of its storage: safetensors refuses tensors sharing memory (views of one
    tensor, e.g. per-expert scales sliced from a stacked one)."""
    t = t.contiguous()
    ptr = t.untyped_storage().data_ptr()
    if ptr in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
        ptr = t.untyped_storage().data_ptr()
    seen.add(ptr)
    return t


def _write_shards(tensors, path, max_shard_size, caller) -> List[str]:
    """Shards of at most `max_shard_size` bytes (a tensor larger than that gets its own), in name order; returns
    the file names written."""
    from safetensors.torch import save_file

    from ._progress import Progress

    shards: List[List[str]] = [[]]
    size = 0
    for k in sorted(tensors):
        n = tensors[k].numel() * tensors[k].element_size()
        if shards[-1] and size + n > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += n
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    meta = {"format": "pt"}
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    with Progress(caller, total=total, unit="bytes written") as progress:
        for fname, keys in zip(names, shards):
            seen: set = set()
            shard = {k: _owned(tensors[k], seen) for k in keys}
            save_file(shard, os.path.join(path, fname), metadata=meta)
            progress.update(sum(t.numel() * t.element_size() for t in shard.values()))
    if len(shards) == 1:
        return names
    weight_map = {k: fname for fname, keys in zip(names, shards) for k in keys}
    index = "model.safetensors.index.json"
    with open(os.path.join(path, index), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
    return names + [index]


def _config_entries(among):
    """``entries(names)``: module names as a checkpoint config names them (ignore lists, config groups' targets):
    plain where that names one module of `among` under the loaders' rule (a dotted run of a name's components,
    formats.registry.matches), else anchored regexes (compressed-tensors' ``re:`` form): a diffusion model's
    top-level ``proj_out``, left dense, must not also name every block's quantized ``proj_out``."""
    import re
    from collections import Counter

    def runs(name):
        parts = name.split(".")
        return {".".join(parts[i:j]) for i in range(len(parts)) for j in range(i + 1, len(parts) + 1)}

    named = Counter(run for n in among for run in runs(n))  # once: every config group's targets read it
    return lambda names: sorted(n if named[n] <= 1 else f"re:{re.escape(n)}$" for n in names)


def _quantization_config(schemes: Dict[str, tuple], dense_linears: List[str]) -> dict:
    entries = _config_entries(list(schemes) + list(dense_linears))
    by_scheme: Dict[tuple, List[str]] = {}
    for module, key in schemes.items():
        by_scheme.setdefault(key, []).append(module)
    groups = {}
    for i, (key, modules) in enumerate(sorted(by_scheme.items(), key=lambda kv: str(kv[0]))):
        if key[0] == "w4":
            from .formats import ct_w4
            g = ct_w4.scheme_config(key[1:])
        else:
            g = _scheme_int8() if key[0] == "int8" else _scheme_fp8(*key[1:])
        # one scheme: every Linear but the ignored ones, as compressed-tensors writes it; several: by name
        g["targets"] = ["Linear"] if len(by_scheme) == 1 else entries(modules)
        groups[f"group_{i}"] = g
    formats = {g["format"] for g in groups.values()}
    return {"quant_method": "compressed-tensors", "format": formats.pop() if len(formats) == 1 else "mixed-precision",
            "config_groups": groups, "ignore": entries(dense_linears), "quantization_status": "compressed",
            "kv_cache_scheme": None, "global_compression_ratio": None, "sparsity_config": {},
            "transform_config": {}, "producer": "torch_lowbit"}


def _write_config(model, path, qconfig, target, updates=None):
    """config.json (the model's config with the checkpoint's ``quantization_config``) and generation_config.json,
    written fresh into `path` (a new directory: nothing there to write through). A model without a transformers
    config keeps the fields of the config.json already at `target`, if that is a regular file (never a link)."""
    cfg = getattr(model, "config", None)
    previous = os.path.join(target, "config.json")
    if cfg is not None and hasattr(cfg, "to_dict"):
        data = cfg.to_dict()
        data.pop("_pre_quantization_dtype", None)  # transformers' own record of a load-time quantization
        if not data.get("architectures"):  # what from_pretrained builds (save_pretrained records it the same way)
            data["architectures"] = [type(model).__name__]
    elif os.path.isfile(previous) and not os.path.islink(previous):
        with open(previous) as f:
            data = json.load(f)
    else:
        data = {}
    data.update(updates or {})
    data["quantization_config"] = qconfig
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(data, f, indent=2, sort_keys=True, default=str)
    gen = getattr(model, "generation_config", None)
    if gen is not None and hasattr(gen, "save_pretrained"):
        gen.save_pretrained(path)


# ------------------------------------------------------------------------------------ save_pretrained on the model
_PUSH_ARGS = ("commit_message", "commit_description", "private", "revision", "create_pr", "tags")


def enable_save_pretrained(model):
    """Make ``model.save_pretrained(d)`` -- and ``model.push_to_hub(repo)``, whose save step calls it -- write what
    :func:`save_quantized` writes (a compressed-tensors checkpoint, atomic per directory) for a transformers model
    holding torch_lowbit layers. Per model: it sets the model's own ``save_pretrained`` (an instance attribute;
    nothing global is patched, other models are untouched). Arguments transformers' ``save_pretrained`` takes are
    honoured (``max_shard_size`` in its spellings, ``is_main_process``, ``push_to_hub`` and its keywords, ``token``)
    or refused by name (``variant``, ``distributed_checkpoint``, ``save_original_format=False``, a ``state_dict``
    that is not the model's own) with an error naming ``torch_lowbit.save_quantized``. With PEFT adapters loaded
    into the model, transformers' own save (adapters only) runs.
    It also sets the model's ``dequantize(dtype=None)``, transformers' way back to a dense model (without it:
    "You need to first quantize your model", or NotImplementedError): :func:`torch_lowbit.dequantize_` in place,
    then the model is a plain transformers model again (no quantization config in ``config.json``, transformers'
    own ``save_pretrained``), and its ``num_parameters()`` (:func:`attach_parameter_count`). Returns the model."""
    tf = _transformers()
    if not isinstance(model, tf.PreTrainedModel):
        raise TypeError(f"enable_save_pretrained: expected a transformers PreTrainedModel, got "
                        f"{type(model).__name__}; save other models with torch_lowbit.save_quantized(model, path)")
    import types

    model.save_pretrained = types.MethodType(_save_pretrained, model)
    model.dequantize = types.MethodType(_dequantize, model)
    return attach_parameter_count(model)


def attach_parameter_count(model):
    """Make a transformers or diffusers model's ``num_parameters()`` count the weights its torch_lowbit layers hold
    as low-bit buffers (``parameters()`` lists none of them: a quantized model counted only what stayed float), one
    per weight, as both libraries count a bitsandbytes 4-bit weight; frozen, so never under ``only_trainable``.
    Per model, as :func:`enable_save_pretrained`. Returns the model."""
    import types

    if callable(getattr(type(model), "num_parameters", None)):
        model.num_parameters = types.MethodType(_num_parameters, model)
    return model


def _num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
    from .nn import low_bit_parameter_count

    n = type(self).num_parameters(self, only_trainable=only_trainable, exclude_embeddings=exclude_embeddings)
    return n if only_trainable else n + low_bit_parameter_count(self)


def _dequantize(self, dtype=None):
    """transformers' ``PreTrainedModel.dequantize`` for a model holding torch_lowbit layers (see
    :func:`enable_save_pretrained`)."""
    from .dequantize import dequantize_

    dequantize_(self, dtype=_spelled_dtype(dtype))
    detach_model_methods(self)
    quantizer = getattr(self, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(self)
    else:
        if hasattr(self.config, "quantization_config"):
            del self.config.quantization_config
        self.is_quantized = False
    return self


def detach_model_methods(model) -> None:
    """The class's own ``save_pretrained``, ``dequantize`` and ``num_parameters`` again, once `model` holds no
    torch_lowbit layer (after dequantizing it)."""
    for method in ("save_pretrained", "dequantize", "num_parameters"):
        model.__dict__.pop(method, None)


def attach_save_pretrained(model) -> None:
    """:func:`enable_save_pretrained` for a transformers model holding torch_lowbit layers
    (``_diffusers_model.attach_diffusers_methods`` for a diffusers one), nothing for any other module: what
    ``quantize_``, ``load_quantized`` and ``from_pretrained`` call, so that a transformers user's ``save_pretrained``
    after them writes a checkpoint that loads right."""
    from .diffusion import is_diffusers_model
    from .formats.hf_names import _transformers_model

    if _transformers_model(model) is not None:
        enable_save_pretrained(model)
    elif is_diffusers_model(model):
        from ._diffusers_model import attach_diffusers_methods
        attach_diffusers_methods(model)


def _refuse(what: str):
    raise ValueError(f"save_pretrained on a torch_lowbit model: {what} is not supported; it writes the "
                     f"compressed-tensors checkpoint of torch_lowbit.save_quantized(model, path)")


def _is_own_state_dict(model, state_dict) -> bool:
    """Is `state_dict` the model's own tensors (what Trainer passes), not other values to write?"""
    own = model.state_dict()
    if set(state_dict) != set(own):
        return False
    return all(isinstance(t, torch.Tensor) and t.data_ptr() == own[k].data_ptr() and t.shape == own[k].shape
               for k, t in state_dict.items())


def _save_pretrained(self, save_directory, is_main_process: bool = True, state_dict=None, push_to_hub: bool = False,
                     max_shard_size="50GB", variant=None, token=None, save_peft_format: bool = True,
                     save_original_format: bool = True, distributed_checkpoint: bool = False, **kwargs):
    """transformers' ``save_pretrained``, writing the model's torch_lowbit layers as compressed-tensors (see
    :func:`torch_lowbit.enable_save_pretrained`)."""
    if getattr(self, "_hf_peft_config_loaded", False):  # adapter weights only: nothing quantized is written
        return type(self).save_pretrained(self, save_directory, is_main_process=is_main_process,
                                          state_dict=state_dict, push_to_hub=push_to_hub,
                                          max_shard_size=max_shard_size, variant=variant, token=token,
                                          save_peft_format=save_peft_format,
                                          save_original_format=save_original_format,
                                          distributed_checkpoint=distributed_checkpoint, **kwargs)
    if variant is not None:
        _refuse(f"variant={variant!r}")
    if distributed_checkpoint:
        _refuse("distributed_checkpoint=True")
    if not save_original_format:
        _refuse("save_original_format=False (the checkpoint always uses the architecture's original names)")
    if state_dict is not None and not _is_own_state_dict(self, state_dict):
        _refuse("a state_dict other than the model's own tensors")
    push = {k: kwargs.pop(k) for k in _PUSH_ARGS if k in kwargs}
    repo_id = kwargs.pop("repo_id", None)
    if kwargs:
        raise TypeError(f"save_pretrained: unexpected keyword arguments {sorted(kwargs)}")
    if not push_to_hub and (push or repo_id is not None):
        raise TypeError(f"save_pretrained: {sorted(push) + (['repo_id'] if repo_id else [])} only apply with "
                        f"push_to_hub=True")
    if not is_main_process:
        return None
    dtype = str(self.dtype).split(".")[1]
    _save(self, save_directory, max_shard_size, "save_pretrained",
          {"dtype": dtype, "architectures": [type(self).__name__]})
    if push_to_hub:
        # push_to_hub saves into its own temporary directory through this same method, then uploads that
        repo_id = repo_id or os.path.basename(os.path.normpath(os.fspath(save_directory)))
        return self.push_to_hub(repo_id, token=token, max_shard_size=max_shard_size, **push)
    return None
