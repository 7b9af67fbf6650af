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

from enum import Enum
from typing import List, Optional, Sequence

import torch
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from .granularity import as_granularity, normalize_block_size
from .quantize import Fp8WeightOnly, Int8Dynamic, kept_in_fp32, kept_name, quantize_



class QuantMethod(str, Enum):
    """``quant_method`` as both libraries take it: a str (transformers looks it up, config.json stores it) and an Enum
    member (diffusers reads ``quant_method.value``). The member's name is its value, so it hashes as the string."""
    torch_lowbit = "torch_lowbit"

    __str__ = str.__str__


QUANT_METHOD = QuantMethod.torch_lowbit
WEIGHTS = ("fp8", "int8", "int4", "nvfp4", "mxfp4", "uint4")
W4_CONFIGS = {"int4": "Int4WeightOnly", "nvfp4": "Nvfp4WeightOnly", "mxfp4": "Mxfp4WeightOnly",
              "uint4": "AffineWeightOnly"}  # 4-bit weights: the quantize_ config of each (torch_lowbit.quantize)
W4_DEFAULT_GROUP = {"int4": 128, "uint4": 64}  # the writers' defaults (llmcompressor W4A16, mlx_lm)
W4_FIXED_GROUP = {"nvfp4": 16, "mxfp4": 32}
TRANSFORMERS_SKIPPED = ["lm_head"]  # modules_to_not_convert=None in transformers


@register_quantization_config(QUANT_METHOD.value)
class TorchLowbitConfig(QuantizationConfigMixin):
    """weights: ``"fp8"`` (W8A16, Fp8Linear; fused MoE experts become Fp8Experts), ``"int8"`` (W8A8 dynamic,
    Int8Linear), or 4-bit W4A16 (W4Linear): ``"int4"`` (``Int4WeightOnly(group_size, symmetric)``), ``"nvfp4"``,
    ``"mxfp4"``, ``"uint4"`` (MLX affine, ``AffineWeightOnly(group_size)``). granularity / block_size: of the fp8
    scales (see ``Fp8WeightOnly``). group_size: of the int4 / uint4 scales (default 128 for int4, 64 for uint4;
    None: per channel, int4 only; nvfp4 and mxfp4 have theirs, 16 and 32). symmetric: int4 without zero points.
    modules_to_not_convert: module names (or dotted name parts) kept in high precision; None (default): each library's
    rule -- ``["lm_head"]`` in transformers, the diffusion rule (:mod:`torch_lowbit.diffusion`: embedders and the final
    layer) in diffusers, where this config works too (``torch_lowbit.diffusers_quantizer``)."""

    def __init__(self, weights: str = "fp8", granularity: str = "channel", block_size: Sequence[int] = (128, 128),
                 modules_to_not_convert: Optional[List[str]] = None, group_size: Optional[int] = -1,
                 symmetric: bool = True, **kwargs):
        # transformers rebuilds a saved config as TorchLowbitConfig(**to_dict()): quant_method comes back with it
        method = kwargs.pop("quant_method", QUANT_METHOD)
        if kwargs:
            raise TypeError(f"TorchLowbitConfig got unexpected keyword arguments {sorted(kwargs)} (it takes weights, "
                            f"granularity, block_size, modules_to_not_convert, group_size, symmetric)")
        if method != QUANT_METHOD:
            raise ValueError(f"TorchLowbitConfig: quant_method must be {QUANT_METHOD.value!r}, got {method!r}")
        if weights not in WEIGHTS:
            raise ValueError(f"TorchLowbitConfig: weights must be one of {WEIGHTS}, got {weights!r}")
        # kept as the alias string: transformers writes this config to config.json
        granularity = as_granularity(granularity, block_size, "TorchLowbitConfig.granularity").kind
        self.quant_method = QUANT_METHOD
        self.weights = weights
        self.granularity = granularity
        self.block_size = list(normalize_block_size(block_size, "TorchLowbitConfig.block_size"))
        self.modules_to_not_convert = _module_names(modules_to_not_convert)
        self.group_size, self.symmetric = _w4_options(weights, group_size, symmetric)

    def quantize_config(self):
        if self.weights == "int8":
            return Int8Dynamic()
        if self.weights in W4_CONFIGS:
            from . import quantize

            cls = getattr(quantize, W4_CONFIGS[self.weights], None)
            if cls is None:
                raise NotImplementedError(f"TorchLowbitConfig(weights={self.weights!r}) needs "
                                          f"torch_lowbit.{W4_CONFIGS[self.weights]}, which this build lacks")
            if self.weights == "int4":
                return cls(group_size=self.group_size, symmetric=self.symmetric)
            return cls(group_size=self.group_size) if self.weights == "uint4" else cls()
        return Fp8WeightOnly(self.granularity, tuple(self.block_size))


def _w4_options(weights: str, group_size, symmetric):
    """(group_size, symmetric) as the config records them: the format's default group size where -1 (not given),
    None for the formats without a choice; a choice a format does not have is refused by name."""
    if not isinstance(symmetric, bool):
        raise TypeError(f"TorchLowbitConfig: symmetric must be a bool, got {type(symmetric).__name__} {symmetric!r}")
    if weights != "int4" and not symmetric:
        raise ValueError(f"TorchLowbitConfig: symmetric=False (zero points) is for weights='int4', not {weights!r}")
    if group_size == -1:
        return W4_DEFAULT_GROUP.get(weights), symmetric
    if weights not in W4_DEFAULT_GROUP:
        if group_size is None or group_size == W4_FIXED_GROUP.get(weights):
            return None, symmetric
        raise ValueError(f"TorchLowbitConfig: group_size={group_size!r} does not apply to weights={weights!r}"
                         + (f" (its groups are {W4_FIXED_GROUP[weights]})" if weights in W4_FIXED_GROUP else ""))
    if group_size is None and weights == "int4":
        return None, symmetric
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"TorchLowbitConfig: group_size must be a positive int"
                         f"{' or None (per channel)' if weights == 'int4' else ''} for weights={weights!r}, "
                         f"got {group_size!r}")
    return group_size, symmetric


def _module_names(names) -> Optional[List[str]]:
    """modules_to_not_convert as a list of names (a single string is one name, not its letters); None stays None (the
    library's default rule)."""
    from .formats.registry import pattern_problem

    if names is None:
        return None
    items = [names] if isinstance(names, str) else names
    if not isinstance(items, (list, tuple)) or not all(isinstance(n, str) for n in items):
        raise TypeError(f"TorchLowbitConfig: modules_to_not_convert must be a list of module names, got "
                        f"{type(names).__name__} {names!r}")
    for n in items:
        problem = pattern_problem(n)
        if problem:
            raise ValueError(f"TorchLowbitConfig: modules_to_not_convert holds {n!r}: {problem}")
    return list(items)


@register_quantizer(QUANT_METHOD.value)
class TorchLowbitHfQuantizer(HfQuantizer):
    requires_calibration = False
    _keep_fp32 = ()

    def update_dtype(self, dtype):
        return torch.bfloat16 if dtype is None else dtype

    def _skipped(self, fqn: str) -> bool:
        from .formats.detect import matches  # the loader's ignore-list rule

        names = self.quantization_config.modules_to_not_convert
        return (any(matches(fqn, p) for p in (TRANSFORMERS_SKIPPED if names is None else names))
                or kept_name(fqn, self._keep_fp32) is not None)

    def _process_model_after_weight_loading(self, model, **kwargs):
        config = self.quantization_config
        # what the model keeps in fp32 stays unconverted, as transformers' own quantizers leave it (T5's wo)
        self._keep_fp32 = kept_in_fp32(model)
        keep = (lambda m, fqn: not self._skipped(fqn))
        if getattr(model, "_is_distributed_loading_by_transformers", False):
            # tp_plan: the plan's modules hold DTensor shards; each is gathered, quantized whole, then cut for this
            # rank (torch_lowbit.distributed); what the plan leaves whole is quantized below as usual
            from .distributed.parallel import quantize_parallel

            quantize_parallel(model, config.quantize_config(), keep)
        # quantize_'s walker: Linears and fused experts (Fp8Experts / Int8Experts), experts it cannot convert left
        # dense with a warning saying why
        quantize_(model, config.quantize_config(), filter_fn=keep)
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
        # adapters (PEFT LoRA) train on the frozen low-bit base: Trainer asks this of a quantized model with adapters
        # (a bare quantized model it refuses on its own)
        return True

    def _dequantize(self, model, dtype=None):
        # HfQuantizer.dequantize's step (model.dequantize() reaches the model's own method first: enable_save_pretrained)
        from .dequantize import dequantize_
        from .hf import detach_model_methods

        dequantize_(model, dtype=dtype)
        detach_model_methods(model)  # the dense model saves and counts as transformers' own
        return model



def _register_with_diffusers():
    """diffusers, where installed, takes the same config (its registration lives in diffusers_quantizer); where it
    is absent, or too old to import it from, transformers' registration stands alone and a warning says why."""
    try:
        import diffusers  # noqa: F401
    except ImportError:
        return
    try:
        from . import diffusers_quantizer  # noqa: F401
    except ImportError as e:
        import warnings

        warnings.warn(f"torch_lowbit: TorchLowbitConfig is not registered with diffusers {diffusers.__version__}: {e}",
                      stacklevel=2)


_register_with_diffusers()
