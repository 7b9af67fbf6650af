"""Apply a transformers tensor-parallel plan to a model holding torch_lowbit layers.

The plan is the architecture's own (``model.tp_plan``: the config's ``base_model_tp_plan`` plus the head's
``_tp_plan``), optionally overridden by a dict. Low-bit layers (Fp8Linear, Int8Linear, W4Linear, Fp8Experts,
Int8Experts, W4Experts) are cut for this rank (:func:`~.shard.shard_layer`) -- at load time by :class:`ShardHook`, so
a rank never holds another rank's bytes -- and get the low-bit styles of :mod:`.styles`; every other module of the
plan (lm_head, norms, dense linears) gets transformers' own style through
``transformers.distributed.tensor_parallel.apply_tensor_parallelism``.
"""
from __future__ import annotations

import os
from typing import Dict, Optional, Union

import torch
from torch import nn

from .layouts import SplitError, layout_of
from .shard import shard_layer


def device_mesh():
    """The 1-D tensor-parallel mesh over every rank of the default process group, initialized from torchrun's
    environment (gloo: CPU, and between Macs) when no group exists yet."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_available():
        raise RuntimeError("tp_plan needs torch.distributed, which this PyTorch build lacks")
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise RuntimeError(f"tp_plan needs a torch.distributed process group: launch with torchrun (e.g. torchrun "
                               f"--nproc-per-node 2 script.py), or call torch.distributed.init_process_group first "
                               f"(environment lacks {', '.join(missing)})")
        dist.init_process_group("gloo")
    if dist.get_backend() != "gloo":
        raise RuntimeError(f"torch_lowbit's tensor parallelism runs on the gloo backend (CPU tensors), the process "
                           f"group uses {dist.get_backend()!r}")
    return init_device_mesh("cpu", (dist.get_world_size(),))


def check_tp_plan(tp_plan) -> None:
    """``"auto"`` or a dict of module-pattern strings to style strings, else a ValueError naming the argument."""
    ok = tp_plan == "auto" if isinstance(tp_plan, str) else (
        isinstance(tp_plan, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in tp_plan.items()))
    if not ok:
        raise ValueError(f"tp_plan must be 'auto' or a dict of module patterns to style names (e.g. "
                         f"{{'model.layers.*.mlp.down_proj': 'rowwise'}}), got {tp_plan!r}")


class Plan(dict):
    """A resolved plan: {module pattern: style}. `lowbit_only` holds the patterns torch_lowbit added for its own
    layers (experts split over I where the architecture dispatches experts by expert parallelism): they never reach
    transformers' styles, whose experts split is deprecated and would not cut dense experts' parameters."""
    lowbit_only: frozenset = frozenset()


EXPERTS_SPLIT = "moe_tp_experts"


def resolve_plan(model: nn.Module, tp_plan: Union[str, Dict[str, str]]) -> Plan:
    """The model's plan (``"auto"``) or the model's plan updated by a dict of ``{module pattern: style}``.

    Since transformers 5.25 the MoE architectures' tensor-parallel plans leave the experts out (they are split by
    expert parallelism, ``ep_plan``'s ``ep_dispatch_experts``, which torch_lowbit does not implement); left out, every
    rank would hold every expert. Experts modules that the ep_plan dispatches and the tp_plan does not name are split
    over their intermediate size instead (``moe_tp_experts``: what the plans of transformers 5.24 and older asked)."""
    check_tp_plan(tp_plan)
    own = dict(getattr(model, "tp_plan", None) or {})
    plan = Plan(own if tp_plan == "auto" else {**own, **tp_plan})
    if not plan:
        raise ValueError(f"tp_plan: {type(model).__name__} has no tensor-parallel plan (no base_model_tp_plan in its "
                         f"config): pass tp_plan as a dict")
    dispatched = [k for k, v in (getattr(model, "ep_plan", None) or {}).items() if v == "ep_dispatch_experts"]
    added = {k: EXPERTS_SPLIT for k in dispatched if k not in plan}
    plan.update(added)
    plan.lowbit_only = frozenset(added)
    return plan


def transformers_tp():
    """transformers' tensor-parallel module (plans, styles), or an ImportError saying what is needed."""
    try:
        from transformers.distributed import parallel_utils, tensor_parallel
    except ImportError as e:
        raise ImportError(f"torch_lowbit's tensor parallelism runs on transformers' tensor-parallel styles "
                          f"(transformers.distributed.tensor_parallel, tested with transformers 5.24 and 5.25), which "
                          f"this transformers lacks: {e}") from None
    return tensor_parallel, parallel_utils


def style_of(name: str, plan: Dict[str, str]) -> Optional[str]:
    _get_parameter_plan = transformers_tp()[1]._get_parameter_plan

    return _get_parameter_plan(parameter_name=name, plan=plan, is_weight=False)


def check_heads(config, plan: Dict[str, str], world: int) -> None:
    """Attention heads split whole: refused up front where the plan splits q/k/v projections and a head count does
    not divide by the world size (the projections' own sizes would split, across a head)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    splits_heads = any(k.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj") and v.startswith("colwise")
                       for k, v in plan.items())
    if not splits_heads:
        return
    for attr in ("num_attention_heads", "num_key_value_heads"):
        n = getattr(text, attr, None)
        if isinstance(n, int) and n % world:
            raise SplitError(f"tp_plan: {attr} = {n} does not split over {world} ranks (the attention projections "
                             f"are split by whole heads)")


class ShardHook:
    """``load_quantized``'s ``module_hook``: each low-bit layer, as it is built, is cut for this rank under the
    plan's style for it (replicated where the plan has none), so that the rank keeps only its shard's bytes."""

    def __init__(self, plan: Dict[str, str], rank: int, world: int):
        self.plan, self.rank, self.world = plan, rank, world
        self.styles: Dict[str, object] = {}
        self.cut_experts = set()  # experts layers whose projections cut_expert cut as they were read

    def _style(self, name: str):
        """(split kind, low-bit style) of the plan's entry for module `name`; (None, None) where it has none."""
        style_name = style_of(name, self.plan)
        if style_name is None or style_name == "replicate":
            return None, None
        from .styles import lowbit_style

        return lowbit_style(style_name, name)

    def __call__(self, name: str, layer: nn.Module) -> nn.Module:
        if layout_of(layer) is None:
            return layer
        kind, style = self._style(name)
        if style is not None:
            self.styles[name] = style
        if name in self.cut_experts:
            layer._lowbit_tp = (kind, self.rank, self.world)
            return layer
        return shard_layer(layer, kind, self.rank, self.world, name)

    def cut_expert(self, name: str, projection: str, q):
        """One expert's projection (a formats.tensors.QuantizedWeight) of experts layer `name`, cut as the experts
        split cuts it -- gate / up rows, down columns -- through the linear layers' layouts, before the layer is
        stacked: the rank never holds the whole layer."""
        import dataclasses

        from ..nn import Fp8Linear, Int8Linear

        kind, _ = self._style(name)
        if kind != "experts":
            return q
        self.cut_experts.add(name)
        lin = (Fp8Linear.from_quantized(q.weight, q.scale, block_size=q.block_size) if q.kind == "fp8"
               else Int8Linear.from_quantized(q.weight, q.scale))
        shard_layer(lin, "rowwise" if projection == "down" else "colwise", self.rank, self.world,
                    f"{name}.*.{projection}_proj")
        return dataclasses.replace(q, weight=lin.weight, scale=lin.weight_scale)


def parallelize(model: nn.Module, mesh, plan: Dict[str, str], hook: Optional[ShardHook] = None) -> nn.Module:
    """Install the plan's styles: low-bit layers (cut here unless `hook` cut them while loading) get the low-bit
    styles; the plan's other modules get transformers' styles, their parameters sharded by transformers."""
    apply_tensor_parallelism = transformers_tp()[0].apply_tensor_parallelism
    rank, world = mesh.get_local_rank(), mesh.size()
    hook = hook or ShardHook(plan, rank, world)
    lowbit = [name for name, m in model.named_modules() if layout_of(m) is not None]
    for name in lowbit:
        layer = model.get_submodule(name)
        if getattr(layer, "_lowbit_tp", None) is None:
            hook(name, layer)
        style = hook.styles.get(name)
        if style is not None:
            style.install_forward(layer, mesh, name)
    inside = tuple(n + "." for n in lowbit)
    own = dict(plan)
    for k in getattr(plan, "lowbit_only", ()):
        own.pop(k, None)
    expanded = model._expand_parallel_plan(own) if hasattr(model, "_expand_parallel_plan") else {}
    dense = {k: v for k, v in expanded.items() if k not in lowbit and not k.startswith(inside)}
    apply_tensor_parallelism(model, mesh, dense)
    model._lowbit_tp_mesh = mesh
    return model


def own_memory(model: nn.Module) -> None:
    """Copy every tensor that is not a cut low-bit tensor out of whatever it views (a memory-mapped checkpoint):
    the model owns its memory, as a model loaded without tensor parallelism does."""
    seen = {}
    for mod in model.modules():
        if getattr(mod, "_lowbit_tp", None) is not None:
            continue
        for table in (mod._parameters, mod._buffers):
            for k, t in table.items():
                if t is None or t.is_meta:
                    continue
                if id(t) not in seen:  # tied weights stay one tensor
                    data = t.detach().clone()
                    seen[id(t)] = nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) \
                        else data
                table[k] = seen[id(t)]


def quantize_parallel(model: nn.Module, config, filter_fn) -> Dict[str, str]:
    """``quantize_`` on a model that transformers loaded split over the ranks (``from_pretrained(...,
    tp_plan="auto", quantization_config=TorchLowbitConfig(...))``: its plan's linear and experts modules hold DTensor
    shards and transformers' forwards). One module at a time: its shards are gathered into the whole dense weight
    (DTensor's ``full_tensor``), quantized exactly as without tensor parallelism (row-wise scales see whole rows),
    cut for this rank and given the low-bit style of its plan entry; a module that does not convert (or that
    `filter_fn` skips) stays as transformers split it. Returns {module name: style} of the converted modules."""
    from torch.distributed.tensor import DTensor

    from ..quantize import _dense_experts, _swappable, quantize_
    from .styles import lowbit_style

    ep_size = getattr(getattr(getattr(model, "config", None), "distributed_config", None), "ep_size", None) or 1
    if ep_size > 1:  # transformers' expert parallelism has cut the experts by expert and routes tokens to its ranks
        raise ValueError(f"TorchLowbitConfig with expert parallelism (DistributedConfig ep_size={ep_size}) is not "
                         f"supported: torch_lowbit splits MoE experts over their intermediate size under the tp_plan; "
                         f"load with ep_size=1")
    plan = resolve_plan(model, "auto")
    any_mesh = next((p.device_mesh for p in model.parameters() if isinstance(p, DTensor)), None)
    done = {}
    for name, mod in list(model.named_modules()):
        shards = {k: p for k, p in mod._parameters.items() if isinstance(p, DTensor)}
        style_name = style_of(name, plan)
        # experts that transformers (5.25 and newer) leaves whole on every rank, split by torch_lowbit (resolve_plan)
        whole_experts = not shards and style_name == EXPERTS_SPLIT and _dense_experts(mod) and any_mesh is not None
        if ((not shards and not whole_experts) or style_name is None or not (_swappable(mod) or _dense_experts(mod))
                or not filter_fn(mod, name)):
            continue
        mesh = next(iter(shards.values())).device_mesh if shards else any_mesh
        kind, style = lowbit_style(style_name, name)
        installed = mod.__dict__.pop("forward", None)  # transformers' TP forward, on the instance
        for k, p in shards.items():
            mod._parameters[k] = nn.Parameter(p.full_tensor(), requires_grad=False)
        new = quantize_(mod, config, filter_fn=lambda m, fqn: True)
        if layout_of(new) is None:  # left dense (experts it cannot convert): back as transformers split it
            mod._parameters.update(shards)
            if installed is not None:
                mod.forward = installed
            continue
        shard_layer(new, kind, mesh.get_local_rank(), mesh.size(), name)
        style.install_forward(new, mesh, name)
        model.set_submodule(name, new)
        done[name] = style_name
    return done
