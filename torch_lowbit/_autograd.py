"""Gradients through the low-bit matmul ops, registered for both namespaces (``lowbit`` and ``lowbit_emu``).

The weights and scales are frozen data: the ops are differentiable w.r.t. their activations and bias only, and
asking for a weight's or scale's gradient raises instead of leaving it silently None. The backward passes
multiply by the low-bit weights as stored, through the transposed-product ops (``fp8_mm_t``,
``fp8_grouped_mm_t``, ``int8_weight_mm_t``, ``w4_mm_t``, ``w4_grouped_mm_t``), never through a dense copy.

Higher-order gradients (``autograd.grad(..., create_graph=True)``, gradient penalties, Hessian-vector products):
the transposed ops are linear in ``grad_out``, so they are differentiable too, through the forward products
(``fp8_mm_t``'s gradient is ``fp8_mm``, ``fp8_grouped_mm_t``'s is ``fp8_grouped_mm``, ``w4_mm_t``'s is
``w4_mm``, ``w4_grouped_mm_t``'s is ``w4_grouped_mm``). ``int8_weight_mm_t``'s is
``gg @ (wq * w_scale)^T``, which no int8 op computes without quantizing ``gg``: it runs as a float32 matmul on a
dequantized copy of the weight that lives only for that call (double backward only; first-order training never
builds it).

W8A8: ``int8_quantize`` rounds its input, so it has no useful derivative. Int8Linear trains through
:func:`int8_linear`, an autograd function whose backward passes the gradient straight through the activation
quantization: ``grad_x = grad_out @ (wq * w_scale)``. Differentiating ``int8_quantize`` / ``int8_mm``'s scales
directly raises and names it.
"""
from __future__ import annotations

import torch

from ._autocast import autocast_dtype, cast
from ._ops import _NAMESPACES


def _transposed(ns: str, name: str):
    """torch.ops.<ns>.<name>; the emulator's tensors live on the CPU, so until the emulator has a kernel for a
    transposed op its backward passes use the CPU kernel."""
    if ns != "lowbit" and not torch._C._dispatch_has_kernel_for_dispatch_key(f"{ns}::{name}", "CPU"):
        ns = "lowbit"
    return getattr(getattr(torch.ops, ns), name)


def _needs(ctx, i):
    # trailing optional inputs that were not given (None) have no entry
    return i < len(ctx.needs_input_grad) and ctx.needs_input_grad[i]


def _refuse_frozen(op, ctx, frozen):
    for i, name in frozen:
        if _needs(ctx, i):
            raise RuntimeError(
                f"{op}: {name} requires grad, but low-bit weights and their scales are frozen data and have no "
                f"gradient here; call {name}.requires_grad_(False) and train the activations' side (biases, "
                "adapters such as LoRA) instead")


def _bias_grad(grad, bias_dtype, N):
    return grad.to(torch.float32).sum_to_size((N,)).to(bias_dtype)


def _fp8_mm_setup(ctx, inputs, output):
    x, weight, scale, bias, block_size = inputs
    ctx.save_for_backward(weight, scale)
    ctx.block_size = block_size
    ctx.bias_dtype = None if bias is None else bias.dtype


def _fp8_grouped_mm_setup(ctx, inputs, output):
    x, weight, scale, offsets, expert_ids, block_size = inputs
    ctx.save_for_backward(weight, scale, offsets, expert_ids)
    ctx.block_size = block_size


def _fp8_mm_t_setup(ctx, inputs, output):
    grad_out, weight, scale, block_size = inputs
    ctx.save_for_backward(weight, scale)
    ctx.block_size = block_size


def _w4_save(ctx, codes, scale, fmt, group_size, K, offset, global_scale):
    ctx.save_for_backward(codes, scale, offset, global_scale)
    ctx.format, ctx.group_size, ctx.K = fmt, group_size, K


def _w4_mm_setup(ctx, inputs, output):
    x, codes, scale, fmt, group_size, offset, global_scale, bias = inputs
    _w4_save(ctx, codes, scale, fmt, group_size, x.shape[-1], offset, global_scale)
    ctx.bias_dtype = None if bias is None else bias.dtype


def _w4_mm_t_setup(ctx, inputs, output):
    grad_out, codes, scale, fmt, group_size, K, offset, global_scale = inputs
    _w4_save(ctx, codes, scale, fmt, group_size, K, offset, global_scale)


_W4_FROZEN = ((1, "codes"), (2, "scale"))


def _w4_grouped_save(ctx, codes, scale, fmt, group_size, K, offsets, expert_ids, offset, global_scale):
    ctx.save_for_backward(codes, scale, offsets, expert_ids, offset, global_scale)
    ctx.format, ctx.group_size, ctx.K = fmt, group_size, K


def _w4_grouped_mm_setup(ctx, inputs, output):
    x, codes, scale, fmt, group_size, offsets, expert_ids, offset, global_scale = inputs
    _w4_grouped_save(ctx, codes, scale, fmt, group_size, x.shape[-1], offsets, expert_ids, offset, global_scale)


def _w4_grouped_mm_t_setup(ctx, inputs, output):
    grad_out, codes, scale, fmt, group_size, K, offsets, expert_ids, offset, global_scale = inputs
    _w4_grouped_save(ctx, codes, scale, fmt, group_size, K, offsets, expert_ids, offset, global_scale)


def _int8_weight_mm_t_setup(ctx, inputs, output):
    grad_out, wq, w_scale = inputs
    ctx.save_for_backward(wq, w_scale)


def _int8_weight_mm(gg, wq, w_scale):
    """``gg @ (wq * w_scale)^T`` in float32 through a transient dequantized weight, in gg's dtype: the adjoint of
    int8_weight_mm_t (only a double backward needs it)."""
    w = wq.to(torch.float32) * w_scale.to(torch.float32).reshape(-1, 1)
    return (gg.to(torch.float32) @ w.T).to(gg.dtype)


def _int8_mm_setup(ctx, inputs, output):
    xq, x_scale, wq, w_scale, bias, out_dtype = inputs
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.N = wq.shape[0]


def _backward_fns(ns):
    def fp8_mm_backward(ctx, grad):
        _refuse_frozen("fp8_mm", ctx, ((1, "weight"), (2, "scale")))
        weight, scale = ctx.saved_tensors
        gx = _transposed(ns, "fp8_mm_t")(grad, weight, scale, ctx.block_size) if _needs(ctx, 0) else None
        gb = _bias_grad(grad, ctx.bias_dtype, weight.shape[0]) if _needs(ctx, 3) else None
        return gx, None, None, gb, None

    def fp8_grouped_mm_backward(ctx, grad):
        _refuse_frozen("fp8_grouped_mm", ctx, ((1, "weight"), (2, "scale")))
        weight, scale, offsets, expert_ids = ctx.saved_tensors
        gx = None
        if _needs(ctx, 0):
            gx = _transposed(ns, "fp8_grouped_mm_t")(grad, weight, scale, offsets, expert_ids, ctx.block_size)
        return gx, None, None, None, None, None

    # the transposed products are linear in grad_out: their gradient is the forward product (double backward)
    def fp8_mm_t_backward(ctx, gg):
        _refuse_frozen("fp8_mm_t", ctx, ((1, "weight"), (2, "scale")))
        weight, scale = ctx.saved_tensors
        return getattr(torch.ops, ns).fp8_mm(gg, weight, scale, None, ctx.block_size), None, None, None

    def fp8_grouped_mm_t_backward(ctx, gg):
        _refuse_frozen("fp8_grouped_mm_t", ctx, ((1, "weight"), (2, "scale")))
        weight, scale, offsets, expert_ids = ctx.saved_tensors
        return (getattr(torch.ops, ns).fp8_grouped_mm(gg, weight, scale, offsets, expert_ids, ctx.block_size),
                None, None, None, None, None)

    def w4_mm_backward(ctx, grad):
        _refuse_frozen("w4_mm", ctx, _W4_FROZEN + ((5, "offset"), (6, "global_scale")))
        codes, scale, offset, global_scale = ctx.saved_tensors
        gx = None
        if _needs(ctx, 0):
            gx = _transposed(ns, "w4_mm_t")(grad, codes, scale, ctx.format, ctx.group_size, ctx.K, offset,
                                            global_scale)
        gb = _bias_grad(grad, ctx.bias_dtype, codes.shape[0]) if _needs(ctx, 7) else None
        return gx, None, None, None, None, None, None, gb

    def w4_mm_t_backward(ctx, gg):
        _refuse_frozen("w4_mm_t", ctx, _W4_FROZEN + ((6, "offset"), (7, "global_scale")))
        codes, scale, offset, global_scale = ctx.saved_tensors
        gx = _transposed(ns, "w4_mm")(gg, codes, scale, ctx.format, ctx.group_size, offset, global_scale, None)
        return gx, None, None, None, None, None, None, None

    def w4_grouped_mm_backward(ctx, grad):
        _refuse_frozen("w4_grouped_mm", ctx, _W4_FROZEN + ((7, "offset"), (8, "global_scale")))
        codes, scale, offsets, expert_ids, offset, global_scale = ctx.saved_tensors
        gx = None
        if _needs(ctx, 0):
            gx = _transposed(ns, "w4_grouped_mm_t")(grad, codes, scale, ctx.format, ctx.group_size, ctx.K, offsets,
                                                    expert_ids, offset, global_scale)
        return gx, None, None, None, None, None, None, None, None

    def w4_grouped_mm_t_backward(ctx, gg):
        _refuse_frozen("w4_grouped_mm_t", ctx, _W4_FROZEN + ((8, "offset"), (9, "global_scale")))
        codes, scale, offsets, expert_ids, offset, global_scale = ctx.saved_tensors
        gx = _transposed(ns, "w4_grouped_mm")(gg, codes, scale, ctx.format, ctx.group_size, offsets, expert_ids,
                                              offset, global_scale)
        return gx, None, None, None, None, None, None, None, None, None

    def int8_weight_mm_t_backward(ctx, gg):
        _refuse_frozen("int8_weight_mm_t", ctx, ((2, "w_scale"),))
        wq, w_scale = ctx.saved_tensors
        return _int8_weight_mm(gg, wq, w_scale), None, None

    def int8_mm_backward(ctx, grad):
        _refuse_frozen("int8_mm", ctx, ((3, "w_scale"),))
        if _needs(ctx, 1):
            raise RuntimeError(
                "int8_mm: x_scale requires grad, but int8_mm multiplies quantized activations and has no gradient "
                "w.r.t. them; train through torch_lowbit.int8_linear (what Int8Linear runs), whose backward passes "
                "the gradient straight through the activation quantization")
        gb = _bias_grad(grad, ctx.bias_dtype, ctx.N) if _needs(ctx, 4) else None
        return None, None, None, None, gb, None

    def int8_quantize_backward(ctx, grad_q, grad_scale):
        raise RuntimeError(
            "int8_quantize is not differentiable (it rounds to int8); train through torch_lowbit.int8_linear (what "
            "Int8Linear runs), whose backward passes the gradient straight through the activation quantization")

    return {
        "fp8_mm": (fp8_mm_backward, _fp8_mm_setup),
        "fp8_grouped_mm": (fp8_grouped_mm_backward, _fp8_grouped_mm_setup),
        "int8_mm": (int8_mm_backward, _int8_mm_setup),
        "fp8_mm_t": (fp8_mm_t_backward, _fp8_mm_t_setup),
        "fp8_grouped_mm_t": (fp8_grouped_mm_t_backward, _fp8_grouped_mm_setup),
        "int8_weight_mm_t": (int8_weight_mm_t_backward, _int8_weight_mm_t_setup),
        "w4_mm": (w4_mm_backward, _w4_mm_setup),
        "w4_mm_t": (w4_mm_t_backward, _w4_mm_t_setup),
        "w4_grouped_mm": (w4_grouped_mm_backward, _w4_grouped_mm_setup),
        "w4_grouped_mm_t": (w4_grouped_mm_t_backward, _w4_grouped_mm_t_setup),
        "int8_quantize": (int8_quantize_backward, None),
    }


def _grad_impl(op, backward, setup):
    """What op's Autograd kernel (csrc/autograd.h: calls that need no gradient never reach Python) runs when a
    gradient is needed: an autograd.Function that runs op below autograd and keeps what `setup` saves for
    `backward`."""
    def forward(*args):
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args)

    def setup_context(ctx, inputs, output):
        if setup is not None:
            setup(ctx, inputs, output)

    fn = type(f"{op._namespace}_{op._opname}_backward", (torch.autograd.Function,),
              {"forward": staticmethod(forward), "setup_context": staticmethod(setup_context),
               "backward": staticmethod(backward)})
    return fn.apply


def _register_autograd():
    from . import _C
    for ns in _NAMESPACES:
        for name, (backward, setup) in _backward_fns(ns).items():
            op = getattr(getattr(torch.ops, ns), name).default
            _C._register_autograd(ns, name, _grad_impl(op, backward, setup))


class _Int8Linear(torch.autograd.Function):
    @staticmethod
    def forward(x, wq, w_scale, bias, ns):
        ops = getattr(torch.ops, ns)
        xq, xs = ops.int8_quantize(x)
        return ops.int8_mm(xq, xs, wq, w_scale, bias, x.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, wq, w_scale, bias, ns = inputs
        ctx.save_for_backward(wq, w_scale)
        ctx.ns = ns
        ctx.bias_dtype = None if bias is None else bias.dtype

    @staticmethod
    def backward(ctx, grad):
        _refuse_frozen("int8_linear", ctx, ((2, "w_scale"),))
        wq, w_scale = ctx.saved_tensors
        gx = _transposed(ctx.ns, "int8_weight_mm_t")(grad, wq, w_scale) if _needs(ctx, 0) else None
        gb = _bias_grad(grad, ctx.bias_dtype, wq.shape[0]) if _needs(ctx, 3) else None
        return gx, None, None, gb, None


def int8_linear(x, wq, w_scale, bias=None, ns="lowbit"):
    dtype = autocast_dtype(x)
    if dtype is not None:  # under torch.autocast, as F.linear: activations and bias in autocast's dtype
        x, bias = cast(x, dtype), cast(bias, dtype)
    # Without a gradient to record (inference, every decode step) the ops run directly: Function.apply binds its
    # default arguments through inspect.signature on every call, which costs several times the op pair.
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in (x, w_scale, bias)):
        return _Int8Linear.forward(x, wq, w_scale, bias, ns)
    return _Int8Linear.apply(x, wq, w_scale, bias, ns)
