"""gpt-oss's experts on 4-bit weights: a W4Experts with gpt-oss's own arithmetic, in place of transformers'
``GptOssExperts`` (same ``forward(hidden_states, router_indices, routing_weights)``).

gpt-oss (transformers' ``GptOssExperts`` and the published checkpoints) differs from the [gate; up] SwiGLU of the
other MoE models in three ways, all kept here:

- gate and up rows interleave: row ``2i`` of ``gate_up`` is gate unit i, row ``2i + 1`` up unit i;
- each projection adds its expert's bias (``gate_up_bias [E, 2I]``, ``down_bias [E, H]``);
- the activation is a clamped SwiGLU: ``gate = min(gate, limit)``, ``up = clamp(up, -limit, limit)``,
  ``(up + 1) * gate * sigmoid(alpha * gate)`` (alpha 1.702, limit 7.0).

The checkpoints store the experts in MXFP4 as ``{p}_blocks`` uint8 ``[E, rows, cols/32, 16]`` (32 E2M1 codes per
16 bytes along the input dimension, the even one in the low nibble) and ``{p}_scales`` uint8 E8M0
``[E, rows, cols/32]``: exactly ``w4_grouped_mm``'s ``[E, N, ceil(K/2)]`` codes and ``[E, N, G]`` scales once the
last two dims of the blocks are merged (a view), so they are used as stored.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..quantize import Mxfp4WeightOnly, register_quantize_experts_handler
from .w4_experts import W4Experts, register_expert_activation

GPTOSS_ACTIVATION = "gptoss_swiglu"
MXFP4_GROUP = 32


@register_expert_activation(GPTOSS_ACTIVATION)
def gptoss_swiglu(gate_up: torch.Tensor, layer) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU of interleaved ``gate_up [rows, 2I]`` (fp32), with the layer's alpha and limit."""
    gate = gate_up[..., 0::2].clamp(max=layer.limit)
    up = gate_up[..., 1::2].clamp(min=-layer.limit, max=layer.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * layer.alpha))


class GptOssW4Experts(W4Experts):
    """gpt-oss's experts (see the module docstring) with 4-bit stacked weights ``gate_up [E, 2I, H]`` (interleaved
    gate / up rows) and ``down [E, H, I]``, biases ``gate_up_bias [E, 2I]`` and ``down_bias [E, H]``.

    ``forward(hidden_states [T, H], router_indices [T, k], routing_weights [T, k])``: transformers' GptOssExperts
    interface (its GptOssMLP passes the router's top-k softmax weights); token t gets
    ``sum_j routing_weights[t, j] * expert_{router_indices[t, j]}(hidden[t])``, summed in fp32.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, alpha: float = 1.702,
                 limit: float = 7.0, format: str = "mxfp4", group_size: int = MXFP4_GROUP, **kw):
        kw.setdefault("bias", True)
        kw["activation"] = GPTOSS_ACTIVATION
        super().__init__(num_experts, hidden_size, intermediate_size, format=format, group_size=group_size, **kw)
        self.alpha, self.limit = float(alpha), float(limit)

    def forward(self, hidden_states: torch.Tensor, router_indices: Optional[torch.Tensor] = None,
                routing_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        if router_indices is None or routing_weights is None:
            raise ValueError("GptOssW4Experts: router_indices and routing_weights are required (the router's top-k "
                             "ids and weights)")
        return super().forward(hidden_states, router_indices, routing_weights)

    @classmethod
    def from_mxfp4(cls, gate_up_blocks: torch.Tensor, gate_up_scales: torch.Tensor, gate_up_bias: torch.Tensor,
                   down_blocks: torch.Tensor, down_scales: torch.Tensor, down_bias: torch.Tensor, *,
                   alpha: float = 1.702, limit: float = 7.0, dtype: torch.dtype = torch.bfloat16,
                   what: str = "GptOssW4Experts") -> "GptOssW4Experts":
        """gpt-oss's stored MXFP4 tensors as a layer, without copying the blocks: ``gate_up_blocks`` uint8
        ``[E, 2I, H/32, 16]``, ``gate_up_scales`` uint8 ``[E, 2I, H/32]``, ``gate_up_bias [E, 2I]``, and
        ``down_*`` ``[E, H, I/32, 16]``, ``[E, H, I/32]``, ``[E, H]``. ``what`` names them in errors."""
        gu_b, d_b = gate_up_blocks, down_blocks
        for name, b in (("gate_up_proj_blocks", gu_b), ("down_proj_blocks", d_b)):
            if b.dtype != torch.uint8 or b.dim() != 4 or b.shape[-1] != MXFP4_GROUP // 2:
                raise ValueError(f"{what}: {name} must be uint8 [E, rows, cols/32, 16] (32 4-bit codes per 16 "
                                 f"bytes), got {b.dtype} of shape {list(b.shape)}")
        E, I2, Gh, _ = gu_b.shape
        H, I = Gh * MXFP4_GROUP, I2 // 2
        want_down = (E, H, -(-I // MXFP4_GROUP), MXFP4_GROUP // 2)
        if I2 % 2 or tuple(d_b.shape) != want_down:
            raise ValueError(f"{what}: down_proj_blocks must be {list(want_down)} to match gate_up_proj_blocks "
                             f"{list(gu_b.shape)} (E, 2I, H/32, 16), got {list(d_b.shape)}")
        parts = {}
        for p, b, s, bias in (("gate_up", gu_b, gate_up_scales, gate_up_bias), ("down", d_b, down_scales, down_bias)):
            if s.dtype not in (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8)) \
                    or tuple(s.shape) != tuple(b.shape[:3]):
                raise ValueError(f"{what}: {p}_proj_scales must be uint8 E8M0 exponents {list(b.shape[:3])} (one per "
                                 f"32 values of {p}_proj_blocks), got {s.dtype} of shape {list(s.shape)}")
            if bias is None or tuple(bias.shape) != tuple(b.shape[:2]) or not bias.is_floating_point():
                got = "none" if bias is None else f"{bias.dtype} of shape {list(bias.shape)}"
                raise ValueError(f"{what}: {p}_proj_bias must be a floating {list(b.shape[:2])} tensor, got {got}")
            parts[p] = {"packed": b.reshape(b.shape[0], b.shape[1], -1), "scale": s.view(torch.uint8), "bias": bias}
        m = cls.from_quantized(parts["gate_up"], parts["down"], format="mxfp4", group_size=MXFP4_GROUP,
                               hidden_size=H, intermediate_size=I, dtype=dtype, activation=GPTOSS_ACTIVATION)
        m.alpha, m.limit = float(alpha), float(limit)
        return m

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, alpha={self.alpha}, limit={self.limit}"


def is_gptoss_experts(m: nn.Module) -> bool:
    """transformers' dense GptOssExperts (by its tensors: transposed ``gate_up_proj [E, H, 2I]``,
    ``down_proj [E, I, H]``, the two biases, and swiglu alpha / limit)."""
    names = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    if not all(isinstance(getattr(m, n, None), torch.Tensor) for n in names) or not hasattr(m, "alpha") \
            or not hasattr(m, "limit"):
        return False
    gu, dn = m.gate_up_proj, m.down_proj
    return gu.dim() == 3 and dn.dim() == 3 and gu.shape[2] % 2 == 0 and \
        tuple(dn.shape) == (gu.shape[0], gu.shape[2] // 2, gu.shape[1]) and \
        tuple(m.gate_up_proj_bias.shape) == (gu.shape[0], gu.shape[2]) and \
        tuple(m.down_proj_bias.shape) == (gu.shape[0], gu.shape[1])


def _quantize_stacked_mxfp4(w: torch.Tensor) -> dict:
    """quantize_w4 mxfp4 of each expert of ``w [E, rows, cols]``, stacked (W4Experts.from_quantized's dict)."""
    from ..quantize_w4 import quantize_w4

    parts = [quantize_w4(w[e].contiguous(), "mxfp4", MXFP4_GROUP) for e in range(w.shape[0])]
    return {"packed": torch.stack([p.weight_packed for p in parts]),
            "scale": torch.stack([p.weight_scale for p in parts])}


@register_quantize_experts_handler(Mxfp4WeightOnly, claims=is_gptoss_experts)
def _quantize_gptoss_experts(experts: nn.Module, config: Mxfp4WeightOnly) -> GptOssW4Experts:
    """transformers' dense GptOssExperts (``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``: transposed) as
    GptOssW4Experts in gpt-oss's own layout: the rows of gate_up stay interleaved, the biases stay as they are."""
    gate_up = _quantize_stacked_mxfp4(experts.gate_up_proj.detach().transpose(1, 2))
    down = _quantize_stacked_mxfp4(experts.down_proj.detach().transpose(1, 2))
    gate_up["bias"], down["bias"] = experts.gate_up_proj_bias.detach(), experts.down_proj_bias.detach()
    E, H, I2 = experts.gate_up_proj.shape
    m = GptOssW4Experts.from_quantized(gate_up, down, format="mxfp4", group_size=MXFP4_GROUP, hidden_size=H,
                                       intermediate_size=I2 // 2, dtype=experts.gate_up_proj.dtype,
                                       activation=GPTOSS_ACTIVATION)
    m.alpha, m.limit = float(experts.alpha), float(experts.limit)
    return m
