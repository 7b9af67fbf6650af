"""Cut a low-bit layer's tensors for one rank (see :mod:`.layouts` for what splits where).

Every tensor of the result owns its memory (a slice is copied out, a replicated tensor is copied too): the layer
keeps no view of the whole checkpoint tensor, so a rank holds its shard's bytes and nothing else, also when the
checkpoint was memory-mapped.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .layouts import Axis, SplitError, check_split, layout_of

# the split of each parallel style: which extent of the layer's layout it divides among the ranks
STYLE_EXTENTS = {"colwise": "N", "rowwise": "K", "experts": "I"}


def cut(t: torch.Tensor, axis: Axis, size: int, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s part of `t` along ``axis.dim``, where the extent of full size `size` runs in ``axis.unit``
    element units, ``axis.halves`` times (each half split alone)."""
    if world == 1:
        return t  # whole, partial edge units included
    per_half = size // axis.unit
    local = per_half // world
    pieces = [t.narrow(axis.dim, h * per_half + rank * local, local) for h in range(axis.halves)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, axis.dim)


def _owned(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().clone()


def shard_layer(layer: nn.Module, style: Optional[str], rank: int, world: int, name: str = "layer") -> nn.Module:
    """`layer` (in place) holding rank `rank`'s part of its tensors under `style` (``"colwise"``, ``"rowwise"``,
    ``"experts"``, or None: replicated, every tensor kept whole). Sizes that do not split evenly (N or K not a
    multiple of world x block) raise a :class:`~.layouts.SplitError` naming `name` and the sizes."""
    layout = layout_of(layer)
    if layout is None:
        raise SplitError(f"{name}: {type(layer).__name__} is not a torch_lowbit layer that splits over ranks")
    extent = None
    if style is not None:
        if style not in STYLE_EXTENTS:
            raise ValueError(f"shard_layer: style must be one of {sorted(STYLE_EXTENTS)} or None, got {style!r}")
        extent = STYLE_EXTENTS[style]
    if not (isinstance(world, int) and world >= 1 and isinstance(rank, int) and 0 <= rank < world):
        raise ValueError(f"shard_layer: need 0 <= rank < world, got rank={rank!r}, world={world!r}")
    local = check_split(name, layer, layout, extent, world) if extent is not None else None
    for tname, holder in _tensors(layer):
        t = holder[tname]
        if t is None:
            continue
        axis = None if extent is None else layout.tensors.get(tname, {}).get(extent)
        piece = t if axis is None else cut(t, axis, layout.extents[extent], rank, world)
        new = _owned(piece)
        holder[tname] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
    if extent is not None:
        layout.resize(layer, extent, local)
    layer._lowbit_tp = (style, rank, world)
    return layer


def _tensors(layer: nn.Module):
    for tname in list(layer._parameters):
        yield tname, layer._parameters
    for tname in list(layer._buffers):
        yield tname, layer._buffers
