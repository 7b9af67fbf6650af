"""What Fp8Linear and Int8Linear share: dtype-stable quantized buffers under ``.to()`` / ``.half()`` (see
``_format_buffers``), a bias that is a frozen parameter, and loading checkpoint scales whose shape differs only by
size-1 dims (``[N, 1]`` vs ``[N]``, 0-d vs ``[1]``)."""
from __future__ import annotations

from typing import Optional

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


class QuantizedLinear(FormatBuffers):
    _format_buffers = ("weight", "weight_scale")
    # Scales: float32 in the module; loaded from fp32 / bf16 / fp16 checkpoints and reshaped by size-1 dims.
    _scale_buffers = ("weight_scale",)

    in_features: int
    out_features: int

    def dense_parameter_count(self) -> int:
        return self.in_features * self.out_features  # the bias is a parameter

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
