"""LoRA (PEFT) on frozen FP8 / INT8 bases: PEFT's LoRA wraps ``Fp8Linear`` and ``Int8Linear`` through its
extension point for custom layers (``LoraConfig._register_custom_module``). One line of user code::

    config = torch_lowbit.peft.register(LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))
    model = peft.get_peft_model(quantized_model, config)

The base layer stays low-bit and frozen; gradients reach the adapters (and the layers before) through the
low-bit ops' backward passes. Adapters keep their own dtype (float32 by default) rather than the base weight's.
Merging an adapter into the base is refused: the sum would have to be re-quantized (rounding the adapter away
or changing the base); run unmerged, or merge into a dense copy of the model.
"""
from __future__ import annotations

from peft import LoraConfig
from peft.tuners.lora.layer import Linear as _PeftLoraLinear

from .nn import Fp8Linear, Int8Linear


class LowbitLoraLinear(_PeftLoraLinear):
    """PEFT's LoRA Linear around an ``Fp8Linear`` / ``Int8Linear``: ``base(x) + lora_B(lora_A(dropout(x))) *
    scaling``, unmerged."""

    def __init__(self, base_layer, adapter_name, **kwargs):
        config = kwargs.get("config")
        if kwargs.get("use_dora") or getattr(config, "use_dora", False):
            raise ValueError(f"{type(self).__name__}: DoRA needs the dense base weight's norms; a low-bit base "
                             "supports plain LoRA (use_dora=False)")
        super().__init__(base_layer, adapter_name, **kwargs)

    def _get_in_out_features(self, module):
        return module.in_features, module.out_features

    def _get_base_layer_device_and_dtype(self, base_layer):
        # the adapters follow the base layer's device but not its weight's dtype (float8 / int8)
        return base_layer.weight.device, None

    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        base = type(self.get_base_layer()).__name__
        raise ValueError(f"{type(self).__name__}: merging a LoRA adapter into a {base} base is not supported: the "
                         "merged weight would have to be re-quantized, which rounds the adapter's update away or "
                         "changes the base. Run the adapters unmerged, or merge into a dense (dequantized) copy of "
                         "the model")

    def __repr__(self) -> str:
        return super().__repr__().replace("lora.Linear", f"lora.{type(self).__name__}")


LOW_BIT_LAYERS = (Fp8Linear, Int8Linear)


def register(config: LoraConfig) -> LoraConfig:
    """Let PEFT's LoRA wrap torch_lowbit's low-bit linear layers under ``config``; returns ``config``."""
    if not isinstance(config, LoraConfig):
        raise TypeError(f"torch_lowbit.peft.register: config must be a peft.LoraConfig, got {type(config).__name__}")
    config._register_custom_module({layer: LowbitLoraLinear for layer in LOW_BIT_LAYERS})
    return config
