"""diffusers' FLUX LoRA loader (``FluxPipeline.load_lora_weights``) compares each LoRA's input features with its
target's through ``transformer.state_dict()["<target>.weight"]`` (and zero-pads a LoRA made for fewer input
features, as Flux Control's are). A W4Linear holds its weight as ``weight_packed`` (compressed-tensors' name), so
that lookup failed with a KeyError on a 4-bit transformer. Here the step is wrapped: the ``lora_A`` of a 4-bit
target is checked (and padded) against the layer's ``in_features`` and kept out of diffusers' lookup; every other
target goes through diffusers' own code. Installed when ``diffusers.loaders.lora_pipeline`` is imported; nothing
of diffusers is imported here."""
from __future__ import annotations

import functools

_STEP = "_maybe_expand_lora_state_dict"


def install(lora_pipeline) -> None:
    mixin = getattr(lora_pipeline, "FluxLoraLoaderMixin", None)
    step = None if mixin is None else mixin.__dict__.get(_STEP)
    if not isinstance(step, classmethod) or getattr(step.__func__, "_lowbit_original", None) is not None:
        return  # another diffusers (no such step) or installed already

    original = step.__func__

    @functools.wraps(original)
    def expand_lora_state_dict(cls, transformer, lora_state_dict):
        prefix = f"{cls.transformer_name}."
        held = {}
        for name, width in _four_bit_targets(transformer):
            key = f"{prefix}{name}.lora_A.weight"
            if key in lora_state_dict:
                held[key] = _fit_in_features(lora_state_dict.pop(key), width, name)
        out = original(cls, transformer, lora_state_dict)
        out.update(held)
        return out

    expand_lora_state_dict._lowbit_original = original
    setattr(mixin, _STEP, classmethod(expand_lora_state_dict))


def _four_bit_targets(model):
    """(LoRA target name, in_features) of the model's W4Linear layers, bare or as a PEFT layer's base_layer."""
    from .nn import W4Linear

    for name, module in model.named_modules():
        if isinstance(module, W4Linear):
            yield name[: -len(".base_layer")] if name.endswith(".base_layer") else name, module.in_features


def _fit_in_features(lora_a, width: int, name: str):
    """lora_A [r, k] for a target of `width` input features: zero-padded where k < width (as diffusers pads a dense
    target's), refused by name where k > width."""
    r, k = lora_a.shape
    if k > width:
        raise ValueError(f"load_lora_weights: the LoRA's {name}.lora_A takes {k} input features, the 4-bit layer "
                         f"{name} has {width}; a quantized layer cannot be widened (load the LoRA into the dense "
                         f"model, or quantize after expanding it)")
    if k == width:
        return lora_a
    padded = lora_a.new_zeros(r, width)
    padded[:, :k] = lora_a
    return padded
