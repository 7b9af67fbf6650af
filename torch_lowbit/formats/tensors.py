"""Read one quantized linear layer's tensors out of a checkpoint and normalize them to what the ops take:
weight [N, K] float8_e4m3fn or int8 (block padding cut off where the format records the true shape), scale fp32
multiplier of shape [1] (per tensor), [N] (per channel) or [ceil(N/bn), ceil(K/bk)] (per block). What differs
between formats (scale name, inverse scales, padding, extra tensors) comes from the QuantFormat."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from ..granularity import Granularity, PerBlock, PerTensor, granularity_with_block_hint
from .registry import QuantFormat
from .source import CheckpointError, Source


@dataclass
class QuantizedWeight:
    kind: str                          # "fp8" or "int8"
    weight: torch.Tensor               # [N, K]
    scale: torch.Tensor                # fp32 multiplier: [1], [N] or [nb, kb]
    granularity: Granularity
    input_scale: Optional[torch.Tensor] = None
    keys: List[str] = field(default_factory=list)  # checkpoint keys consumed

    @property
    def block_size(self) -> Optional[Tuple[int, int]]:
        return self.granularity.block_size


def normalize_scale(key: str, scale: torch.Tensor, N: int, K: int, block_size: Optional[Tuple[int, int]],
                    inverse: bool = False) -> Tuple[torch.Tensor, Granularity]:
    """The fp32 multiplier in its canonical layout and its granularity (the format's block size applies to a
    scale of that block's shape)."""
    if not scale.is_floating_point():
        raise CheckpointError(f"{key} must be a floating-point scale, got {scale.dtype}")
    try:
        g = granularity_with_block_hint(scale.shape, N, K, block_size, what=key)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    s = scale.to(torch.float32).reshape(g.scale_shape(N, K)).contiguous()
    return (s.reciprocal() if inverse else s), g


def read_quantized(src: Source, fmt: QuantFormat, prefix: str, kind: str,
                   expected_shape: Optional[Tuple[int, int]] = None) -> QuantizedWeight:
    """The quantized weight of module `prefix` (its ``.weight`` is known to be fp8 / int8)."""
    wkey = f"{prefix}.weight"
    skey = f"{prefix}.{fmt.scale_key}"
    keys = [wkey]
    weight = src.get(wkey)
    if weight.dim() != 2:
        raise CheckpointError(f"{wkey} must be a 2-D [out_features, in_features] weight, got shape {list(weight.shape)}")
    okey = f"{prefix}.{fmt.original_shape_key}" if fmt.original_shape_key else None
    if okey is not None and okey in src:
        shape = src.get(okey).reshape(-1)
        if shape.numel() != 2 or shape.is_floating_point():
            raise CheckpointError(f"{okey} must hold two integers [N, K], got {shape.tolist()}")
        n, k = (int(v) for v in shape.tolist())
        keys.append(okey)
        if not (0 <= n <= weight.shape[0] and 0 <= k <= weight.shape[1]):
            raise CheckpointError(f"{okey} = {[n, k]} does not fit in {wkey}'s shape {list(weight.shape)}")
        if (n, k) != tuple(weight.shape):
            weight = weight[:n, :k].contiguous()
    N, K = weight.shape
    if expected_shape is not None and (N, K) != tuple(expected_shape):
        raise CheckpointError(f"{wkey} has shape {[N, K]} but the model's layer {prefix} expects "
                              f"{list(expected_shape)} (out_features, in_features)")
    if skey in src:
        scale, gran = normalize_scale(skey, src.get(skey), N, K, fmt.block_size, fmt.scale_is_inverse)
        keys.append(skey)
    elif fmt.scale_required:
        raise CheckpointError(f"{wkey} is {weight.dtype} but its scale {skey} is missing from the checkpoint")
    else:
        scale, gran = torch.ones(1), PerTensor()
    zkey = f"{prefix}.weight_zero_point"
    if zkey in src and bool(src.get(zkey).ne(0).any()):
        raise CheckpointError(f"{zkey} is nonzero: asymmetric weights are not supported")
    if kind == "int8":
        if isinstance(gran, PerBlock):
            raise CheckpointError(f"{skey}: int8 weights take per-tensor or per-channel scales, not blocks")
        scale = scale.expand(N).contiguous() if scale.numel() == 1 else scale
    input_scale = None
    for extra in fmt.extra_keys:
        ekey = f"{prefix}.{extra}"
        if ekey in src and ekey not in keys:
            keys.append(ekey)
            if extra == "input_scale" and kind == "fp8":
                input_scale = src.get(ekey).to(torch.float32)
    if kind == "fp8" and weight.dtype != torch.float8_e4m3fn:
        raise CheckpointError(f"{wkey} is {weight.dtype}, expected float8_e4m3fn")
    return QuantizedWeight(kind, weight, scale, gran, input_scale, keys)


# ------------------------------------------------------------------------------------------------- 4-bit weights
@dataclass
class W4Weight:
    """One 4-bit linear weight in what ``W4Linear.from_quantized`` takes (see ``torch_lowbit.w4_mm``): ``packed``
    uint8 ``[N, ceil(K/2)]`` (even k in the low nibble), ``scale`` ``[N, G]`` in its stored dtype, ``offset`` (int8
    zero points for int4, biases for uint4), ``global_scale`` (nvfp4's fp32 multiplier)."""
    format: str
    group_size: int
    in_features: int
    packed: torch.Tensor
    scale: torch.Tensor
    offset: Optional[torch.Tensor] = None
    global_scale: Optional[torch.Tensor] = None
    keys: List[str] = field(default_factory=list)

    def describe(self) -> str:
        groups = "channel" if self.group_size >= self.in_features else f"group {self.group_size}"
        extra = {"int4": ", zero points", "uint4": ", biases"}.get(self.format, "") if self.offset is not None else ""
        return f"W4Linear({self.format}, {groups}{extra})"


def nibble_bytes(words: torch.Tensor, cols: int, key: str) -> torch.Tensor:
    """uint8 ``[rows, ceil(cols/2)]`` of 32-bit words packing eight 4-bit codes each, code j in bits
    ``4*(j%8)`` of word ``j//8`` (compressed-tensors' pack-quantized, MLX): on a little-endian host those are
    already two codes per byte with the even one low, so this is a view of the words' memory (a slice, copied only
    where the words pad the row: never a dense copy)."""
    if words.dim() != 2 or words.dtype not in (torch.int32, torch.uint32):
        raise CheckpointError(f"{key} must be 2-D int32 / uint32 words of eight 4-bit codes, got {words.dtype} "
                              f"of shape {list(words.shape)}")
    need = -(-cols // 8)
    if words.shape[1] != need:
        raise CheckpointError(f"{key} has {words.shape[1]} words per row, expected ceil({cols} / 8) = {need} for "
                              f"{cols} 4-bit codes")
    b = words.contiguous().view(torch.uint8)
    if sys.byteorder == "big":  # a word's low byte is its last one there
        b = b.view(words.shape[0], need, 4).flip(-1).reshape(words.shape[0], need * 4)
    half = (cols + 1) // 2
    return b if half == b.shape[1] else b[:, :half].contiguous()


def nibble_words(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """The inverse of :func:`nibble_bytes`: int32 ``[rows, ceil(cols/8)]`` (unused codes zero)."""
    rows, need = packed.shape[0], -(-cols // 8)
    b = torch.zeros(rows, need * 4, dtype=torch.uint8)
    b[:, :packed.shape[1]] = packed.cpu()
    if cols % 2:  # the last byte's high nibble is no code: written as 0, as compressed-tensors pads
        b[:, cols // 2] &= 0x0F
    if sys.byteorder == "big":
        b = b.view(rows, need, 4).flip(-1).reshape(rows, need * 4)
    return b.view(torch.int32)


def unpack_nibbles(b: torch.Tensor, cols: int) -> torch.Tensor:
    """uint8 codes ``[rows, cols]`` of two-per-byte rows (small tensors only: zero points)."""
    return torch.stack((b & 0x0F, b >> 4), -1).reshape(b.shape[0], -1)[:, :cols]
