"""A dense copy of a low-bit model, to merge LoRA adapters into (a low-bit base refuses the merge: the sum would
have to be re-quantized) or to compare against."""
from __future__ import annotations

import copy
from collections import Counter
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ._ops import _FLOAT_DTYPES as _DTYPES  # what the low-bit layers compute in
from ._ops import fp8_dequantize
from .nn import Fp8Linear, Int8Experts, Int8Linear, W4Experts, W4Linear
from .nn.experts import Fp8Experts
from .quantize import swap_children

_EXPERTS_CHOICES = ("refuse", "keep")
_LINEARS = (Fp8Linear, Int8Linear, W4Linear)
_EXPERTS = (W4Experts, Fp8Experts, Int8Experts)


def dequantize_model(model: nn.Module, *, dtype: Optional[torch.dtype] = None, experts: str = "refuse") -> nn.Module:
    """A copy of ``model`` in which every ``Fp8Linear`` / ``Int8Linear`` / ``W4Linear`` is an ``nn.Linear`` holding
    its exactly dequantized weight: ``fp8_dequantize(weight, weight_scale)`` / ``weight * weight_scale`` (computed in
    float64) / ``w4_dequantize`` (the format's fp32 arithmetic, as ``w4_mm`` reads it), rounded once to ``dtype``.
    ``model`` is left as it was (its low-bit tensors are not copied); everything else is deep-copied. Works on a PEFT
    model too, whose LoRA layers then merge::

        merged = torch_lowbit.dequantize_model(peft_model).merge_and_unload()
        merged = PeftModel.from_pretrained(torch_lowbit.dequantize_model(base), adapter_dir).merge_and_unload()

    dtype: of the dense weights and biases (bfloat16, float16 or float32); default: the dtype holding most of the
    model's floating-point parameters (embeddings, norms: what ``model.to(dtype)`` set), bfloat16 if it has none.
    The weights stay frozen (requires_grad=False, as they were); each bias keeps its requires_grad.
    Fused experts (``Fp8Experts``, ``Int8Experts``, ``W4Experts``) become dense fused experts holding their dequantized ``gate_up_proj
    [E, 2I, H]`` / ``down_proj [E, H, I]`` (the layer's ``dequantize``): the model's own experts module where
    ``quantize_`` made them (Qwen3MoeExperts, MixtralExperts, ...), else :class:`DenseSwiGLUExperts`.
    experts: 4-bit experts with their own arithmetic (gpt-oss's ``GptOssW4Experts``: clamped SwiGLU, biases) have no
    dense counterpart here: ``"refuse"`` (default) raises naming them, ``"keep"`` copies every fused experts layer
    as it is (fp8, 4-bit; LoRA adapters on the linear layers merge all the same).
    """
    dtype, found = _plan(model, dtype, experts, "dequantize_model")
    # deepcopy takes each low-bit module's entry in memo as its copy: the dense layer, wherever it is referenced
    memo = {i: _dense(m, dtype) for i, m in found.items()}
    return copy.deepcopy(model, memo)


def dequantize_(model: nn.Module, *, dtype: Optional[torch.dtype] = None, experts: str = "refuse") -> nn.Module:
    """In place, what :func:`dequantize_model` does in a copy: every low-bit layer of ``model`` is replaced by its
    dense counterpart (same ``dtype`` default, ``experts`` choices and errors, checked before anything changes), one
    layer at a time, so the low-bit and dense weights are held together for one layer only. A module shared by
    several parents gets one dense replacement. Returns ``model`` (the dense layer if ``model`` itself is a low-bit
    layer). What ``model.dequantize()`` runs on a transformers model holding torch_lowbit layers."""
    dtype, found = _plan(model, dtype, experts, "dequantize_")
    if id(model) in found:
        return _dense(model, dtype)
    done = {}

    def dense(child):
        if id(child) in found and id(child) not in done:
            done[id(child)] = _dense(child, dtype)
        return done.get(id(child), child)

    swap_children(model, dense)
    return model


def _plan(model, dtype, experts, caller):
    """(the dense dtype, id -> module of every low-bit module of ``model`` that becomes dense), with every argument
    and module checked."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{caller}: model must be an nn.Module, got {type(model).__name__}")
    if experts not in _EXPERTS_CHOICES:
        raise ValueError(f"{caller}: experts must be one of {_EXPERTS_CHOICES}, got {experts!r}")
    dtype = dtype or _model_dtype(model)
    if dtype not in _DTYPES:
        raise ValueError(f"{caller}: dtype must be one of {_DTYPES}, got {dtype!r}")
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, _LINEARS):
            found[id(module)] = module
        elif isinstance(module, _EXPERTS) and experts != "keep":
            if not isinstance(module, W4Experts) or (module.activation == "swiglu" and module.gate_up_bias is None):
                found[id(module)] = module
            else:
                raise ValueError(f"{caller}: {name or 'model'} is a {type(module).__name__} with its own arithmetic "
                                 f"(activation {module.activation!r}, biases), which has no dense counterpart here; "
                                 "pass experts='keep' to keep them 4-bit")
    return dtype, found


def _dense(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    return _dense_linear(module, dtype) if isinstance(module, _LINEARS) else _dense_experts(module, dtype)


def _model_dtype(model: nn.Module) -> torch.dtype:
    counts = Counter()
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] += p.numel()
    return counts.most_common(1)[0][0] if counts else torch.bfloat16


def _dense_linear(layer, dtype: torch.dtype) -> nn.Linear:
    if isinstance(layer, Fp8Linear):
        w = fp8_dequantize(layer.weight, layer.weight_scale, layer.block_size, dtype=dtype)
    elif isinstance(layer, W4Linear):
        w = layer.dequantize(dtype)
    else:
        w = layer.weight.to(torch.float64) * layer.weight_scale.to(torch.float64).reshape(-1, 1)
    dense = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
    dense.weight = nn.Parameter(w.to(dtype), requires_grad=False)
    if layer.bias is not None:
        dense.bias = nn.Parameter(layer.bias.detach().to(dtype, copy=True), requires_grad=layer.bias.requires_grad)
    return dense


class DenseSwiGLUExperts(nn.Module):
    """Dense fused SwiGLU experts in transformers 5's layout (``gate_up_proj [E, 2I, H]``, gate rows then up rows;
    ``down_proj [E, H, I]``) and interface (``forward(hidden, top_k_index, top_k_weights)``): what
    ``dequantize_model`` makes of a W4Experts whose original module it does not know (one built by a loader)."""

    def __init__(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor):
        super().__init__()
        self.num_experts, _, self.hidden_dim = gate_up_proj.shape
        self.intermediate_dim = down_proj.shape[2]
        self.gate_up_proj = nn.Parameter(gate_up_proj, requires_grad=False)
        self.down_proj = nn.Parameter(down_proj, requires_grad=False)

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        x = hidden.reshape(-1, self.hidden_dim)
        ids, weights = top_k_index.reshape(x.shape[0], -1), top_k_weights.reshape(x.shape[0], -1)
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            token, slot = torch.where(ids == e)
            gate, up = (x[token] @ self.gate_up_proj[e].T).chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ self.down_proj[e].T
            out.index_add_(0, token, y * weights[token, slot, None].to(y.dtype))
        return out.reshape(hidden.shape)


def _dense_experts(layer: nn.Module, dtype: torch.dtype) -> nn.Module:
    gate_up, down = layer.dequantize(dtype)
    template = getattr(layer, "_dense_template", None)
    if template is None:
        return DenseSwiGLUExperts(gate_up, down)
    # the model's own module (its tensors on meta), with the dequantized ones in their place
    memo = {id(template.gate_up_proj): nn.Parameter(gate_up, requires_grad=False),
            id(template.down_proj): nn.Parameter(down, requires_grad=False)}
    return copy.deepcopy(template, memo)
