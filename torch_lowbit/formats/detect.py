"""Which quantized-checkpoint format a checkpoint is, from its config (config.json ``quantization_config``,
hf_quant_config.json) or, without a config, from its tensor names and dtypes.

Rules, first match wins:
1. ``quantization_config.quant_method`` (from the ``config`` argument, else the directory's config.json):
   ``modelopt`` -> ModelOpt; ``compressed-tensors`` -> compressed-tensors; ``fp8`` -> Hugging Face fine-grained FP8;
   ``fbgemm_fp8`` -> fbgemm; anything else -> an error naming the quant_method.
2. An ``hf_quant_config.json`` (or a config dict with a ``quantization`` section) -> ModelOpt.
3. No config: a ``*.weight_scale_inv`` tensor -> Hugging Face fine-grained FP8 (blocks of 128 x 128, as
   transformers assumes); any float8_e4m3fn tensor -> diffusion FP8 (scale from ``*.scale_weight`` (ComfyUI) or
   ``*.weight_scale`` when present, else 1); otherwise an error (nothing quantized to load).
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from .source import CheckpointError, Source

FORMATS = ("modelopt", "compressed-tensors", "fp8", "fbgemm_fp8", "diffusion-fp8")
_QUANT_METHODS = {"modelopt": "modelopt", "compressed-tensors": "compressed-tensors",
                  "compressed_tensors": "compressed-tensors", "fp8": "fp8", "fbgemm_fp8": "fbgemm_fp8"}
# transformers' FineGrainedFP8Config default when weight_block_size is not given
HF_FP8_DEFAULT_BLOCK = (128, 128)
QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.int8)
_UNSUPPORTED_WEIGHT_DTYPES = (torch.float8_e5m2, getattr(torch, "float8_e4m3fnuz", None),
                              getattr(torch, "float8_e5m2fnuz", None))


@dataclass
class QuantFormat:
    """How to read one checkpoint's quantized linear layers.

    name: one of FORMATS. scale_key: suffix of a weight's scale tensor (``{module}.{scale_key}``).
    block_size: (bn, bk) for block scales, or None. ignore: module-name patterns kept in high precision.
    scale_required: False only for diffusion files (a raw fp8 weight means scale 1).
    extra_keys: per-module suffixes that belong to a quantized layer besides weight / scale / bias (static input
    scales, zero points, ...): consumed, not reported as unused. details: what the config said, for the report.
    """
    name: str
    scale_key: str = "weight_scale"
    block_size: Optional[Tuple[int, int]] = None
    ignore: List[str] = field(default_factory=list)
    scale_required: bool = True
    extra_keys: Tuple[str, ...] = ()
    details: Dict[str, Any] = field(default_factory=dict)

    def __str__(self):
        return self.name

    def is_ignored(self, module_name: str) -> bool:
        return any(matches(module_name, p) for p in self.ignore)


def matches(name: str, pattern: str) -> bool:
    """Does an ignore-list entry name this module?

    ``re:REGEX``: ``re.match`` (compressed-tensors); an entry with ``*?[``: fnmatch on the full name (ModelOpt);
    a plain entry: the name itself, or any dotted run of its components -- ``lm_head``, ``mlp.gate`` and
    ``model.layers.0`` match ``model.layers.0.mlp.gate`` and what lies under ``model.layers.0``, while ``gate``
    does not match ``gate_proj`` and ``layers.1`` does not match ``layers.10``.
    """
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    p = pattern.strip(".")
    return p != "" and f".{p}." in f".{name}."


def _as_list(v) -> List[str]:
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    return [str(x) for x in v]


def _block(v, where: str) -> Optional[Tuple[int, int]]:
    if v is None:
        return None
    if not (isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(b, int) and b > 0 for b in v)):
        raise CheckpointError(f"{where} must be two positive integers [bn, bk], got {v!r}")
    return (int(v[0]), int(v[1]))


def split_config(config: Optional[dict]) -> Tuple[Optional[dict], Optional[dict]]:
    """(quantization_config, modelopt quantization section) out of whatever dict the user passed: a full
    config.json, its quantization_config alone, or an hf_quant_config.json."""
    if config is None:
        return None, None
    if not isinstance(config, dict):
        raise CheckpointError(f"config must be a dict, got {type(config).__name__}")
    if "quantization_config" in config:
        return config["quantization_config"], None
    if "quantization" in config and isinstance(config["quantization"], dict):
        return None, config["quantization"]
    if "quant_method" in config:
        return config, None
    return None, None


# ------------------------------------------------------------------------------------------ per format
def _modelopt(qc: Optional[dict], mo: Optional[dict]) -> QuantFormat:
    merged = dict(mo or {})
    merged.update({k: v for k, v in (qc or {}).items() if k != "quantization"})
    if isinstance((qc or {}).get("quantization"), dict):
        merged.update(qc["quantization"])
    algo = str(merged.get("quant_algo") or "FP8")
    if not algo.upper().startswith("FP8"):
        raise CheckpointError(f"ModelOpt quant_algo {algo!r} is not supported: torch_lowbit loads FP8 "
                              f"(per tensor 'FP8', per channel 'FP8_PER_CHANNEL_PER_TOKEN')")
    return QuantFormat("modelopt", "weight_scale", None, _as_list(merged.get("exclude_modules")),
                       extra_keys=("input_scale",),
                       details={"quant_algo": algo, "kv_cache_quant_algo": merged.get("kv_cache_quant_algo")})


def _compressed_tensors(qc: dict) -> QuantFormat:
    fmt = qc.get("format", "dense")
    groups = qc.get("config_groups") or {}
    formats = {fmt} | {g.get("format") for g in groups.values() if isinstance(g, dict) and g.get("format")}
    bad = formats - {"float-quantized", "int-quantized", "naive-quantized", "dense"}
    if bad:
        raise CheckpointError(f"compressed-tensors format {sorted(bad)[0]!r} is not supported: torch_lowbit loads "
                              f"'float-quantized' (FP8), 'int-quantized' (INT8) and 'naive-quantized'")
    block = None
    kinds = []
    for gname, g in groups.items():
        w = (g or {}).get("weights") or {}
        if not w:
            continue
        where = f"compressed-tensors config_groups.{gname}.weights"
        if w.get("num_bits", 8) != 8 or w.get("type", "float") not in ("float", "int"):
            raise CheckpointError(f"{where}: {w.get('num_bits')}-bit {w.get('type')} weights are not supported "
                                  f"(8-bit float or int only)")
        strategy = w.get("strategy", "tensor")
        if strategy not in ("tensor", "channel", "block"):
            raise CheckpointError(f"{where}.strategy {strategy!r} is not supported (tensor, channel, block)")
        if w.get("symmetric", True) is False:
            raise CheckpointError(f"{where}: asymmetric weights (zero points) are not supported")
        if strategy == "block":
            b = _block(w.get("block_structure"), f"{where}.block_structure")
            if block is not None and b != block:
                raise CheckpointError(f"{where}.block_structure {list(b)} differs from another group's {list(block)}")
            block = b
        kinds.append({"group": gname, "type": w.get("type"), "strategy": strategy,
                      "activations": ((g or {}).get("input_activations") or {}).get("strategy")})
    return QuantFormat("compressed-tensors", "weight_scale", block, _as_list(qc.get("ignore")),
                       extra_keys=("input_scale", "input_zero_point", "weight_zero_point", "weight_shape_original",
                                   "weight_g_idx"),
                       details={"format": fmt, "groups": kinds})


def _hf_fp8(qc: dict) -> QuantFormat:
    if "weight_block_size" in qc:
        block = _block(qc["weight_block_size"], "quantization_config.weight_block_size")
    else:
        block = HF_FP8_DEFAULT_BLOCK
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise CheckpointError(f"quantization_config.fmt {fmt!r} is not supported (e4m3 only)")
    return QuantFormat("fp8", "weight_scale_inv", block, _as_list(qc.get("modules_to_not_convert")),
                       extra_keys=("input_scale",),
                       details={"weight_block_size": block, "activation_scheme": qc.get("activation_scheme")})


def _fbgemm(qc: dict) -> QuantFormat:
    return QuantFormat("fbgemm_fp8", "weight_scale", None, _as_list(qc.get("modules_to_not_convert")),
                       extra_keys=("input_scale_ub",),
                       details={"activation_scale_ub": qc.get("activation_scale_ub")})


def _from_tensors(src: Source) -> QuantFormat:
    keys = src.keys()
    if any(k.endswith(".weight_scale_inv") for k in keys):
        return QuantFormat("fp8", "weight_scale_inv", HF_FP8_DEFAULT_BLOCK,
                           details={"weight_block_size": HF_FP8_DEFAULT_BLOCK, "config": "none (inferred)"})
    if any(src.dtype(k) == torch.float8_e4m3fn for k in keys):
        if any(k.endswith(".scale_weight") for k in keys):
            scale_key, kind = "scale_weight", "ComfyUI scaled fp8"
        elif any(k.endswith(".weight_scale") for k in keys):
            scale_key, kind = "weight_scale", "fp8 with weight_scale"
        else:
            scale_key, kind = "scale_weight", "raw e4m3 (scale 1)"
        return QuantFormat("diffusion-fp8", scale_key, None, scale_required=False,
                           extra_keys=("scale_input", "input_scale"), details={"kind": kind})
    if any(src.dtype(k) in _UNSUPPORTED_WEIGHT_DTYPES for k in keys):
        raise CheckpointError("the checkpoint holds float8_e5m2 / fnuz tensors: torch_lowbit reads e4m3fn only")
    raise CheckpointError(f"{src.description}: no quantization config and no float8_e4m3fn tensors: this is not a "
                          f"quantized checkpoint torch_lowbit can recognize (load it with model.load_state_dict, "
                          f"or pass config= with a quantization_config)")


def detect(src: Source, config: Optional[dict] = None) -> QuantFormat:
    if config is not None:
        qc, mo = split_config(config)
        if qc is None and mo is None:
            raise CheckpointError("config has no 'quantization_config', 'quant_method' or ModelOpt 'quantization' "
                                  "section")
    else:
        qc, _ = split_config(src.config) if src.config else (None, None)
        _, mo = split_config(src.modelopt_config) if src.modelopt_config else (None, None)
    if qc is not None:
        method = qc.get("quant_method")
        if method is None:
            raise CheckpointError("quantization_config has no 'quant_method'")
        kind = _QUANT_METHODS.get(str(method).lower())
        if kind is None:
            raise CheckpointError(f"unknown quant_method {method!r}: torch_lowbit loads "
                                  f"{sorted(set(_QUANT_METHODS) - {'compressed_tensors'})}")
        if kind == "modelopt":
            return _modelopt(qc, mo)
        if kind == "compressed-tensors":
            return _compressed_tensors(qc)
        if kind == "fp8":
            return _hf_fp8(qc)
        return _fbgemm(qc)
    if mo is not None:
        return _modelopt(None, mo)
    return _from_tensors(src)


def detect_format(path_or_state_dict, *, config: Optional[dict] = None) -> QuantFormat:
    """The :class:`QuantFormat` of a checkpoint directory, .safetensors file or state dict (``str()`` of it is the
    format's name: modelopt, compressed-tensors, fp8, fbgemm_fp8 or diffusion-fp8). See the module docstring for
    the rules. ``config``: a config.json dict, its quantization_config, or an hf_quant_config.json dict."""
    from .source import open_source

    src = open_source(path_or_state_dict)
    try:
        return detect(src, config)
    finally:
        src.close()
