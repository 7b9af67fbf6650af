"""MoE experts: how the loader finds them in a model and fills them from per-expert checkpoint tensors.

An *experts module* is a module of the model that is either a :class:`torch_lowbit.nn.Fp8Experts`, or any module
with 3-D tensors ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` -- the fused experts of transformers >= 5
(``Qwen3MoeExperts``, ...), whose ``forward(hidden, top_k_index, top_k_weights)`` Fp8Experts shares, so the MoE
block's router and forward stay as they are. Checkpoints store experts one by one, as published:
``{name}.{e}.gate_proj.weight``, ``{name}.{e}.up_proj.weight``, ``{name}.{e}.down_proj.weight`` (+ scales).
FP8 experts replace the module by an Fp8Experts (gate rows, then up rows); unquantized experts are stacked into the
module's own ``gate_up_proj`` / ``down_proj``.

Experts held as an ``nn.ModuleList`` of MLPs (transformers < 5) are not experts modules: each expert's
gate/up/down ``nn.Linear`` becomes an Fp8Linear by the ordinary linear rule (correct, one matmul per expert).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from ..granularity import Granularity, PerBlock, PerChannel, PerTensor
from ..nn.experts import Fp8Experts
from .registry import QuantFormat
from .source import CheckpointError, Source
from .tensors import QuantizedWeight, read_quantized

PROJS = ("gate", "up", "down")


def is_experts_module(m: nn.Module) -> bool:
    if isinstance(m, Fp8Experts):
        return True
    gu, dn = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    return isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor) and gu.dim() == 3 and dn.dim() == 3


def experts_dims(m: nn.Module) -> Tuple[int, int, int]:
    if isinstance(m, Fp8Experts):
        return m.num_experts, m.hidden_size, m.intermediate_size
    E, I2, H = m.gate_up_proj.shape
    return E, H, I2 // 2


# Where SiLU is recognized: both signs, the region around 0, and large |x| where x * sigmoid(x) saturates
_SILU_PROBE = (-20.0, -6.5, -3.0, -1.25, -0.5, -0.125, 0.0, 0.0625, 0.4, 1.0, 2.5, 4.75, 9.0, 30.0)


def computes_silu(act) -> bool:
    """Does `act` compute x * sigmoid(x)? Judged by its values on probe inputs, not by its class: transformers 5
    uses its own ``SiLUActivation`` module (``ACT2FN["silu"]``), others use nn.SiLU or F.silu."""
    x = torch.tensor(_SILU_PROBE, dtype=torch.float32)
    try:
        with torch.no_grad():
            y = act(x)
    except Exception:  # an activation that cannot run on a CPU float tensor is not one we can vouch for
        return False
    if not isinstance(y, torch.Tensor) or y.shape != x.shape or not y.is_floating_point():
        return False
    want = x.double() * torch.sigmoid(x.double())
    return bool(torch.allclose(y.double(), want, rtol=1e-5, atol=1e-6))


def _check_activation(name: str, m: nn.Module):
    act = getattr(m, "act_fn", None)
    if act is None or computes_silu(act):
        return
    raise CheckpointError(f"experts module {name} uses activation {act!r}, which does not compute x * sigmoid(x); "
                          f"Fp8Experts implements SwiGLU with SiLU")


def _stack_scales(key: str, parts: List[QuantizedWeight]) -> Tuple[torch.Tensor, Granularity]:
    """One expert's scale for row-stacked weights (gate then up, or down alone) and its granularity: block scales
    concatenated, equal per-tensor scales kept as one, anything else expanded to per channel."""
    grans = [q.granularity for q in parts]
    if any(isinstance(g, PerBlock) for g in grans):
        if not all(isinstance(g, PerBlock) for g in grans):
            raise CheckpointError(f"{key}: block scales cannot be mixed with per-tensor / per-channel scales")
        bn = grans[0].block_n
        rows = [q.weight.shape[0] for q in parts]
        if len(parts) > 1 and any(r % bn for r in rows[:-1]):
            raise CheckpointError(f"{key}: gate and up have {rows[0]} rows, not a multiple of the block height {bn}: "
                                  f"their block scales cannot be stacked into one gate_up weight")
        return torch.cat([q.scale for q in parts], dim=0), grans[0]
    if all(isinstance(g, PerTensor) for g in grans) and all(torch.equal(parts[0].scale, q.scale) for q in parts):
        return parts[0].scale.reshape(()), PerTensor()
    return torch.cat([q.scale.reshape(-1).expand(q.weight.shape[0]) for q in parts]), PerChannel()


def _uniform(key: str, scales: List[Tuple[torch.Tensor, Granularity]]) -> torch.Tensor:
    """Stack the experts' scales, widening per-tensor ones to per channel when the experts disagree."""
    grans = {g.kind for _, g in scales}
    if len(grans) > 1:
        if "block" in grans:
            raise CheckpointError(f"{key}: some experts have block scales and others do not")
        n = max(s.numel() for s, _ in scales)
        return torch.stack([s.reshape(-1).expand(n) for s, _ in scales]).contiguous()
    return torch.stack([s for s, _ in scales]).contiguous()


def load_experts(src: Source, fmt: QuantFormat, name: str, module: nn.Module, device, dtype,
                 ) -> Optional[Tuple[nn.Module, List[str], str, bool]]:
    """(module to put at `name`, checkpoint keys used, description, quantized?) or None when the checkpoint has
    no per-expert tensors for it (then its own keys, if any, load like any other parameter)."""
    E, H, I = experts_dims(module)
    wkeys = {(e, p): f"{name}.{e}.{p}_proj.weight" for e in range(E) for p in PROJS}
    present = [k for k in wkeys.values() if k in src]
    if not present:
        return None
    missing = [k for k in wkeys.values() if k not in src]
    if missing:
        raise CheckpointError(f"experts module {name} has {E} experts but {missing[0]} is missing from the checkpoint "
                              f"({len(missing)} expert weights missing)")
    _check_activation(name, module)
    kinds = {k: fmt.weight_kind(k, src.dtype(k)) for k in wkeys.values()}
    if set(kinds.values()) == {None}:
        return _load_dense(src, name, module, wkeys, device, dtype)
    unquantized = [k for k, v in kinds.items() if v is None]
    if unquantized:
        raise CheckpointError(f"{unquantized[0]} is {src.dtype(unquantized[0])} while other experts of {name} are "
                              f"quantized: torch_lowbit needs all experts of a layer in one format")
    if "int8" in kinds.values():
        k = next(k for k, v in kinds.items() if v == "int8")
        raise CheckpointError(f"{k} is int8: int8 MoE experts are not supported (Fp8Experts takes FP8 experts)")
    ignored = [f"{name}.{e}.{p}_proj" for e in range(E) for p in PROJS
               if fmt.is_ignored(f"{name}.{e}.{p}_proj") or fmt.is_ignored(name)]
    if ignored:
        raise CheckpointError(f"{ignored[0]}.weight is float8 but {ignored[0]} is in the checkpoint's ignore list")

    gate_up = torch.empty(E, 2 * I, H, dtype=torch.float8_e4m3fn)
    down = torch.empty(E, H, I, dtype=torch.float8_e4m3fn)
    gu_scales, d_scales, used = [], [], []
    for e in range(E):
        q = {p: read_quantized(src, fmt, f"{name}.{e}.{p}_proj", "fp8", shape)
             for p, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I)))}
        gate_up[e, :I].copy_(q["gate"].weight)
        gate_up[e, I:].copy_(q["up"].weight)
        down[e].copy_(q["down"].weight)
        gu_scales.append(_stack_scales(f"{name}.{e}.gate/up_proj scales", [q["gate"], q["up"]]))
        d_scales.append(_stack_scales(f"{name}.{e}.down_proj scale", [q["down"]]))
        used += [k for p in PROJS for k in q[p].keys]
    gu_scale = _uniform(f"{name} gate/up scales", gu_scales)
    d_scale = _uniform(f"{name} down scales", d_scales)
    layer = Fp8Experts.from_quantized(gate_up, gu_scale, down, d_scale, block_size=fmt.block_size,
                                      dtype=dtype or torch.bfloat16)
    layer = layer.to(device) if device is not None else layer
    desc = f"Fp8Experts(E={E}, gate_up {layer.gate_up_granularity.kind}, down {layer.down_granularity.kind})"
    return layer, used, desc, True


def _load_dense(src: Source, name: str, module: nn.Module, wkeys: Dict, device, dtype):
    if isinstance(module, Fp8Experts):
        raise CheckpointError(f"the checkpoint stores the experts of {name} unquantized ({wkeys[(0, 'gate')]} is "
                              f"{src.dtype(wkeys[(0, 'gate')])}), but the model holds an Fp8Experts there")
    E, H, I = experts_dims(module)
    old_gu, old_d = module.gate_up_proj, module.down_proj
    tdtype = dtype or old_gu.dtype
    tdev = device if device is not None else (old_gu.device if old_gu.device.type != "meta" else torch.device("cpu"))
    gate_up = torch.empty(E, 2 * I, H, dtype=tdtype, device=tdev)
    down = torch.empty(E, H, I, dtype=tdtype, device=tdev)
    for e in range(E):
        for p, dst in (("gate", gate_up[e, :I]), ("up", gate_up[e, I:]), ("down", down[e])):
            t = src.get(wkeys[(e, p)])
            if tuple(t.shape) != tuple(dst.shape):
                raise CheckpointError(f"{wkeys[(e, p)]} has shape {list(t.shape)}, expected {list(dst.shape)}")
            dst.copy_(t)
    for attr, new, old in (("gate_up_proj", gate_up, old_gu), ("down_proj", down, old_d)):
        if isinstance(old, nn.Parameter):
            new = nn.Parameter(new, requires_grad=old.requires_grad)
        setattr(module, attr, new)
    return module, list(wkeys.values()), f"stored as {src.dtype(wkeys[(0, 'gate')])}", False
