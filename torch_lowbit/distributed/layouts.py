"""How each low-bit layer's tensors split under tensor parallelism.

A layer has named extents -- ``N`` (out_features) and ``K`` (in_features) for the linear layers, ``I`` (the
intermediate size) for the experts layers -- and a parallel style splits one of them evenly across the ranks:
column-wise splits ``N``, row-wise splits ``K``, the experts' tensor-parallel style splits ``I`` (gate_up's rows,
down's columns). A layout says, for each tensor of the layer, along which dimension each extent runs and in units
of how many elements (1 for a weight or a per-channel scale, the block for a block scale, the group for a 4-bit
group scale, 2 for two 4-bit codes per byte); ``halves`` = 2 where the dimension holds two stacked parts that split
separately (gate rows, then up rows). A tensor in which the split extent does not run (a per-tensor scale, a
row-wise layer's per-channel scale and bias) is replicated.

A split must give every rank a whole number of units: otherwise a block (or a pair of 4-bit codes) would straddle
two ranks, and :func:`check_split` refuses, naming the layer, the tensor and the sizes.

One layout per layer class, registered with :func:`register_layout`: a new layer class is one function here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Type

from torch import nn

from ..granularity import PerBlock


@dataclass(frozen=True)
class Axis:
    """Extent ``dim`` of a tensor: ``halves`` stacked parts of ``extent / unit`` entries each."""
    dim: int
    unit: int = 1
    halves: int = 1


@dataclass
class Layout:
    """``extents``: the layer's extent sizes by name. ``tensors``: buffer / parameter name -> {extent name -> Axis}
    (a tensor in no entry, or None, is not split). ``resize``: sets the layer's attributes after a split
    (extent name, new size)."""
    extents: Dict[str, int]
    tensors: Dict[str, Dict[str, Axis]]
    resize: Callable[[nn.Module, str, int], None]


class SplitError(ValueError):
    """A layer that cannot split evenly over the ranks (raised at load time, before any collective runs)."""


_LAYOUTS: Dict[Type[nn.Module], Callable[[nn.Module], Layout]] = {}


def register_layout(cls: Type[nn.Module]):
    def decorator(fn: Callable[[nn.Module], Layout]):
        _LAYOUTS[cls] = fn
        return fn
    return decorator


def layout_of(layer: nn.Module) -> Optional[Layout]:
    """The layout of a low-bit layer, None for a module torch_lowbit does not shard."""
    for cls in type(layer).__mro__:
        if cls in _LAYOUTS:
            return _LAYOUTS[cls](layer)
    return None


def check_split(name: str, layer: nn.Module, layout: Layout, extent: str, world: int) -> int:
    """The size of `extent` on each rank, or a SplitError naming the layer, the tensor and the sizes."""
    what = f"{name} ({type(layer).__name__})"
    if extent not in layout.extents:
        raise SplitError(f"{what}: a split of {extent!r} is not defined for this layer (it has "
                         f"{sorted(layout.extents)})")
    size = layout.extents[extent]
    if size % world:
        raise SplitError(f"{what}: {extent} = {size} does not split evenly over {world} ranks")
    local = size // world
    if world == 1:  # no boundary to align (a partial edge block stays where it is)
        return local
    for tname, axes in layout.tensors.items():
        axis = axes.get(extent)
        if axis is not None and local % axis.unit:
            raise SplitError(f"{what}: {extent} = {size} over {world} ranks gives {local} per rank, which is not a "
                             f"multiple of {axis.unit} ({tname} holds {extent} in units of {axis.unit}: a unit would "
                             f"straddle two ranks)")
    return local


# ------------------------------------------------------------------------------------------------ the layouts
def _linear_resize(layer, extent, size):
    if extent == "N":
        layer.out_features = size
    else:
        layer.in_features = size


def _nk(n_unit=1, k_unit=1) -> Dict[str, Axis]:
    return {"N": Axis(0, n_unit), "K": Axis(1, k_unit)}


def _fp8_scale_axes(g, experts: bool = False, halves: int = 1, n: str = "N", k: str = "K") -> Dict[str, Axis]:
    """Where a scale of granularity `g` holds the output rows (`n`) and the input columns (`k`)."""
    lead = 1 if experts else 0
    if g.kind == "tensor":
        return {}
    if isinstance(g, PerBlock):
        return {n: Axis(lead, g.block_n, halves), k: Axis(lead + 1, g.block_k)}
    return {n: Axis(lead, 1, halves)}


def _register_linear_layouts():
    from ..nn import Fp8Linear, Int8Linear, W4Linear

    @register_layout(Fp8Linear)
    def _fp8_linear(layer):
        return Layout({"N": layer.out_features, "K": layer.in_features},
                      {"weight": _nk(), "weight_scale": _fp8_scale_axes(layer.granularity), "bias": {"N": Axis(0)}},
                      _linear_resize)

    @register_layout(Int8Linear)
    def _int8_linear(layer):
        per_channel = layer.weight_scale.shape[0] == layer.out_features and layer.weight_scale.numel() > 1
        return Layout({"N": layer.out_features, "K": layer.in_features},
                      {"weight": _nk(), "weight_scale": {"N": Axis(0)} if per_channel else {}, "bias": {"N": Axis(0)}},
                      _linear_resize)

    @register_layout(W4Linear)
    def _w4_linear(layer):
        K = layer.in_features
        # one group per row (group_size >= K): the scale stays whole on every rank, and ceil(K / group_size) stays 1
        grouped = _nk(1, layer.group_size) if layer.group_size < K else {"N": Axis(0)}
        return Layout({"N": layer.out_features, "K": K},
                      {"weight_packed": _nk(1, 2), "weight_scale": grouped, "weight_offset": grouped,
                       "bias": {"N": Axis(0)}},
                      _linear_resize)


def _experts_resize(layer, extent, size):
    layer.intermediate_size = size


def _register_experts_layouts():
    from ..nn import Fp8Experts, Int8Experts, W4Experts

    # gate_up [E, 2I, H]: I runs along dim 1, twice (gate rows, then up rows); down [E, H, I]: along dim 2
    gate_up_rows, down_cols = Axis(1, 1, 2), Axis(2)

    @register_layout(Fp8Experts)
    def _fp8_experts(layer):
        gu = _fp8_scale_axes(layer.gate_up_granularity, experts=True, halves=2, n="I", k="H")
        dn = _fp8_scale_axes(layer.down_granularity, experts=True, n="H", k="I")
        return Layout({"I": layer.intermediate_size},
                      {"gate_up": {"I": gate_up_rows}, "down": {"I": down_cols},
                       "gate_up_scale": gu, "down_scale": dn},
                      _experts_resize)

    @register_layout(Int8Experts)
    def _int8_experts(layer):
        return Layout({"I": layer.intermediate_size},
                      {"gate_up": {"I": gate_up_rows}, "down": {"I": down_cols}, "gate_up_scale": {"I": gate_up_rows}},
                      _experts_resize)

    @register_layout(W4Experts)
    def _w4_experts(layer):
        if getattr(layer, "down_bias", None) is not None:
            # each rank would add the whole bias to its partial sum
            raise SplitError(f"{type(layer).__name__} with a down-projection bias does not split over ranks")
        down_groups = {"I": Axis(2, layer.group_size)}  # groups along I: a rank holds whole groups
        rows = {"I": gate_up_rows}
        return Layout({"I": layer.intermediate_size},
                      {"gate_up_packed": rows, "gate_up_scale": rows, "gate_up_offset": rows, "gate_up_bias": rows,
                       "down_packed": {"I": Axis(2, 2)}, "down_scale": down_groups, "down_offset": down_groups},
                      _experts_resize)


_register_linear_layouts()
_register_experts_layouts()
