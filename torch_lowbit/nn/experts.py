"""Fp8Experts: the SwiGLU experts of a mixture-of-experts block, with stacked FP8 weights, run by fp8_grouped_mm.

Interface of transformers' fused experts modules (``Qwen3MoeExperts`` and friends since transformers 5):
``forward(hidden [T, H], topk_ids [T, k], topk_weights [T, k]) -> [T, H]``; the router that picks the experts
stays outside. Expert e computes ``down_e(silu(gate_e(x)) * up_e(x))``, with ``gate_up[e]`` holding the gate rows
first, then the up rows.
"""
from __future__ import annotations

import copy
import math
from typing import NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .._ops import fp8_dequantize, fp8_grouped_mm
from .._storage import as_fp8_dtype, fp8_storage_dtype, to_fp8_storage
from ..granularity import Granularity, GranularityLike, PerBlock, as_granularity, granularity_with_block_hint
from ..quantize import Fp8WeightOnly, quantize_fp8, register_quantize_experts_handler
from ._format_buffers import FormatBuffers

def check_inputs(layer: nn.Module, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
    """Shape and dtype checks of an experts layer's forward (static under torch.compile), so that a wrong argument
    is named, not a reshape."""
    what, H = type(layer).__name__, layer.hidden_size
    if hidden.dim() < 1 or hidden.shape[-1] != H:
        raise ValueError(f"{what}: hidden must be [..., hidden_size] = [..., {H}], got shape {tuple(hidden.shape)}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype.is_complex or topk_ids.dtype == torch.bool:
        raise ValueError(f"{what}: topk_ids must be an integer tensor, got {topk_ids.dtype}")
    T = math.prod(hidden.shape[:-1])
    if topk_ids.dim() < 1 or math.prod(topk_ids.shape[:-1]) != T:
        raise ValueError(f"{what}: topk_ids must be [T, k] with T = {T} tokens (hidden is "
                         f"{tuple(hidden.shape)}), got shape {tuple(topk_ids.shape)}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"{what}: topk_weights must have topk_ids' shape {tuple(topk_ids.shape)}, got "
                         f"{tuple(topk_weights.shape)}")
    if not topk_weights.is_floating_point():
        raise ValueError(f"{what}: topk_weights must be a floating tensor, got {topk_weights.dtype}")


def attach_dense_template(layer: nn.Module, experts: nn.Module) -> nn.Module:
    """Keep the model's own experts module, its two tensors on the meta device, outside ``layer``'s module tree (no
    state, not walked): what ``torch_lowbit.dequantize_model`` rebuilds with ``layer.dequantize()``, so that the
    dense copy has the class the model expects. Returns ``layer``."""
    memo = {id(t): (nn.Parameter(t.detach().to("meta"), requires_grad=False) if isinstance(t, nn.Parameter)
                    else t.detach().to("meta")) for t in (experts.gate_up_proj, experts.down_proj)}
    object.__setattr__(layer, "_dense_template", copy.deepcopy(experts, memo))
    return layer


class Routing(NamedTuple):
    """Token-expert pairs sorted by expert: pair i (in sorted order) is slot ``order[i]`` of the flattened
    ``[T, k]`` routing, token ``tokens[i]``, expert ``sorted_ids[i]`` (E for a skipped slot, sorted past every
    group); expert e's pairs are rows ``offsets[e]:offsets[e + 1]``."""
    order: torch.Tensor
    sorted_ids: torch.Tensor
    tokens: torch.Tensor
    offsets: torch.Tensor      # int32 [E + 1]
    expert_ids: torch.Tensor   # int32 arange(E)
    k: int


def route(layer: nn.Module, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
    """(hidden as [T, H], Routing) after check_inputs; no host synchronization."""
    check_inputs(layer, hidden, topk_ids, topk_weights)
    E = layer.num_experts
    x = hidden.reshape(-1, layer.hidden_size)
    ids = topk_ids.reshape(-1).to(torch.int64)
    torch._assert_async((ids < E).all(),
                        f"{type(layer).__name__}: topk_ids must be < num_experts (negative ids skip a slot)")
    # skipped slots get id E: after sorting they lie past offsets[E], in no group, and come out as zeros
    ids = torch.where(ids < 0, torch.full_like(ids, E), ids)
    order = torch.argsort(ids, stable=True)
    sorted_ids = ids[order]
    bounds = torch.arange(E + 1, device=ids.device, dtype=torch.int64)
    offsets = torch.searchsorted(sorted_ids, bounds, out_int32=True)
    expert_ids = torch.arange(E, device=ids.device, dtype=torch.int32)
    k = topk_ids.shape[-1]
    return x, Routing(order, sorted_ids, order // k, offsets, expert_ids, k)


def swiglu_weight_count(layer: nn.Module) -> int:
    """The weights of E SwiGLU experts: gate, up and down, each H x I (a fused experts layer's dense parameters)."""
    return 3 * layer.num_experts * layer.hidden_size * layer.intermediate_size


def swiglu(gate_up: torch.Tensor, I: int, dtype: torch.dtype) -> torch.Tensor:
    """silu(gate) * up of each row of ``gate_up [rows, 2I]`` (gate first), in fp32, rounded once to `dtype`."""
    gate, up = gate_up.float().split(I, dim=-1)
    return (F.silu(gate) * up).to(dtype)


def combine(y: torch.Tensor, topk_weights: torch.Tensor, r: Routing, hidden: torch.Tensor) -> torch.Tensor:
    """Sum of each token's expert outputs ``y`` (rows in the Routing's sorted order) weighted by its routing
    weights, in fp32, rounded once to hidden's dtype and shape."""
    E = r.expert_ids.numel()
    w = topk_weights.reshape(-1)[r.order].float()
    w = torch.where(r.sorted_ids < E, w, torch.zeros_like(w))  # a skipped slot's weight may be anything
    contrib = y.float() * w[:, None]
    # back to (token, slot) order, then a fixed-order sum over the k slots: deterministic on every device
    per_slot = torch.empty_like(contrib).index_copy_(0, r.order, contrib)
    out = per_slot.reshape(-1, r.k, y.shape[-1]).sum(dim=1)
    return out.to(hidden.dtype).reshape(hidden.shape)


def _quantize_stacked(w: torch.Tensor, granularity: Granularity) -> Tuple[torch.Tensor, torch.Tensor]:
    """quantize_fp8 of each expert of ``w [E, N, K]``, stacked: scales ``[E]``, ``[E, N]`` or ``[E, nb, kb]``."""
    E, N, K = w.shape
    parts = [quantize_fp8(w[e], granularity) for e in range(E)]
    q = torch.stack([as_fp8_dtype(p[0]) for p in parts]) if parts else torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    shape = granularity.scale_shape(N, K, experts=E)
    s = torch.stack([p[1] for p in parts]).reshape(shape) if parts else torch.ones(shape)
    return q, s


def _normalize_scale(name: str, scale: torch.Tensor, E: int, N: int, K: int,
                     block_size) -> Tuple[torch.Tensor, Granularity]:
    """(fp32 scale in its canonical shape [E] / [E, N] / [E, nb, kb], its granularity); ``block_size`` applies to
    the scales that have its block shape (gate_up and down may differ)."""
    g = granularity_with_block_hint(scale.shape, N, K, block_size, experts=E, what=f"Fp8Experts: {name}")
    return scale.detach().to(torch.float32).reshape(g.scale_shape(N, K, experts=E)).contiguous(), g


class Fp8Experts(FormatBuffers):
    """E SwiGLU experts with FP8 weights: ``gate_up [E, 2I, H]`` (gate rows, then up rows), ``down [E, H, I]``.

    Scales (fp32), chosen per projection: ``[E]`` per tensor, ``[E, rows]`` per channel, or
    ``[E, ceil(rows/bn), ceil(cols/bk)]`` per block with ``block_size=(bn, bk)``.

    ``forward(hidden [T, H] (or [..., H]), topk_ids [T, k], topk_weights [T, k])``: token t gets
    ``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t])``. A negative id skips that slot (a token whose
    ids are all negative gets zeros); experts that receive no token cost nothing. Token-expert pairs are sorted by
    expert so that each expert's rows are one group of ``fp8_grouped_mm``; the weighted results are summed per
    token in fp32 and rounded once to hidden's dtype. No host synchronization and no data-dependent Python
    control flow: the layer traces under ``torch.compile(fullgraph=True)``.

    Activations: the experts compute W8A16. ``activation_scheme`` records the activation quantization a
    checkpoint wrote them for (None, ``"dynamic"`` FP8 per token, ``"static"`` FP8 per tensor with
    ``input_scale [E, 3]``: each expert's gate, up and down input scales), so that ``save_quantized`` writes the
    checkpoint's scheme back instead of relabelling it.
    """
    _format_buffers = ("gate_up", "down", "gate_up_scale", "down_scale", "input_scale")
    _fp8_buffers = ("gate_up", "down")

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *,
                 granularity: GranularityLike = "channel", block_size: Optional[Sequence[int]] = None,
                 down_granularity: Optional[GranularityLike] = None, device=None, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        g = as_granularity(granularity, block_size, "Fp8Experts: granularity")
        dg = g if down_granularity is None else as_granularity(down_granularity, block_size,
                                                               "Fp8Experts: down_granularity")
        blocks = {x.block_size for x in (g, dg) if isinstance(x, PerBlock)}
        if len(blocks) > 1:
            raise ValueError(f"Fp8Experts: gate_up and down must share one block size, got {sorted(blocks)}")
        E, H, I = int(num_experts), int(hidden_size), int(intermediate_size)
        self.num_experts, self.hidden_size, self.intermediate_size = E, H, I
        self.gate_up_granularity, self.down_granularity = g, dg
        self.block_size = blocks.pop() if blocks else None
        self.dtype = dtype  # dtype of the dense model this layer stands in for (activations keep their own)
        wdtype = fp8_storage_dtype(device)
        self.register_buffer("gate_up", torch.zeros(E, 2 * I, H, dtype=torch.uint8, device=device).view(wdtype))
        self.register_buffer("down", torch.zeros(E, H, I, dtype=torch.uint8, device=device).view(wdtype))
        self.register_buffer("gate_up_scale", torch.ones(g.scale_shape(2 * I, H, experts=E), device=device))
        self.register_buffer("down_scale", torch.ones(dg.scale_shape(H, I, experts=E), device=device))
        self.register_buffer("input_scale", None)
        self.activation_scheme: Optional[str] = None

    def set_activation_scheme(self, scheme: Optional[str], input_scale: Optional[torch.Tensor] = None) -> "Fp8Experts":
        """Record the checkpoint's activation scheme (see the class docstring); ``"static"`` needs ``input_scale``
        ``[E, 3]`` (gate, up, down per expert), positive and finite. Returns the layer."""
        if scheme not in (None, "dynamic", "static"):
            raise ValueError(f"Fp8Experts: activation_scheme must be None, 'dynamic' or 'static', got {scheme!r}")
        if (scheme == "static") != (input_scale is not None):
            raise ValueError(f"Fp8Experts: input_scale goes with activation_scheme='static' (and only with it), got "
                             f"activation_scheme={scheme!r} and input_scale "
                             f"{None if input_scale is None else list(input_scale.shape)}")
        if input_scale is not None:
            E = self.num_experts
            if tuple(input_scale.shape) != (E, 3) or not bool(torch.isfinite(input_scale).all()
                                                                and (input_scale > 0).all()):
                raise ValueError(f"Fp8Experts: input_scale must be [E, 3] = [{E}, 3] positive finite scales (gate, "
                                 f"up, down of each expert), got shape {list(input_scale.shape)}")
            input_scale = input_scale.detach().to(device=self.gate_up_scale.device, dtype=torch.float32)
        self.activation_scheme, self.input_scale = scheme, input_scale
        return self

    # ------------------------------------------------------------------------------------------ builders
    @classmethod
    def from_quantized(cls, gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
                       down_scale: torch.Tensor, *, block_size: Optional[Sequence[int]] = None,
                       dtype: torch.dtype = torch.bfloat16) -> "Fp8Experts":
        """Wrap already-quantized stacked weights (float8_e4m3fn or uint8 bits) without copying them."""
        for name, w in (("gate_up", gate_up), ("down", down)):
            if w.dim() != 3 or w.dtype not in (torch.float8_e4m3fn, torch.uint8):
                raise ValueError(f"Fp8Experts: {name} must be a 3-D float8_e4m3fn (or uint8) tensor, "
                                 f"got {w.dtype} of shape {tuple(w.shape)}")
        E, I2, H = gate_up.shape
        if I2 % 2:
            raise ValueError(f"Fp8Experts: gate_up must be [E, 2I, H] (gate rows then up rows), got {tuple(gate_up.shape)}")
        I = I2 // 2
        if tuple(down.shape) != (E, H, I):
            raise ValueError(f"Fp8Experts: down must be [E, H, I] = {[E, H, I]} to match gate_up {list(gate_up.shape)}, "
                             f"got {list(down.shape)}")
        gus, g = _normalize_scale("gate_up_scale", gate_up_scale, E, 2 * I, H, block_size)
        ds, dg = _normalize_scale("down_scale", down_scale, E, H, I, block_size)
        m = cls(E, H, I, granularity=g, down_granularity=dg, device="meta", dtype=dtype)
        device = gate_up.device
        m.gate_up = to_fp8_storage(gate_up, device)
        m.down = to_fp8_storage(down, device)
        m.gate_up_scale = gus.to(device)
        m.down_scale = ds.to(device)
        return m

    @classmethod
    def from_float(cls, gate_up: torch.Tensor, down: torch.Tensor, granularity: GranularityLike = "channel",
                   block_size: Optional[Sequence[int]] = None) -> "Fp8Experts":
        """Quantize dense stacked weights ``gate_up [E, 2I, H]`` and ``down [E, H, I]`` (absmax, symmetric)."""
        if gate_up.dim() != 3 or down.dim() != 3:
            raise ValueError(f"Fp8Experts.from_float: gate_up and down must be 3-D, got {tuple(gate_up.shape)} "
                             f"and {tuple(down.shape)}")
        g = as_granularity(granularity, block_size, "Fp8Experts.from_float: granularity")
        q_gu, s_gu = _quantize_stacked(gate_up, g)
        q_d, s_d = _quantize_stacked(down, g)
        dtype = gate_up.dtype if gate_up.is_floating_point() else torch.bfloat16
        return cls.from_quantized(q_gu, s_gu, q_d, s_d, block_size=g.block_size, dtype=dtype)

    # ------------------------------------------------------------------------------------------ forward
    def dense_parameter_count(self) -> int:
        return swiglu_weight_count(self)

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        E, I = self.num_experts, self.intermediate_size
        x, r = route(self, hidden, topk_ids, topk_weights)
        gu = fp8_grouped_mm(x[r.tokens], self.gate_up, self.gate_up_scale, r.offsets, r.expert_ids,
                            self.gate_up_granularity.block_size)
        y = fp8_grouped_mm(swiglu(gu, I, x.dtype), self.down, self.down_scale, r.offsets, r.expert_ids,
                           self.down_granularity.block_size)
        return combine(y, topk_weights, r, hidden)

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """The dense ``(gate_up [E, 2I, H], down [E, H, I])``: ``fp8_dequantize`` of each expert's weight and scales
        (exact products, rounded once to ``dtype``, default the layer's ``dtype``)."""
        dtype = dtype or self.dtype
        return tuple(torch.stack([fp8_dequantize(w[e], s[e], g.block_size, dtype) for e in range(self.num_experts)])
                     if self.num_experts else torch.empty(w.shape, dtype=dtype, device=w.device)
                     for w, s, g in ((self.gate_up, self.gate_up_scale, self.gate_up_granularity),
                                     (self.down, self.down_scale, self.down_granularity)))

    def extra_repr(self) -> str:
        gran = f"gate_up {self.gate_up_granularity.kind}, down {self.down_granularity.kind}"
        bs = f", block_size={self.block_size}" if self.block_size is not None else ""
        scheme = (f", checkpoint activations fp8 {self.activation_scheme} (running weights only)"
                  if self.activation_scheme is not None else "")
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, {gran}{bs}{scheme}")

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        self._adopt_optional_buffer("input_scale", state_dict, prefix, self.gate_up_scale.device)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


@register_quantize_experts_handler(Fp8WeightOnly)
def _quantize_fp8_experts(experts: nn.Module, config: Fp8WeightOnly) -> Fp8Experts:
    return attach_dense_template(Fp8Experts.from_float(experts.gate_up_proj.detach(), experts.down_proj.detach(),
                                                       config.granularity, config.block_size), experts)
