"""Weight quantization: ``quantize_fp8`` / ``quantize_int8`` for one weight, ``quantize_`` for a whole model.

Scales are multipliers, as in every checkpoint format: ``w ~= dequant(q) * scale``. They are computed in float32
whatever the weight's dtype (a bf16 ``amax / 448`` would lose 8 bits of the scale).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Tuple

import torch
import torch.nn as nn

from ._storage import FP8, fp8_storage_dtype

FP8_MAX = 448.0   # largest finite float8_e4m3fn
INT8_MAX = 127.0  # symmetric: -128 is never produced
GRANULARITIES = ("tensor", "channel", "block")


def normalize_block_size(block_size, name="block_size") -> Tuple[int, int]:
    """(block_n, block_k) as a tuple of two positive ints, or a ValueError naming the argument."""
    try:
        bn, bk = (int(b) for b in block_size)
        ok = bn > 0 and bk > 0 and all(int(b) == b for b in block_size)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{name} must be two positive ints (block_n, block_k), got {block_size!r}")
    return bn, bk


def check_granularity(granularity, name="granularity") -> str:
    if granularity not in GRANULARITIES:
        raise ValueError(f"{name} must be one of {GRANULARITIES}, got {granularity!r}")
    return granularity


def _check_weight(w, fn):
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{fn}: w must be a torch.Tensor, got {type(w).__name__}")
    if not w.is_floating_point() or w.dtype == FP8:
        raise ValueError(f"{fn}: w must be a floating-point weight (bfloat16, float16, float32, float64), got {w.dtype}")
    if w.dim() != 2:
        raise ValueError(f"{fn}: w must be [N, K] (nn.Linear layout), got shape {tuple(w.shape)}")


def _amax_rows(w32: torch.Tensor) -> torch.Tensor:
    # amax over an empty dim is an error in torch; an empty row quantizes like a zero row
    if w32.shape[1] == 0:
        return w32.new_zeros(w32.shape[0])
    return w32.abs().amax(dim=1)


def _check_finite(scale, fn):
    if scale.device.type == "meta":  # a model built on the meta device has no values to check yet
        return
    if not bool(torch.isfinite(scale).all()):
        raise ValueError(f"{fn}: w contains NaN or inf; no finite scale can represent it")


def _safe(scale: torch.Tensor) -> torch.Tensor:
    # an all-zero block has scale 0: divide its zeros by 1 instead, so they stay 0 rather than NaN
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def _to_fp8(q32: torch.Tensor) -> torch.Tensor:
    """Saturating cast of float32 values (already within +-448 up to rounding) to e4m3fn codes, rounded to nearest
    even by torch's cast. On a device that cannot hold fp8 the cast runs on the CPU and the codes come back as
    uint8 bits on the device."""
    q32 = q32.clamp(-FP8_MAX, FP8_MAX)  # values past 448 would cast to NaN: e4m3fn has no inf
    if fp8_storage_dtype(q32.device) == FP8:
        return q32.to(FP8)
    return q32.cpu().to(FP8).view(torch.uint8).to(q32.device)


def quantize_fp8(w: torch.Tensor, granularity: str = "tensor", block_size=(128, 128)):
    """Quantize a weight ``w [N, K]`` to float8_e4m3fn codes and float32 scales with ``scale = amax / 448``.

    granularity:
      - ``"tensor"``: one scale, shape ``[1]`` (the compressed-tensors layout; ModelOpt's 0-d scales work as well);
      - ``"channel"``: one per output row, shape ``[N]``;
      - ``"block"``: one per ``block_size = (block_n, block_k)`` tile, shape ``[ceil(N/block_n), ceil(K/block_k)]``;
        edge blocks may be partial. ``block_size`` is ignored for the other granularities.

    Values are divided by their scale in float32 and cast with saturation (to +-448) and round-to-nearest-even.
    An all-zero tensor / row / block gets scale 0 and codes 0 (never NaN). Returns ``(w_fp8, scale)``; ``w_fp8`` is
    float8_e4m3fn, or uint8 bits on a device that cannot hold fp8 (mps before PyTorch 2.15).
    """
    fn = "quantize_fp8"
    _check_weight(w, fn)
    check_granularity(granularity)
    w32 = w.detach().to(torch.float32)
    N, K = w32.shape
    if granularity == "tensor":
        amax = w32.abs().amax() if w32.numel() else w32.new_zeros(())
        scale = (amax / FP8_MAX).reshape(1)
        q = w32 / _safe(scale)
    elif granularity == "channel":
        scale = _amax_rows(w32) / FP8_MAX
        q = w32 / _safe(scale)[:, None]
    else:
        bn, bk = normalize_block_size(block_size)
        # a block longer than its dimension is one partial block (the ops' rule): pad to the dimension only
        bn, bk = min(bn, max(N, 1)), min(bk, max(K, 1))
        nb, kb = -(-N // bn), -(-K // bk)
        # pad to whole blocks with zeros, which change no block's amax, and view as [nb, bn, kb, bk]
        padded = nn.functional.pad(w32, (0, kb * bk - K, 0, nb * bn - N)).view(nb, bn, kb, bk)
        if padded.numel():
            scale = padded.abs().amax(dim=(1, 3)) / FP8_MAX
        else:
            scale = w32.new_zeros(nb, kb)
        q = (padded / _safe(scale)[:, None, :, None]).view(nb * bn, kb * bk)[:N, :K]
    _check_finite(scale, fn)
    return _to_fp8(q.contiguous()), scale


def quantize_int8(w: torch.Tensor):
    """Symmetric per-output-channel int8 quantization of ``w [N, K]``: ``scale = amax / 127`` (float32 ``[N]``),
    ``q = round_half_even(w / scale)`` clamped to ``[-127, 127]``. A zero row gets scale 0 and codes 0.
    Returns ``(wq int8 [N, K], scale)``.
    """
    fn = "quantize_int8"
    _check_weight(w, fn)
    w32 = w.detach().to(torch.float32)
    scale = _amax_rows(w32) / INT8_MAX
    _check_finite(scale, fn)
    q = torch.round(w32 / _safe(scale)[:, None]).clamp_(-INT8_MAX, INT8_MAX)  # torch.round is half-to-even
    return q.to(torch.int8), scale


# ---------------------------------------------------------------------------------------------- quantize_
@dataclasses.dataclass(frozen=True)
class Fp8WeightOnly:
    """W8A16: fp8 weights (``Fp8Linear``), activations stay in their dtype. ``block_size`` is used only with
    ``granularity="block"``."""
    granularity: str = "channel"
    block_size: Tuple[int, int] = (128, 128)

    def __post_init__(self):
        check_granularity(self.granularity, "Fp8WeightOnly.granularity")
        object.__setattr__(self, "block_size", normalize_block_size(self.block_size, "Fp8WeightOnly.block_size"))

    def quantize_linear(self, linear: nn.Linear) -> nn.Module:
        from .nn import Fp8Linear
        return Fp8Linear.from_float(linear, granularity=self.granularity, block_size=self.block_size)


@dataclasses.dataclass(frozen=True)
class Int8Dynamic:
    """W8A8: int8 per-channel weights, activations quantized per row at run time (``Int8Linear``)."""

    def quantize_linear(self, linear: nn.Linear) -> nn.Module:
        from .nn import Int8Linear
        return Int8Linear.from_float(linear)


CONFIGS = (Fp8WeightOnly, Int8Dynamic)
SKIPPED_BY_DEFAULT = ("lm_head",)


def _swappable(module) -> bool:
    # MultiheadAttention reads out_proj.weight directly instead of calling it: that Linear must stay a Linear
    return (isinstance(module, nn.Linear) and not isinstance(module, nn.modules.linear.NonDynamicallyQuantizableLinear)
            and module.weight.dim() == 2 and module.weight.is_floating_point())


def default_filter(module: nn.Module, fqn: str) -> bool:
    """Quantize every swappable nn.Linear except those named ``lm_head`` (the logits are accuracy-critical)."""
    return fqn.rsplit(".", 1)[-1] not in SKIPPED_BY_DEFAULT


def quantize_(model: nn.Module, config, filter_fn: Optional[Callable[[nn.Module, str], bool]] = None) -> nn.Module:
    """Replace the ``nn.Linear`` layers of ``model`` in place by quantized layers, torchao style.

    config: ``Fp8WeightOnly(granularity="channel", block_size=(128, 128))`` -> ``Fp8Linear``, or ``Int8Dynamic()``
    -> ``Int8Linear``. ``filter_fn(module, fqn) -> bool`` is asked about each nn.Linear (``fqn`` is its dotted name
    in ``model``) and replaces the default filter, which skips layers named ``lm_head``. A Linear shared by several
    parents is quantized once and stays shared. Returns ``model`` (or the new layer if ``model`` is itself a Linear).
    """
    if not isinstance(config, CONFIGS):
        raise TypeError(f"quantize_: config must be torch_lowbit.Fp8WeightOnly(...) or torch_lowbit.Int8Dynamic(), "
                        f"got {config!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize_: model must be an nn.Module, got {type(model).__name__}")
    if filter_fn is None:
        filter_fn = default_filter
    elif not callable(filter_fn):
        raise TypeError(f"quantize_: filter_fn must be callable as filter_fn(module, fqn), got {filter_fn!r}")
    if _swappable(model):
        return config.quantize_linear(model) if filter_fn(model, "") else model
    done = {}  # id(linear) -> its replacement, so shared (tied) layers stay shared
    for fqn, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if id(child) in done:
                setattr(parent, name, done[id(child)])
            elif _swappable(child) and filter_fn(child, f"{fqn}.{name}" if fqn else name):
                done[id(child)] = config.quantize_linear(child)
                setattr(parent, name, done[id(child)])
    return model
