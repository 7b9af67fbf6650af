"""NVIDIA ModelOpt FP8 (``export_hf_checkpoint``): ``weight`` fp8 + ``weight_scale`` fp32 (0-d per tensor, ``[N]``
per channel) + ``input_scale``. ``FP8`` checkpoints are written for static per-tensor activations (``input_scale``,
a multiplier: ``x ~= fp8(x / input_scale) * input_scale``), ``FP8_PER_CHANNEL_PER_TOKEN`` for dynamic per-token
ones. Recognized by
``quantization_config.quant_method == "modelopt"`` or an ``hf_quant_config.json`` beside config.json;
``exclude_modules`` (fnmatch wildcards) stay in high precision.

``NVFP4`` checkpoints (W4A4, read as W4A16: weights only): ``weight`` uint8 ``[N, K/2]`` (two E2M1 codes per byte,
the even k low), ``weight_scale`` float8_e4m3fn ``[N, K/16]``, ``weight_scale_2`` fp32 (a multiplier of the whole
product), ``input_scale`` (unused: activations stay in their dtype) -- compressed-tensors' nvfp4 layout with the
global scale inverted."""
from __future__ import annotations

import torch

from ..granularity import PerChannel, PerTensor
from .registry import CheckpointError, CheckpointFormat, Example, config_field, name_list
from .tensors import W4Weight

NVFP4_GROUP = 16


# ModelOpt's FP8 algorithms and the activation quantization each was exported for
_ACTIVATIONS = {"FP8": "fp8-static-tensor", "FP8_PER_CHANNEL_PER_TOKEN": "fp8-dynamic-token", "FP8_PB_WO": None}


class ModelOpt(CheckpointFormat):
    name = "modelopt"
    quant_methods = ("modelopt",)
    side_config = "hf_quant_config.json"

    def is_side_config(self, cfg):
        return isinstance(cfg.get("quantization"), dict)

    def parse(self, qc, side, where):
        merged, at = {}, where
        if side is not None:
            merged.update(config_field(side, "quantization", dict, where.side, {}))
            at = where.side + ".quantization"
        if qc is not None:
            merged.update({k: v for k, v in qc.items() if k != "quantization"})
            merged.update(config_field(qc, "quantization", dict, where.qc, {}))
            at = where.qc
        algo = config_field(merged, "quant_algo", str, at, "FP8")
        if algo.upper() == "NVFP4":
            group = config_field(merged, "group_size", int, at, NVFP4_GROUP)
            if group != NVFP4_GROUP:
                raise CheckpointError(f"{at}.group_size must be {NVFP4_GROUP} for NVFP4, got {group}")
            return self.make(ignore=name_list(merged, "exclude_modules", at), extra_keys=("input_scale",),
                             weights=((("Linear",), "nvfp4"),),
                             activations=((("Linear",), "ModelOpt NVFP4 activations (W4A4)"),),
                             details={"quant_algo": algo, "group_size": group,
                                      "kv_cache_quant_algo": merged.get("kv_cache_quant_algo")})
        if not algo.upper().startswith("FP8"):
            raise CheckpointError(f"ModelOpt quant_algo {algo!r} is not supported ({at}.quant_algo): torch_lowbit "
                                  f"loads FP8 (per tensor 'FP8', per channel 'FP8_PER_CHANNEL_PER_TOKEN') and NVFP4")
        return self.make(ignore=name_list(merged, "exclude_modules", at), extra_keys=("input_scale",),
                         activations=((("Linear",), _ACTIVATIONS.get(algo.upper(), f"ModelOpt {algo}")),),
                         details={"quant_algo": algo, "kv_cache_quant_algo": merged.get("kv_cache_quant_algo")})

    def w4_present(self, src, fmt, prefix):
        wkey = f"{prefix}.weight"
        return fmt.weight_args(prefix) == "nvfp4" and wkey in src and src.dtype(wkey) == torch.uint8

    def w4_weight(self, src, fmt, prefix, shape):
        wkey, skey, gkey = f"{prefix}.weight", f"{prefix}.weight_scale", f"{prefix}.weight_scale_2"
        if fmt.weight_args(prefix) != "nvfp4" or wkey not in src or src.dtype(wkey) != torch.uint8:
            return None
        N, K = shape
        G = -(-K // NVFP4_GROUP)
        for key, dtype, want in ((wkey, torch.uint8, (N, (K + 1) // 2)), (skey, torch.float8_e4m3fn, (N, G))):
            if key not in src:
                raise CheckpointError(f"{key} is missing: {wkey} is an NVFP4 weight")
            if src.dtype(key) != dtype or tuple(src.shape(key)) != want:
                raise CheckpointError(f"{key} must be {dtype} of shape {list(want)} (NVFP4 [{N}, {K}], groups of "
                                      f"{NVFP4_GROUP}), got {src.dtype(key)} of shape {list(src.shape(key))}")
        if gkey not in src:
            raise CheckpointError(f"{gkey} is missing: NVFP4 weights multiply by it")
        g = src.get(gkey)
        if g.numel() != 1 or not g.is_floating_point():
            raise CheckpointError(f"{gkey} must be one floating-point number, got {g.dtype} of shape {list(g.shape)}")
        keys = [wkey, skey, gkey] + [k for k in (f"{prefix}.input_scale",) if k in src]
        return W4Weight("nvfp4", NVFP4_GROUP, K, src.get(wkey), src.get(skey), None,
                        g.to(torch.float32).reshape(1), keys)

    def examples(self):
        return {"modelopt-tensor": Example(PerTensor(), "0d", extra=("input_scale",), options=(("file", True),)),
                "modelopt-channel": Example(PerChannel(), "N")}

    def example_config(self, example, keep):
        exclude = [f"*{k}" for k in keep]  # ModelOpt writes fnmatch patterns
        if example.option("file"):
            return None, {"producer": {"name": "modelopt", "version": "0.29"},
                          "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None,
                                           "exclude_modules": exclude}}
        return {"quant_method": "modelopt", "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN", "exclude_modules": exclude}, None


FORMAT = ModelOpt()
