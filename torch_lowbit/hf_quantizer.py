"""``TorchLowbitConfig``: quantize a dense model into torch_lowbit layers while transformers loads it, through
transformers' public extension point (``register_quantization_config`` / ``register_quantizer``)::

    model = AutoModelForCausalLM.from_pretrained(dense_path, dtype=torch.bfloat16,
                                                 quantization_config=torch_lowbit.TorchLowbitConfig("fp8"))

transformers loads the dense checkpoint as usual, then the quantizer runs ``quantize_`` on it (which also turns fused
MoE experts into ``Fp8Experts`` / ``Int8Experts``): peak memory is the dense model's, for a moment. (Quantizing
each tensor as it is read would need transformers' internal conversion-op API; this uses only the stable hooks.) Such
a model's ``save_pretrained`` writes what ``torch_lowbit.save_quantized`` writes (a compressed-tensors checkpoint,
which transformers and torch_lowbit read back): ``postprocess_model`` sets it per model (``enable_save_pretrained``).

Importing this module imports transformers and registers the method ``torch_lowbit`` once.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from .granularity import as_granularity, normalize_block_size
from .quantize import Fp8WeightOnly, Int8Dynamic, quantize_

QUANT_METHOD = "torch_lowbit"
WEIGHTS = ("fp8", "int8")


@register_quantization_config(QUANT_METHOD)
class TorchLowbitConfig(QuantizationConfigMixin):
    """weights: ``"fp8"`` (W8A16, Fp8Linear; fused MoE experts become Fp8Experts) or ``"int8"`` (W8A8 dynamic,
    Int8Linear). granularity / block_size: of the fp8 scales (see ``Fp8WeightOnly``). modules_to_not_convert:
    module names (or dotted name parts) kept in high precision; default ``["lm_head"]``."""

    def __init__(self, weights: str = "fp8", granularity: str = "channel", block_size: Sequence[int] = (128, 128),
                 modules_to_not_convert: Optional[List[str]] = None, **kwargs):
        # transformers rebuilds a saved config as TorchLowbitConfig(**to_dict()): quant_method comes back with it
        method = kwargs.pop("quant_method", QUANT_METHOD)
        if kwargs:
            raise TypeError(f"TorchLowbitConfig got unexpected keyword arguments {sorted(kwargs)} (it takes weights, "
                            f"granularity, block_size, modules_to_not_convert)")
        if method != QUANT_METHOD:
            raise ValueError(f"TorchLowbitConfig: quant_method must be {QUANT_METHOD!r}, got {method!r}")
        if weights not in WEIGHTS:
            raise ValueError(f"TorchLowbitConfig: weights must be one of {WEIGHTS}, got {weights!r}")
        # kept as the alias string: transformers writes this config to config.json
        granularity = as_granularity(granularity, block_size, "TorchLowbitConfig.granularity").kind
        self.quant_method = QUANT_METHOD
        self.weights = weights
        self.granularity = granularity
        self.block_size = list(normalize_block_size(block_size, "TorchLowbitConfig.block_size"))
        self.modules_to_not_convert = _module_names(modules_to_not_convert)

    def quantize_config(self):
        if self.weights == "int8":
            return Int8Dynamic()
        return Fp8WeightOnly(self.granularity, tuple(self.block_size))


def _module_names(names) -> List[str]:
    """modules_to_not_convert as a list of names (a single string is one name, not its letters)."""
    from .formats.registry import pattern_problem

    if names is None:
        return ["lm_head"]
    items = [names] if isinstance(names, str) else names
    if not isinstance(items, (list, tuple)) or not all(isinstance(n, str) for n in items):
        raise TypeError(f"TorchLowbitConfig: modules_to_not_convert must be a list of module names, got "
                        f"{type(names).__name__} {names!r}")
    for n in items:
        problem = pattern_problem(n)
        if problem:
            raise ValueError(f"TorchLowbitConfig: modules_to_not_convert holds {n!r}: {problem}")
    return list(items)


@register_quantizer(QUANT_METHOD)
class TorchLowbitHfQuantizer(HfQuantizer):
    requires_calibration = False

    def update_dtype(self, dtype):
        return torch.bfloat16 if dtype is None else dtype

    def _skipped(self, fqn: str) -> bool:
        from .formats.detect import matches  # the loader's ignore-list rule

        return any(matches(fqn, p) for p in self.quantization_config.modules_to_not_convert)

    def _process_model_after_weight_loading(self, model, **kwargs):
        config = self.quantization_config
        # quantize_'s walker: Linears and fused experts (Fp8Experts / Int8Experts), experts it cannot convert left
        # dense with a warning saying why
        quantize_(model, config.quantize_config(), filter_fn=lambda m, fqn: not self._skipped(fqn))
        return model

    def postprocess_model(self, model, **kwargs):
        from .hf import enable_save_pretrained

        model = super().postprocess_model(model, **kwargs)
        return enable_save_pretrained(model)

    def is_serializable(self):
        # Reached only when transformers' own PreTrainedModel.save_pretrained runs on this model (the model's
        # save_pretrained, set by postprocess_model, writes the checkpoint without it): transformers' writer would
        # store this config, which is no checkpoint format, so it must refuse, and says to read this warning.
        from transformers.utils import logging

        logging.get_logger(__name__).warning_once(
            "torch_lowbit: PreTrainedModel.save_pretrained cannot write a torch_lowbit model; call "
            "model.save_pretrained(path) on the model itself, or torch_lowbit.save_quantized(model, path)")
        return False

    @property
    def is_trainable(self):
        return False

