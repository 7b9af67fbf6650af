"""Read one quantized linear layer's tensors out of a checkpoint and normalize them to what the ops take:
weight [N, K] float8_e4m3fn or int8 (compressed-tensors' block padding cut off), scale fp32 of shape [1] (per
tensor), [N] (per channel) or [ceil(N/bn), ceil(K/bk)] (per block)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from .detect import QuantFormat, _UNSUPPORTED_WEIGHT_DTYPES
from .source import CheckpointError, Source


@dataclass
class QuantizedWeight:
    kind: str                          # "fp8" or "int8"
    weight: torch.Tensor               # [N, K]
    scale: torch.Tensor                # fp32: [1], [N] or [nb, kb]
    block_size: Optional[Tuple[int, int]]
    input_scale: Optional[torch.Tensor] = None
    keys: List[str] = field(default_factory=list)  # checkpoint keys consumed

    @property
    def granularity(self) -> str:
        if self.block_size is not None:
            return "block"
        return "tensor" if self.scale.numel() == 1 and self.weight.shape[0] != 1 else "channel"


def weight_kind(fmt: QuantFormat, key: str, dtype: torch.dtype) -> Optional[str]:
    """"fp8" / "int8" for a quantized weight this format can hold, None for a high-precision one; errors for the
    rest (e5m2, int8 in an FP8-only format)."""
    if dtype == torch.float8_e4m3fn:
        return "fp8"
    if dtype in _UNSUPPORTED_WEIGHT_DTYPES:
        raise CheckpointError(f"{key} is {dtype}: torch_lowbit reads float8_e4m3fn weights only")
    if dtype == torch.int8:
        if fmt.name != "compressed-tensors":
            raise CheckpointError(f"{key} is int8, but a {fmt.name} checkpoint holds FP8 weights only")
        return "int8"
    return None


def normalize_scale(key: str, scale: torch.Tensor, N: int, K: int,
                    block_size: Optional[Tuple[int, int]]) -> Tuple[torch.Tensor, Optional[Tuple[int, int]]]:
    """fp32 scale in the layout the ops take, and the block size to pass (None unless the scale is per block)."""
    if scale.is_floating_point() is False:
        raise CheckpointError(f"{key} must be a floating-point scale, got {scale.dtype}")
    s = scale.to(torch.float32)
    shape = tuple(s.shape)
    if block_size is not None:
        bn, bk = block_size
        if shape == (math.ceil(N / bn), math.ceil(K / bk)):
            return s.contiguous(), block_size
    if s.numel() == 1:
        return s.reshape(1), None
    if shape in ((N,), (N, 1)):
        return s.reshape(N).contiguous(), None
    expected = f"1 element (per tensor), [{N}] or [{N}, 1] (per channel)"
    if block_size is not None:
        bn, bk = block_size
        expected += f", or [{math.ceil(N / bn)}, {math.ceil(K / bk)}] (blocks of {bn}x{bk})"
    raise CheckpointError(f"{key} has shape {list(shape)}, which fits no scale layout of the {N}x{K} weight: "
                          f"expected {expected}")


def read_quantized(src: Source, fmt: QuantFormat, prefix: str, kind: str,
                   expected_shape: Optional[Tuple[int, int]] = None) -> QuantizedWeight:
    """The quantized weight of module `prefix` (its ``.weight`` is known to be fp8 / int8)."""
    wkey = f"{prefix}.weight"
    skey = f"{prefix}.{fmt.scale_key}"
    keys = [wkey]
    weight = src.get(wkey)
    if weight.dim() != 2:
        raise CheckpointError(f"{wkey} must be a 2-D [out_features, in_features] weight, got shape {list(weight.shape)}")
    # compressed-tensors pads block-quantized weights to whole blocks and records the true shape
    okey = f"{prefix}.weight_shape_original"
    if okey in src:
        n, k = (int(v) for v in src.get(okey).reshape(-1).tolist())
        keys.append(okey)
        if n > weight.shape[0] or k > weight.shape[1]:
            raise CheckpointError(f"{okey} = {[n, k]} is larger than {wkey}'s shape {list(weight.shape)}")
        if (n, k) != tuple(weight.shape):
            weight = weight[:n, :k].contiguous()
    N, K = weight.shape
    if expected_shape is not None and (N, K) != tuple(expected_shape):
        raise CheckpointError(f"{wkey} has shape {[N, K]} but the model's layer {prefix} expects "
                              f"{list(expected_shape)} (out_features, in_features)")
    if skey in src:
        scale, block = normalize_scale(skey, src.get(skey), N, K, fmt.block_size)
        keys.append(skey)
    elif fmt.scale_required:
        raise CheckpointError(f"{wkey} is {weight.dtype} but its scale {skey} is missing from the checkpoint")
    else:
        scale, block = torch.ones(1), None
    zkey = f"{prefix}.weight_zero_point"
    if zkey in src and bool(src.get(zkey).ne(0).any()):
        raise CheckpointError(f"{zkey} is nonzero: asymmetric weights are not supported")
    if kind == "int8":
        if block is not None:
            raise CheckpointError(f"{skey}: int8 weights take per-tensor or per-channel scales, not blocks")
        scale = scale.expand(N).contiguous() if scale.numel() == 1 else scale
    input_scale = None
    for extra in fmt.extra_keys:
        ekey = f"{prefix}.{extra}"
        if ekey in src:
            keys.append(ekey)
            if extra == "input_scale" and kind == "fp8":
                input_scale = src.get(ekey).to(torch.float32)
    if kind == "fp8" and weight.dtype != torch.float8_e4m3fn:
        raise CheckpointError(f"{wkey} is {weight.dtype}, expected float8_e4m3fn")
    return QuantizedWeight(kind, weight, scale, block, input_scale, keys)
