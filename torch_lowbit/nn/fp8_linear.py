"""Fp8Linear: W8A16 linear layer, fp8 (e4m3fn) weights with per-tensor / per-channel / block scales."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn

from .. import _ops
from .._storage import FP8, as_fp8_dtype, as_stored_fp8
from ..quantize import check_granularity, normalize_block_size, quantize_fp8
from ._quantized_linear import QuantizedLinear


def _scale_shape(granularity, block_size, N, K):
    if granularity == "tensor":
        return (1,)
    if granularity == "channel":
        return (N,)
    return (math.ceil(N / block_size[0]), math.ceil(K / block_size[1]))


def _infer_granularity(weight_scale, block_size, N, K):
    """The granularity a scale tensor encodes for an [N, K] weight (the op's rules), or a ValueError."""
    shape = tuple(weight_scale.shape)
    if block_size is not None:
        want = _scale_shape("block", block_size, N, K)
        if shape != want:
            raise ValueError(f"Fp8Linear: with block_size={block_size} weight_scale must have shape {want} "
                             f"(ceil(N/block_n), ceil(K/block_k)) for weight [{N}, {K}], got {shape}")
        return "block"
    if weight_scale.numel() == 1:
        return "tensor"
    if shape in ((N,), (N, 1)):
        return "channel"
    hint = "; 2-D block scales need block_size=(block_n, block_k)" if weight_scale.dim() == 2 else ""
    raise ValueError(f"Fp8Linear: weight_scale must have one element (per tensor), shape [N] or [N, 1] (per channel) "
                     f"or be block scales with block_size, for weight [{N}, {K}]; got {shape}{hint}")


class Fp8Linear(QuantizedLinear):
    """``y = x @ (fp8(weight) * weight_scale).T + bias``, computed by ``torch_lowbit.fp8_mm`` (fp32 accumulation,
    output in x's dtype, the weight never dequantized in memory).

    Buffers (checkpoint names): ``weight`` ``[N, K]`` float8_e4m3fn (held as uint8 bits on a device that cannot
    hold fp8: mps before PyTorch 2.15; state_dicts always carry float8_e4m3fn), ``weight_scale`` float32 (``[1]``
    per tensor, ``[N]`` per channel, ``[ceil(N/bn), ceil(K/bk)]`` per block; 0-d and ``[N, 1]`` are accepted),
    ``bias`` ``[N]`` in ``dtype`` (optional), ``input_scale`` (optional: the static activation scale of ModelOpt /
    compressed-tensors checkpoints, kept for round trips, unused by this weight-only layer).
    """
    _format_buffers = ("weight", "weight_scale", "input_scale")
    _scale_buffers = ("weight_scale", "input_scale")

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, granularity: str = "channel",
                 block_size=None, device=None, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        check_granularity(granularity)
        if granularity == "block":
            block_size = normalize_block_size((128, 128) if block_size is None else block_size)
        elif block_size is not None:
            raise ValueError(f"Fp8Linear: block_size is only used with granularity='block', got block_size="
                             f"{block_size!r} with granularity={granularity!r}")
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.granularity, self.block_size = granularity, block_size
        N, K = self.out_features, self.in_features
        self.register_buffer("weight", as_stored_fp8(torch.zeros(N, K, dtype=torch.uint8, device=device)))
        self.register_buffer("weight_scale", torch.ones(_scale_shape(granularity, block_size, N, K),
                                                        dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(N, dtype=dtype, device=device) if bias else None)
        self.register_buffer("input_scale", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        return _ops.fp8_mm(x, self.weight, self.weight_scale, self.bias, self.block_size)

    @classmethod
    def from_quantized(cls, weight: torch.Tensor, weight_scale: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                       block_size=None, input_scale: Optional[torch.Tensor] = None) -> "Fp8Linear":
        """A layer around existing tensors (e.g. from a checkpoint). ``weight`` ``[N, K]`` float8_e4m3fn or uint8 bits
        is used as is (made contiguous if it is not); scales are widened to float32 and keep their shape; the
        granularity follows from ``weight_scale``'s shape and ``block_size``."""
        if not isinstance(weight, torch.Tensor) or weight.dtype not in (FP8, torch.uint8) or weight.dim() != 2:
            raise ValueError("Fp8Linear.from_quantized: weight must be [N, K] float8_e4m3fn or uint8 (fp8 bits), got "
                             + (f"{weight.dtype} of shape {tuple(weight.shape)}" if isinstance(weight, torch.Tensor)
                                else type(weight).__name__))
        N, K = weight.shape
        block_size = None if block_size is None else normalize_block_size(block_size)
        for name, t in (("weight_scale", weight_scale), ("bias", bias), ("input_scale", input_scale)):
            if t is None and name != "weight_scale":
                continue
            if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dtype == FP8:
                raise ValueError(f"Fp8Linear.from_quantized: {name} must be a floating tensor, got "
                                 f"{getattr(t, 'dtype', type(t).__name__)}")
            if t.device != weight.device:
                raise ValueError(f"Fp8Linear.from_quantized: {name} is on {t.device} but weight is on {weight.device}")
        if bias is not None and tuple(bias.shape) != (N,):
            raise ValueError(f"Fp8Linear.from_quantized: bias must be [N] = [{N}], got {tuple(bias.shape)}")
        granularity = _infer_granularity(weight_scale, block_size, N, K)
        layer = cls(K, N, bias=bias is not None, granularity=granularity, block_size=block_size, device="meta",
                    dtype=bias.dtype if bias is not None else torch.bfloat16)
        layer.weight = as_stored_fp8(weight.contiguous())
        layer.weight_scale = weight_scale.to(torch.float32)
        layer.bias = bias
        layer.input_scale = None if input_scale is None else input_scale.to(torch.float32)
        return layer

    @classmethod
    def from_float(cls, linear: nn.Linear, granularity: str = "channel", block_size=(128, 128)) -> "Fp8Linear":
        """Quantize an nn.Linear with ``quantize_fp8`` (``block_size`` is used only with ``granularity="block"``).
        The bias is kept in its dtype."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"Fp8Linear.from_float: linear must be an nn.Linear, got {type(linear).__name__}")
        w, s = quantize_fp8(linear.weight.detach(), granularity, block_size)
        bias = None if linear.bias is None else linear.bias.detach()
        return cls.from_quantized(w, s, bias, block_size=block_size if granularity == "block" else None)

    def extra_repr(self) -> str:
        s = (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
             f"granularity={self.granularity}")
        if self.block_size is not None:
            s += f", block_size={self.block_size}"
        if self.weight.dtype != FP8:
            s += ", weight held as uint8 bits"
        return s

    # ---- fp8 <-> uint8 bits at the edges
    def _move_format_buffer(self, name, t, fn):
        if name != "weight":
            return super()._move_format_buffer(name, t, fn)
        bits = t.view(torch.uint8)  # uint8 is never converted by module dtype casts, and moves to any device
        moved = fn(bits)
        if moved.dtype != torch.uint8:
            moved = bits.to(moved.device)
        return as_stored_fp8(moved)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = as_fp8_dtype(destination[prefix + "weight"])

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        self._adopt_optional_buffer("input_scale", state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _load_weight_entry(self, state_dict, key, error_msgs):
        if key not in state_dict:
            return
        v = state_dict[key]
        if v.dtype not in (FP8, torch.uint8):
            return self._reject_weight(state_dict, key, error_msgs, "float8_e4m3fn (or uint8 fp8 bits)")
        if v.dtype != self.weight.dtype:  # the same bytes, never a value conversion
            state_dict[key] = v.view(self.weight.dtype)
