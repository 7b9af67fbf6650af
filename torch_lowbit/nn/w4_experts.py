"""W4Experts: the SwiGLU experts of a mixture-of-experts block with stacked 4-bit weights (the formats of
``torch_lowbit.w4_mm``), run by ``w4_grouped_mm``. The interface and routing of :class:`Fp8Experts`
(``forward(hidden, topk_ids, topk_weights)``, gate rows then up rows in ``gate_up``)."""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
from torch import nn

from .._ops import w4_dequantize, w4_grouped_mm
from .._storage import FP8, as_stored_fp8
from ..quantize import (AffineWeightOnly, Int4WeightOnly, Mxfp4WeightOnly, Nvfp4WeightOnly,
                        register_quantize_experts_handler)
from ..quantize_w4 import W4_DEFAULT_GROUP, quantize_w4
from ._format_buffers import FormatBuffers
from .experts import attach_dense_template, combine, route, swiglu_weight_count
from .w4_linear import W4_OFFSETS, W4_SCALE_DTYPES, check_w4_options, load_w4_entries

_PROJECTIONS = ("gate_up", "down")
# from_float quantizes this many weight elements at a time (slices of whole experts): quantize_w4's float32
# temporaries stay a few hundred MB where a real MoE layer's projection (Qwen3-30B-A3B: 128 x 1536 x 2048) would
# take several GB at once
_QUANTIZE_SLICE_ELEMENTS = 1 << 26


def _quantize_experts(w: torch.Tensor, format: str, group_size: int, symmetric: bool, **kw) -> dict:
    E, N, K = w.shape
    step = max(1, _QUANTIZE_SLICE_ELEMENTS // max(N * K, 1))
    parts = [quantize_w4(w[i:i + step], format, group_size, symmetric, **kw) for i in range(0, max(E, 1), step)]
    return {name: None if parts[0][i] is None else torch.cat([q[i] for q in parts]) if len(parts) > 1 else parts[0][i]
            for i, name in enumerate(("packed", "scale", "offset", "scale_2"))}


# name -> fn(gate_up fp32 [rows, 2I], layer) -> fp32 [rows, I]: what an experts layer computes between its two
# products (W4Experts' ``activation``); "swiglu" is silu(gate) * up with the gate rows first
EXPERT_ACTIVATIONS: Dict[str, Callable[[torch.Tensor, torch.nn.Module], torch.Tensor]] = {}


def register_expert_activation(name: str):
    """Decorator: ``fn(gate_up, layer)`` becomes the activation ``W4Experts(activation=name)`` computes (fp32 in,
    fp32 out; ``layer`` carries its parameters). A name is registered once."""
    def decorator(fn):
        if name in EXPERT_ACTIVATIONS and EXPERT_ACTIVATIONS[name] is not fn:
            raise ValueError(f"register_expert_activation: {name!r} is already registered")
        EXPERT_ACTIVATIONS[name] = fn
        return fn
    return decorator


@register_expert_activation("swiglu")
def _swiglu(gate_up: torch.Tensor, layer) -> torch.Tensor:
    gate, up = gate_up.split(layer.intermediate_size, dim=-1)
    return torch.nn.functional.silu(gate) * up


def expert_row_bias(bias: torch.Tensor, r) -> torch.Tensor:
    """fp32 ``[rows, N]``: each sorted row's expert's bias ``bias [E, N]``; zeros for skipped slots (sorted id E),
    whose rows the grouped product leaves zero."""
    padded = torch.cat([bias.float(), bias.new_zeros(1, bias.shape[-1], dtype=torch.float32)])
    return padded[r.sorted_ids]


class W4Experts(FormatBuffers):
    """E SwiGLU experts with 4-bit weights: ``gate_up`` ``[E, 2I, H]`` (gate rows, then up rows) and ``down``
    ``[E, H, I]``, each stored as W4Linear stores one weight, stacked over experts:
    ``{p}_packed`` uint8 ``[E, rows, ceil(cols/2)]``, ``{p}_scale`` ``[E, rows, ceil(cols/group_size)]`` in the
    format's scale dtype, ``{p}_offset`` (optional: zero points / biases, the scale's shape) and ``{p}_scale_2``
    (optional fp32 ``[E]``: nvfp4's per-expert multiplier), for p in gate_up, down. ``format`` and
    ``group_size`` are shared by both projections.

    ``forward`` routes as Fp8Experts does (no host synchronization; negative ids skip a slot), and runs
    ``w4_grouped_mm`` for each projection with SwiGLU between them in fp32.

    ``activation``: a name of :data:`EXPERT_ACTIVATIONS` (default ``"swiglu"``; gpt-oss registers its own).
    ``bias=True`` adds ``{p}_bias`` ``[E, rows]`` (the dense model's dtype: not a format buffer), each row's
    expert's bias added in fp32 after that projection's product.
    """
    _format_buffers = tuple(f"{p}_{s}" for p in _PROJECTIONS for s in ("packed", "scale", "offset", "scale_2"))

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, format: str = "int4",
                 group_size: int = 128, scale_dtype: Optional[torch.dtype] = None, offset: bool = False,
                 global_scale: bool = False, device=None, dtype: torch.dtype = torch.bfloat16,
                 activation: str = "swiglu", bias: bool = False):
        super().__init__()
        if activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"W4Experts: activation must be one of {list(EXPERT_ACTIVATIONS)}, got {activation!r}")
        self.activation = activation
        scale_dtype = check_w4_options("W4Experts", format, scale_dtype, offset, global_scale)
        if int(group_size) < 1:
            raise ValueError(f"W4Experts: group_size must be >= 1, got {group_size}")
        E, H, I = int(num_experts), int(hidden_size), int(intermediate_size)
        self.num_experts, self.hidden_size, self.intermediate_size = E, H, I
        self.format, self.group_size, self.dtype = format, int(group_size), dtype
        self._fp8_buffers = tuple(f"{p}_scale" for p in _PROJECTIONS) if scale_dtype == FP8 else ()
        for p, (rows, cols) in zip(_PROJECTIONS, ((2 * I, H), (H, I))):
            G = -(-cols // self.group_size)
            self.register_buffer(f"{p}_packed", torch.zeros(E, rows, (cols + 1) // 2, dtype=torch.uint8, device=device))
            scale = torch.zeros(E, rows, G, dtype=torch.uint8 if scale_dtype == FP8 else scale_dtype, device=device)
            self.register_buffer(f"{p}_scale", as_stored_fp8(scale) if scale_dtype == FP8 else scale)
            off_dtype = torch.int8 if format == "int4" else scale_dtype
            self.register_buffer(f"{p}_offset",
                                 torch.zeros(E, rows, G, dtype=off_dtype, device=device) if offset else None)
            self.register_buffer(f"{p}_scale_2",
                                 torch.ones(E, dtype=torch.float32, device=device) if global_scale else None)
            self.register_buffer(f"{p}_bias", torch.zeros(E, rows, dtype=dtype, device=device) if bias else None)

    def dense_parameter_count(self) -> int:  # and the experts' biases (buffers here)
        biases = (getattr(self, f"{p}_bias") for p in _PROJECTIONS)
        return swiglu_weight_count(self) + sum(b.numel() for b in biases if b is not None)

    def _project(self, p: str, x: torch.Tensor, r) -> torch.Tensor:
        return w4_grouped_mm(x, getattr(self, f"{p}_packed"), getattr(self, f"{p}_scale"), self.format,
                             self.group_size, r.offsets, r.expert_ids, getattr(self, f"{p}_offset"),
                             getattr(self, f"{p}_scale_2"))

    def _biased(self, p: str, y: torch.Tensor, r) -> torch.Tensor:
        """The product `y` plus its rows' expert biases, in fp32 (y itself where the layer has none)."""
        bias = getattr(self, f"{p}_bias", None)
        return y if bias is None else y.float() + expert_row_bias(bias, r)

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        x, r = route(self, hidden, topk_ids, topk_weights)
        gu = self._biased("gate_up", self._project("gate_up", x[r.tokens], r), r)
        h = EXPERT_ACTIVATIONS[self.activation](gu.float(), self).to(x.dtype)
        y = self._biased("down", self._project("down", h, r), r)
        return combine(y, topk_weights, r, hidden)

    @classmethod
    def from_quantized(cls, gate_up: dict, down: dict, *, format: str, group_size: int, hidden_size: int,
                       intermediate_size: int, dtype: torch.dtype = torch.bfloat16,
                       activation: str = "swiglu") -> "W4Experts":
        """Wrap stacked 4-bit tensors without copying them: ``gate_up`` / ``down`` are dicts with ``packed``,
        ``scale`` and optionally ``offset``, ``scale_2`` and ``bias`` (``[E, rows]``) (the layouts of the class
        docstring). Checked by one call of the op per projection on no rows, so a bad layout fails here with the
        op's message."""
        E = gate_up["packed"].shape[0]
        m = cls(E, hidden_size, intermediate_size, format=format, group_size=group_size,
                scale_dtype=gate_up["scale"].dtype, offset=gate_up.get("offset") is not None,
                global_scale=gate_up.get("scale_2") is not None, device="meta", dtype=dtype,
                activation=activation, bias=gate_up.get("bias") is not None)
        for p, t, rows in zip(_PROJECTIONS, (gate_up, down), (2 * intermediate_size, hidden_size)):
            if any((t.get(k) is None) != (gate_up.get(k) is None) for k in ("offset", "scale_2", "bias")):
                raise ValueError("W4Experts.from_quantized: gate_up and down must both have, or both lack, offset, "
                                 "scale_2 and bias")
            if t.get("bias") is not None:
                if tuple(t["bias"].shape) != (E, rows) or not t["bias"].is_floating_point():
                    raise ValueError(f"W4Experts.from_quantized: {p} bias must be a floating [E, rows] = "
                                     f"{[E, rows]} tensor, got {t['bias'].dtype} of shape {list(t['bias'].shape)}")
                setattr(m, f"{p}_bias", t["bias"].contiguous())
            scale = t["scale"].contiguous()
            setattr(m, f"{p}_packed", t["packed"].contiguous())
            setattr(m, f"{p}_scale", as_stored_fp8(scale) if scale.dtype == FP8 else scale)
            setattr(m, f"{p}_offset", None if t.get("offset") is None else t["offset"].contiguous())
            setattr(m, f"{p}_scale_2", None if t.get("scale_2") is None else
                    t["scale_2"].to(torch.float32).reshape(E).contiguous())
        device = gate_up["packed"].device
        if device.type != "meta":
            none = torch.zeros(1, dtype=torch.int32, device=device)
            for p, cols in zip(_PROJECTIONS, (hidden_size, intermediate_size)):
                m._project(p, torch.empty(0, cols, dtype=dtype, device=device),
                           type("R", (), {"offsets": none, "expert_ids": none[:0]})())
        return m

    @classmethod
    def from_float(cls, gate_up: torch.Tensor, down: torch.Tensor, format: str = "int4",
                   group_size: Optional[int] = None, symmetric: bool = True, *,
                   scale_dtype: Optional[torch.dtype] = None, rule: str = "mlx") -> "W4Experts":
        """Quantize dense stacked experts ``gate_up [E, 2I, H]`` and ``down [E, H, I]`` with
        :func:`torch_lowbit.quantize_w4.quantize_w4` (each expert as its own weight, many experts per call, in slices
        that bound the float32 temporaries; nvfp4: a tensor scale per expert and projection). ``group_size``: None
        for the format's default; one value for both projections, per channel for a projection whose K (H, or I) it
        reaches. ``symmetric``, ``scale_dtype``, ``rule``: as quantize_w4. The layer computes the [gate; up] SwiGLU
        with no biases."""
        fn = "W4Experts.from_float"
        for name, w in (("gate_up", gate_up), ("down", down)):
            if not isinstance(w, torch.Tensor) or w.dim() != 3 or not w.is_floating_point():
                raise ValueError(f"{fn}: {name} must be a floating-point 3-D tensor, got "
                                 + (f"{w.dtype} of shape {tuple(w.shape)}" if isinstance(w, torch.Tensor)
                                    else type(w).__name__))
        E, I2, H = gate_up.shape
        if I2 % 2 or tuple(down.shape) != (E, H, I2 // 2):
            raise ValueError(f"{fn}: gate_up must be [E, 2I, H] and down [E, H, I]; got gate_up "
                             f"{list(gate_up.shape)} and down {list(down.shape)}")
        if format not in W4_DEFAULT_GROUP:
            raise ValueError(f"{fn}: format must be one of {list(W4_DEFAULT_GROUP)}, got {format!r}")
        group = W4_DEFAULT_GROUP[format] if group_size is None else int(group_size)
        gu, dn = (_quantize_experts(w.detach(), format, group, symmetric, scale_dtype=scale_dtype, rule=rule)
                  for w in (gate_up, down))
        dtype = gate_up.dtype if gate_up.dtype in W4_SCALE_DTYPES["int4"] else torch.float32  # a compute dtype
        return cls.from_quantized(gu, dn, format=format, group_size=group, hidden_size=H, intermediate_size=I2 // 2,
                                  dtype=dtype)

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """The dense ``(gate_up [E, 2I, H], down [E, H, I])`` as ``w4_grouped_mm`` reads them (the format's fp32
        arithmetic, rounded once to ``dtype``, default the layer's ``dtype``; biases, if any, not included)."""
        dtype = dtype or self.dtype
        out = []
        for p, K in zip(_PROJECTIONS, (self.hidden_size, self.intermediate_size)):
            packed, scale, offset, scale_2 = (getattr(self, f"{p}_{s}") for s in ("packed", "scale", "offset",
                                                                                   "scale_2"))
            out.append(torch.stack([w4_dequantize(packed[e], scale[e], self.format, self.group_size, K,
                                                  None if offset is None else offset[e],
                                                  None if scale_2 is None else scale_2[e:e + 1], dtype)
                                    for e in range(self.num_experts)]) if self.num_experts else
                       torch.empty(0, *packed.shape[1:2], K, dtype=dtype, device=packed.device))
        return out[0], out[1]

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        for p in _PROJECTIONS:
            load_w4_entries(self, state_dict, prefix + p, (self.num_experts,), error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def extra_repr(self) -> str:
        s = (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
             f"intermediate_size={self.intermediate_size}, format={self.format}, group_size={self.group_size}")
        if self.gate_up_offset is not None:
            s += f", offset={W4_OFFSETS[self.format].name}"
        if self.activation != "swiglu":
            s += f", activation={self.activation}"
        if self.gate_up_bias is not None:
            s += ", biases"
        return s


def _from_experts(experts: nn.Module, format: str, group_size: Optional[int], **kw) -> W4Experts:
    return attach_dense_template(W4Experts.from_float(experts.gate_up_proj.detach(), experts.down_proj.detach(),
                                                      format, group_size, **kw), experts)


@register_quantize_experts_handler(Int4WeightOnly)
def _quantize_int4_experts(experts: nn.Module, config: Int4WeightOnly) -> W4Experts:
    E, I2, H = experts.gate_up_proj.shape
    group = max(H, I2 // 2, 1) if config.group_size is None else config.group_size  # per channel in both
    return _from_experts(experts, "int4", group, symmetric=config.symmetric)


@register_quantize_experts_handler(Nvfp4WeightOnly)
def _quantize_nvfp4_experts(experts: nn.Module, config: Nvfp4WeightOnly) -> W4Experts:
    return _from_experts(experts, "nvfp4", None)


@register_quantize_experts_handler(Mxfp4WeightOnly)
def _quantize_mxfp4_experts(experts: nn.Module, config: Mxfp4WeightOnly) -> W4Experts:
    return _from_experts(experts, "mxfp4", None)


@register_quantize_experts_handler(AffineWeightOnly)
def _quantize_affine_experts(experts: nn.Module, config: AffineWeightOnly) -> W4Experts:
    return _from_experts(experts, "uint4", config.group_size, rule=config.rule)
