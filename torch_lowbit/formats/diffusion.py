"""Diffusion FP8 files (FLUX fp8 and friends), single .safetensors without a config: raw e4m3 weights (scale 1),
or ComfyUI's scaled fp8 (``scale_weight`` per tensor, a ``scaled_fp8`` marker tensor), or ``weight_scale``.
Recognized by any float8_e4m3fn tensor when nothing else claims the file (register it last). fp8 tensors outside
linear layers (norms, ...) are upcast exactly: ``float(w) * scale``."""
from __future__ import annotations

import torch

from ..granularity import PerTensor
from .registry import CheckpointFormat, Example


class DiffusionFp8(CheckpointFormat):
    name = "diffusion-fp8"
    scale_key = "scale_weight"
    upcasts_unscaled = True

    def from_tensors(self, src):
        keys = src.keys()
        if not any(src.dtype(k) == torch.float8_e4m3fn for k in keys):
            return None
        if any(k.endswith(".scale_weight") for k in keys):
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
