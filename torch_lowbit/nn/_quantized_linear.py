"""What Fp8Linear and Int8Linear share: dtype-stable quantized buffers under ``.to()`` / ``.half()`` (see
``_format_buffers``), a bias that is a frozen parameter, and loading checkpoint scales whose shape differs only by
size-1 dims (``[N, 1]`` vs ``[N]``, 0-d vs ``[1]``)."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn

from ._format_buffers import FormatBuffers


def frozen_bias(bias: Optional[torch.Tensor]) -> Optional[nn.Parameter]:
    """The layers' bias: an nn.Parameter (so that PEFT's ``bias="all"`` / ``"lora_only"``, ``requires_grad_()`` and
    optimizers over ``parameters()`` can train it, as they train nn.Linear's) that starts frozen, like the low-bit
    weight beside it (inference never records a graph). It shares ``bias``'s storage; state_dict name ``bias``;
    like nn.Linear's, it follows ``.half()`` / ``.to(dtype)``."""
    return None if bias is None else nn.Parameter(bias, requires_grad=False)


def _squeezed(shape):
    return [d for d in shape if d != 1]


def same_attributes(layers, names, where) -> None:
    """Refuse `layers` (for one fused layer) unless each of `names` has one value across them."""
    for name in names:
        values = [getattr(layer, name) for layer in layers]
        if any(v != values[0] for v in values):
            raise ValueError(f"{where}: the layers' {name} differ: {values}")


def same_tensor(layers, name, where) -> Optional[torch.Tensor]:
    """The per-tensor buffer `name` that `layers` share (None where none has it); refused where they differ, as one
    layer holds one."""
    values = [getattr(layer, name) for layer in layers]
    if all(v is None for v in values):
        return None
    if any(v is None or v.shape != values[0].shape or not torch.equal(v, values[0]) for v in values):
        raise ValueError(f"{where}: the layers' {name} differ ({[None if v is None else v.tolist() for v in values]}); "
                         f"one layer holds one {name}")
    return values[0]


def cat_per_row(layers, name) -> torch.Tensor:
    """The layers' per-row (or one-element, per-tensor) scales `name` as one per-row vector of them all."""
    return torch.cat([getattr(layer, name).reshape(-1).expand(layer.out_features) for layer in layers])


class QuantizedLinear(FormatBuffers):
    _format_buffers = ("weight", "weight_scale")
    # Scales: float32 in the module; loaded from fp32 / bf16 / fp16 checkpoints and reshaped by size-1 dims.
    _scale_buffers = ("weight_scale",)

    in_features: int
    out_features: int

    def dense_parameter_count(self) -> int:
        return self.in_features * self.out_features  # the bias is a parameter

    @classmethod
    def cat_out_features(cls, layers: Sequence["QuantizedLinear"]) -> "QuantizedLinear":
        """One layer whose output features are `layers`' in order (what fusing attention's q, k and v projections
        makes): each row keeps its codes and scales, so each slice of the output is what its layer gives. Refused,
        naming what differs, where the layers cannot be one layer (another class, format or in_features, a bias on
        some only, per-tensor values that differ and have no per-row form)."""
        layers, where = list(layers), f"{cls.__name__}.cat_out_features"
        if not layers:
            raise ValueError(f"{where}: no layers")
        for i, layer in enumerate(layers):
            if type(layer) is not cls:
                raise ValueError(f"{where}: layers[{i}] is a {type(layer).__name__}, expected {cls.__name__}")
        same_attributes(layers, ("in_features",), where)
        if len({layer.bias is None for layer in layers}) > 1:
            raise ValueError(f"{where}: some layers have a bias and some not ({[l.bias is not None for l in layers]})")
        bias = None if layers[0].bias is None else torch.cat([layer.bias.detach() for layer in layers])
        return cls._cat_rows(layers, bias, where)

    @classmethod
    def _cat_rows(cls, layers, bias, where):
        raise NotImplementedError(where)

    def _check_input(self, x: torch.Tensor) -> None:
        """The layer's own check of x, so that the error names the layer's argument rather than an op's internal
        one (Int8Linear's int8_mm sees xq); static under torch.compile."""
        if x.dim() >= 1 and x.shape[-1] != self.in_features:
            raise ValueError(f"{type(self).__name__}: x must be [..., in_features] = [..., {self.in_features}], got "
                             f"shape {tuple(x.shape)}")

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # the weight's entries first: a layer may adopt an optional scale buffer there, which the loop below reshapes
        self._load_weight_entry(state_dict, prefix + "weight", error_msgs)
        for name in self._scale_buffers:
            key, cur = prefix + name, getattr(self, name)
            if key not in state_dict or cur is None:
                continue
            v = state_dict[key]
            if v.shape != cur.shape and _squeezed(v.shape) == _squeezed(cur.shape):
                v = v.reshape(cur.shape)
            if v.is_floating_point() and v.dtype != cur.dtype:
                v = v.to(cur.dtype)
            state_dict[key] = v
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        # nn.Module saves parameters before buffers: the bias keeps its place after the weight's scale, as when it
        # was a buffer (weight, weight_scale, bias, input_scale), so state_dicts read as before
        key = prefix + "bias"
        if key in destination:
            bias = destination.pop(key)
            keys = list(destination)
            later = [(k, destination.pop(k)) for k in keys[keys.index(prefix + "weight_scale") + 1:]]
            destination[key] = bias
            destination.update(later)

    def _load_weight_entry(self, state_dict, key, error_msgs):
        raise NotImplementedError

    @staticmethod
    def _reject_weight(state_dict, key, error_msgs, expected):
        got = state_dict.pop(key).dtype
        error_msgs.append(f"{key}: expected {expected}, got {got}; quantize the weight first (from_float, "
                          f"quantize_fp8, quantize_int8) instead of loading a float weight into a quantized layer")
