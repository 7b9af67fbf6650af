"""Tensor-parallel styles for the low-bit layers, on transformers' styles and torch.distributed's collectives.

- column-wise (``colwise``; ``colwise_rep`` / ``colwise_gather_output`` gather the output): each rank holds a slice of
  the output rows N and computes its slice of the output from the whole (replicated) input: transformers'
  ``ColwiseParallel`` on the layer's local tensors. No communication unless the output is gathered (a DTensor
  ``Shard`` -> ``Replicate`` redistribution).
- row-wise (``rowwise``; ``rowwise_rep`` / ``rowwise_split_input`` take a replicated input): each rank holds a slice of
  the input columns K and computes a partial product of its slice of the input; the partial outputs, in float32,
  are summed over the ranks (torch.distributed's all-reduce), then the bias is added once and the result rounded to
  the input's dtype. INT8 activations are quantized per token with the scale of the WHOLE row -- each rank's row
  absmax, max-reduced over the ranks -- so every rank uses the activation scale and int8 codes of the
  single-process layer, and the int32 products differ only in which rank sums them.
- experts (``moe_tp_experts``): each rank holds a slice of every expert's intermediate size I (gate and up rows,
  down columns), runs the whole routing, and the partial outputs are summed as for row-wise (Int8Experts quantize
  the down projection's input with the whole row's scale, as above).

Partial sums are all-reduced in float32, so a bf16 / fp16 model is rounded once after the sum, as the single-process
layer rounds once after its fp32 accumulation (a float32 input costs a prefill GEMM more than a bf16 one on CPUs
whose GEMM runs on bf16 units; a world of one rank runs the layers' own forwards). The collectives run on the mesh's
device type (``cpu`` for gloo): tensors of another device (mps between Macs) are copied there and back.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, Type

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from .. import _ops
from .layouts import SplitError
from .parallel import EXPERTS_SPLIT, transformers_tp

_tp = transformers_tp()[0]
ALL_PARALLEL_STYLES, ColwiseParallel, RowwiseParallel = (_tp.ALL_PARALLEL_STYLES, _tp.ColwiseParallel,
                                                          _tp.RowwiseParallel)
# deprecated in transformers 5.25 (removal announced for 5.28): the experts style keeps only its input handling, which
# the base layer's (arguments as given) replaces once it is gone -- the low-bit experts forward runs on local tensors
MoeExpertsParallel = getattr(_tp, "MoeExpertsParallel", None)


# ------------------------------------------------------------------------------------------------ collectives
def _collective(t: torch.Tensor, mesh, placement) -> torch.Tensor:
    """`t` (this rank's local tensor of DTensor layout `placement`) redistributed to Replicate on `mesh`."""
    if mesh.size() == 1:
        return t
    home = t.device
    local = t if home.type == mesh.device_type else t.to(mesh.device_type)
    out = DTensor.from_local(local, mesh, [placement], run_check=False).redistribute(mesh, [Replicate()]).to_local()
    return out.to(home) if out.device != home else out


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def all_reduce(t: torch.Tensor, mesh, op: str = "sum") -> torch.Tensor:
    """The sum (or max) of `t` over the ranks of `mesh`, on every rank, computed in place in `t` (a fresh partial
    result). The c10d all-reduce that transformers' own row-wise inference path calls: a third of the latency of the
    same reduction as a DTensor ``Partial`` -> ``Replicate`` redistribution (0.4 vs 1.4 ms between two gloo ranks
    here), and a decode step runs two per layer."""
    if mesh.size() == 1:
        return t
    home = t.device
    buf = t.contiguous() if home.type == mesh.device_type else t.to(mesh.device_type)
    dist.all_reduce(buf, op=_REDUCE_OPS[op], group=mesh.get_group())
    return buf.to(home) if buf.device != home else buf


def all_gather_last_dim(t: torch.Tensor, mesh) -> torch.Tensor:
    return _collective(t.contiguous(), mesh, Shard(t.dim() - 1))


def shared_int8_quantize(x: torch.Tensor, mesh):
    """``int8_quantize`` of rows split over the ranks (each rank holds a slice of every row): the row scale is the
    whole row's ``absmax / 127`` (absmax max-reduced over the ranks), so each rank's codes are its slice of the
    single-process codes. Rules of ``int8_quantize``: round half to even of the fp32 quotient, clamp to +-127; a zero
    row gives scale 0, a row holding NaN or +-inf (on any rank) scale NaN, and codes 0."""
    xf = x.float()
    amax = xf.abs().amax(-1) if xf.shape[-1] else xf.new_zeros(xf.shape[:-1])
    amax = torch.where(torch.isnan(amax), torch.full_like(amax, float("inf")), amax)  # NaN wins the max as inf
    amax = all_reduce(amax, mesh, "max")
    scale = amax / 127
    finite = torch.isfinite(scale)
    q = torch.round(xf / scale.unsqueeze(-1)).clamp_(-127, 127)
    q = torch.where((finite & (scale > 0)).unsqueeze(-1), q, torch.zeros_like(q)).to(torch.int8)
    return q, torch.where(finite, scale, torch.full_like(scale, float("nan")))


# ------------------------------------------------------------------------------------------------ row-wise partials
@contextlib.contextmanager
def _bias_hidden(module: nn.Module):
    bias = module._parameters.get("bias")
    module._parameters["bias"] = None
    try:
        yield
    finally:
        module._parameters["bias"] = bias


def _weight_only_partial(module: nn.Module, x: torch.Tensor, mesh) -> torch.Tensor:
    """The layer's own forward on the float32 input, without its bias: a float32 partial product."""
    with _bias_hidden(module):
        return type(module).forward(module, x.float())


def _int8_linear_partial(module: nn.Module, x: torch.Tensor, mesh) -> torch.Tensor:
    module._check_input(x)
    q, s = shared_int8_quantize(x, mesh)
    return _ops.int8_mm(q, s, module.weight, module.weight_scale, None, torch.float32)


def _check_fp8_rowwise(module: nn.Module, name: str) -> None:
    if module.quantize_activations and module.activation_scheme == "dynamic":
        raise SplitError(f"{name} (Fp8Linear): row-wise parallel with dynamic per-token FP8 activations is not "
                         f"supported (load with activations='weights-only')")


_ROWWISE_PARTIALS: Dict[Type[nn.Module], Callable] = {}
_ROWWISE_CHECKS: Dict[Type[nn.Module], Callable] = {}


def _register_rowwise():
    from ..nn import Fp8Linear, Int8Linear, W4Linear

    _ROWWISE_PARTIALS.update({Fp8Linear: _weight_only_partial, W4Linear: _weight_only_partial,
                              Int8Linear: _int8_linear_partial})
    _ROWWISE_CHECKS[Fp8Linear] = _check_fp8_rowwise


def _lookup(table: Dict[Type[nn.Module], Callable], module: nn.Module, what: str, name: str):
    for cls in type(module).__mro__:
        if cls in table:
            return table[cls]
    if what:
        raise SplitError(f"{name}: {type(module).__name__} has no {what}")
    return None


# ------------------------------------------------------------------------------------------------ experts partials
def _weight_only_experts_partial(module, hidden, topk_ids, topk_weights, mesh):
    return type(module).forward(module, hidden.float(), topk_ids, topk_weights)


def _int8_experts_partial(module, hidden, topk_ids, topk_weights, mesh):
    """Int8Experts' forward on this rank's slice of I, the down projection's input quantized with whole-row scales
    (one max-reduce for all rows of all experts)."""
    return module.run(hidden.float(), topk_ids, topk_weights, quantize_down=lambda h: shared_int8_quantize(h, mesh))


_EXPERTS_PARTIALS: Dict[Type[nn.Module], Callable] = {}


def _register_experts():
    from ..nn import Fp8Experts, Int8Experts, W4Experts

    _EXPERTS_PARTIALS.update({Fp8Experts: _weight_only_experts_partial, W4Experts: _weight_only_experts_partial,
                              Int8Experts: _int8_experts_partial})


_register_rowwise()
_register_experts()


# ------------------------------------------------------------------------------------------------ the styles
class LowbitColwise(ColwiseParallel):
    """transformers' ColwiseParallel on a low-bit layer holding its N slice (local tensors, replicated input)."""

    def __init__(self, template: ColwiseParallel):
        super().__init__(input_layouts=template.input_layouts, output_layouts=template.output_layouts,
                         use_local_output=True)

    def should_use_local_tensors(self, module):
        return True

    def install_forward(self, module, mesh, name: str = ""):
        module._hf_quantized_needs_local_tp = True  # transformers' flag: the forward runs on local tensors
        return super().install_forward(module, mesh)

    def transform_output_post_forward(self, module, output, mesh, config=None):
        # config: transformers >= 5.25 passes the model config (unused: the N split is plain)
        if isinstance(self.output_layouts, Shard):
            return output
        return all_gather_last_dim(output, mesh)


class LowbitRowwise(RowwiseParallel):
    """transformers' RowwiseParallel input handling; the partial product in float32, summed over the ranks."""

    def __init__(self, template: RowwiseParallel):
        super().__init__(input_layouts=template.input_layouts, output_layouts=Replicate(), use_local_output=True)

    def should_use_local_tensors(self, module):
        return True

    def install_forward(self, module, mesh, name: str = ""):
        partial = _lookup(_ROWWISE_PARTIALS, module, "row-wise parallel forward", name)
        check = _lookup(_ROWWISE_CHECKS, module, "", name)
        if check is not None:
            check(module, name)
        if mesh.size() == 1:  # nothing to sum: the layer's own forward, in the input's dtype
            return module

        def tp_forward(x, *args, **kwargs):
            (x, *args), kwargs = self.transform_inputs_pre_forward(module, (x, *args), kwargs, mesh)
            out = all_reduce(partial(module, x, mesh), mesh)
            bias = module._parameters.get("bias")
            if bias is not None:
                out = out + bias.float()
            return out.to(x.dtype)
        module.forward = tp_forward
        return module


class LowbitExperts(MoeExpertsParallel or _tp.TensorParallelLayer):
    """transformers' MoeExpertsParallel input handling; each rank's experts slice in float32, summed over the
    ranks."""

    def install_forward(self, module, mesh, name: str = ""):
        partial = _lookup(_EXPERTS_PARTIALS, module, "experts tensor-parallel forward", name)
        if mesh.size() == 1:
            return module

        def tp_forward(hidden, topk_ids, topk_weights):
            (hidden, topk_ids, topk_weights), _ = self.transform_inputs_pre_forward(
                module, (hidden, topk_ids, topk_weights), {}, mesh)
            return all_reduce(partial(module, hidden, topk_ids, topk_weights, mesh), mesh).to(hidden.dtype)
        module.forward = tp_forward
        return module


# transformers' style name -> (the split it makes: see shard.STYLE_EXTENTS, the low-bit style)
def lowbit_style(style_name: str, name: str):
    """(split kind, style object) standing in for transformers' style `style_name` on a low-bit layer."""
    template = ALL_PARALLEL_STYLES[style_name] if style_name in ALL_PARALLEL_STYLES else None
    if isinstance(template, ColwiseParallel):
        return "colwise", LowbitColwise(template)
    if isinstance(template, RowwiseParallel):
        return "rowwise", LowbitRowwise(template)
    if style_name == EXPERTS_SPLIT or (MoeExpertsParallel is not None and isinstance(template, MoeExpertsParallel)):
        return "experts", LowbitExperts()
    raise SplitError(f"{name}: the tensor-parallel plan asks for style {style_name!r}, which torch_lowbit's low-bit "
                     f"layers do not implement (colwise*, rowwise*, moe_tp_experts)")
