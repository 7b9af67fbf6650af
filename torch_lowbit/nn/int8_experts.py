"""Int8Experts: the SwiGLU experts of a mixture-of-experts block, W8A8 on the int8 ops (what Int8Linear runs, per
expert).

Same interface as :class:`torch_lowbit.nn.Fp8Experts` and transformers' fused experts modules:
``forward(hidden [T, H], topk_ids [T, k], topk_weights [T, k]) -> [T, H]``.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
from torch import nn

from .. import _ops
from ..quantize import Int8Dynamic, quantize_int8, register_quantize_experts_handler
from ._format_buffers import FormatBuffers
from .experts import attach_dense_template, combine, route, swiglu, swiglu_weight_count


def _check_stacked(name: str, w: torch.Tensor, scale: torch.Tensor):
    """An int8 ``[E, N, K]`` weight and its per-channel scale (``[E, N]``, ``[E, N, 1]``, or ``[E]`` / ``[E, 1]``
    per tensor, widened) -> the fp32 ``[E, N]`` scale."""
    if not isinstance(w, torch.Tensor) or w.dtype != torch.int8 or w.dim() != 3:
        raise ValueError(f"Int8Experts: {name} must be a 3-D int8 tensor, got "
                         + (f"{w.dtype} of shape {tuple(w.shape)}" if isinstance(w, torch.Tensor)
                            else type(w).__name__))
    E, N, _ = w.shape
    if not isinstance(scale, torch.Tensor) or not scale.is_floating_point() or scale.dtype == torch.float8_e4m3fn:
        raise ValueError(f"Int8Experts: {name}_scale must be a floating tensor, got "
                         f"{getattr(scale, 'dtype', type(scale).__name__)}")
    if tuple(scale.shape) in ((E, N), (E, N, 1)):
        return scale.detach().to(torch.float32).reshape(E, N).contiguous()
    if tuple(scale.shape) in ((E,), (E, 1), (E, 1, 1)):
        return scale.detach().to(torch.float32).reshape(E, 1).expand(E, N).contiguous()
    raise ValueError(f"Int8Experts: {name}_scale must be [E, N] = [{E}, {N}] (per channel), [E, N, 1] or [E] (per "
                     f"tensor), got {list(scale.shape)}")


class Int8Experts(FormatBuffers):
    """E SwiGLU experts with int8 weights, W8A8: ``gate_up [E, 2I, H]`` (gate rows, then up rows), ``down [E, H, I]``
    int8, per-channel fp32 scales ``gate_up_scale [E, 2I]``, ``down_scale [E, H]``.

    ``forward(hidden [T, H] (or [..., H]), topk_ids [T, k], topk_weights [T, k])``: token t gets
    ``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t])``, where each projection is what
    :class:`Int8Linear` computes (``torch_lowbit.int8_linear``: the input quantized per row -- per token, then per
    token and expert for ``down`` -- by ``int8_quantize``, ``int8_mm`` with int32 accumulation, output in the
    activation dtype); ``silu(gate) * up`` in fp32, rounded to the activation dtype; the weighted sum per token in
    fp32. A negative id skips that slot. Gradients reach ``hidden`` (and ``topk_weights``) straight through the
    activation quantization, as for Int8Linear; the weights are frozen.

    Each expert that receives tokens runs its own ``int8_mm`` (there is no grouped int8 op): the group bounds are
    read on the host once per call (one device synchronization) and the experts are looped over in Python. So the
    layer runs under ``torch.compile`` with a graph break, not under ``torch.compile(fullgraph=True)`` (use
    Fp8Experts for that).
    """
    _format_buffers = ("gate_up", "down", "gate_up_scale", "down_scale")

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, device=None,
                 dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        E, H, I = int(num_experts), int(hidden_size), int(intermediate_size)
        self.num_experts, self.hidden_size, self.intermediate_size = E, H, I
        self.dtype = dtype  # dtype of the dense model this layer stands in for (activations keep their own)
        self.register_buffer("gate_up", torch.zeros(E, 2 * I, H, dtype=torch.int8, device=device))
        self.register_buffer("down", torch.zeros(E, H, I, dtype=torch.int8, device=device))
        self.register_buffer("gate_up_scale", torch.ones(E, 2 * I, device=device))
        self.register_buffer("down_scale", torch.ones(E, H, device=device))

    @classmethod
    def from_quantized(cls, gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
                       down_scale: torch.Tensor, *, dtype: torch.dtype = torch.bfloat16) -> "Int8Experts":
        """Wrap stacked int8 weights (used as they are) and their per-channel (or per-tensor, widened) scales."""
        gus = _check_stacked("gate_up", gate_up, gate_up_scale)
        ds = _check_stacked("down", down, down_scale)
        E, I2, H = gate_up.shape
        if I2 % 2:
            raise ValueError(f"Int8Experts: gate_up must be [E, 2I, H] (gate rows then up rows), got "
                             f"{tuple(gate_up.shape)}")
        I = I2 // 2
        if tuple(down.shape) != (E, H, I):
            raise ValueError(f"Int8Experts: down must be [E, H, I] = {[E, H, I]} to match gate_up "
                             f"{list(gate_up.shape)}, got {list(down.shape)}")
        for name, t in (("gate_up_scale", gate_up_scale), ("down", down), ("down_scale", down_scale)):
            if t.device != gate_up.device:
                raise ValueError(f"Int8Experts: {name} is on {t.device} but gate_up is on {gate_up.device}")
        m = cls(E, H, I, device="meta", dtype=dtype)
        m.gate_up, m.down = gate_up.contiguous(), down.contiguous()
        m.gate_up_scale, m.down_scale = gus, ds
        return m

    @classmethod
    def from_float(cls, gate_up: torch.Tensor, down: torch.Tensor) -> "Int8Experts":
        """Quantize dense stacked weights ``gate_up [E, 2I, H]`` and ``down [E, H, I]`` with ``quantize_int8``
        (symmetric, per output channel of each expert)."""
        if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) or gate_up.dim() != 3 \
                or down.dim() != 3:
            raise ValueError(f"Int8Experts.from_float: gate_up and down must be 3-D tensors, got "
                             f"{getattr(gate_up, 'shape', type(gate_up).__name__)} and "
                             f"{getattr(down, 'shape', type(down).__name__)}")

        def stacked(w):
            parts = [quantize_int8(w[e]) for e in range(w.shape[0])]
            if not parts:
                return torch.zeros(w.shape, dtype=torch.int8, device=w.device), w.new_ones(0, w.shape[1]).float()
            return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
        (q_gu, s_gu), (q_d, s_d) = stacked(gate_up), stacked(down)
        dtype = gate_up.dtype if gate_up.is_floating_point() else torch.bfloat16
        return cls.from_quantized(q_gu, s_gu, q_d, s_d, dtype=dtype)

    def dense_parameter_count(self) -> int:
        return swiglu_weight_count(self)

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return self.run(hidden, topk_ids, topk_weights)

    def run(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
            quantize_down: Optional[Callable] = None) -> torch.Tensor:
        """forward, where ``quantize_down(h) -> (int8 codes, row scales)`` may replace the per-row quantization of
        the down projection's input (all experts' rows at once): tensor parallelism gives it each row's whole-row
        scale (``torch_lowbit.distributed``). With it the down products are not differentiable."""
        E, H, I = self.num_experts, self.hidden_size, self.intermediate_size
        x, r = route(self, hidden, topk_ids, topk_weights)
        xs = x[r.tokens]
        bounds = r.offsets.tolist()  # the one host synchronization: which rows each expert owns
        rows = []  # (expert, first row, end row)
        compiling = torch.compiler.is_compiling()
        for e in range(E):
            a, b = bounds[e], bounds[e + 1]
            if compiling:  # unbacked sizes: no branch on them; an expert without tokens is an empty product
                torch._check(0 <= a)
                torch._check(a <= b)
                torch._check(b <= xs.shape[0])
                rows.append((e, a, b))
            elif b > a:  # an expert without tokens costs nothing
                rows.append((e, a, b))
        gate_up = [_ops.int8_linear(xs[a:b], self.gate_up[e], self.gate_up_scale[e]) for e, a, b in rows]
        if quantize_down is None:
            pieces = [_ops.int8_linear(swiglu(gu, I, x.dtype), self.down[e], self.down_scale[e])
                      for gu, (e, _, _) in zip(gate_up, rows)]
        else:
            # every expert's rows at once, rows 0:bounds[E] in order (offsets start at 0; swiglu works row by row)
            h = swiglu(torch.cat(gate_up) if gate_up else x.new_zeros(0, 2 * I), I, x.dtype)
            q, s = quantize_down(h)
            pieces = [_ops.int8_mm(q[a:b], s[a:b], self.down[e], self.down_scale[e], None, x.dtype)
                      for e, a, b in rows]
        # rows past bounds[E] are skipped slots: zeros, whose weight combine() sets to 0
        pieces.append(x.new_zeros(xs.shape[0] - bounds[E], H))
        return combine(torch.cat(pieces), topk_weights, r, hidden)

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """The dense ``(gate_up [E, 2I, H], down [E, H, I])``: each int8 weight times its row's scale, exact (in
        float64), rounded once to ``dtype`` (default the layer's ``dtype``)."""
        dtype = dtype or self.dtype
        return tuple((w.double() * s.double()[..., None]).to(dtype)
                     for w, s in ((self.gate_up, self.gate_up_scale), (self.down, self.down_scale)))

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, weights int8 per channel, activations int8 per token "
                f"(dynamic)")


@register_quantize_experts_handler(Int8Dynamic)
def _quantize_int8_experts(experts: nn.Module, config: Int8Dynamic) -> Int8Experts:
    return attach_dense_template(Int8Experts.from_float(experts.gate_up_proj.detach(), experts.down_proj.detach()),
                                 experts)
