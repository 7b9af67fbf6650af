"""Diffusion FP8 files (FLUX fp8 and friends), single .safetensors without a config: raw e4m3 weights (scale 1),
or ComfyUI's scaled fp8 (``scale_weight`` per tensor, a ``scaled_fp8`` marker tensor), or ``weight_scale``.
Recognized by any float8_e4m3fn tensor when nothing else claims the file (register it last). fp8 tensors outside
linear layers (norms, ...) are upcast exactly: ``float(w) * scale``."""
from __future__ import annotations

import torch

from ..granularity import PerTensor
from .registry import UNSUPPORTED_WEIGHT_DTYPES, CheckpointFormat, Example, QuantFormat
from .source import CheckpointError, Source

MARKER = "scaled_fp8"  # ComfyUI's file-level tensor: its dtype names the fp8 format of the file


class DiffusionFp8(CheckpointFormat):
    name = "diffusion-fp8"
    scale_key = "scale_weight"
    upcasts_unscaled = True

    def from_tensors(self, src):
        keys = src.keys()
        if not any(src.dtype(k) == torch.float8_e4m3fn for k in keys):
            return None
        if any(k.endswith(".scale_weight") or k.rsplit(".", 1)[-1] == MARKER for k in keys):
            scale_key, kind = "scale_weight", "ComfyUI scaled fp8"
        elif any(k.endswith(".weight_scale") for k in keys):
            scale_key, kind = "weight_scale", "fp8 with weight_scale"
        else:
            scale_key, kind = "scale_weight", "raw e4m3 (scale 1)"
        return self.make(scale_key=scale_key, scale_required=False, extra_keys=("scale_input", "input_scale"),
                         details={"kind": kind})

    def examples(self):
        return {"diffusion-raw": Example(None),
                "comfy": Example(PerTensor(), "1", extra=("scale_input",), marker="scaled_fp8")}


FORMAT = DiffusionFp8()


def check_dtypes(src: Source, where: str):
    """A diffusion FP8 file holds float8_e4m3fn weights (beside high-precision tensors): a float8_e5m2 / fnuz tensor
    in it (a mixed-format file: e5m2 is another format, torch_lowbit reads e4m3fn) is refused by name."""
    for k in src.keys():
        if src.dtype(k) in UNSUPPORTED_WEIGHT_DTYPES:
            others = "" if not any(src.dtype(o) == torch.float8_e4m3fn for o in src.keys()) else \
                " beside float8_e4m3fn tensors (a mixed-dtype file)"
            raise CheckpointError(f"{where}: tensor {k!r} is {src.dtype(k)}{others}; torch_lowbit reads "
                                  f"float8_e4m3fn weights only")


def weight_scale(src: Source, fmt: QuantFormat, key: str, where: str) -> torch.Tensor:
    """The fp32 multiplier of the float8_e4m3fn tensor `key` (``{module}.weight``) of a diffusion FP8 file: its
    ``scale_weight`` / ``weight_scale`` tensor, ``[1]`` (per tensor) or ``[N]`` (per row); 1 in a raw e4m3 file.
    In a scaled file (one holding such scales or ComfyUI's ``scaled_fp8`` marker) every fp8 weight has its scale:
    a missing one is an error naming the file and the tensor, never a silent scale of 1."""
    skey = _scale_key(src, fmt, key, where)
    if skey is None:
        return torch.ones(1)
    scale = src.get(skey)
    rows = src.shape(key)[0] if src.shape(key) else 1
    if not scale.is_floating_point() or scale.dtype == torch.float8_e4m3fn or scale.numel() not in (1, rows):
        raise CheckpointError(f"{where}: {skey!r} must be a floating-point scale of one value or one per row "
                              f"({rows}) of {key!r}, got {scale.dtype} of shape {list(scale.shape)}")
    return scale.to(torch.float32).reshape(-1)


def _scale_key(src: Source, fmt: QuantFormat, key: str, where: str):
    """The key of `key`'s scale, None in a raw file; in a scaled file a missing one is an error."""
    skey = key.rsplit(".", 1)[0] + "." + fmt.scale_key
    if skey not in src:
        if fmt.details.get("kind") != "raw e4m3 (scale 1)":
            raise CheckpointError(f"{where}: tensor {key!r} is float8_e4m3fn but its scale {skey!r} is missing, and "
                                  f"this is a scaled fp8 file ({fmt.details.get('kind')}): each fp8 weight needs its "
                                  f"scale")
        return None
    return skey


def check_scales(src: Source, fmt: QuantFormat, where: str):
    """Every float8_e4m3fn weight of a scaled file has its scale (before anything is read)."""
    for k in src.keys():
        if k.endswith(".weight") and src.dtype(k) == torch.float8_e4m3fn:
            _scale_key(src, fmt, k, where)
