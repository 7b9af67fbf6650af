"""Int8Linear: W8A8 dynamic linear layer, int8 per-channel weights and per-row int8 activations."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from .. import _ops
from ..quantize import Int8Dynamic, quantize_int8, register_quantize_module_handler
from ._quantized_linear import QuantizedLinear, cat_per_row, frozen_bias


class Int8Linear(QuantizedLinear):
    """``xq, xs = int8_quantize(x)``; ``y = int8_mm(xq, xs, weight, weight_scale, bias, out_dtype=x.dtype)``:
    symmetric absmax int8 activations per row (token), computed at run time, int32 accumulation. Trainable
    around (``torch_lowbit.int8_linear``): gradients reach ``x`` straight through the activation quantization,
    ``grad_x = grad_out @ (weight * weight_scale)``, and the bias; the weight is frozen.

    Buffers (checkpoint names): ``weight`` ``[N, K]`` int8, ``weight_scale`` float32 ``[N]`` (``[N, 1]`` and one
    element are accepted, as compressed-tensors' int-quantized format stores them); ``bias`` ``[N]`` (optional) is
    a parameter, frozen until trained (see ``frozen_bias``).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, device=None,
                 dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.in_features, self.out_features = int(in_features), int(out_features)
        N, K = self.out_features, self.in_features
        self.register_buffer("weight", torch.zeros(N, K, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.ones(N, dtype=torch.float32, device=device))
        self.register_parameter("bias", frozen_bias(torch.zeros(N, dtype=dtype, device=device) if bias else None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        return _ops.int8_linear(x, self.weight, self.weight_scale, self.bias)

    @classmethod
    def _cat_rows(cls, layers, bias, where):
        weight = torch.cat([layer.weight for layer in layers])
        return cls.from_quantized(weight, cat_per_row(layers, "weight_scale"), bias)

    @classmethod
    def from_quantized(cls, weight: torch.Tensor, weight_scale: torch.Tensor,
                       bias: Optional[torch.Tensor] = None) -> "Int8Linear":
        """A layer around existing tensors: ``weight`` ``[N, K]`` int8 used as is (made contiguous if it is not),
        ``weight_scale`` ``[N]``, ``[N, 1]`` or one element, widened to float32, keeping its shape."""
        if not isinstance(weight, torch.Tensor) or weight.dtype != torch.int8 or weight.dim() != 2:
            raise ValueError("Int8Linear.from_quantized: weight must be [N, K] int8, got "
                             + (f"{weight.dtype} of shape {tuple(weight.shape)}" if isinstance(weight, torch.Tensor)
                                else type(weight).__name__))
        N, K = weight.shape
        for name, t in (("weight_scale", weight_scale), ("bias", bias)):
            if t is None and name == "bias":
                continue
            if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dtype == torch.float8_e4m3fn:
                raise ValueError(f"Int8Linear.from_quantized: {name} must be a floating tensor, got "
                                 f"{getattr(t, 'dtype', type(t).__name__)}")
            if t.device != weight.device:
                raise ValueError(f"Int8Linear.from_quantized: {name} is on {t.device} but weight is on {weight.device}")
        if not (weight_scale.numel() == 1 or tuple(weight_scale.shape) in ((N,), (N, 1))):
            raise ValueError(f"Int8Linear.from_quantized: weight_scale must be [N] = [{N}], [N, 1] or one element, got "
                             f"{tuple(weight_scale.shape)}")
        if bias is not None and tuple(bias.shape) != (N,):
            raise ValueError(f"Int8Linear.from_quantized: bias must be [N] = [{N}], got {tuple(bias.shape)}")
        layer = cls(K, N, bias=bias is not None, device="meta",
                    dtype=bias.dtype if bias is not None else torch.bfloat16)
        layer.weight = weight.contiguous()
        layer.weight_scale = weight_scale.to(torch.float32)
        layer.bias = frozen_bias(bias)
        return layer

    @classmethod
    def from_float(cls, linear: nn.Linear) -> "Int8Linear":
        """Quantize an nn.Linear with ``quantize_int8`` (per output channel). The bias is kept in its dtype."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"Int8Linear.from_float: linear must be an nn.Linear, got {type(linear).__name__}")
        wq, s = quantize_int8(linear.weight.detach())
        return cls.from_quantized(wq, s, None if linear.bias is None else linear.bias.detach())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"activations=int8 per row (dynamic)")

    def _load_weight_entry(self, state_dict, key, error_msgs):
        if key in state_dict and state_dict[key].dtype != torch.int8:
            self._reject_weight(state_dict, key, error_msgs, "int8")


@register_quantize_module_handler(Int8Dynamic)
def _quantize_int8_dynamic(linear: nn.Linear, config: Int8Dynamic) -> Int8Linear:
    return Int8Linear.from_float(linear)
