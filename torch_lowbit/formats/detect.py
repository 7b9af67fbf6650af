"""Which quantized-checkpoint format a checkpoint is, asking the registered formats (``formats/registry.py``).

Rules, first match wins:
1. ``quantization_config.quant_method`` (from the ``config`` argument, else the directory's config.json): the
   registered format that claims it (modelopt, compressed-tensors, fp8, fbgemm_fp8); an unknown one is an error.
   A quantization_config without one (or config.json's ``quantization``) that a format recognizes: MLX's.
2. A format's side config (ModelOpt's ``hf_quant_config.json``, or a ``config`` dict shaped like it).
3. No config: each format's tensor rule, in registration order: a ``*.weight_scale_inv`` tensor -> Hugging Face
   fine-grained FP8 (blocks of 128 x 128, as transformers assumes); any float8_e4m3fn tensor -> diffusion FP8;
   otherwise an error (nothing quantized to load).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from .registry import (UNSUPPORTED_WEIGHT_DTYPES, CheckpointFormat, QuantFormat, config_field,  # noqa: F401
                       format_for_method, matches, registered_formats)
from .source import CheckpointError, Source

CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class ConfigPlace:
    """Where a format's config came from, for error messages: ``qc`` names the quantization_config, ``side`` the
    side config (a file name or "config")."""
    qc: str = "quantization_config"
    side: str = "side config"


def _claiming_format(qc: dict) -> Optional[CheckpointFormat]:
    """The format that recognizes a quantization_config without ``quant_method`` (MLX's)."""
    return next((f for f in registered_formats() if f.claims_config(qc)), None)


def _side_format(cfg: dict) -> Optional[CheckpointFormat]:
    return next((f for f in registered_formats() if f.is_side_config(cfg)), None)


def split_config(config, where: str = "config") -> Tuple[Optional[dict], Optional[Tuple[CheckpointFormat, dict]], str]:
    """(quantization_config, (format, its side config) or None, where the quantization_config is) out of whatever
    dict the user passed: a full config.json, its quantization_config alone, or a format's side config."""
    if config is None:
        return None, None, where
    if not isinstance(config, dict):
        raise CheckpointError(f"{where} must be a JSON object (dict), got {type(config).__name__}")
    if "quantization_config" in config:
        return config_field(config, "quantization_config", dict, where), None, f"{where}.quantization_config"
    q = config.get("quantization")
    if isinstance(q, dict) and _claiming_format(q) is not None:  # MLX's config.json (older mlx_lm: no _config)
        return q, None, f"{where}.quantization"
    side = _side_format(config)
    if side is not None:
        return None, (side, config), where
    if "quant_method" in config or _claiming_format(config) is not None:
        return config, None, where
    return None, None, where


def _parse(fmt: CheckpointFormat, qc, side, place: ConfigPlace) -> QuantFormat:
    q = fmt.parse(qc, side, place)
    q.format = fmt
    return q


def detect(src: Source, config: Optional[dict] = None) -> QuantFormat:
    if config is not None:
        qc, side, qwhere = split_config(config, "config")
        if qc is None and side is None:
            raise CheckpointError("config has no 'quantization_config', 'quant_method' or a side config such as "
                                  "ModelOpt's 'quantization' section")
        sides = {side[0].name: (side[1], "config")} if side else {}
    else:
        path = src.config_path(CONFIG_FILE)
        qc, _, qwhere = split_config(src.read_config(CONFIG_FILE), path or CONFIG_FILE)
        sides = {}
        for f in registered_formats():
            if f.side_config:
                cfg = src.read_config(f.side_config)
                if cfg is not None:
                    sides[f.name] = (cfg, src.config_path(f.side_config))
    if qc is not None:
        method = config_field(qc, "quant_method", str, qwhere)
        if method is None:
            fmt = _claiming_format(qc)
            if fmt is None:
                raise CheckpointError(f"{qwhere} has no 'quant_method'")
            return _parse(fmt, qc, None, ConfigPlace(qwhere, "side config"))
        fmt = format_for_method(method)
        if fmt is None:
            known = sorted(m for f in registered_formats() for m in f.quant_methods[:1])
            raise CheckpointError(f"unknown quant_method {method!r} in {qwhere}: torch_lowbit loads {known}")
        side_cfg, side_where = sides.get(fmt.name, (None, "side config"))
        return _parse(fmt, qc, side_cfg, ConfigPlace(qwhere, side_where))
    for f in registered_formats():
        if f.name in sides:
            side_cfg, side_where = sides[f.name]
            return _parse(f, None, side_cfg, ConfigPlace(qwhere, side_where))
    for f in registered_formats():
        q = f.from_tensors(src)
        if q is not None:
            q.format = f
            return q
    if any(src.dtype(k) in UNSUPPORTED_WEIGHT_DTYPES for k in src.keys()):
        raise CheckpointError("the checkpoint holds float8_e5m2 / fnuz tensors: torch_lowbit reads e4m3fn only")
    raise CheckpointError(f"{src.description}: no quantization config and no float8_e4m3fn tensors: this is not a "
                          f"quantized checkpoint torch_lowbit can recognize (load it with model.load_state_dict, "
                          f"or pass config= with a quantization_config)")


def detect_format(path_or_state_dict, *, config: Optional[dict] = None) -> QuantFormat:
    """The :class:`QuantFormat` of a checkpoint directory, .safetensors file or state dict (``str()`` of it is the
    format's name: modelopt, compressed-tensors, fp8, fbgemm_fp8, diffusion-fp8 or a registered one). See the
    module docstring for the rules. ``config``: a config.json dict, its quantization_config, or a side config
    (an hf_quant_config.json dict)."""
    from .source import open_source

    src = open_source(path_or_state_dict, mmap=True)  # nothing is kept: no copy needed
    try:
        return detect(src, config)
    finally:
        src.close()
