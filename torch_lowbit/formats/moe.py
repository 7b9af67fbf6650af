"""MoE experts: how the loader finds them in a model and fills them from per-expert checkpoint tensors.

An *experts module* is a module of the model that is either a torch_lowbit experts layer (``Fp8Experts``,
``Int8Experts``, ``W4Experts``), or any module
with 3-D tensors ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` -- the fused experts of transformers >= 5
(``Qwen3MoeExperts``, ...), whose ``forward(hidden, top_k_index, top_k_weights)`` Fp8Experts shares, so the MoE
block's router and forward stay as they are. Checkpoints store experts one by one, as published:
``{name}.{e}.gate_proj.weight``, ``{name}.{e}.up_proj.weight``, ``{name}.{e}.down_proj.weight`` (+ scales).
FP8 experts replace the module by an Fp8Experts (gate rows, then up rows), INT8 ones (compressed-tensors' int-quantized
W8A8, per-channel scales) by an Int8Experts, 4-bit ones (any layout a format's ``w4_weight`` reads: compressed-tensors
pack-quantized / nvfp4 / mxfp4, ModelOpt NVFP4) by a W4Experts; MLX stores experts already stacked
(``switch_mlp.{gate,up,down}_proj`` ``[E, N, K/8]`` words: the format names the prefix, ``stacked_experts``).
Unquantized experts are stacked into the module's own ``gate_up_proj`` / ``down_proj``.

Experts held as an ``nn.ModuleList`` of MLPs (transformers < 5) are not experts modules: each expert's
gate/up/down ``nn.Linear`` becomes an Fp8Linear by the ordinary linear rule (correct, one matmul per expert).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..granularity import Granularity, PerBlock, PerChannel, PerTensor
from ..nn.experts import Fp8Experts
from ..nn.int8_experts import Int8Experts
from ..nn.w4_experts import W4Experts
from .registry import FP8_LAYER_SCHEMES, QuantFormat
from .source import CheckpointError, Source
from .tensors import QuantizedWeight, read_quantized

PROJS = ("gate", "up", "down")


QUANTIZED_EXPERTS = (Fp8Experts, Int8Experts, W4Experts)


def is_experts_module(m: nn.Module) -> bool:
    if isinstance(m, QUANTIZED_EXPERTS):
        return True
    gu, dn = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    return isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor) and gu.dim() == 3 and dn.dim() == 3


def experts_dims(m: nn.Module) -> Tuple[int, int, int]:
    if isinstance(m, QUANTIZED_EXPERTS):
        return m.num_experts, m.hidden_size, m.intermediate_size
    E, I2, H = m.gate_up_proj.shape
    return E, H, I2 // 2


# Where SiLU is recognized: both signs, the region around 0, and large |x| where x * sigmoid(x) saturates
_SILU_PROBE = (-20.0, -6.5, -3.0, -1.25, -0.5, -0.125, 0.0, 0.0625, 0.4, 1.0, 2.5, 4.75, 9.0, 30.0)


def computes_silu(act) -> bool:
    """Does `act` compute x * sigmoid(x)? Judged by its values on probe inputs, not by its class: transformers 5
    uses its own ``SiLUActivation`` module (``ACT2FN["silu"]``), others use nn.SiLU or F.silu."""
    x = torch.tensor(_SILU_PROBE, dtype=torch.float32)
    try:
        with torch.no_grad():
            y = act(x)
    except Exception:  # an activation that cannot run on a CPU float tensor is not one we can vouch for
        return False
    if not isinstance(y, torch.Tensor) or y.shape != x.shape or not y.is_floating_point():
        return False
    want = x.double() * torch.sigmoid(x.double())
    return bool(torch.allclose(y.double(), want, rtol=1e-5, atol=1e-6))


# transformers' use_experts_implementation flags, at the values of the [gate; up] SwiGLU layout the quantized layers
# compute; any other value (gpt-oss: transposed, interleaved, biased) is another arithmetic
_SWIGLU_FLAGS = {"is_transposed": False, "is_concatenated": True, "has_bias": False, "has_gate": True,
                 "has_post_expert_norm": False}
_EXPERT_TENSORS = ("gate_up_proj", "down_proj")


def unconvertible_reason(m: nn.Module) -> Optional[str]:
    """Why the dense fused experts module `m` cannot become an Fp8Experts / Int8Experts without changing what it
    computes, or None when it can. Checked: transformers' layout flags (``is_transposed``, ``has_bias``, ...),
    the shapes ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``, tensors besides those two (biases, norms:
    the layer would drop them), the activation (SiLU by its values), and -- where the weights are real, not on
    meta -- the module's own forward on a probe (one token on the first and last expert) against the float64
    SwiGLU of its weights, which also catches a forward signature the quantized layers do not share."""
    for flag, want in _SWIGLU_FLAGS.items():
        if hasattr(m, flag) and bool(getattr(m, flag)) != want:
            return (f"{flag}={getattr(m, flag)!r} (the quantized experts compute the [gate; up] SwiGLU layout, "
                    f"{flag}={want})")
    gu, dn = m.gate_up_proj, m.down_proj
    E, I2, H = gu.shape
    if I2 % 2 or tuple(dn.shape) != (E, H, I2 // 2):
        return (f"gate_up_proj {list(gu.shape)} and down_proj {list(dn.shape)} are not [E, 2I, H] and [E, H, I] "
                f"(transposed or interleaved experts)")
    extra = [n for n, _ in list(m.named_parameters()) + list(m.named_buffers()) if n not in _EXPERT_TENSORS]
    if extra:
        return f"it holds {', '.join(extra)} besides gate_up_proj / down_proj, which the quantized layer would drop"
    act = getattr(m, "act_fn", None)
    if act is not None and not computes_silu(act):
        return (f"its activation {act!r} does not compute x * sigmoid(x) (the quantized experts implement SwiGLU "
                f"with SiLU)")
    return _probe_reason(m)


def _probe_reason(m: nn.Module) -> Optional[str]:
    gu, dn = m.gate_up_proj.detach(), m.down_proj.detach()
    E, I2, H = gu.shape
    if gu.is_meta or dn.is_meta or E == 0 or not gu.is_floating_point():
        return None  # nothing to run: the structural checks stand alone
    I = I2 // 2
    experts = sorted({0, E - 1})
    x = torch.randn(len(experts), H, generator=torch.Generator().manual_seed(0)).to(gu.device, gu.dtype)
    ids = torch.tensor(experts, device=gu.device).reshape(-1, 1)
    weights = torch.full((len(experts), 1), 0.75, dtype=gu.dtype, device=gu.device)
    try:
        with torch.no_grad():
            got = m(x, ids, weights)
    except Exception as e:  # any failure means the layer's forward(hidden, topk_ids, topk_weights) is not its own
        return f"its forward(hidden, top_k_index, top_k_weights) fails on a probe ({type(e).__name__}: {e})"
    want = torch.zeros(len(experts), H, dtype=torch.float64)
    for i, e in enumerate(experts):
        h = gu[e].double().cpu() @ x[i].double().cpu()
        want[i] = 0.75 * (dn[e].double().cpu() @ (F.silu(h[:I]) * h[I:]))
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
        return f"its forward on a probe returns {getattr(got, 'shape', type(got).__name__)}, not [T, H]"
    # the module computes in its own dtype: a half-precision forward rounds gate, up and the activation
    tol = 1e-4 if gu.dtype in (torch.float32, torch.float64) else 5e-2
    err = (got.double().cpu() - want).abs().max().item()
    if not err <= tol * max(want.abs().max().item(), 1e-30):
        return (f"its forward differs from the SwiGLU of its gate_up_proj / down_proj on a probe (max error "
                f"{err:.3g}): it computes something else")
    return None


def _check_activation(name: str, m: nn.Module):
    act = getattr(m, "act_fn", None)
    if act is None or computes_silu(act):
        return
    raise CheckpointError(f"experts module {name} uses activation {act!r}, which does not compute x * sigmoid(x); "
                          f"Fp8Experts implements SwiGLU with SiLU")


def _stack_scales(key: str, parts: List[QuantizedWeight]) -> Tuple[torch.Tensor, Granularity]:
    """One expert's scale for row-stacked weights (gate then up, or down alone) and its granularity: block scales
    concatenated, equal per-tensor scales kept as one, anything else expanded to per channel."""
    grans = [q.granularity for q in parts]
    if any(isinstance(g, PerBlock) for g in grans):
        if not all(isinstance(g, PerBlock) for g in grans):
            raise CheckpointError(f"{key}: block scales cannot be mixed with per-tensor / per-channel scales")
        bn = grans[0].block_n
        rows = [q.weight.shape[0] for q in parts]
        if len(parts) > 1 and any(r % bn for r in rows[:-1]):
            raise CheckpointError(f"{key}: gate and up have {rows[0]} rows, not a multiple of the block height {bn}: "
                                  f"their block scales cannot be stacked into one gate_up weight")
        return torch.cat([q.scale for q in parts], dim=0), grans[0]
    if all(isinstance(g, PerTensor) for g in grans) and all(torch.equal(parts[0].scale, q.scale) for q in parts):
        return parts[0].scale.reshape(()), PerTensor()
    return torch.cat([q.scale.reshape(-1).expand(q.weight.shape[0]) for q in parts]), PerChannel()


def _uniform(key: str, scales: List[Tuple[torch.Tensor, Granularity]]) -> torch.Tensor:
    """Stack the experts' scales, widening per-tensor ones to per channel when the experts disagree."""
    grans = {g.kind for _, g in scales}
    if len(grans) > 1:
        if "block" in grans:
            raise CheckpointError(f"{key}: some experts have block scales and others do not")
        n = max(s.numel() for s, _ in scales)
        return torch.stack([s.reshape(-1).expand(n) for s, _ in scales]).contiguous()
    return torch.stack([s for s, _ in scales]).contiguous()


def load_experts(src: Source, fmt: QuantFormat, name: str, module: nn.Module, device, dtype, cut_expert=None,
                 ) -> Optional[Tuple[nn.Module, List[str], str, bool]]:
    """(module to put at `name`, checkpoint keys used, description, quantized?) or None when the checkpoint has
    no per-expert tensors for it (then its own keys, if any, load like any other parameter).
    cut_expert: ``cut_expert(name, projection, QuantizedWeight) -> QuantizedWeight``, applied to each FP8 / INT8
    expert projection as it is read, before it is stacked (tensor parallelism keeps one rank's slice of the
    intermediate size there, so the whole layer is never stacked)."""
    E, H, I = experts_dims(module)
    w4 = _load_w4(src, fmt, name, module, device, dtype)
    if w4 is not None:
        return w4
    wkeys = {(e, p): f"{name}.{e}.{p}_proj.weight" for e in range(E) for p in PROJS}
    present = [k for k in wkeys.values() if k in src]
    packed = [k + "_packed" for k in wkeys.values() if k + "_packed" in src] + [
        k for k in present if src.dtype(k) == torch.uint32]
    if packed:
        raise CheckpointError(f"{packed[0]}: 4-bit MoE experts are not supported in {fmt.name} checkpoints (its "
                              f"format reads no 4-bit weight there)")
    if not present:
        return None
    missing = [k for k in wkeys.values() if k not in src]
    if missing:
        raise CheckpointError(f"experts module {name} has {E} experts but {missing[0]} is missing from the checkpoint "
                              f"({len(missing)} expert weights missing)")
    _check_activation(name, module)
    kinds = {k: fmt.weight_kind(k, src.dtype(k)) for k in wkeys.values()}
    if set(kinds.values()) == {None}:
        return _load_dense(src, name, module, wkeys, device, dtype)
    unquantized = [k for k, v in kinds.items() if v is None]
    if unquantized:
        raise CheckpointError(f"{unquantized[0]} is {src.dtype(unquantized[0])} while other experts of {name} are "
                              f"quantized: torch_lowbit needs all experts of a layer in one format")
    if len(set(kinds.values())) > 1:
        k = next(k for k, v in kinds.items() if v != kinds[wkeys[(0, "gate")]])
        raise CheckpointError(f"{k} is {src.dtype(k)} while {wkeys[(0, 'gate')]} is {src.dtype(wkeys[(0, 'gate')])}: "
                              f"torch_lowbit needs all experts of a layer in one format")
    kind = kinds[wkeys[(0, "gate")]]
    ignored = [f"{name}.{e}.{p}_proj" for e in range(E) for p in PROJS
               if fmt.is_ignored(f"{name}.{e}.{p}_proj") or fmt.is_ignored(name)]
    if ignored:
        raise CheckpointError(f"{ignored[0]}.weight is {kind} but {ignored[0]} is in the checkpoint's ignore list")

    wdtype = torch.int8 if kind == "int8" else torch.float8_e4m3fn
    gu_scales, d_scales, input_scales, used = [], [], [], []
    for e in range(E):
        q = {p: read_quantized(src, fmt, f"{name}.{e}.{p}_proj", kind, shape)
             for p, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I)))}
        used += [k for p in PROJS for k in q[p].keys]
        if cut_expert is not None:
            q = {p: cut_expert(name, p, q[p]) for p in PROJS}
        if e == 0:
            part = q["gate"].weight.shape[0]  # of the intermediate size I: all of it, or this rank's (cut_expert)
            gate_up = torch.empty(E, 2 * part, H, dtype=wdtype)
            down = torch.empty(E, H, part, dtype=wdtype)
        gate_up[e, :part].copy_(q["gate"].weight)
        gate_up[e, part:].copy_(q["up"].weight)
        down[e].copy_(q["down"].weight)
        if kind == "int8":  # read_quantized gives int8 weights per-channel [N] scales
            gu_scales.append(torch.cat([q["gate"].scale.reshape(-1), q["up"].scale.reshape(-1)]))
            d_scales.append(q["down"].scale.reshape(-1))
        else:
            gu_scales.append(_stack_scales(f"{name}.{e}.gate/up_proj scales", [q["gate"], q["up"]]))
            d_scales.append(_stack_scales(f"{name}.{e}.down_proj scale", [q["down"]]))
            input_scales.append([q[p].input_scale for p in PROJS])
    if kind == "int8":
        layer = Int8Experts.from_quantized(gate_up, torch.stack(gu_scales), down, torch.stack(d_scales),
                                           dtype=dtype or torch.bfloat16)
        desc = f"Int8Experts(E={E}, channel)"
    else:
        gu_scale = _uniform(f"{name} gate/up scales", gu_scales)
        d_scale = _uniform(f"{name} down scales", d_scales)
        layer = Fp8Experts.from_quantized(gate_up, gu_scale, down, d_scale, block_size=fmt.block_size,
                                          dtype=dtype or torch.bfloat16)
        _record_activation_scheme(layer, name, FP8_LAYER_SCHEMES.get(experts_activation_scheme(fmt, name, E)),
                                  input_scales)
        desc = f"Fp8Experts(E={E}, gate_up {layer.gate_up_granularity.kind}, down {layer.down_granularity.kind})"
    layer = layer.to(device) if device is not None else layer
    return layer, used, desc, True


def experts_activation_scheme(fmt: QuantFormat, name: str, E: int):
    """The activation scheme the checkpoint wrote experts module `name` for, by its per-expert projections' names
    (what a config group targets: ``Linear``, or names / regexes of the expert Linears), one for all of them."""
    schemes = {fmt.activation_scheme(f"{name}.{e}.{p}_proj") for e in range(E) for p in PROJS}
    if len(schemes) > 1:
        raise CheckpointError(f"the checkpoint writes the experts of {name} for different activation schemes "
                              f"({sorted(map(str, schemes))}): torch_lowbit needs one scheme for all experts of a layer")
    return schemes.pop() if schemes else None


def _record_activation_scheme(layer: Fp8Experts, name: str, scheme, input_scales):
    """The checkpoint's FP8 activation scheme on the experts layer (which computes W8A16), so that a save keeps it:
    static per-tensor scales as ``input_scale [E, 3]`` (gate, up, down of each expert)."""
    if scheme != "static":
        layer.set_activation_scheme(scheme)
        return
    missing = [f"{name}.{e}.{p}_proj.input_scale" for e, row in enumerate(input_scales)
               for p, s in zip(PROJS, row) if s is None or s.numel() != 1]
    if missing:
        raise CheckpointError(f"{missing[0]} is missing or not one number: the checkpoint's config says {name} takes "
                              f"static per-tensor FP8 activations, whose scale that tensor holds")
    scales = torch.tensor([[float(s) for s in row] for row in input_scales], dtype=torch.float32)
    try:
        layer.set_activation_scheme("static", scales)
    except ValueError as e:
        raise CheckpointError(f"{name}: {e}") from None


def _load_dense(src: Source, name: str, module: nn.Module, wkeys: Dict, device, dtype):
    if isinstance(module, QUANTIZED_EXPERTS):
        raise CheckpointError(f"the checkpoint stores the experts of {name} unquantized ({wkeys[(0, 'gate')]} is "
                              f"{src.dtype(wkeys[(0, 'gate')])}), but the model holds an {type(module).__name__} there")
    E, H, I = experts_dims(module)
    old_gu, old_d = module.gate_up_proj, module.down_proj
    tdtype = dtype or old_gu.dtype
    tdev = device if device is not None else (old_gu.device if old_gu.device.type != "meta" else torch.device("cpu"))
    gate_up = torch.empty(E, 2 * I, H, dtype=tdtype, device=tdev)
    down = torch.empty(E, H, I, dtype=tdtype, device=tdev)
    for e in range(E):
        for p, dst in (("gate", gate_up[e, :I]), ("up", gate_up[e, I:]), ("down", down[e])):
            t = src.get(wkeys[(e, p)])
            if tuple(t.shape) != tuple(dst.shape):
                raise CheckpointError(f"{wkeys[(e, p)]} has shape {list(t.shape)}, expected {list(dst.shape)}")
            dst.copy_(t)
    for attr, new, old in (("gate_up_proj", gate_up, old_gu), ("down_proj", down, old_d)):
        if isinstance(old, nn.Parameter):
            new = nn.Parameter(new, requires_grad=old.requires_grad)
        setattr(module, attr, new)
    return module, list(wkeys.values()), f"stored as {src.dtype(wkeys[(0, 'gate')])}", False


# ------------------------------------------------------------------------------------------------- 4-bit experts
def _w4_pieces(src: Source, fmt: QuantFormat, name: str, E: int, H: int, I: int):
    """Where the 4-bit experts of `name` are: [(module prefix, weight shape, experts, projection, rows)] in read
    order -- per expert and projection (``{name}.{e}.gate_proj`` [I, H], ...), or, where the format stores them
    stacked (MLX), one piece per projection of shape [E, N, K] -- or None when the checkpoint holds no 4-bit
    weight for them."""
    form = fmt.format
    if form is None:
        return None
    rows = {"gate": slice(0, I), "up": slice(I, 2 * I), "down": slice(0, H)}
    shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    for base in form.stacked_experts(name):
        if form.w4_present(src, fmt, f"{base}.gate_proj"):
            return [(f"{base}.{p}_proj", (E,) + shapes[p], slice(0, E), p, rows[p]) for p in PROJS]
    if not form.w4_present(src, fmt, f"{name}.0.gate_proj"):
        return None
    return [(f"{name}.{e}.{p}_proj", shapes[p], slice(e, e + 1), p, rows[p]) for e in range(E) for p in PROJS]


class _W4Stack:
    """The stacked tensors of one projection (gate_up or down) of a W4Experts, filled piece by piece: each
    piece's codes, scales and offsets are copied in as read, so at most one checkpoint tensor is held besides
    what the layer keeps (never a dense copy of an expert)."""

    def __init__(self, E: int, rows: int, cols: int):
        self.E, self.rows, self.cols = E, rows, cols
        self.t: Dict[str, Optional[torch.Tensor]] = {}
        self.scale_2: List[Optional[torch.Tensor]] = [None] * E

    def put(self, prefix: str, key: str, part, experts: slice, rows: slice, G: int):
        """Copy `part` ([n, rows, ...] or [rows, ...] for one expert) into tensor `key`, allocated on first use."""
        if part is None:
            return
        part = part.reshape(experts.stop - experts.start, rows.stop - rows.start, -1)
        if key not in self.t:
            width = (self.cols + 1) // 2 if key == "packed" else G
            self.t[key] = torch.empty(self.E, self.rows, width, dtype=part.dtype)
        dst = self.t[key][experts, rows]
        if part.shape[-1] != dst.shape[-1]:
            if part.shape[-1] != 1:
                raise CheckpointError(f"{prefix}: {part.shape[-1]} groups per row where the experts read before it "
                                      f"have {dst.shape[-1]}: a W4Experts projection has one layout for all experts")
            part = part.expand(-1, -1, dst.shape[-1])  # one scale per row, repeated over the groups: the same weights
        dst.copy_(part)


def _load_w4(src: Source, fmt: QuantFormat, name: str, module: nn.Module, device, dtype):
    """The experts of `name` as a W4Experts when the checkpoint stores them 4-bit, else None."""
    E, H, I = experts_dims(module)
    pieces = _w4_pieces(src, fmt, name, E, H, I)
    if pieces is None:
        return None
    if isinstance(module, (Fp8Experts, Int8Experts)):
        raise CheckpointError(f"the checkpoint stores the experts of {name} as 4-bit weights, but the model holds an "
                              f"{type(module).__name__} there")
    if not isinstance(module, W4Experts):
        _check_activation(name, module)
    ignored = [prefix for prefix, *_ in pieces if fmt.is_ignored(prefix) or fmt.is_ignored(name)]
    if ignored:
        raise CheckpointError(f"{ignored[0]} holds a 4-bit weight but is in the checkpoint's ignore list")
    stacks = {"gate_up": _W4Stack(E, 2 * I, H), "down": _W4Stack(E, H, I)}
    first, used, group = None, [], None
    for prefix, shape, experts, p, rows in pieces:
        w = fmt.format.w4_weight(src, fmt, prefix, shape)
        if w is None:
            raise CheckpointError(f"experts module {name}: {prefix} holds no 4-bit weight while {pieces[0][0]} does "
                                  f"(a missing or unquantized expert): torch_lowbit needs all experts of a layer in "
                                  f"one format")
        if first is None:
            first = w
        if (w.format, w.scale.dtype, w.offset is None, w.global_scale is None) != (
                first.format, first.scale.dtype, first.offset is None, first.global_scale is None):
            raise CheckpointError(f"{prefix} is a {w.describe()} weight ({w.scale.dtype} scales) while "
                                  f"{pieces[0][0]} is {first.describe()} ({first.scale.dtype} scales): torch_lowbit "
                                  f"needs all experts of a layer in one 4-bit format")
        G = w.scale.shape[-1]
        if G > 1:  # a projection with one group per row takes any group size at least its width
            if group is not None and w.group_size != group:
                raise CheckpointError(f"{prefix} has groups of {w.group_size} while other experts of {name} have "
                                      f"groups of {group}: a W4Experts layer has one group size")
            group = w.group_size
        stack = stacks["down" if p == "down" else "gate_up"]
        stack.put(prefix, "packed", w.packed, experts, rows, G)
        stack.put(prefix, "scale", w.scale, experts, rows, G)
        stack.put(prefix, "offset", w.offset, experts, rows, G)
        if w.global_scale is not None:
            _put_scale_2(stack, prefix, w.global_scale, experts)
        used += w.keys
    if group is None:  # every projection per channel
        group = max(H, I, 1)
    for st, cols in ((stacks["gate_up"], H), (stacks["down"], I)):
        G = -(-cols // group)
        for key in ("scale", "offset"):  # per-channel projections beside grouped ones: their scale repeated
            if key in st.t and st.t[key].shape[-1] != G:
                st.t[key] = st.t[key].expand(-1, -1, G).contiguous()
    parts = []
    for st in (stacks["gate_up"], stacks["down"]):
        d = {"packed": st.t["packed"], "scale": st.t["scale"], "offset": st.t.get("offset")}
        if first.global_scale is not None:
            d["scale_2"] = torch.stack(st.scale_2)
        parts.append(d)
    try:
        layer = W4Experts.from_quantized(*parts, format=first.format, group_size=group, hidden_size=H,
                                         intermediate_size=I, dtype=dtype or torch.bfloat16)
    except (ValueError, RuntimeError) as e:
        raise CheckpointError(f"{name}: the checkpoint's 4-bit experts do not make a W4Experts: {e}") from None
    layer = layer.to(device) if device is not None else layer
    groups = "channel" if group >= max(H, I) else f"group {group}"
    extra = {"int4": ", zero points", "uint4": ", biases"}.get(first.format, "") if first.offset is not None else ""
    return layer, used, f"W4Experts(E={E}, {first.format}, {groups}{extra})", True


def _put_scale_2(stack: _W4Stack, prefix: str, g: torch.Tensor, experts: slice):
    """nvfp4's global multiplier per expert: gate and up must share one (W4Experts holds one per expert and
    projection; llmcompressor fuses gate and up's global scales for this reason)."""
    g = g.to(torch.float32).reshape(-1)
    for i, e in enumerate(range(experts.start, experts.stop)):
        v = g[i if g.numel() > 1 else 0].reshape(())
        have = stack.scale_2[e]
        if have is not None and not torch.equal(have, v):
            raise CheckpointError(f"{prefix}'s global scale {float(v)!r} differs from the gate projection's "
                                  f"{float(have)!r} of the same expert: a W4Experts layer holds one global scale per "
                                  f"expert for gate and up (fused), so these experts cannot be stacked")
        stack.scale_2[e] = v
