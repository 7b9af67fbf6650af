"""W4Linear: W4A16 linear layer, 4-bit weights in one of the formats of ``torch_lowbit.w4_mm`` (nvfp4, mxfp4, int4
with optional zero points, uint4 with MLX's additive biases), group scales along K."""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
import torch.nn as nn

from .. import _ops
from .._storage import FP8, as_stored_fp8
from ..quantize import (AffineWeightOnly, Int4WeightOnly, Mxfp4WeightOnly, Nvfp4WeightOnly,
                        register_quantize_module_handler)
from ..quantize_w4 import W4_DEFAULT_GROUP, quantize_w4
from ._quantized_linear import QuantizedLinear, frozen_bias, same_attributes, same_tensor

# scale dtypes each format stores (the first is what a new layer holds); uint8 = bits of an 8-bit scale encoding
W4_SCALE_DTYPES = {
    "nvfp4": (FP8, torch.uint8),
    "mxfp4": (torch.uint8,),
    "int4": (torch.bfloat16, torch.float16, torch.float32),
    "uint4": (torch.bfloat16, torch.float16, torch.float32),
}


class W4OffsetKind(NamedTuple):
    """What weight_offset holds in a format that takes one."""
    name: str  # "zero points" / "biases"
    stored_as: str  # how a checkpoint stores them (for errors)
    holds: Callable[[torch.Tensor], bool]  # whether a checkpoint tensor is stored so


W4_OFFSETS = {"int4": W4OffsetKind("zero points", "int8 zero points", lambda t: t.dtype == torch.int8),
              "uint4": W4OffsetKind("biases", "floating biases", lambda t: t.is_floating_point() and t.element_size() > 1)}
W4_GLOBAL_SCALE = ("nvfp4",)
# the float8 dtype whose encoding a format's one-byte scales are (uint8 holds the same bits); a checkpoint's scales
# in another float8 dtype are another format's, whose bits would decode to other values
W4_SCALE_ENCODING = {"nvfp4": FP8, "mxfp4": getattr(torch, "float8_e8m0fnu", None)}


def check_w4_options(layer: str, format: str, scale_dtype: Optional[torch.dtype], offset: bool,
                     global_scale: bool) -> torch.dtype:
    """A 4-bit layer's format options, checked (errors name `layer`); returns the scale dtype it holds."""
    if format not in W4_SCALE_DTYPES:
        raise ValueError(f"{layer}: format must be one of {list(W4_SCALE_DTYPES)}, got {format!r}")
    scale_dtype = scale_dtype or W4_SCALE_DTYPES[format][0]
    if scale_dtype not in W4_SCALE_DTYPES[format]:
        raise ValueError(f"{layer}: format {format!r} stores scales as one of "
                         f"{[str(d) for d in W4_SCALE_DTYPES[format]]}, got {scale_dtype}")
    if offset and format not in W4_OFFSETS:
        raise ValueError(f"{layer}: format {format!r} takes no offset (formats with one: {list(W4_OFFSETS)})")
    if global_scale and format not in W4_GLOBAL_SCALE:
        raise ValueError(f"{layer}: format {format!r} takes no global scale")
    return scale_dtype


def _w4_scale_mismatch(format: str, v: torch.Tensor) -> Optional[str]:
    """Why checkpoint scales ``v`` are not scales of ``format`` (None if they are)."""
    encoding = W4_SCALE_ENCODING.get(format)
    if encoding is not None:  # one-byte codes: taken as bits, so only the format's own encoding (or raw bytes)
        ok = v.dtype == torch.uint8 or v.dtype == encoding
        expected = f"{encoding} codes (or their bits as uint8)"
    else:
        ok = v.is_floating_point() and v.element_size() > 1
        expected = "float16 / bfloat16 / float32 values"
    return None if ok else f"format {format!r} stores scales as {expected}"


def load_w4_entries(module: nn.Module, state_dict: dict, base: str, scale_2_shape, error_msgs: list) -> None:
    """Prepare a state_dict's entries ``{base}_packed / _scale / _offset / _scale_2`` for one 4-bit weight of
    ``module`` (a W4Linear, or one projection of W4Experts; ``base`` is the prefixed key stem) before nn.Module
    copies them: nn.Module's copy converts by value, which would turn one format's scale codes into another's
    values, so
    - one-byte scale codes (nvfp4's E4M3, mxfp4's E8M0, or their uint8 bits) are taken as bits, and scales or
      offsets that belong to another format are errors naming the key;
    - an offset or global scale the layer was built without is adopted (a strict=False load would drop it and
      run another weight), one the format cannot take is an error.
    """
    fmt, name = module.format, base.rsplit(".", 1)[-1]
    key = base + "_packed"
    if key in state_dict and state_dict[key].dtype != torch.uint8:
        QuantizedLinear._reject_weight(state_dict, key, error_msgs, "uint8 (two 4-bit codes per byte)")
    key, cur = base + "_scale", getattr(module, name + "_scale")
    if key in state_dict:
        why = _w4_scale_mismatch(fmt, state_dict[key])
        if why is not None:
            error_msgs.append(f"{key}: {why}, got {state_dict.pop(key).dtype} (a checkpoint of another 4-bit format?)")
        elif cur.element_size() == 1:
            state_dict[key] = state_dict[key].view(cur.dtype)
    key = base + "_offset"
    if key in state_dict:
        v = state_dict[key]
        if fmt not in W4_OFFSETS:
            error_msgs.append(f"{key}: format {fmt!r} takes no offset (formats with one: {list(W4_OFFSETS)})")
            state_dict.pop(key)
        elif not W4_OFFSETS[fmt].holds(v):
            error_msgs.append(f"{key}: format {fmt!r} stores offsets as {W4_OFFSETS[fmt].stored_as}, got {v.dtype} "
                              "(a checkpoint of another 4-bit format?)")
            state_dict.pop(key)
        elif getattr(module, name + "_offset") is None:
            dtype = torch.int8 if fmt == "int4" else cur.dtype
            setattr(module, name + "_offset", torch.zeros(cur.shape, dtype=dtype, device=cur.device))
    key = base + "_scale_2"
    if key in state_dict:
        if fmt not in W4_GLOBAL_SCALE:
            error_msgs.append(f"{key}: format {fmt!r} takes no global scale (formats with one: {list(W4_GLOBAL_SCALE)})")
            state_dict.pop(key)
        elif getattr(module, name + "_scale_2") is None:
            setattr(module, name + "_scale_2", torch.ones(scale_2_shape, dtype=torch.float32, device=cur.device))


class W4Linear(QuantizedLinear):
    """``y = x @ w.T + bias`` with ``w`` a 4-bit weight read as stored by ``torch_lowbit.w4_mm`` (fp32 accumulation,
    output in x's dtype; the weight is never dequantized in memory).

    Buffers: ``weight_packed`` uint8 ``[N, ceil(K/2)]`` (two codes per byte, even k in the low nibble),
    ``weight_scale`` ``[N, ceil(K/group_size)]`` in the format's scale dtype (never converted by ``.half()`` /
    ``.to(dtype)``), ``weight_offset`` (optional: int8 zero points for ``int4``, biases in the scale's dtype for
    ``uint4``), ``weight_scale_2`` (optional fp32 ``[1]``: nvfp4's per-tensor multiplier), ``bias`` ``[N]``.
    ``format`` and ``group_size`` are attributes.
    """
    _format_buffers = ("weight_packed", "weight_scale", "weight_offset", "weight_scale_2")
    _scale_buffers = ("weight_scale_2",)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, format: str = "int4",
                 group_size: Optional[int] = None, scale_dtype: Optional[torch.dtype] = None, offset: bool = False,
                 global_scale: bool = False, device=None, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        scale_dtype = check_w4_options("W4Linear", format, scale_dtype, offset, global_scale)
        self.in_features, self.out_features = int(in_features), int(out_features)
        N, K = self.out_features, self.in_features
        group_size = max(K, 1) if group_size is None else int(group_size)
        if group_size < 1:
            raise ValueError(f"W4Linear: group_size must be >= 1 (None: per channel), got {group_size}")
        self.format, self.group_size = format, group_size
        self._fp8_buffers = ("weight_scale",) if scale_dtype == FP8 else ()
        G = -(-K // group_size)
        self.register_buffer("weight_packed", torch.zeros(N, (K + 1) // 2, dtype=torch.uint8, device=device))
        scale = torch.zeros(N, G, dtype=torch.uint8 if scale_dtype == FP8 else scale_dtype, device=device)
        self.register_buffer("weight_scale", as_stored_fp8(scale) if scale_dtype == FP8 else scale)
        off_dtype = torch.int8 if format == "int4" else scale_dtype
        self.register_buffer("weight_offset", torch.zeros(N, G, dtype=off_dtype, device=device) if offset else None)
        self.register_buffer("weight_scale_2",
                             torch.ones(1, dtype=torch.float32, device=device) if global_scale else None)
        self.register_parameter("bias", frozen_bias(torch.zeros(N, dtype=dtype, device=device) if bias else None))

    @property
    def qweight(self) -> torch.Tensor:
        """``weight_packed`` under the name packed 4-bit layers (GPTQ, AWQ) give it: PEFT reads a LoRA target's
        device from ``qweight`` / ``weight`` / its first parameter, and a W4Linear without bias has none of the
        last two."""
        return self.weight_packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        return _ops.w4_mm(x, self.weight_packed, self.weight_scale, self.format, self.group_size, self.weight_offset,
                          self.weight_scale_2, self.bias)

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The dense ``[N, K]`` weight (fp32 arithmetic, rounded once to ``dtype``, default the bias's or bf16)."""
        dtype = dtype or (self.bias.dtype if self.bias is not None else torch.bfloat16)
        return _ops.w4_dequantize(self.weight_packed, self.weight_scale, self.format, self.group_size,
                                  self.in_features, self.weight_offset, self.weight_scale_2, dtype)

    @classmethod
    def _cat_rows(cls, layers, bias, where):
        first = layers[0]
        same_attributes(layers, ("format", "group_size"), where)
        same_attributes([layer.weight_scale for layer in layers], ("dtype",), where + ": weight_scale")
        if len({layer.weight_offset is None for layer in layers}) > 1:
            raise ValueError(f"{where}: some layers have {W4_OFFSETS[first.format].name} and some not")

        def cat(name):  # one-byte scales as their bits: no dtype conversion on the way
            parts = [getattr(layer, name) for layer in layers]
            if parts[0] is None:
                return None
            return torch.cat([p.view(torch.uint8) if p.element_size() == 1 else p for p in parts]).view(parts[0].dtype)

        return cls.from_quantized(cat("weight_packed"), cat("weight_scale"), format=first.format,
                                  group_size=first.group_size, in_features=first.in_features, bias=bias,
                                  weight_offset=cat("weight_offset"),
                                  weight_scale_2=same_tensor(layers, "weight_scale_2", where))

    @classmethod
    def from_quantized(cls, weight_packed: torch.Tensor, weight_scale: torch.Tensor, *, format: str,
                       group_size: int, in_features: int, bias: Optional[torch.Tensor] = None,
                       weight_offset: Optional[torch.Tensor] = None,
                       weight_scale_2: Optional[torch.Tensor] = None) -> "W4Linear":
        """A layer around existing tensors (a checkpoint's, converted to the layouts above); checked by one call of
        the op on an empty input, so a bad layout fails here with the op's message."""
        if not isinstance(weight_packed, torch.Tensor) or weight_packed.dtype != torch.uint8 or weight_packed.dim() != 2:
            raise ValueError("W4Linear.from_quantized: weight_packed must be uint8 [N, ceil(K/2)], got "
                             + (f"{weight_packed.dtype} of shape {tuple(weight_packed.shape)}"
                                if isinstance(weight_packed, torch.Tensor) else type(weight_packed).__name__))
        N = weight_packed.shape[0]
        layer = cls(in_features, N, bias=bias is not None, format=format, group_size=group_size,
                    scale_dtype=weight_scale.dtype, offset=weight_offset is not None,
                    global_scale=weight_scale_2 is not None, device="meta",
                    dtype=bias.dtype if bias is not None else torch.bfloat16)
        layer.weight_packed = weight_packed.contiguous()
        layer.weight_scale = as_stored_fp8(weight_scale.contiguous()) if weight_scale.dtype == FP8 else \
            weight_scale.contiguous()
        layer.weight_offset = None if weight_offset is None else weight_offset.contiguous()
        layer.weight_scale_2 = None if weight_scale_2 is None else weight_scale_2.to(torch.float32).reshape(1)
        layer.bias = frozen_bias(bias)
        if not weight_packed.is_meta:
            probe_dtype = bias.dtype if bias is not None else torch.float32
            layer(torch.empty(0, in_features, dtype=probe_dtype, device=weight_packed.device))
        return layer

    @classmethod
    def from_float(cls, linear: nn.Linear, format: str = "int4", group_size: Optional[int] = None,
                   symmetric: bool = True, *, scale_dtype: Optional[torch.dtype] = None,
                   rule: str = "mlx") -> "W4Linear":
        """Quantize an nn.Linear with :func:`torch_lowbit.quantize_w4.quantize_w4` (round to nearest, each format
        as its writer computes it; ``group_size`` None: the format's default, >= in_features: per channel). The
        bias is kept in its dtype."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"W4Linear.from_float: linear must be an nn.Linear, got {type(linear).__name__}")
        K = linear.in_features
        q = quantize_w4(linear.weight.detach(), format, group_size, symmetric, scale_dtype=scale_dtype, rule=rule)
        group = min(W4_DEFAULT_GROUP[format] if group_size is None else int(group_size), max(K, 1))  # as quantize_w4
        bias = None if linear.bias is None else linear.bias.detach()
        return cls.from_quantized(q.weight_packed, q.weight_scale, format=format, group_size=group, in_features=K,
                                  bias=bias, weight_offset=q.weight_offset, weight_scale_2=q.weight_scale_2)

    def extra_repr(self) -> str:
        s = (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
             f"format={self.format}, group_size={self.group_size}")
        if self.weight_offset is not None:
            s += f", offset={W4_OFFSETS[self.format].name}"
        return s

    def _load_weight_entry(self, state_dict, key, error_msgs):
        load_w4_entries(self, state_dict, key, (1,), error_msgs)


@register_quantize_module_handler(Int4WeightOnly)
def _quantize_int4_weight_only(linear: nn.Linear, config: Int4WeightOnly) -> W4Linear:
    group = max(linear.in_features, 1) if config.group_size is None else config.group_size
    return W4Linear.from_float(linear, "int4", group, config.symmetric)


@register_quantize_module_handler(Nvfp4WeightOnly)
def _quantize_nvfp4_weight_only(linear: nn.Linear, config: Nvfp4WeightOnly) -> W4Linear:
    return W4Linear.from_float(linear, "nvfp4")


@register_quantize_module_handler(Mxfp4WeightOnly)
def _quantize_mxfp4_weight_only(linear: nn.Linear, config: Mxfp4WeightOnly) -> W4Linear:
    return W4Linear.from_float(linear, "mxfp4")


@register_quantize_module_handler(AffineWeightOnly)
def _quantize_affine_weight_only(linear: nn.Linear, config: AffineWeightOnly) -> W4Linear:
    return W4Linear.from_float(linear, "uint4", config.group_size, rule=config.rule)
