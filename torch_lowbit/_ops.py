"""Python wrappers of torch.ops.lowbit.* and their fake (meta) kernels.

The fakes are registered when torch_lowbit is imported, for both namespaces (`lowbit` and the emulator's
`lowbit_emu`), so the ops trace under torch.compile(fullgraph=True) and torch.export with symbolic shapes.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_NAMESPACES = ("lowbit", "lowbit_emu")


def _blocks(op, block_size):
    """block_size as ints for the op (which checks the count and the signs); a non-integral entry such as 128.5
    is an error here rather than truncated (the rule of quantize.normalize_block_size)."""
    if block_size is None:
        return None
    try:
        ints = [b if isinstance(b, torch.SymInt) else int(b) for b in block_size]
        ok = not any(isinstance(b, str) for b in block_size) and all(i == b for i, b in zip(ints, block_size))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{op}: block_size must be integers [block_n, block_k], got {block_size!r}")
    return ints


def fp8_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor] = None,
           block_size: Optional[Sequence[int]] = None) -> torch.Tensor:
    """``x @ (fp8(weight) * scale).T + bias`` without materializing the dequantized weight.

    x: ``[..., K]`` bfloat16 / float16 / float32. weight: ``[N, K]`` float8_e4m3fn, or uint8 holding the same
    bits. scale (fp32; bf16/fp16 widened): one element (per tensor), ``[N]`` or ``[N, 1]`` (per output channel),
    or ``[ceil(N/bn), ceil(K/bk)]`` with ``block_size=(bn, bk)`` (partial edge blocks allowed).
    Returns ``[..., N]`` in x's dtype, accumulated in fp32 and rounded once.
    """
    return torch.ops.lowbit.fp8_mm(x, weight, scale, bias, _blocks("fp8_mm", block_size))


def fp8_dequantize(weight: torch.Tensor, scale: torch.Tensor, block_size: Optional[Sequence[int]] = None,
                   dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The dense ``[N, K]`` weight ``fp8(weight) * scale`` in ``dtype`` (same scale layouts as :func:`fp8_mm`)."""
    return torch.ops.lowbit.fp8_dequantize(weight, scale, _blocks("fp8_dequantize", block_size), dtype)


def fp8_grouped_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor,
                   expert_ids: Optional[torch.Tensor] = None,
                   block_size: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Ragged grouped (MoE) matmul: group g owns rows ``offsets[g]:offsets[g+1]`` of ``x [T, K]`` and multiplies
    them by expert ``expert_ids[g]`` of ``weight [E, N, K]`` (fp8). ``offsets`` is int32 ``[G+1]`` starting at 0,
    non-decreasing, ``offsets[G] <= T``; ``expert_ids`` is int32 ``[G]`` (default ``arange(G)``). Rows of a
    group whose expert id is -1, and rows in no group, are zero. scale: ``[E]``, ``[E, N]`` or
    ``[E, ceil(N/bn), ceil(K/bk)]`` with ``block_size``. Returns ``[T, N]`` in x's dtype.
    """
    return torch.ops.lowbit.fp8_grouped_mm(x, weight, scale, offsets, expert_ids,
                                           _blocks("fp8_grouped_mm", block_size))


def int8_quantize(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 quantization of ``x [..., K]``: ``scale = absmax / 127`` (fp32, shape ``[...]``),
    ``q = round_half_even(x / scale).clamp(-127, 127)`` (int8). An all-zero row gives ``q = 0``, ``scale = 0``.
    """
    return torch.ops.lowbit.int8_quantize(x)


def int8_mm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
            bias: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """W8A8 matmul: ``(xq @ wq.T) * x_scale[..., None] * w_scale + bias`` with an exact int32 accumulator.

    xq: int8 ``[..., K]``; x_scale: ``[...]``; wq: int8 ``[N, K]``; w_scale: ``[N]``, ``[N, 1]`` or one element.
    Returns ``[..., N]`` in ``out_dtype`` (default bfloat16).
    """
    return torch.ops.lowbit.int8_mm(xq, x_scale, wq, w_scale, bias, out_dtype)


def fp8_mm_t(grad_out: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
             block_size: Optional[Sequence[int]] = None) -> torch.Tensor:
    """The transposed product of :func:`fp8_mm`'s backward pass: ``grad_out[..., N] @ (fp8(weight) * scale)``
    -> ``[..., K]`` in grad_out's dtype (fp32 accumulation), read from the fp8 weight as stored. Same weight and
    scale layouts as :func:`fp8_mm`.

    Precision (this and the other transposed products): the weight is exact, except on a CPU with AMX or
    AVX-512 BF16 (``torch_lowbit.testing.cpu_gemm_route()`` not ``"fp32"``) for bf16 grad_out of 8 rows or more, where it is multiplied as :func:`fp8_dequantize` gives it in bf16 -- the product a
    bf16 layer on the dequantized weight computes in its own backward pass.
    """
    return torch.ops.lowbit.fp8_mm_t(grad_out, weight, scale, _blocks("fp8_mm_t", block_size))


def fp8_grouped_mm_t(grad_out: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor,
                     expert_ids: Optional[torch.Tensor] = None,
                     block_size: Optional[Sequence[int]] = None) -> torch.Tensor:
    """The transposed product of :func:`fp8_grouped_mm`: rows of group g of ``grad_out [T, N]`` times expert
    ``expert_ids[g]`` of ``weight [E, N, K]`` (dequantized) -> ``[T, K]``; rows of -1 groups and rows in no group
    are zero."""
    return torch.ops.lowbit.fp8_grouped_mm_t(grad_out, weight, scale, offsets, expert_ids, _blocks("fp8_grouped_mm_t", block_size))


def int8_weight_mm_t(grad_out: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """``grad_out[..., N] @ (wq * w_scale)`` -> ``[..., K]`` in grad_out's dtype: the transposed product of an
    int8 weight ``[N, K]`` (``w_scale`` ``[N]``, ``[N, 1]`` or one element), for Int8Linear's backward pass."""
    return torch.ops.lowbit.int8_weight_mm_t(grad_out, wq, w_scale)


def int8_linear(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """W8A8 linear, what Int8Linear runs: ``int8_mm(*int8_quantize(x), wq, w_scale, bias, out_dtype=x.dtype)``,
    differentiable w.r.t. ``x`` and ``bias``: the backward passes the gradient straight through the activation
    quantization, ``grad_x = grad_out @ (wq * w_scale)`` (:func:`int8_weight_mm_t`)."""
    from ._autograd import int8_linear as _int8_linear
    return _int8_linear(x, wq, w_scale, bias)


def w4_mm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, format: str, group_size: int,
          offset: Optional[torch.Tensor] = None, global_scale: Optional[torch.Tensor] = None,
          bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ w.T + bias`` for a 4-bit weight ``w [N, K]`` read as stored (W4A16).

    codes: uint8 ``[N, ceil(K/2)]``, two 4-bit codes per byte along K, the even k in the low nibble. scale:
    ``[N, ceil(K/group_size)]``, one per group of ``group_size`` consecutive k (the last group may be partial).
    format (csrc/w4_formats.h): ``"nvfp4"`` (E2M1 values, e4m3 scales as float8_e4m3fn or uint8 bits, optional
    one-element fp32 ``global_scale`` multiplier), ``"mxfp4"`` (E2M1, e8m0 scales as uint8 bits), ``"int4"``
    (``code - 8``, float scales, optional int8 zero points ``offset``: ``w = (q - zp) * s``), ``"uint4"``
    (``code``, float scales, optional biases ``offset`` in the scale's dtype: ``w = q * s + b``, MLX affine).
    x: ``[..., K]`` bfloat16 / float16 / float32; returns ``[..., N]`` in x's dtype, fp32 accumulation.
    """
    return torch.ops.lowbit.w4_mm(x, codes, scale, format, int(group_size), offset, global_scale, bias)


def w4_dequantize(codes: torch.Tensor, scale: torch.Tensor, format: str, group_size: int, K: int,
                  offset: Optional[torch.Tensor] = None, global_scale: Optional[torch.Tensor] = None,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The dense ``[N, K]`` 4-bit weight (the layouts of :func:`w4_mm`) computed in fp32, rounded once to dtype."""
    return torch.ops.lowbit.w4_dequantize(codes, scale, format, int(group_size), K, offset, global_scale, dtype)


def w4_mm_t(grad_out: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, format: str, group_size: int, K: int,
            offset: Optional[torch.Tensor] = None, global_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The transposed product of :func:`w4_mm`'s backward pass: ``grad_out[..., N] @ w`` -> ``[..., K]`` in
    grad_out's dtype (fp32 accumulation), read from the 4-bit weight as stored."""
    return torch.ops.lowbit.w4_mm_t(grad_out, codes, scale, format, int(group_size), K, offset, global_scale)


def w4_grouped_mm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, format: str, group_size: int,
                  offsets: torch.Tensor, expert_ids: Optional[torch.Tensor] = None,
                  offset: Optional[torch.Tensor] = None, global_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Ragged grouped (MoE) W4A16 matmul, the contract of :func:`fp8_grouped_mm` with 4-bit experts: group g owns
    rows ``offsets[g]:offsets[g+1]`` of ``x [T, K]`` and multiplies them by expert ``expert_ids[g]`` (int32, default
    ``arange(G)``; -1: zero rows) of ``codes [E, N, ceil(K/2)]`` with ``scale`` / ``offset`` ``[E, N, G]`` and nvfp4's
    ``global_scale [E]`` (the layouts of :func:`w4_mm` per expert). Rows in no group are zero. Returns ``[T, N]``.
    Note ``offsets`` (the groups' row bounds) and ``offset`` (the weight's zero points or biases) are different
    arguments."""
    return torch.ops.lowbit.w4_grouped_mm(x, codes, scale, format, int(group_size), offsets, expert_ids, offset,
                                          global_scale)


def w4_grouped_mm_t(grad_out: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, format: str, group_size: int,
                    K: int, offsets: torch.Tensor, expert_ids: Optional[torch.Tensor] = None,
                    offset: Optional[torch.Tensor] = None,
                    global_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The transposed product of :func:`w4_grouped_mm`: rows of group g of ``grad_out [T, N]`` times expert
    ``expert_ids[g]``'s weight ``[N, K]`` -> ``[T, K]``; rows of -1 groups and rows in no group are zero."""
    return torch.ops.lowbit.w4_grouped_mm_t(grad_out, codes, scale, format, int(group_size), K, offsets, expert_ids,
                                            offset, global_scale)


FP8_MAX = 448.0  # largest finite float8_e4m3fn


def fp8_fake_quantize(x: torch.Tensor, input_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x [..., K]`` quantized to float8_e4m3fn and back, in float32: the activation arithmetic of FP8 W8A8
    checkpoints (compressed-tensors' ``fake_quantize``, run in float32 whatever x's dtype).

    Dynamic (``input_scale=None``): one scale per row (token), ``s = amax(|x_row|) / 448``. Static: ``s`` is the
    checkpoint's one-element ``input_scale`` (a multiplier: ``x ~= fp8(x / s) * s``). Then
    ``q = e4m3(clamp(x / s, -448, 448))`` (round to nearest even; beyond 448 saturates) and the result is
    ``q * s`` in float32, so nothing is rounded below float32 beyond the fp8 rounding itself. A zero row gives
    zeros; a row holding NaN gives NaN, and so does a dynamic row holding +-inf (its scale is inf); with a static
    scale +-inf saturates to +-448 s. Differentiable as the identity (straight through the rounding).
    """
    with torch.no_grad():
        x32 = x.detach().to(torch.float32)
        if input_scale is not None:
            scale = input_scale.detach().to(device=x.device, dtype=torch.float32).reshape(())
        elif x32.shape[-1] == 0:
            scale = x32.new_zeros((*x32.shape[:-1], 1))
        else:
            scale = x32.abs().amax(dim=-1, keepdim=True) / FP8_MAX
        # a zero row has scale 0: divide its zeros by 1, so they stay 0 rather than NaN
        ratio = (x32 / torch.where(scale == 0, torch.ones_like(scale), scale)).clamp(-FP8_MAX, FP8_MAX)
        out = _round_to_e4m3(ratio) * scale
    if torch.is_grad_enabled() and x.requires_grad:
        out = _StraightThrough.apply(x, out)
    return out


def _round_to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """float32 values within +-448 rounded to the nearest e4m3fn value (ties to even), as float32. Where the
    device cannot hold fp8 (mps before PyTorch 2.15) the cast runs on the CPU."""
    from ._storage import FP8, fp8_storage_dtype

    if fp8_storage_dtype(v.device) == FP8:
        return v.to(FP8).to(torch.float32)
    return v.cpu().to(FP8).to(torch.float32).to(v.device)


class _StraightThrough(torch.autograd.Function):
    """Forward: the quantized value; backward: x's gradient as if it were the identity (cast to x's dtype)."""

    @staticmethod
    def forward(ctx, x, quantized):
        ctx.x_dtype = x.dtype
        return quantized

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.x_dtype), None


# ---------------------------------------------------------------------------------------------- fakes
def _check(cond, msg):
    if not cond:
        raise RuntimeError(msg)


def _same_device(op, ref_name, ref, **tensors):
    """The device check of csrc/checks.cpp. Needed here too: with one argument on the meta device the dispatcher
    runs the fake kernel, which would otherwise return an uninitialized tensor on the other device."""
    for name, t in tensors.items():
        _check(t is None or t.device == ref.device,
               f"{op}: {name} is on {t.device if t is not None else None} but {ref_name} is on {ref.device}; "
               "all tensors must be on one device")


# The fakes repeat the dtype / rank / K checks of csrc/checks.cpp with the same wording, so that a traced model
# (torch.compile, torch.export) fails at trace time with the message eager would give. Shape relations go through
# torch._check, which also works on symbolic sizes. Scale layouts are left to the real kernels.
_FP8_WEIGHT_DTYPES = (torch.float8_e4m3fn, torch.uint8)


def _check_float(op, name, t):
    _check(t.dtype in _FLOAT_DTYPES, f"{op}: {name} must be bfloat16, float16 or float32, got {t.dtype}")


def _check_fp8_weight(op, weight, scale, dim):
    _check(weight.dtype in _FP8_WEIGHT_DTYPES,
           f"{op}: weight must be float8_e4m3fn or uint8 (fp8 e4m3 bits), got {weight.dtype}")
    _check(weight.dim() == dim, f"{op}: weight must be {'[N, K]' if dim == 2 else '[E, N, K]'}, got shape "
                                f"{tuple(weight.shape)}")
    _check(scale.dtype in _FLOAT_DTYPES, f"{op}: scale must be float32, bfloat16 or float16, got {scale.dtype}")


def _fake_fp8_mm(x, weight, scale, bias=None, block_size=None):
    op = "fp8_mm"
    _same_device(op, "x", x, weight=weight, scale=scale, bias=bias)
    _check_float(op, "x", x)
    _check(x.dim() >= 1, f"{op}: x must have at least one dimension [..., K]")
    _check_fp8_weight(op, weight, scale, 2)
    torch._check(x.shape[-1] == weight.shape[1], lambda: f"{op}: x's last dimension ({x.shape[-1]}) must equal "
                 f"weight's K ({weight.shape[1]}); weight is [N, K] = {list(weight.shape)}")
    if bias is not None:
        _check(bias.dim() == 1, f"{op}: bias must be [N], got shape {tuple(bias.shape)}")
        torch._check(bias.shape[0] == weight.shape[0],
                     lambda: f"{op}: bias must be [N] = [{weight.shape[0]}], got {list(bias.shape)}")
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _fake_fp8_dequantize(weight, scale, block_size=None, dtype=torch.bfloat16):
    op = "fp8_dequantize"
    _same_device(op, "weight", weight, scale=scale)
    _check(dtype in _FLOAT_DTYPES, f"{op}: dtype must be bfloat16, float16 or float32, got {dtype}")
    _check_fp8_weight(op, weight, scale, 2)
    return weight.new_empty(tuple(weight.shape), dtype=dtype)


def _fake_grouped(op, xname, transposed, x, weight, scale, offsets, expert_ids):
    """fp8_grouped_mm (x [T, K] -> [T, N]) and its transposed product (grad_out [T, N] -> [T, K])."""
    _same_device(op, xname, x, weight=weight, scale=scale, offsets=offsets, expert_ids=expert_ids)
    _check_float(op, xname, x)
    _check(x.dim() == 2, f"{op}: {xname} must be {'[T, N]' if transposed else '[T, K]'}, got shape {tuple(x.shape)}")
    _check_fp8_weight(op, weight, scale, 3)
    inner = 1 if transposed else 2
    torch._check(x.shape[1] == weight.shape[inner],
                 lambda: f"{op}: {xname}'s last dimension ({x.shape[1]}) must equal weight's "
                 f"{'N' if transposed else 'K'} ({weight.shape[inner]}); weight is [E, N, K] = {list(weight.shape)}")
    _check(offsets.dtype == torch.int32, f"{op}: offsets must be int32, got {offsets.dtype}")
    _check(offsets.dim() == 1, f"{op}: offsets must be [G + 1] with G >= 0, got shape {tuple(offsets.shape)}")
    if expert_ids is not None:
        _check(expert_ids.dtype == torch.int32, f"{op}: expert_ids must be int32, got {expert_ids.dtype}")
    return x.new_empty((x.shape[0], weight.shape[2 if transposed else 1]))


def _fake_fp8_grouped_mm(x, weight, scale, offsets, expert_ids=None, block_size=None):
    return _fake_grouped("fp8_grouped_mm", "x", False, x, weight, scale, offsets, expert_ids)


def _fake_fp8_mm_t(grad_out, weight, scale, block_size=None):
    op = "fp8_mm_t"
    _same_device(op, "grad_out", grad_out, weight=weight, scale=scale)
    _check_float(op, "grad_out", grad_out)
    _check(grad_out.dim() >= 1, f"{op}: grad_out must have at least one dimension [..., N]")
    _check_fp8_weight(op, weight, scale, 2)
    torch._check(grad_out.shape[-1] == weight.shape[0], lambda: f"{op}: grad_out's last dimension must equal weight's N")
    return grad_out.new_empty((*grad_out.shape[:-1], weight.shape[1]))


def _fake_fp8_grouped_mm_t(grad_out, weight, scale, offsets, expert_ids=None, block_size=None):
    return _fake_grouped("fp8_grouped_mm_t", "grad_out", True, grad_out, weight, scale, offsets, expert_ids)


def _fake_int8_weight_mm_t(grad_out, wq, w_scale):
    op = "int8_weight_mm_t"
    _same_device(op, "grad_out", grad_out, wq=wq, w_scale=w_scale)
    _check_float(op, "grad_out", grad_out)
    _check(grad_out.dim() >= 1, f"{op}: grad_out must have at least one dimension [..., N]")
    _check(wq.dtype == torch.int8, f"{op}: wq must be int8, got {wq.dtype}")
    _check(wq.dim() == 2, f"{op}: wq must be [N, K], got shape {tuple(wq.shape)}")
    torch._check(grad_out.shape[-1] == wq.shape[0], lambda: f"{op}: grad_out's last dimension must equal wq's N")
    return grad_out.new_empty((*grad_out.shape[:-1], wq.shape[1]))


def _fake_int8_quantize(x):
    op = "int8_quantize"
    _check_float(op, "x", x)
    _check(x.dim() >= 1, f"{op}: x must have at least one dimension [..., K]")
    return x.new_empty(tuple(x.shape), dtype=torch.int8), x.new_empty(tuple(x.shape[:-1]), dtype=torch.float32)


def _fake_int8_mm(xq, x_scale, wq, w_scale, bias=None, out_dtype=None):
    op = "int8_mm"
    _same_device(op, "xq", xq, x_scale=x_scale, wq=wq, w_scale=w_scale, bias=bias)
    _check(xq.dtype == torch.int8, f"{op}: xq must be int8, got {xq.dtype}")
    _check(xq.dim() >= 1, f"{op}: xq must have at least one dimension [..., K]")
    _check(wq.dtype == torch.int8, f"{op}: wq must be int8, got {wq.dtype}")
    _check(wq.dim() == 2, f"{op}: wq must be [N, K], got shape {tuple(wq.shape)}")
    _check(out_dtype is None or out_dtype in _FLOAT_DTYPES,
           f"{op}: out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    torch._check(xq.shape[-1] == wq.shape[1], lambda: f"{op}: xq's last dimension ({xq.shape[-1]}) must equal "
                 f"wq's K ({wq.shape[1]}); wq is [N, K] = {list(wq.shape)}")
    return xq.new_empty((*xq.shape[:-1], wq.shape[0]), dtype=out_dtype or torch.bfloat16)


def _check_w4_codes(op, codes, scale, group_size, K, grouped=False):
    dim = 3 if grouped else 2
    _check(codes.dtype == torch.uint8, f"{op}: codes must be uint8 (two 4-bit codes per byte), got {codes.dtype}")
    _check(codes.dim() == dim, f"{op}: codes must be {'[E, N, ceil(K/2)]' if grouped else '[N, ceil(K/2)]'}, got "
                               f"shape {tuple(codes.shape)}")
    _check(group_size >= 1, f"{op}: group_size must be >= 1, got {group_size}")
    # the scale layout the kernels read (checks.cpp), so that a traced graph fails where the eager call would
    torch._check(scale.dim() == dim and tuple(scale.shape[:-1]) == tuple(codes.shape[:-1])
                 and scale.shape[-1] == (K + group_size - 1) // group_size,
                 lambda: f"{op}: scale must be {'[E, ' if grouped else '['}N, ceil(K/group_size)] for K = {K}, "
                 f"group_size = {group_size}, got {list(scale.shape)}")


def _fake_w4_mm(x, codes, scale, format, group_size, offset=None, global_scale=None, bias=None):
    op = "w4_mm"
    _same_device(op, "x", x, codes=codes, scale=scale, offset=offset, global_scale=global_scale, bias=bias)
    _check_float(op, "x", x)
    _check(x.dim() >= 1, f"{op}: x must have at least one dimension [..., K]")
    torch._check(codes.dim() != 2 or codes.shape[1] == (x.shape[-1] + 1) // 2,
                 lambda: f"{op}: codes rows must hold ceil(K/2) = {(x.shape[-1] + 1) // 2} bytes for K = "
                 f"{x.shape[-1]}, got codes of shape {list(codes.shape)}")
    _check_w4_codes(op, codes, scale, group_size, x.shape[-1])
    if bias is not None:
        _check(bias.dim() == 1, f"{op}: bias must be [N], got shape {tuple(bias.shape)}")
    return x.new_empty((*x.shape[:-1], codes.shape[0]))


def _fake_w4_dequantize(codes, scale, format, group_size, K, offset=None, global_scale=None, dtype=torch.bfloat16):
    op = "w4_dequantize"
    _same_device(op, "codes", codes, scale=scale, offset=offset, global_scale=global_scale)
    _check(dtype in _FLOAT_DTYPES, f"{op}: dtype must be bfloat16, float16 or float32, got {dtype}")
    _check_w4_codes(op, codes, scale, group_size, K)
    return codes.new_empty((codes.shape[0], K), dtype=dtype)


def _fake_w4_mm_t(grad_out, codes, scale, format, group_size, K, offset=None, global_scale=None):
    op = "w4_mm_t"
    _same_device(op, "grad_out", grad_out, codes=codes, scale=scale, offset=offset, global_scale=global_scale)
    _check_float(op, "grad_out", grad_out)
    _check(grad_out.dim() >= 1, f"{op}: grad_out must have at least one dimension [..., N]")
    _check_w4_codes(op, codes, scale, group_size, K)
    torch._check(grad_out.shape[-1] == codes.shape[0], lambda: f"{op}: grad_out's last dimension must equal the "
                 "weight's N")
    return grad_out.new_empty((*grad_out.shape[:-1], K))


def _fake_w4_grouped(op, transposed, x, codes, scale, group_size, K, offsets, expert_ids, offset, global_scale):
    """w4_grouped_mm (x [T, K] -> [T, N]) and its transposed product (grad_out [T, N] -> [T, K])."""
    xname = "grad_out" if transposed else "x"
    _same_device(op, xname, x, codes=codes, scale=scale, offsets=offsets, expert_ids=expert_ids, offset=offset,
                 global_scale=global_scale)
    _check_float(op, xname, x)
    _check(x.dim() == 2, f"{op}: {xname} must be {'[T, N]' if transposed else '[T, K]'}, got shape {tuple(x.shape)}")
    _check_w4_codes(op, codes, scale, group_size, K, grouped=True)
    if transposed:
        torch._check(x.shape[1] == codes.shape[1], lambda: f"{op}: grad_out's last dimension must equal the weight's N")
    else:
        torch._check(codes.shape[2] == (K + 1) // 2, lambda: f"{op}: codes rows must hold ceil(K/2) = {(K + 1) // 2} "
                     f"bytes for K = {K}, got codes of shape {list(codes.shape)}")
    _check(offsets.dtype == torch.int32, f"{op}: offsets must be int32, got {offsets.dtype}")
    _check(offsets.dim() == 1, f"{op}: offsets must be [G + 1] with G >= 0, got shape {tuple(offsets.shape)}")
    if expert_ids is not None:
        _check(expert_ids.dtype == torch.int32, f"{op}: expert_ids must be int32, got {expert_ids.dtype}")
    return x.new_empty((x.shape[0], K if transposed else codes.shape[1]))


def _fake_w4_grouped_mm(x, codes, scale, format, group_size, offsets, expert_ids=None, offset=None,
                        global_scale=None):
    return _fake_w4_grouped("w4_grouped_mm", False, x, codes, scale, group_size, x.shape[-1], offsets, expert_ids,
                            offset, global_scale)


def _fake_w4_grouped_mm_t(grad_out, codes, scale, format, group_size, K, offsets, expert_ids=None, offset=None,
                          global_scale=None):
    return _fake_w4_grouped("w4_grouped_mm_t", True, grad_out, codes, scale, group_size, K, offsets, expert_ids,
                            offset, global_scale)


_FAKES = {
    "fp8_mm": _fake_fp8_mm,
    "fp8_dequantize": _fake_fp8_dequantize,
    "fp8_grouped_mm": _fake_fp8_grouped_mm,
    "int8_quantize": _fake_int8_quantize,
    "int8_mm": _fake_int8_mm,
    "fp8_mm_t": _fake_fp8_mm_t,
    "fp8_grouped_mm_t": _fake_fp8_grouped_mm_t,
    "int8_weight_mm_t": _fake_int8_weight_mm_t,
    "w4_mm": _fake_w4_mm,
    "w4_dequantize": _fake_w4_dequantize,
    "w4_mm_t": _fake_w4_mm_t,
    "w4_grouped_mm": _fake_w4_grouped_mm,
    "w4_grouped_mm_t": _fake_w4_grouped_mm_t,
}


def _register_fakes():
    for ns in _NAMESPACES:
        for name, fn in _FAKES.items():
            torch.library.register_fake(f"{ns}::{name}", fn)
