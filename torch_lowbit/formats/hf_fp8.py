"""Hugging Face fine-grained FP8 (transformers' ``FineGrainedFP8Config``; DeepSeek-V3/R1, Qwen3-FP8):
``quant_method: fp8``, ``weight_block_size`` (default 128 x 128), ``weight_scale_inv`` -- despite its name a
multiplier -- of shape ``[ceil(N/bn), ceil(K/bk)]`` (or one element with ``weight_block_size: null``).
``modules_to_not_convert`` stay in high precision. Without a config, a ``*.weight_scale_inv`` tensor identifies
it (blocks of 128 x 128, as transformers assumes)."""
from __future__ import annotations

from ..granularity import DEFAULT_BLOCK, PerBlock, PerTensor
from .registry import CheckpointError, CheckpointFormat, Example, block_field, config_field, name_list

EXAMPLE_BLOCK = PerBlock(16, 32)


def _activations(qc, block, at):
    """transformers' FP8Linear quantizes activations per token and per group of block_k columns when dynamic (a
    scheme torch_lowbit does not run), with the checkpoint's ``input_scale`` when static."""
    scheme = config_field(qc, "activation_scheme", str, at, "dynamic")
    if scheme == "static":
        return "fp8-static-tensor"
    if scheme == "dynamic":
        return f"FP8 dynamic per-token-group (1x{block[1]})" if block else "FP8 dynamic (transformers' FP8Linear)"
    raise CheckpointError(f"{at}.activation_scheme {scheme!r} is not supported ('dynamic' or 'static')")


class HfFineGrainedFp8(CheckpointFormat):
    name = "fp8"
    quant_methods = ("fp8",)
    scale_key = "weight_scale_inv"

    def parse(self, qc, side, where):
        at = where.qc
        block = block_field(qc, "weight_block_size", at, DEFAULT_BLOCK)  # an explicit null: per-tensor scales
        fmt = config_field(qc, "fmt", str, at, "e4m3")
        if fmt != "e4m3":
            raise CheckpointError(f"{at}.fmt {fmt!r} is not supported (e4m3 only)")
        return self.make(block_size=block, ignore=name_list(qc, "modules_to_not_convert", at),
                         extra_keys=("input_scale",), activations=((("Linear",), _activations(qc, block, at)),),
                         details={"weight_block_size": block, "activation_scheme": qc.get("activation_scheme")})

    def from_tensors(self, src):
        if not any(k.endswith("." + self.scale_key) for k in src.keys()):
            return None
        return self.make(block_size=DEFAULT_BLOCK,
                         details={"weight_block_size": DEFAULT_BLOCK, "config": "none (inferred)"},
                         notes=[f"no config: {self.scale_key} read as blocks of {DEFAULT_BLOCK[0]}x{DEFAULT_BLOCK[1]}"])

    def examples(self):
        return {"hf-fp8-block": Example(EXAMPLE_BLOCK, "blocks"), "hf-fp8-tensor": Example(PerTensor(), "1")}

    def example_config(self, example, keep):
        block = example.granularity.block_size
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": list(block) if block else None, "modules_to_not_convert": list(keep)}, None


FORMAT = HfFineGrainedFp8()
