"""Weight quantization: ``quantize_fp8`` / ``quantize_int8`` for one weight, ``quantize_`` for a whole model.

Scales are multipliers, as in every checkpoint format: ``w ~= dequant(q) * scale``. They are computed in float32
whatever the weight's dtype (a bf16 ``amax / 448`` would lose 8 bits of the scale).
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Type

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


def _check_group_size(config: str, group_size, allow_none: bool):
    if group_size is None and allow_none:
        return
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"{config}: group_size must be an int >= 1{' or None (per channel)' if allow_none else ''}, "
                         f"got {group_size!r}")


# ---- 4-bit weights (W4Linear; the arithmetic of each format: torch_lowbit.quantize_w4)
@dataclasses.dataclass(frozen=True)
class Int4WeightOnly:
    """W4A16, signed int4 as compressed-tensors' W4A16 (``symmetric=True``: ``w ~ q * s``, ``s = amax / 7.5``) or
    W4A16_ASYM (``symmetric=False``: int8 zero points, ``w ~ (q - zp) * s``), a scale per ``group_size`` K values
    (None: per output channel), scales in the weight's dtype."""
    group_size: Optional[int] = 128
    symmetric: bool = True

    def __post_init__(self):
        _check_group_size("Int4WeightOnly", self.group_size, allow_none=True)


@dataclasses.dataclass(frozen=True)
class Nvfp4WeightOnly:
    """W4A16, NVFP4 as compressed-tensors' NVFP4A16: E2M1 values, an e4m3 scale per 16 K values, an fp32 tensor
    scale (``amax / (6 * 448)``)."""


@dataclasses.dataclass(frozen=True)
class Mxfp4WeightOnly:
    """W4A16, OCP MXFP4 as compressed-tensors writes it: E2M1 values, a power-of-two (e8m0) scale per 32 K values."""


@dataclasses.dataclass(frozen=True)
class AffineWeightOnly:
    """W4A16, unsigned 4-bit codes with a scale and an additive bias per ``group_size`` K values (``w ~ q * s + b``,
    MLX's affine quantization, format ``"uint4"``); ``rule="mlx"`` (``mlx.core.quantize``) or ``"minmax"``
    (``b = group min``: torchao's int4 weight-only arithmetic)."""
    group_size: int = 64
    rule: str = "mlx"

    def __post_init__(self):
        from .quantize_w4 import UINT4_RULES

        _check_group_size("AffineWeightOnly", self.group_size, allow_none=False)
        if self.rule not in UINT4_RULES:
            raise ValueError(f"AffineWeightOnly: rule must be one of {UINT4_RULES}, got {self.rule!r}")


_HANDLERS: Dict[type, Callable[[nn.Module, Any], nn.Module]] = {}
_EXPERTS_HANDLERS: Dict[type, Callable[[nn.Module, Any], nn.Module]] = {}


def _handler_registrar(table: Dict[type, Callable], fn: str, what: str):
    """The decorator factory of one handler table: one handler per config class, a clash is an error."""
    def register(config_cls: Type):
        if not isinstance(config_cls, type):
            raise TypeError(f"{fn}: config_cls must be a class, got {config_cls!r}")

        def decorator(handler):
            if config_cls in table and table[config_cls] is not handler:
                raise ValueError(f"a quantize_ {what} for {config_cls.__qualname__} is already registered "
                                 f"({table[config_cls].__qualname__})")
            table[config_cls] = handler
            return handler
        return decorator
    return register


def register_quantize_module_handler(config_cls: Type):
    """Decorator: ``handler(module, config) -> new module`` is what ``quantize_(model, config_cls(...))`` does to
    each nn.Linear its filter accepts. One handler per config class (a subclass uses its parent's unless it
    registers its own)."""
    return _handler_registrar(_HANDLERS, "register_quantize_module_handler", "handler")(config_cls)


# config class -> [(claims(module) -> bool, handler)]: experts with their own arithmetic (gpt-oss's)
_OWN_EXPERTS_HANDLERS: Dict[type, list] = {}


def register_quantize_experts_handler(config_cls: Type, claims: Optional[Callable[[nn.Module], bool]] = None):
    """Decorator: ``handler(experts, config) -> new module`` is what ``quantize_(model, config_cls(...))`` does to
    each dense fused MoE experts module (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) its filter accepts
    (torch_lowbit.nn registers Fp8Experts for Fp8WeightOnly, Int8Experts for Int8Dynamic, W4Experts for the 4-bit
    configs).
    ``claims(module) -> bool``: the handler is for the experts modules it accepts only -- experts that compute
    their own arithmetic (gpt-oss's), asked before the [gate; up] SwiGLU handler and without its SwiGLU check:
    such a handler answers for what the module computes."""
    if claims is None:
        return _handler_registrar(_EXPERTS_HANDLERS, "register_quantize_experts_handler",
                                  "experts handler")(config_cls)

    def decorator(handler):
        _OWN_EXPERTS_HANDLERS.setdefault(config_cls, []).append((claims, handler))
        return handler
    return decorator


def _experts_handler_for(config):
    return next((_EXPERTS_HANDLERS[c] for c in type(config).__mro__ if c in _EXPERTS_HANDLERS), None)


def _own_experts_handler_for(config, module):
    return next((h for c in type(config).__mro__ for claims, h in _OWN_EXPERTS_HANDLERS.get(c, ()) if claims(module)),
                None)


def _handler_for(config):
    for cls in type(config).__mro__:
        if cls in _HANDLERS:
            return _HANDLERS[cls]
    names = " or ".join(f"{c.__module__.split('.')[0]}.{c.__qualname__}(...)" for c in _HANDLERS)
    raise TypeError(f"quantize_: config must be {names} (or the torchao names Float8WeightOnlyConfig(), "
                    f"Int8DynamicActivationInt8WeightConfig(), Int4WeightOnlyConfig()), got {config!r}")


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


_TORCHAO_INT4_ALGORITHMS = ("tinygemm",)  # HQQ optimizes the scales: other arithmetic


def Int4WeightOnlyConfig(group_size: int = 128, layout=None, use_hqq: bool = False, zero_point_domain=None,
                         set_inductor_config: bool = True, preserve_zero=None, int4_packing_format="plain",
                         int4_choose_qparams_algorithm="tinygemm", version: int = 2) -> AffineWeightOnly:
    """torchao's name for 4-bit weight-only quantization: unsigned codes with a float zero point per group, which is
    ``w ~ q * s + min`` with ``s = (max - min) / 15``: :class:`AffineWeightOnly` ``(group_size, rule="minmax")``.
    ``layout`` / ``int4_packing_format`` choose torchao's memory layouts and change nothing here (sparse ones are
    refused); ``use_hqq=True``, ``int4_choose_qparams_algorithm="hqq"``, an integer ``zero_point_domain`` and
    ``preserve_zero=True`` compute other scales and are refused."""
    name = "Int4WeightOnlyConfig"
    _check_group_size(name, group_size, allow_none=False)
    if use_hqq:
        _refuse(name, "use_hqq", use_hqq, "round-to-nearest min/max scales only")
    if _option_name(int4_choose_qparams_algorithm).lower() not in _TORCHAO_INT4_ALGORITHMS:
        _refuse(name, "int4_choose_qparams_algorithm", int4_choose_qparams_algorithm,
                "round-to-nearest min/max scales ('tinygemm') only")
    if zero_point_domain is not None and _option_name(zero_point_domain).upper() not in ("FLOAT", "NONE"):
        _refuse(name, "zero_point_domain", zero_point_domain, "a float zero point (the group min) only")
    if preserve_zero:
        _refuse(name, "preserve_zero", preserve_zero, "the group's own min/max range only")
    for arg, v in (("layout", layout), ("int4_packing_format", int4_packing_format)):
        if v is not None and "sparse" in _option_name(v).lower():
            _refuse(name, arg, v, "dense 4-bit weights only")
    return AffineWeightOnly(group_size=group_size, rule="minmax")


SKIPPED_BY_DEFAULT = ("lm_head",)
_DEFAULT_SKIP_REASON = "skipped by the default filter (lm_head)"


def _swappable(module) -> bool:
    # MultiheadAttention reads out_proj.weight directly instead of calling it: that Linear must stay a Linear
    return (isinstance(module, nn.Linear) and not isinstance(module, nn.modules.linear.NonDynamicallyQuantizableLinear)
            and module.weight.dim() == 2 and module.weight.is_floating_point())


def _dense_experts(module) -> bool:
    """A fused MoE experts module still holding float weights (not one of our quantized experts layers)."""
    from .formats.moe import is_experts_module

    return (is_experts_module(module) and isinstance(getattr(module, "gate_up_proj", None), torch.Tensor)
            and module.gate_up_proj.is_floating_point() and module.down_proj.is_floating_point())


def default_filter(module: nn.Module, fqn: str) -> bool:
    """Quantize every swappable nn.Linear and fused experts module except those named ``lm_head`` (the logits are
    accuracy-critical)."""
    return fqn.rsplit(".", 1)[-1] not in SKIPPED_BY_DEFAULT


def kept_in_fp32(model: nn.Module) -> Tuple[str, ...]:
    """The module names a transformers model keeps in high precision (``_keep_in_fp32_modules`` and its ``_strict``
    twin), which transformers' own quantizers leave unconverted: T5's ``wo``, whose input the model casts to that
    layer's weight dtype (an fp8 weight would make it fp8 activations)."""
    names = set()
    for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
        names |= set(getattr(model, attr, None) or ())
    return tuple(sorted(names))


def kept_name(fqn: str, names: Sequence[str]) -> Optional[str]:
    """The entry of ``names`` that module ``fqn`` is or lies in (whole name components, the loaders' ignore-list
    rule), or None."""
    from .formats.registry import matches

    return next((k for k in names if matches(fqn, k)), None)


class _KeepFp32Filter:
    """quantize_'s default on a model that keeps modules in fp32: ``default_filter``, and those modules left alone."""

    def __init__(self, model: nn.Module):
        self.model, self.keep = type(model).__name__, kept_in_fp32(model)

    def skip_reason(self, fqn: str) -> Optional[str]:
        if not default_filter(None, fqn):
            return _DEFAULT_SKIP_REASON
        k = kept_name(fqn, self.keep)
        return None if k is None else f"kept in fp32 by the model ({self.model}._keep_in_fp32_modules: {k!r})"

    def __call__(self, module: nn.Module, fqn: str) -> bool:
        return self.skip_reason(fqn) is None


@dataclasses.dataclass
class QuantizeReport:
    """What ``quantize_(..., return_report=True)`` did. ``converted``: module name -> what it became (the new
    layer's class and scheme, e.g. ``"Fp8Linear(channel)"``, ``"Int8Experts(E=8)"``); ``skipped``: name of each
    nn.Linear / fused experts module left in high precision -> why (the filter declined it, or the experts
    compute something the quantized layers cannot)."""
    converted: Dict[str, str] = dataclasses.field(default_factory=dict)
    skipped: Dict[str, str] = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"quantize_: {len(self.converted)} modules converted, {len(self.skipped)} left in high precision"]
        lines += [f"  kept {n}: {why}" for n, why in self.skipped.items()]
        return "\n".join(lines)


def _describe(layer: nn.Module) -> str:
    """The report's words for a new layer, as the loader's report writes them."""
    name = type(layer).__name__
    if hasattr(layer, "format") and hasattr(layer, "group_size"):  # W4Linear, W4Experts
        experts = f"E={layer.num_experts}, " if hasattr(layer, "num_experts") else ""
        return f"{name}({experts}{layer.format}, group {layer.group_size})"
    if hasattr(layer, "gate_up_granularity"):
        return (f"{name}(E={layer.num_experts}, gate_up {layer.gate_up_granularity.kind}, "
                f"down {layer.down_granularity.kind})")
    if hasattr(layer, "num_experts"):
        return f"{name}(E={layer.num_experts}, channel)"
    gran = getattr(layer, "granularity", None)
    if gran is not None and hasattr(gran, "describe"):
        return f"{name}({gran.describe()})"
    return f"{name}(channel)" if layer.__class__.__name__.startswith("Int8") else name


def _default_filter_for(model: nn.Module) -> Callable[[nn.Module, str], bool]:
    """quantize_'s filter when none is given: the diffusion rule on a diffusers model, else ``default_filter`` (and
    the modules a transformers model keeps in fp32)."""
    from .diffusion import diffusion_filter, is_diffusers_model

    if is_diffusers_model(model):
        return diffusion_filter
    return _KeepFp32Filter(model) if kept_in_fp32(model) else default_filter


def _skip_reason(filter_fn, fqn: str) -> str:
    """The report's words for a module the filter declined."""
    from .diffusion import diffusion_filter, diffusion_skip_reason

    if filter_fn is default_filter:
        return _DEFAULT_SKIP_REASON
    if isinstance(filter_fn, _KeepFp32Filter):
        return filter_fn.skip_reason(fqn)
    if filter_fn is diffusion_filter:
        return diffusion_skip_reason(fqn)
    return "filter_fn returned False"


class _Walker:
    """Decides and performs the swap of each candidate module (nn.Linear or fused experts), recording why."""

    def __init__(self, config, filter_fn, report: QuantizeReport):
        self.config, self.filter_fn, self.report = config, filter_fn, report
        self.linear_handler = _handler_for(config)
        self.experts_handler = _experts_handler_for(config)

    def kind(self, module) -> Optional[str]:
        if _swappable(module):
            return "linear"
        if _dense_experts(module):
            return "experts"
        return None

    def convert(self, module, fqn: str, kind: str) -> Optional[nn.Module]:
        from .formats.moe import unconvertible_reason

        if not self.filter_fn(module, fqn):
            self.report.skipped[fqn] = _skip_reason(self.filter_fn, fqn)
            return None
        own = _own_experts_handler_for(self.config, module) if kind == "experts" else None
        if own is not None:
            new = own(module, self.config)
        elif kind == "experts":
            if self.experts_handler is None:
                why = f"no experts layer implements {type(self.config).__name__}"
            else:
                why = unconvertible_reason(module)
            if why is not None:
                self.report.skipped[fqn] = why
                warnings.warn(f"quantize_: MoE experts {fqn or type(module).__name__} left in high precision: {why}",
                              stacklevel=3)
                return None
            new = self.experts_handler(module, self.config)
        else:
            new = self.linear_handler(module, self.config)
        self.report.converted[fqn] = _describe(new)
        return new


def swap_children(model: nn.Module, replacement: Callable[[nn.Module], nn.Module]) -> None:
    """Put ``replacement(child)`` in place of every submodule of ``model`` under every name it has (a module a parent
    holds twice included: ``named_children`` names it once); ``replacement`` returns the child itself to keep it."""
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            if child is not None:
                new = replacement(child)
                if new is not child:
                    setattr(parent, name, new)


def quantize_(model: nn.Module, config, filter_fn: Optional[Callable[[nn.Module, str], bool]] = None, *,
              return_report: bool = False):
    """Replace the ``nn.Linear`` layers and the fused MoE experts of ``model`` in place by quantized layers,
    torchao style.

    config: ``Fp8WeightOnly(granularity="channel")`` -> ``Fp8Linear`` / ``Fp8Experts``, ``Int8Dynamic()`` ->
    ``Int8Linear`` / ``Int8Experts`` (torchao's ``Float8WeightOnlyConfig`` / ``Int8DynamicActivationInt8WeightConfig``
    are aliases), the 4-bit ``Int4WeightOnly(group_size, symmetric)``, ``Nvfp4WeightOnly()``, ``Mxfp4WeightOnly()``,
    ``AffineWeightOnly(group_size)`` -> ``W4Linear`` / ``W4Experts`` (torchao's ``Int4WeightOnlyConfig`` is an
    alias), or any config class with a handler registered by
    ``register_quantize_module_handler`` (and, for experts, ``register_quantize_experts_handler``).

    Experts: a fused experts module (transformers >= 5: ``Qwen3MoeExperts``, ``MixtralExperts``, ... with 3-D
    ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``) becomes one quantized experts layer with the same
    ``forward(hidden, top_k_index, top_k_weights)``; experts held as a ModuleList of MLPs are plain nn.Linear layers
    and are converted one by one. Experts that compute something else -- an activation other than SiLU, biases or
    other extra tensors (gpt-oss), a transposed or interleaved layout, a forward that does not match their weights'
    SwiGLU on a probe -- are left in high precision with a warning naming the reason (and in the report), never
    converted wrong.

    ``filter_fn(module, fqn) -> bool`` is asked about each candidate: every nn.Linear and every fused experts module
    (``fqn`` is its dotted name in ``model``; tell them apart by ``isinstance(module, nn.Linear)``). It replaces the
    default filter, which skips modules named ``lm_head`` and those a transformers model keeps in fp32
    (``_keep_in_fp32_modules``, as transformers' quantizers do: T5's ``wo``) (on a diffusers model -- a transformer or UNet,
    ``pipe.transformer`` -- the default is :func:`torch_lowbit.diffusion.diffusion_filter`: embedders and the final
    layer stay in high precision). A module shared by several parents is quantized once and stays shared. Progress (modules done)
    is shown on a terminal (``torch_lowbit._progress``).

    Returns ``model`` (or the new layer if ``model`` is itself a Linear / experts module); with
    ``return_report=True``, ``(model, QuantizeReport)``: ``converted`` (name -> new layer) and ``skipped``
    (name -> why it stayed in high precision).
    """
    from ._progress import Progress

    if not isinstance(model, nn.Module):
        from .diffusion import pipeline_hint

        raise TypeError(f"quantize_: model must be an nn.Module, got {type(model).__name__}{pipeline_hint(model)}")
    if filter_fn is None:
        filter_fn = _default_filter_for(model)
    elif not callable(filter_fn):
        raise TypeError(f"quantize_: filter_fn must be callable as filter_fn(module, fqn), got {filter_fn!r}")
    report = QuantizeReport()
    walker = _Walker(config, filter_fn, report)  # refuses a config nothing implements, before any work

    def result(m):
        return (m, report) if return_report else m

    kind = walker.kind(model)
    if kind is not None:
        new = walker.convert(model, "", kind)
        return result(model if new is None else new)
    candidates = {}  # fqn -> (module, kind); the first name of a shared module
    seen = set()
    for fqn, m in model.named_modules():
        k = walker.kind(m)
        if k is not None and id(m) not in seen and not any(fqn.startswith(c + ".") for c in candidates):
            seen.add(id(m))
            candidates[fqn] = (m, k)
    done = {}  # id(module) -> its replacement (or itself when kept), so shared (tied) modules stay shared
    with Progress("quantize_", len(candidates), "modules") as progress:
        for fqn, (m, k) in candidates.items():
            new = walker.convert(m, fqn, k)
            done[id(m)] = m if new is None else new
            progress.update()
    swap_children(model, lambda child: done.get(id(child), child))
    if report.converted:
        from .hf import attach_save_pretrained  # a transformers model's save_pretrained writes what loads right
        attach_save_pretrained(model)
    return result(model)
