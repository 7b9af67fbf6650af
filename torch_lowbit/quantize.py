"""Weight quantization: ``quantize_fp8`` / ``quantize_int8`` for one weight, ``quantize_`` for a whole model.

Scales are multipliers, as in every checkpoint format: ``w ~= dequant(q) * scale``. They are computed in float32
whatever the weight's dtype (a bf16 ``amax / 448`` would lose 8 bits of the scale).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Dict, Optional, Tuple, Type

import torch
import torch.nn as nn

from ._storage import FP8, fp8_storage_dtype
from .granularity import (GranularityLike, PerBlock, PerChannel, PerTensor, as_granularity,  # noqa: F401
                          normalize_block_size)

FP8_MAX = 448.0   # largest finite float8_e4m3fn
INT8_MAX = 127.0  # symmetric: -128 is never produced


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


def quantize_fp8(w: torch.Tensor, granularity: GranularityLike = "tensor", block_size=None):
    """Quantize a weight ``w [N, K]`` to float8_e4m3fn codes and float32 scales with ``scale = amax / 448``.

    granularity (a :mod:`torch_lowbit.granularity` class or its string alias):
      - ``PerTensor()`` / ``"tensor"``: one scale, shape ``[1]`` (the compressed-tensors layout; ModelOpt's 0-d
        scales work as well);
      - ``PerChannel()`` / ``"channel"``: one per output row, shape ``[N]``;
      - ``PerBlock(block_n, block_k)`` / ``"block"`` with ``block_size = (block_n, block_k)`` (default 128 x 128):
        one per tile, shape ``[ceil(N/block_n), ceil(K/block_k)]``; edge blocks may be partial. ``block_size`` is
        ignored for the other granularities.

    Values are divided by their scale in float32 and cast with saturation (to +-448) and round-to-nearest-even.
    An all-zero tensor / row / block gets scale 0 and codes 0 (never NaN). Returns ``(w_fp8, scale)``; ``w_fp8`` is
    float8_e4m3fn, or uint8 bits on a device that cannot hold fp8 (mps before PyTorch 2.15).
    """
    fn = "quantize_fp8"
    _check_weight(w, fn)
    g = as_granularity(granularity, block_size)
    w32 = w.detach().to(torch.float32)
    N, K = w32.shape
    if isinstance(g, PerTensor):
        amax = w32.abs().amax() if w32.numel() else w32.new_zeros(())
        scale = (amax / FP8_MAX).reshape(1)
        q = w32 / _safe(scale)
    elif isinstance(g, PerChannel):
        scale = _amax_rows(w32) / FP8_MAX
        q = w32 / _safe(scale)[:, None]
    else:
        bn, bk = g.block_size
        # a block longer than its dimension is one partial block (the ops' rule): pad to the dimension only
        bn, bk = min(bn, max(N, 1)), min(bk, max(K, 1))
        nb, kb = math.ceil(N / bn), math.ceil(K / bk)
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
# Configs are plain data; the module that implements a config registers its handler with
# @register_quantize_module_handler(Config) (torch_lowbit.nn does for the configs below), so this file imports no
# layer and a new config is one dataclass plus one handler.
@dataclasses.dataclass(frozen=True)
class Fp8WeightOnly:
    """W8A16: fp8 weights (``Fp8Linear``), activations stay in their dtype. ``granularity``: ``PerChannel()``
    (default), ``PerTensor()``, ``PerBlock(bn, bk)`` or a string alias; ``block_size`` is the block of the alias
    ``"block"`` (default 128 x 128). After construction ``granularity`` is a Granularity and ``block_size`` its
    block (None unless per block)."""
    granularity: GranularityLike = "channel"
    block_size: Optional[Tuple[int, int]] = None

    def __post_init__(self):
        bs = None if self.block_size is None else normalize_block_size(self.block_size, "Fp8WeightOnly.block_size")
        g = as_granularity(self.granularity, bs, "Fp8WeightOnly.granularity")
        object.__setattr__(self, "granularity", g)
        object.__setattr__(self, "block_size", g.block_size)


@dataclasses.dataclass(frozen=True)
class Int8Dynamic:
    """W8A8: int8 per-channel weights, activations quantized per row at run time (``Int8Linear``)."""


_HANDLERS: Dict[type, Callable[[nn.Module, Any], nn.Module]] = {}


def register_quantize_module_handler(config_cls: Type):
    """Decorator: ``handler(module, config) -> new module`` is what ``quantize_(model, config_cls(...))`` does to
    each nn.Linear its filter accepts. One handler per config class (a subclass uses its parent's unless it
    registers its own)."""
    if not isinstance(config_cls, type):
        raise TypeError(f"register_quantize_module_handler: config_cls must be a class, got {config_cls!r}")

    def decorator(handler):
        if config_cls in _HANDLERS and _HANDLERS[config_cls] is not handler:
            raise ValueError(f"a quantize_ handler for {config_cls.__qualname__} is already registered "
                             f"({_HANDLERS[config_cls].__qualname__})")
        _HANDLERS[config_cls] = handler
        return handler
    return decorator


def _handler_for(config):
    for cls in type(config).__mro__:
        if cls in _HANDLERS:
            return _HANDLERS[cls]
    names = " or ".join(f"{c.__module__.split('.')[0]}.{c.__qualname__}(...)" for c in _HANDLERS)
    raise TypeError(f"quantize_: config must be {names} (or the torchao names Float8WeightOnlyConfig(), "
                    f"Int8DynamicActivationInt8WeightConfig()), got {config!r}")


# ---- torchao's names, for code written against torchao: the keyword arguments that mean the same here are taken,
# those that would change the arithmetic are refused rather than ignored
def _option_name(v) -> str:
    """An enum member or a class instance by its name (torchao need not be installed to pass its objects)."""
    if v is None or isinstance(v, str):
        return str(v)
    return getattr(v, "name", None) or type(v).__name__


def _refuse(config: str, arg: str, value, supported: str):
    raise ValueError(f"{config}: {arg}={value!r} is not supported by torch_lowbit ({supported})")


def Float8WeightOnlyConfig(weight_dtype: torch.dtype = torch.float8_e4m3fn, set_inductor_config: bool = True,
                           version: int = 2) -> Fp8WeightOnly:
    """torchao's name for :class:`Fp8WeightOnly` (per-channel e4m3 weights). ``set_inductor_config`` and
    ``version`` select torchao internals and change nothing here; ``weight_dtype`` must be float8_e4m3fn."""
    if weight_dtype != torch.float8_e4m3fn:
        _refuse("Float8WeightOnlyConfig", "weight_dtype", weight_dtype, "float8_e4m3fn weights only")
    return Fp8WeightOnly(granularity=PerChannel())


def Int8DynamicActivationInt8WeightConfig(layout=None, act_mapping_type=None, weight_only_decode: bool = False,
                                          granularity=None, set_inductor_config: bool = True,
                                          version: int = 2) -> Int8Dynamic:
    """torchao's name for :class:`Int8Dynamic`: symmetric per-token int8 activations, per-channel int8 weights.
    ``layout`` may be None or ``PlainLayout()``, ``act_mapping_type`` None or SYMMETRIC, ``granularity`` None,
    per row / channel; ``weight_only_decode=True`` is refused (activations are always quantized)."""
    name = "Int8DynamicActivationInt8WeightConfig"
    if layout is not None and _option_name(layout) != "PlainLayout":
        _refuse(name, "layout", layout, "PlainLayout() only")
    if act_mapping_type is not None and _option_name(act_mapping_type).upper() != "SYMMETRIC":
        _refuse(name, "act_mapping_type", act_mapping_type, "symmetric activations only")
    if weight_only_decode:
        _refuse(name, "weight_only_decode", weight_only_decode, "activations are quantized for every batch size")
    if granularity is not None and _option_name(granularity) not in ("PerRow", "PerChannel", "channel"):
        _refuse(name, "granularity", granularity, "per-row activations and per-channel weights only")
    return Int8Dynamic()


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

    config: ``Fp8WeightOnly(granularity="channel")`` -> ``Fp8Linear``, ``Int8Dynamic()`` -> ``Int8Linear`` (torchao's
    ``Float8WeightOnlyConfig`` / ``Int8DynamicActivationInt8WeightConfig`` are aliases), or any config class with a
    handler registered by ``register_quantize_module_handler``. ``filter_fn(module, fqn) -> bool`` is asked about
    each nn.Linear (``fqn`` is its dotted name in ``model``) and replaces the default filter, which skips layers
    named ``lm_head``. A Linear shared by several parents is quantized once and stays shared. Returns ``model`` (or
    the new layer if ``model`` is itself a Linear).
    """
    handler = _handler_for(config)
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize_: model must be an nn.Module, got {type(model).__name__}")
    if filter_fn is None:
        filter_fn = default_filter
    elif not callable(filter_fn):
        raise TypeError(f"quantize_: filter_fn must be callable as filter_fn(module, fqn), got {filter_fn!r}")
    if _swappable(model):
        return handler(model, config) if filter_fn(model, "") else model
    done = {}  # id(linear) -> its replacement, so shared (tied) layers stay shared
    for fqn, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if id(child) in done:
                setattr(parent, name, done[id(child)])
            elif _swappable(child) and filter_fn(child, f"{fqn}.{name}" if fqn else name):
                done[id(child)] = handler(child, config)
                setattr(parent, name, done[id(child)])
    return model
