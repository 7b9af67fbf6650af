"""Tensor parallelism for low-bit models over torch.distributed (gloo), on transformers' plans and styles and
torch.distributed's collectives (c10d all-reduce, DTensor redistribution).

``torch_lowbit.from_pretrained(path, tp_plan="auto")`` under ``torchrun`` (see the README) loads a quantized
checkpoint split over the ranks: :mod:`.layouts` says how each low-bit layer's tensors split, :mod:`.shard` cuts them
for a rank, :mod:`.styles` are the column-wise / row-wise / experts styles for the low-bit layers, :mod:`.parallel`
applies a plan. Experts shard like linear layers (over their intermediate size, transformers' ``moe_tp_experts``),
also where transformers 5.25+ plans leave them to expert parallelism (``ep_plan``), which is not implemented.
"""
from __future__ import annotations

from typing import Dict, Union

import torch
from torch import nn

from .layouts import Axis, Layout, SplitError, layout_of, register_layout  # noqa: F401
from .shard import shard_layer  # noqa: F401


def load_parallel(model: nn.Module, path, tp_plan: Union[str, Dict[str, str]], *, device=None, dtype=None,
                  strict: bool = False, activations: str = "weights-only"):
    """Load a quantized checkpoint into the meta-built transformers `model` for this rank under `tp_plan` and
    install the plan's styles; returns the LoadReport. The checkpoint is memory-mapped, and each low-bit layer is cut
    as soon as it is built, so the rank copies only its shard's bytes out of the file; everything else is then
    copied out too (the model does not depend on the file afterwards)."""
    from ..formats import load_quantized
    from .parallel import ShardHook, check_heads, device_mesh, own_memory, parallelize, resolve_plan

    mesh = device_mesh()
    plan = resolve_plan(model, tp_plan)
    world, rank = mesh.size(), mesh.get_local_rank()
    check_heads(model.config, plan, world)
    hook = ShardHook(plan, rank, world)
    report = load_quantized(model, path, device=device, dtype=dtype, strict=strict, activations=activations,
                            mmap=True, module_hook=hook)
    own_memory(model)
    if device is not None:
        model.to(device)
    if world > 1:  # one rank: nothing split, no style to run (transformers applies no plan at tp_size 1 either)
        parallelize(model, mesh, plan, hook)
    # experts layers stacked from projections cut as they were read (the others are cut once built)
    report.details["tensor_parallel"] = {"world_size": world, "rank": rank,
                                         "experts_cut_while_reading": sorted(hook.cut_experts)}
    return report


def lowbit_bytes(model: nn.Module) -> int:
    """Bytes of storage the model's low-bit layers hold (their codes, scales and biases), counting each storage
    once (a view of a larger tensor counts the whole storage it keeps alive)."""
    seen, total = set(), 0
    for m in model.modules():
        if layout_of(m) is None:
            continue
        for t in list(m._buffers.values()) + list(m._parameters.values()):
            if t is None or not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            if st.data_ptr() in seen:
                continue
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total
