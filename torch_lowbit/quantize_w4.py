"""Round-to-nearest 4-bit weight quantization (W4A16) into the layouts of ``torch_lowbit.w4_mm`` / ``W4Linear``.

Each format follows the arithmetic of the writer whose checkpoints it reads, in float32, except where
compressed-tensors computes in the weight's dtype (int4 throughout, NVFP4's divisor and ``group_amax / 6``): there
this module rounds each op to the weight's dtype too (bf16 / fp16 weights), so that it writes the same codes.

- ``int4`` (compressed-tensors ``pack-quantized``, llmcompressor W4A16 / W4A16_ASYM, round to nearest): the group's
  range always holds 0 (``lo = min(w_min, 0)``, ``hi = max(w_max, 0)``). Symmetric: ``s = max(|lo|, |hi|) / 7.5``,
  ``q = round(w / s)`` clamped to ``[-8, 7]``. Asymmetric: ``s = (hi - lo) / 15``, integer zero point
  ``zp = round(clamp(-8 - lo / s, -8, 7))``, ``q = round(w / s + zp)`` clamped to ``[-8, 7]``, ``w ~ (q - zp) * s``.
  ``round`` is half to even; ``s`` is rounded to the scale dtype before ``q`` is computed from it.
- ``nvfp4`` (compressed-tensors ``nvfp4-pack-quantized``): a per-tensor divisor ``gs = 448 * 6 / amax``, group
  scales of 16 ``s = e4m3(gs * group_amax / 6)`` (saturating, round to nearest even), values
  ``e2m1(w / (s / gs))`` (round to nearest even, saturating at 6). The layer stores ``1 / gs`` as its fp32
  multiplier ``weight_scale_2`` (what the loaders do with the checkpoint's ``weight_global_scale``).
- ``mxfp4`` (OCP microscaling as compressed-tensors writes it): an e8m0 scale per 32, ``2^(e - 2)`` with
  ``2^e`` the group amax rounded to a power of two (up when its mantissa is >= 1.75, so fewer values saturate than
  with the OCP spec's plain ``floor(log2(amax))``), values ``e2m1(w / 2^(e - 2))`` saturating at 6.
- ``uint4`` with an additive bias per group, ``w ~ q * s + b``:
  ``rule="mlx"`` (``mlx.core.quantize``, affine mode, as its Metal kernel computes it -- the one that writes the
  Hub's mlx-community checkpoints): ``w_max = max(0, group max)``, ``s = max((w_max - w_min) / 15, 1e-7)``, signed
  so that the group's larger-magnitude edge maps to the code ``q0 = round(edge / s)``; then ``s = edge / q0`` and
  ``b = edge`` (``b = 0`` if ``q0 == 0``); codes ``round((w - b) / s)`` clamped to ``[0, 15]`` (halves away from
  zero) from the float32 ``s`` and ``b``, which are then stored in the scale dtype. (MLX's CPU path differs only on
  exact ties, which it rounds to even, and in groups with no value >= 0, whose max it does not raise to 0.)
  ``rule="minmax"`` (torchao's ``Int4WeightOnlyConfig``): ``s = (w_max - w_min) / 15``, ``b = w_min``, codes
  ``round((w - b) / s)`` (half to even) from the stored ``s`` and ``b``.

An all-zero group gets scale 0 and decodes to zeros (writers that store an epsilon there decode to the same zeros).
NaN or inf in the weight is refused.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ._storage import FP8, fp8_storage_dtype

W4_DEFAULT_GROUP = {"nvfp4": 16, "mxfp4": 32, "int4": 128, "uint4": 64}  # as csrc/w4_formats.h
UINT4_RULES = ("mlx", "minmax")
E2M1_MAX = 6.0
E4M3_MAX = 448.0
_FLOAT_SCALE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class W4Quantized(NamedTuple):
    """The tensors of a 4-bit weight, named as ``W4Linear.from_quantized`` takes them (stacked experts: each with a
    leading ``[E]``, as ``W4Experts.from_quantized`` takes them)."""
    weight_packed: torch.Tensor             # uint8 [N, ceil(K/2)]
    weight_scale: torch.Tensor              # [N, G] in the format's scale dtype
    weight_offset: Optional[torch.Tensor]   # int8 zero points (int4 asymmetric) or biases (uint4), [N, G]
    weight_scale_2: Optional[torch.Tensor]  # nvfp4: fp32 [1] multiplier ([E]: one per expert)


def pack_w4_codes(codes: torch.Tensor) -> torch.Tensor:
    """int codes in [0, 16) ``[..., N, K]`` -> uint8 ``[..., N, ceil(K/2)]``, the even k in the low nibble."""
    K = codes.shape[-1]
    c = codes.to(torch.uint8)
    if K % 2:
        c = torch.nn.functional.pad(c, (0, 1))
    c = c.reshape(*c.shape[:-1], (K + 1) // 2, 2)
    return (c[..., 0] | (c[..., 1] << 4)).contiguous()


def _round_half_even_e2m1(r: torch.Tensor) -> torch.Tensor:
    """float32 ratios -> uint8 e2m1 codes (sign bit 8), nearest value with ties to the even code, saturating at +-6.
    The e2m1 magnitudes are steps of 0.5 below 2, of 1 in [2, 4) and of 2 from 4, and an even code is an even
    multiple of its step: torch.round (half to even) of a / step, offset to the code, is the format's rounding."""
    a = r.abs().clamp(max=E2M1_MAX)
    code = torch.where(a < 2, torch.round(a * 2), torch.where(a < 4, torch.round(a) + 2, torch.round(a * 0.5) + 4))
    return code.to(torch.uint8) | torch.signbit(r).to(torch.uint8) << 3


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    t = torch.trunc(x)
    return torch.where((x - t).abs() >= 0.5, t + torch.sign(x), t)


def _safe(s: torch.Tensor) -> torch.Tensor:
    return torch.where(s == 0, torch.ones_like(s), s)


def _to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """float32 >= 0 -> e4m3 (round to nearest even, saturating at 448), as float8_e4m3fn or uint8 bits where the
    device holds no fp8."""
    q = v.clamp(max=E4M3_MAX)
    if fp8_storage_dtype(q.device) == FP8:
        return q.to(FP8)
    return q.cpu().to(FP8).view(torch.uint8).to(q.device)


def _e4m3_as_f32(s: torch.Tensor) -> torch.Tensor:
    if s.dtype == FP8:
        return s.to(torch.float32)
    return s.cpu().view(FP8).to(torch.float32).to(s.device)


def _groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """w [..., N, K] -> [..., N, G, group_size]; a partial last group is padded with copies of its last value, which
    change neither its min nor its max, and whose codes _ungroup drops."""
    K = w.shape[-1]
    G = -(-K // group_size)
    if G * group_size != K:
        w = torch.nn.functional.pad(w.unsqueeze(0) if w.dim() == 2 else w, (0, G * group_size - K),
                                    mode="replicate").view(*w.shape[:-1], G * group_size)
    return w.reshape(*w.shape[:-1], G, group_size)


def _ungroup(grouped: torch.Tensor, K: int) -> torch.Tensor:
    return grouped.flatten(-2)[..., :K]


def _per_group(t: torch.Tensor) -> torch.Tensor:
    """a value per group [..., N, G] broadcast over its group's K values in _groups' layout"""
    return t.unsqueeze(-1)


def quantize_w4(w: torch.Tensor, format: str, group_size: Optional[int] = None, symmetric: bool = True, *,
                scale_dtype: Optional[torch.dtype] = None, rule: str = "mlx") -> W4Quantized:
    """Quantize ``w [N, K]`` to one of ``w4_mm``'s 4-bit formats by rounding to nearest (see the module docstring
    for each format's arithmetic); ``w [E, N, K]`` (stacked experts) quantizes each expert as its own weight (nvfp4:
    a tensor scale per expert, ``weight_scale_2 [E]``), all at once. ``group_size``: K values per scale (default the format's: nvfp4 16, mxfp4 32,
    int4 128, uint4 64; any value >= K is per channel). ``symmetric``: int4 only (False adds int8 zero points).
    ``scale_dtype``: int4 / uint4 scales (and biases) as bfloat16 / float16 / float32; default the weight's dtype
    (float32 for a float64 weight). ``rule``: uint4's bias rule, ``"mlx"`` or ``"minmax"`` (torchao).
    Returns :class:`W4Quantized`."""
    fn = "quantize_w4"
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{fn}: w must be a torch.Tensor, got {type(w).__name__}")
    if not w.is_floating_point() or w.dtype == FP8 or w.dim() not in (2, 3):
        raise ValueError(f"{fn}: w must be a floating-point [N, K] weight (or [E, N, K] stacked experts), got "
                         f"{w.dtype} of shape {tuple(w.shape)}")
    if format not in W4_DEFAULT_GROUP:
        raise ValueError(f"{fn}: format must be one of {list(W4_DEFAULT_GROUP)}, got {format!r}")
    lead, (N, K) = tuple(w.shape[:-2]), w.shape[-2:]
    group_size = W4_DEFAULT_GROUP[format] if group_size is None else int(group_size)
    if group_size < 1:
        raise ValueError(f"{fn}: group_size must be >= 1, got {group_size}")
    group_size = min(group_size, max(K, 1))  # longer than a row: one (per-channel) group, as the ops read it
    if not symmetric and format != "int4":
        raise ValueError(f"{fn}: symmetric=False (zero points) is for format 'int4'; format {format!r} has its own "
                         "offset rule or none")
    if format == "uint4" and rule not in UINT4_RULES:
        raise ValueError(f"{fn}: rule must be one of {UINT4_RULES} for format 'uint4', got {rule!r}")
    if format in ("int4", "uint4"):
        scale_dtype = scale_dtype or (w.dtype if w.dtype in _FLOAT_SCALE_DTYPES else torch.float32)
        if scale_dtype not in _FLOAT_SCALE_DTYPES:
            raise ValueError(f"{fn}: scale_dtype must be one of {_FLOAT_SCALE_DTYPES}, got {scale_dtype}")
    elif scale_dtype is not None:
        raise ValueError(f"{fn}: format {format!r} stores its scales in its own encoding; scale_dtype must be None")
    cd = w.dtype if w.dtype in _FLOAT_SCALE_DTYPES else torch.float32  # the writers' compute dtype
    wc = w.detach().to(cd)
    w32 = wc.to(torch.float32)
    if w32.device.type != "meta" and not bool(torch.isfinite(w32).all()):
        raise ValueError(f"{fn}: w contains NaN or inf; no finite scale can represent it")
    G = -(-K // group_size)
    grouped = _groups(w32, group_size)
    if K:
        lo, hi = torch.aminmax(grouped, dim=-1)
    else:
        lo = hi = w32.new_zeros(*lead, N, G)
    amax = torch.maximum(lo.abs(), hi.abs())
    offset = global_mult = None

    if format == "int4":
        # compressed-tensors computes in the weight's dtype, each op rounded to it (torch's bf16 / fp16 ops)
        lo0, hi0 = torch.clamp(lo, max=0).to(cd), torch.clamp(hi, min=0).to(cd)
        if symmetric:
            scale = (amax.to(cd) / 7.5).to(scale_dtype)
            s_c = _safe(scale.to(cd))
            q = torch.round(_groups(wc, group_size) / _per_group(s_c)).clamp(-8, 7)
        else:
            scale = ((hi0 - lo0) / 15).to(scale_dtype)
            s_c = _safe(scale.to(cd))
            zp = torch.round(torch.clamp(-8 - lo0 / s_c, -8, 7))
            q = torch.round(_groups(wc, group_size) / _per_group(s_c) + _per_group(zp)).clamp(-8, 7)
            offset = zp.to(torch.int8)
        codes = _ungroup(q + 8, K).to(torch.uint8)
    elif format == "uint4":  # float32 arithmetic (MLX's kernels; torchao's min/max rule)
        if rule == "mlx":
            hi = torch.clamp(hi, min=0)  # MLX's Metal kernel starts its max at 0
            s = torch.clamp((hi - lo) / 15, min=1e-7)
            low_edge = lo.abs() > hi.abs()
            s = torch.where(low_edge, s, -s)
            edge = torch.where(low_edge, lo, hi)
            q0 = _round_half_away(edge / s)
            s = torch.where(q0 != 0, edge / torch.where(q0 != 0, q0, torch.ones_like(q0)), s)
            b = torch.where(q0 != 0, edge, torch.zeros_like(edge))
            q = _round_half_away((grouped - _per_group(b)) / _per_group(s))
            scale, offset = s.to(scale_dtype), b.to(scale_dtype)
        else:
            scale, offset = ((hi - lo) / 15).to(scale_dtype), lo.to(scale_dtype)
            s32, b32 = _safe(scale.to(torch.float32)), offset.to(torch.float32)
            q = torch.round((grouped - _per_group(b32)) / _per_group(s32))
        codes = _ungroup(q.clamp(0, 15), K).to(torch.uint8)
    elif format == "nvfp4":
        # compressed-tensors: the divisor 2688 / amax and amax_g / 6 in the weight's dtype, their product, the e4m3
        # cast and the values' quotient in float32
        # one tensor scale per weight (per expert of a stack), kept as [..., 1, 1] to broadcast over its groups
        tensor_amax = (amax.amax(dim=(-2, -1), keepdim=True) if N * G else w32.new_zeros(*lead, 1, 1)).to(cd)
        gs = torch.where(tensor_amax > 0, (E4M3_MAX * E2M1_MAX) / _safe(tensor_amax),
                         torch.ones_like(tensor_amax)).to(torch.float32)  # an all-zero weight: 1, no global scaling
        scale = _to_e4m3(gs * (amax.to(cd) / E2M1_MAX).to(torch.float32))
        eff = _safe(_e4m3_as_f32(scale) / gs)
        codes = _ungroup(_round_half_even_e2m1(grouped / _per_group(eff)), K)
        global_mult = (1.0 / gs).reshape(lead or (1,)).to(torch.float32)
    else:  # mxfp4
        mant, exp = torch.frexp(amax)  # amax = mant * 2^exp, mant in [0.5, 1)
        e = (exp - 1) + (mant >= 0.875).to(exp.dtype)  # floor(log2(amax)), up by one at a mantissa >= 1.75
        biased = torch.where(amax > 0, e - 2 + 127, torch.zeros_like(e)).clamp(0, 254)
        scale = biased.to(torch.uint8)
        s32 = torch.pow(2.0, (biased - 127).to(torch.float32))
        codes = _ungroup(_round_half_even_e2m1(grouped / _per_group(s32)), K)
    return W4Quantized(pack_w4_codes(codes), scale.contiguous(), None if offset is None else offset.contiguous(),
                       global_mult)
