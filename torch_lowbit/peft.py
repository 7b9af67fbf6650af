"""LoRA (PEFT) on frozen FP8 / INT8 / 4-bit bases (QLoRA): once torch_lowbit is imported, PEFT's LoRA wraps
``Fp8Linear``, ``Int8Linear`` and ``W4Linear`` with plain PEFT calls, ``target_modules="all-linear"`` included (see
``torch_lowbit._peft_dispatch`` for the two hooks this takes)::

    model = peft.get_peft_model(quantized_model, LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))
    model = peft.PeftModel.from_pretrained(quantized_model, adapter_dir)

:func:`register` does the same for one config explicitly (PEFT's ``LoraConfig._register_custom_module``).

The base layer stays low-bit and frozen; gradients reach the adapters (and the layers before) through the
low-bit ops' backward passes. Adapters keep their own dtype (float32 by default) rather than the base weight's.
``bias="all"`` / ``"lora_only"`` train the low-bit layers' biases, as on nn.Linear. Fused experts held quantized
(``W4Experts`` and its siblings) take no adapter: a config that targets them warns and leaves them frozen.
Merging an adapter into a low-bit base is refused: the sum would have to be re-quantized (rounding the adapter
away or changing the base). Run unmerged, or merge into a dense copy::

    merged = torch_lowbit.dequantize_model(peft_model).merge_and_unload()
    merged = peft.PeftModel.from_pretrained(torch_lowbit.dequantize_model(base), adapter_dir).merge_and_unload()
"""
from __future__ import annotations

import warnings

from peft import LoraConfig
from peft.tuners.lora.layer import Linear as _PeftLoraLinear
from peft.tuners.tuners_utils import BaseTunerLayer

try:
    from peft.tuners.tuners_utils import SEQ_CLS_HEAD_NAMES
except ImportError:  # older PEFT: the heads it looks for by name
    SEQ_CLS_HEAD_NAMES = ("score", "classifier")

from .nn import Fp8Experts, Fp8Linear, Int8Experts, Int8Linear, W4Experts, W4Linear


class LowbitLoraLinear(_PeftLoraLinear):
    """PEFT's LoRA Linear around an ``Fp8Linear`` / ``Int8Linear`` / ``W4Linear``:
    ``base(x) + lora_B(lora_A(dropout(x))) * scaling``, unmerged."""

    def __init__(self, base_layer, adapter_name, **kwargs):
        config = kwargs.get("config")
        if kwargs.get("use_dora") or getattr(config, "use_dora", False):
            raise ValueError(f"{type(self).__name__}: DoRA needs the dense base weight's norms; a low-bit base "
                             "supports plain LoRA (use_dora=False)")
        super().__init__(base_layer, adapter_name, **kwargs)

    def _get_in_out_features(self, module):
        return module.in_features, module.out_features

    def _get_base_layer_device_and_dtype(self, base_layer):
        # the adapters follow the base layer's device but not its weight's dtype (float8 / int8 / 4-bit codes)
        weight = getattr(base_layer, "weight", None)
        return (weight if weight is not None else base_layer.weight_packed).device, None

    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        base = self.get_base_layer()
        if not isinstance(base, LOW_BIT_LAYERS):  # a dense copy's nn.Linear (dequantize_model): PEFT's own merge
            return super().merge(safe_merge=safe_merge, adapter_names=adapter_names)
        raise ValueError(f"{type(self).__name__}: merging a LoRA adapter into a {type(base).__name__} base is not "
                         "supported: the merged weight would have to be re-quantized, which rounds the adapter's "
                         "update away or changes the base. Run the adapters unmerged, or merge into a dense "
                         "(dequantized) copy: torch_lowbit.dequantize_model(peft_model).merge_and_unload()")

    def __repr__(self) -> str:
        return super().__repr__().replace("lora.Linear", f"lora.{type(self).__name__}")


LOW_BIT_LAYERS = (Fp8Linear, Int8Linear, W4Linear)
LOW_BIT_EXPERTS = (Fp8Experts, Int8Experts, W4Experts)
# the fused experts' parameters (transformers v5) these modules hold quantized: what PEFT's target_parameters name
_EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")


def dispatch_low_bit(target, adapter_name, config, **kwargs):
    """A PEFT LoRA dispatcher: ``LowbitLoraLinear`` for a target whose base layer is a torch_lowbit layer, None
    (PEFT's own dispatchers decide) for any other target, or where ``config`` maps the layer's type to a custom
    module of its own (PEFT tries that mapping first)."""
    base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
    if not isinstance(base, LOW_BIT_LAYERS):
        return None
    if any(isinstance(base, layer) for layer in (getattr(config, "_custom_modules", None) or ())):
        return None
    return LowbitLoraLinear(target, adapter_name, config=config, **kwargs)


def low_bit_linear_names(model, config) -> set:
    """The names of ``model``'s torch_lowbit linear layers that LoRA's ``target_modules="all-linear"`` means: PEFT
    expands it to ``nn.Linear`` layers only, less the output embedding, a sequence-classification head (for that task
    type) and layers inside adapters; the same exclusions apply here."""
    names = {n for n, m in model.named_modules() if isinstance(m, LOW_BIT_LAYERS)}
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is None and str(getattr(config, "task_type", "")).rsplit(".", 1)[-1] == "SEQ_CLS":
        head = next((h for h in (getattr(model, n, None) for n in SEQ_CLS_HEAD_NAMES) if h is not None), None)
    excluded = {n for n, m in model.named_modules() if head is not None and m is head}
    for prefix, m in model.named_modules():
        if isinstance(m, BaseTunerLayer):
            excluded |= {f"{prefix}.{suffix}" if prefix else suffix for suffix, _ in m.named_modules() if suffix}
    return names - excluded


def warn_of_quantized_expert_targets(model, config) -> None:
    """Warn where LoRA's ``target_parameters`` name fused experts that torch_lowbit holds quantized: PEFT matches
    parameters by name, finds none on those modules and leaves them without adapters, saying nothing clear."""
    targets = set(getattr(config, "target_parameters", None) or ())
    if not targets:
        return
    hit = [(n, m) for n, m in model.named_modules() if isinstance(m, LOW_BIT_EXPERTS)
           and any(f"{n}.{p}" == t or f"{n}.{p}".endswith(f".{t}") for p in _EXPERT_PARAMETERS for t in targets)]
    if hit:
        warnings.warn(
            f"torch_lowbit: LoRA target_parameters {sorted(targets)} name the fused experts of {len(hit)} module(s) "
            f"held quantized (e.g. {hit[0][0]!r}, a {type(hit[0][1]).__name__}); LoRA cannot adapt quantized expert "
            "weights, so those experts stay frozen and get no adapter. To train them, quantize_ with a filter_fn "
            "that leaves the experts in float.", UserWarning, stacklevel=2)


def register(config: LoraConfig) -> LoraConfig:
    """Let PEFT's LoRA wrap torch_lowbit's low-bit linear layers under ``config``; returns ``config``."""
    if not isinstance(config, LoraConfig):
        raise TypeError(f"torch_lowbit.peft.register: config must be a peft.LoraConfig, got {type(config).__name__}")
    config._register_custom_module({layer: LowbitLoraLinear for layer in LOW_BIT_LAYERS})
    return config
