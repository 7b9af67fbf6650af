"""NVIDIA ModelOpt FP8 (``export_hf_checkpoint``): ``weight`` fp8 + ``weight_scale`` fp32 (0-d per tensor, ``[N]``
per channel) + ``input_scale``. ``FP8`` checkpoints are written for static per-tensor activations (``input_scale``,
a multiplier: ``x ~= fp8(x / input_scale) * input_scale``), ``FP8_PER_CHANNEL_PER_TOKEN`` for dynamic per-token
ones. Recognized by
``quantization_config.quant_method == "modelopt"`` or an ``hf_quant_config.json`` beside config.json;
``exclude_modules`` (fnmatch wildcards) stay in high precision."""
from __future__ import annotations

from ..granularity import PerChannel, PerTensor
from .registry import CheckpointError, CheckpointFormat, Example, config_field, name_list


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
        if not algo.upper().startswith("FP8"):
            raise CheckpointError(f"ModelOpt quant_algo {algo!r} is not supported ({at}.quant_algo): torch_lowbit "
                                  f"loads FP8 (per tensor 'FP8', per channel 'FP8_PER_CHANNEL_PER_TOKEN')")
        return self.make(ignore=name_list(merged, "exclude_modules", at), extra_keys=("input_scale",),
                         activations=((("Linear",), _ACTIVATIONS.get(algo.upper(), f"ModelOpt {algo}")),),
                         details={"quant_algo": algo, "kv_cache_quant_algo": merged.get("kv_cache_quant_algo")})

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
