"""load_quantized: put a quantized checkpoint into a model, swapping its nn.Linear layers (and MoE experts) for
torch_lowbit layers, without ever materializing a high-precision copy of a quantized weight."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Union

import torch
from torch import nn

from .._progress import Progress
from .detect import detect
from .hf_names import RenamedSource, transformers_key_renaming
from .meta_buffers import move_non_persistent_buffers, recompute_meta_buffers, still_on_meta
from .moe import experts_activation_scheme, is_experts_module, load_experts
from .registry import ACTIVATION_SCHEMES, FP8_LAYER_SCHEMES, QUANTIZED_DTYPES, QuantFormat
from .source import CheckpointError, Source, open_source
from .tensors import read_quantized


@dataclass
class LoadReport:
    """What load_quantized did.

    format: the detected format (modelopt, compressed-tensors, fp8, fbgemm_fp8, mlx, diffusion-fp8).
    converted: module name -> what it became (e.g. ``"Fp8Linear(block 128x128)"``, ``"Int8Linear(channel)"``,
    ``"W4Linear(int4, group 128, zero points)"``).
    high_precision: name of each nn.Linear / experts module loaded unquantized -> why (in the ignore list, or
    stored unquantized in the checkpoint).
    unused_keys: checkpoint tensors that went nowhere. missing_keys: model tensors the checkpoint did not provide
    (left as they were). ignored_keys: checkpoint tensors the model's class says it does not load (transformers'
    ``_keys_to_ignore_on_load_unexpected``: DeepSeek-V3's and GLM-4.5's multi-token-prediction layer, Qwen3-Next's
    ``mtp.*``), never read, as transformers skips them. details: what the checkpoint's config said (block size,
    quant_algo, ...).
    renamed_keys: checkpoint key -> model key, for the keys transformers' conversion mapping renames.
    recomputed_buffers: non-persistent buffers (in no checkpoint) that were on meta and were recomputed.
    activations: module name -> the activation quantization the checkpoint wrote it for (``"fp8-dynamic-token"``,
    ``"fp8-static-tensor"``, ... or a description), for each converted module written for one.
    notes: anything the caller should know (e.g. the activation scheme not run, static input scales not used).
    """
    format: str
    converted: Dict[str, str] = field(default_factory=dict)
    high_precision: Dict[str, str] = field(default_factory=dict)
    unused_keys: List[str] = field(default_factory=list)
    missing_keys: List[str] = field(default_factory=list)
    details: Dict[str, Any] = field(default_factory=dict)
    renamed_keys: Dict[str, str] = field(default_factory=dict)
    recomputed_buffers: List[str] = field(default_factory=list)
    activations: Dict[str, str] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)
    ignored_keys: List[str] = field(default_factory=list)

    def __str__(self):
        lines = [f"format: {self.format} {self.details}",
                 f"converted: {len(self.converted)} modules", f"high precision: {len(self.high_precision)} modules"]
        for title, keys in (("unused keys", self.unused_keys), ("missing keys", self.missing_keys)):
            shown = ", ".join(keys[:8]) + (f", ... ({len(keys)} in all)" if len(keys) > 8 else "")
            lines.append(f"{title}: {shown or 'none'}")
        if self.ignored_keys:
            lines.append(f"ignored keys: {len(self.ignored_keys)} (the model class does not load them)")
        if self.renamed_keys:
            lines.append(f"renamed keys: {len(self.renamed_keys)} (transformers' conversion mapping)")
        if self.recomputed_buffers:
            lines.append(f"recomputed buffers: {', '.join(self.recomputed_buffers)}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _target_device(device, old: Optional[torch.Tensor]):
    if device is not None:
        return torch.device(device)
    if old is not None and old.device.type != "meta":
        return old.device
    return torch.device("cpu")


def _inside(name: str, done) -> bool:
    """Is `name` (a module or tensor name) one of the modules in `done` or under one of them?"""
    parts = name.split(".")
    return any(".".join(parts[:i]) in done for i in range(1, len(parts) + 1))


def _is_plain_linear(m: nn.Module) -> bool:
    return type(m) is nn.Linear or (isinstance(m, nn.Linear) and not hasattr(m, "weight_scale"))


ACTIVATIONS_OPTIONS = ("weights-only", "checkpoint")


def _fp8_layer_scheme(name, q, scheme):
    """Fp8Linear's activation_scheme for a layer the checkpoint wrote for `scheme` (None where it runs none)."""
    layer_scheme = FP8_LAYER_SCHEMES.get(scheme)
    if layer_scheme == "static":
        s = q.input_scale
        if s is None:
            raise CheckpointError(f"{name}.input_scale is missing: the checkpoint's config says {name} takes static "
                                  f"per-tensor FP8 activations, whose scale that tensor holds")
        if s.numel() != 1 or not bool(torch.isfinite(s).all() and (s > 0).all()):
            raise CheckpointError(f"{name}.input_scale must be one positive finite number (a static per-tensor "
                                  f"activation scale), got shape {list(s.shape)} values {s.reshape(-1)[:4].tolist()}")
    return layer_scheme


def _read_bias(src, name, linear, dev, dtype, used, report):
    if linear.bias is None:
        return None
    bkey = f"{name}.bias"
    if bkey not in src:
        report.missing_keys.append(bkey)
        return None
    b = src.get(bkey)
    if tuple(b.shape) != (linear.out_features,):
        raise CheckpointError(f"{bkey} has shape {list(b.shape)}, expected [{linear.out_features}]")
    used.add(bkey)
    return b.to(device=dev, dtype=dtype or (linear.bias.dtype if linear.bias.is_floating_point() else torch.bfloat16))


def _swap_w4_linear(model, name, linear, w, src, device, dtype, used, report, fmt, module_hook=None):
    """A 4-bit weight (:class:`~torch_lowbit.formats.tensors.W4Weight`) as a W4Linear, its tensors as stored."""
    from ..nn.w4_linear import W4Linear

    scheme = fmt.activation_scheme(name)
    if scheme is not None:  # W4Linear computes W4A16 whatever the checkpoint was written for: the report says so
        report.activations[name] = scheme

    dev = _target_device(device, linear.weight)
    bias = _read_bias(src, name, linear, dev, dtype, used, report)
    move = (lambda t: None if t is None else t.to(dev))
    try:
        layer = W4Linear.from_quantized(move(w.packed), move(w.scale), format=w.format, group_size=w.group_size,
                                        in_features=w.in_features, bias=bias, weight_offset=move(w.offset),
                                        weight_scale_2=move(w.global_scale))
    except (ValueError, RuntimeError) as e:
        raise CheckpointError(f"{name}: the checkpoint's 4-bit weight does not make a W4Linear: {e}") from None
    model.set_submodule(name, _hooked(module_hook, name, layer))
    report.converted[name] = w.describe()
    used.update(w.keys)


def _swap_linear(model, name, linear, q, src, device, dtype, used, report, fmt, activations, module_hook=None):
    from ..nn import Fp8Linear, Int8Linear
    from .._storage import to_fp8_storage

    dev = _target_device(device, linear.weight)
    bias = _read_bias(src, name, linear, dev, dtype, used, report)
    scheme = fmt.activation_scheme(name)
    if scheme is not None:
        report.activations[name] = scheme
    if q.kind == "fp8":
        layer_scheme = _fp8_layer_scheme(name, q, scheme)
        layer = Fp8Linear.from_quantized(to_fp8_storage(q.weight, dev), q.scale.to(dev), bias,
                                         block_size=q.block_size,
                                         input_scale=None if q.input_scale is None else q.input_scale.to(dev),
                                         activation_scheme=layer_scheme,
                                         quantize_activations=activations == "checkpoint" and layer_scheme is not None)
        report.converted[name] = f"Fp8Linear({q.granularity.describe()})"
    else:
        layer = Int8Linear.from_quantized(q.weight.to(dev), q.scale.to(dev), bias)
        report.converted[name] = "Int8Linear(channel)"
    model.set_submodule(name, _hooked(module_hook, name, layer))
    used.update(q.keys)


def _hooked(module_hook, name: str, layer: nn.Module) -> nn.Module:
    """The layer `module_hook` makes of a freshly built low-bit layer (tensor parallelism cuts it for one rank here,
    before the next one is read), or the layer itself."""
    return layer if module_hook is None else module_hook(name, layer)


def _searched(patterns) -> Callable[[str], bool]:
    """Whether a name holds a match of any of the regexes (re.search), as transformers matches a model's name
    patterns against tensor names; never, for none."""
    if not patterns:
        return lambda key: False
    pattern = re.compile("|".join(f"(?:{p})" for p in sorted(patterns)))
    return lambda key: pattern.search(key) is not None


def _fp32_tensors(model: nn.Module, dtype: Optional[torch.dtype]) -> Callable[[str], bool]:
    """Which tensors a load in `dtype` keeps in float32, as transformers' loader does (its dtype plan): a model's
    ``_keep_in_fp32_modules`` in a float16 load, its ``_keep_in_fp32_modules_strict`` in a float16 or bfloat16 one
    (T5's ``wo``, which float16 overflows; DeepSeek-V3's and GLM-4.5's router ``gate.weight`` and
    ``e_score_correction_bias``, whose bfloat16 rounding changes which experts a token takes); ``*`` in an entry is
    any run, as there."""
    entries = set()
    if dtype == torch.float16:
        entries |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    if dtype in (torch.float16, torch.bfloat16):
        entries |= set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    return _searched({e.replace("*", ".*") for e in entries})


def _load_rest(model, src: Source, fmt: QuantFormat, done, device, dtype, used, report):
    """Every parameter / persistent buffer outside the converted modules, like load_state_dict(strict=False);
    meta tensors are replaced, others copied in place (so tied weights stay tied). Floating-point tensors take
    `dtype`, except those the model keeps in float32 (_fp32_tensors)."""
    kept_fp32 = _fp32_tensors(model, dtype)
    groups: Dict[int, List[str]] = {}
    tensors = {}
    for key, t in model.state_dict(keep_vars=True).items():
        if t is None or _inside(key, done):
            continue
        groups.setdefault(id(t), []).append(key)
        tensors[id(t)] = t
    for tid, keys in groups.items():
        old = tensors[tid]
        found = [k for k in keys if k in src]
        if not found:
            report.missing_keys.extend(keys)
            continue
        key = found[0]
        dense = None if fmt.format is None else fmt.format.dense_tensor(src, fmt, key, tuple(old.shape))
        if dense is not None:  # stored packed (MLX's quantized embeddings): dequantized once, here
            value, keys_read = dense
            used.update(keys_read)
        elif tuple(src.shape(key)) != tuple(old.shape):
            raise CheckpointError(f"{key} has shape {list(src.shape(key))} but the model expects {list(old.shape)}")
        else:
            value = src.get(key)
        used.update(found)
        if value.dtype in (torch.float8_e4m3fn, torch.int8) and old.is_floating_point():
            value = _upcast_unscaled(key, value, src, fmt, used)
        tdtype = old.dtype
        if dtype is not None and old.is_floating_point():
            tdtype = torch.float32 if kept_fp32(key) else dtype
        tdev = _target_device(device, old)
        if old.device.type == "meta" or old.device != tdev or old.dtype != tdtype:
            new = value.to(device=tdev, dtype=tdtype)
            if isinstance(old, nn.Parameter):
                new = nn.Parameter(new, requires_grad=old.requires_grad)  # one object for all tied names
            for k in keys:
                _assign(model, k, new)
        else:
            with torch.no_grad():
                old.copy_(value)


def _upcast_unscaled(key, value, src, fmt: QuantFormat, used):
    """A quantized tensor in a module torch_lowbit does not convert: only formats whose fp8 means float(w) * scale
    (diffusion files) are upcast (exactly); anything else would silently lose its scale."""
    if fmt.format is None or not fmt.format.upcasts_unscaled or value.dtype != torch.float8_e4m3fn:
        raise CheckpointError(f"{key} is {value.dtype} but the model's tensor there is floating point and not part of "
                              f"an nn.Linear torch_lowbit converts")
    skey = key.rsplit(".", 1)[0] + "." + fmt.scale_key
    out = value.float()
    if key.endswith(".weight") and skey in src:
        out = out * src.get(skey).float()
        used.add(skey)
    return out


def _assign(model, key, new):
    mod_name, _, attr = key.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    if isinstance(new, nn.Parameter):
        mod._parameters[attr] = new
    else:
        mod._buffers[attr] = new


def load_quantized(model: nn.Module, path_or_state_dict, *, config: Optional[dict] = None, device=None,
                   dtype: Optional[torch.dtype] = None, strict: bool = False, mmap: bool = False,
                   rename_keys: Union[bool, Callable[[str], str]] = True,
                   activations: str = "weights-only",
                   module_hook: Optional[Callable[[str, nn.Module], nn.Module]] = None) -> LoadReport:
    """Load a quantized checkpoint into `model`, in place, and return a :class:`LoadReport`.

    path_or_state_dict: a checkpoint directory (config.json with quantization_config and/or hf_quant_config.json;
    one .safetensors file or shards with model.safetensors.index.json), a single .safetensors file, or a state
    dict (then pass ``config`` unless the format shows in the tensors). ``.bin`` / ``.pt`` files are refused:
    nothing is ever unpickled, and no file outside the checkpoint directory is opened, whatever the index says
    (a Hugging Face cache snapshot may link into its ``blobs`` folder). Tensors are read one at a time, so peak
    memory stays near the quantized size; build the model on the meta device (``with torch.device("meta"):
    model = ...``) to avoid allocating its dense weights at all.

    Each ``nn.Linear`` whose checkpoint weight is float8_e4m3fn (or int8 for compressed-tensors W8A8) and that
    the checkpoint's ignore list (``ignore`` / ``modules_to_not_convert`` / ``exclude_modules``: exact names,
    dotted component runs, fnmatch wildcards, ``re:`` regexes) does not name becomes an ``Fp8Linear`` /
    ``Int8Linear``; one whose checkpoint weight is 4-bit (compressed-tensors pack-quantized / nvfp4 / mxfp4,
    ModelOpt NVFP4, MLX) becomes a ``W4Linear`` holding the stored codes and scales (W4A16);
    MoE experts modules become ``Fp8Experts`` / ``Int8Experts`` / ``W4Experts`` (4-bit experts, per expert or MLX's
    stacked ``switch_mlp``; see ``torch_lowbit.formats.moe``).
    Everything else (embeddings, norms, lm_head, router gates, ...) loads like ``load_state_dict``; MLX's
    quantized embeddings are dequantized once, into the dense embedding. device: where the loaded
    tensors go (default: where each model tensor is, cpu for meta). dtype: dtype of the high-precision
    parameters and biases (default: each model tensor's own), except what a transformers model keeps in float32 in
    a load of that dtype, as transformers keeps it (``_keep_in_fp32_modules`` in float16, ``_strict`` also in
    bfloat16: T5's ``wo``, DeepSeek-V3's router gate). strict: raise if any key is unused or missing.
    Where stderr is a terminal, a line a second says how many tensors have been read.
    mmap: by default each tensor is copied out of the file as it is read, so the model owns its memory and does
    not depend on the file afterwards; ``mmap=True`` keeps CPU tensors memory-mapped (no copy, pages shared with
    the page cache), and then the file must stay unchanged while the model lives: truncating it kills the
    process (SIGBUS), rewriting it changes the weights.

    Always errors, whatever `strict`: a quantized tensor of the checkpoint that no module took (the model has no
    such module, or names it differently), and a model tensor still on the meta device after loading (it could not
    run). Non-persistent buffers of a meta-built transformers model (rotary ``inv_freq``) are recomputed by the
    model's own initializer; other models: build them under ``torch_lowbit.parameters_on_meta()``, which keeps
    buffers real. rename_keys: for a transformers model, map checkpoint keys to the model's names with
    transformers' own conversion mapping (Mixtral's ``block_sparse_moe.experts.{e}.w1`` ->
    ``mlp.experts`` gate rows, ...); False: keys as they are; a callable: your own ``key -> model key``.

    activations: ``"weights-only"`` (default): Fp8Linear layers compute W8A16, activations in their own dtype,
    which is closer to the unquantized model than the checkpoint's own W8A8 stack; the report says when the
    checkpoint was written for quantized activations. ``"checkpoint"``: Fp8Linear layers run the checkpoint's FP8
    activation scheme -- dynamic per-token or static per-tensor (``input_scale``) -- so that outputs match the
    writer's stack (compressed-tensors). Either way each layer -- Fp8Experts included -- records its scheme
    (``activation_scheme``, and static input scales), and ``save_quantized`` writes it back. Schemes torch_lowbit
    does not run (per-token-group, asymmetric, INT8 static) and MoE experts (Fp8Experts compute weights only) stay
    W8A16, and the report's notes say so.

    module_hook: ``hook(name, layer) -> layer``, called on each low-bit layer as soon as it is built from the
    checkpoint, before the next one is read; what it returns goes into the model (tensor parallelism cuts the layer
    for its rank there: ``torch_lowbit.distributed``). A hook with a ``cut_expert(name, projection, weight)`` method
    also gets each per-expert FP8 / INT8 projection of a checkpoint as it is read (see ``formats.moe.load_experts``).
    """
    if activations not in ACTIVATIONS_OPTIONS:
        raise ValueError(f"load_quantized: activations must be one of {ACTIVATIONS_OPTIONS}, got {activations!r}")
    src = open_source(path_or_state_dict, mmap=mmap)
    progress = Progress("loading", len(src.keys()), "tensors")  # silent unless stderr is a terminal
    src.count_reads(progress)
    rename = transformers_key_renaming(model) if rename_keys is True else (rename_keys or None)
    try:
        if rename is not None:
            src = RenamedSource(src, rename)
        fmt = detect(src, config)
        report = LoadReport(format=fmt.name, details=dict(fmt.details))
        used = set()
        done = set()  # modules replaced or filled here: _load_rest leaves them alone

        for name, mod in list(model.named_modules()):
            if not name or not is_experts_module(mod) or _inside(name, done):
                continue
            res = ((fmt.format.experts(src, fmt, name, mod, device, dtype) if fmt.format is not None else None)
                   or load_experts(src, fmt, name, mod, device, dtype, getattr(module_hook, "cut_expert", None)))
            if res is None:
                continue
            layer, keys, desc, quantized = res
            used.update(keys)
            done.add(name)
            if quantized:
                model.set_submodule(name, _hooked(module_hook, name, layer))
                report.converted[name] = desc
                scheme = experts_activation_scheme(fmt, name, layer.num_experts)
                if scheme is not None:
                    report.activations[name] = scheme
            else:
                report.high_precision[name] = desc

        for name, mod in list(model.named_modules()):
            if not _is_plain_linear(mod) or _inside(name, done):
                continue
            w4 = None if fmt.format is None else fmt.format.w4_weight(src, fmt, name,
                                                                        (mod.out_features, mod.in_features))
            if w4 is not None:
                if fmt.is_ignored(name):
                    raise CheckpointError(f"{name} holds a 4-bit weight but is in the checkpoint's ignore list")
                _swap_w4_linear(model, name, mod, w4, src, device, dtype, used, report, fmt, module_hook)
                done.add(name)
                continue
            wkey = f"{name}.weight"
            if wkey not in src:
                continue
            kind = fmt.weight_kind(wkey, src.dtype(wkey))
            if kind is None:
                report.high_precision[name] = ("in the ignore list" if fmt.is_ignored(name)
                                               else f"stored as {src.dtype(wkey)}")
                continue
            if fmt.is_ignored(name):
                raise CheckpointError(f"{wkey} is {src.dtype(wkey)} but {name} is in the checkpoint's ignore list")
            q = read_quantized(src, fmt, name, kind, (mod.out_features, mod.in_features))
            _swap_linear(model, name, mod, q, src, device, dtype, used, report, fmt, activations, module_hook)
            done.add(name)

        _load_rest(model, src, fmt, done, device, dtype, used, report)
        original = src.original if isinstance(src, RenamedSource) else (lambda k: k)
        declared = _declared_unused(model)
        left = [k for k in src.keys() if k not in used]
        unused = sorted(k for k in left if not declared(k))
        report.ignored_keys = sorted(original(k) for k in left if declared(k))
        _refuse_unused_quantized(src, fmt, unused, original)
        report.unused_keys = [original(k) for k in unused]
        report.renamed_keys = dict(src.renamed) if isinstance(src, RenamedSource) else {}
        _finish_buffers(model, device, report)
        _add_notes(fmt, report, activations)
        if strict and (report.unused_keys or report.missing_keys):
            raise CheckpointError(f"strict load: {len(report.unused_keys)} unused keys "
                                  f"{report.unused_keys[:5]}, {len(report.missing_keys)} missing keys "
                                  f"{report.missing_keys[:5]}")
        if report.converted:
            from ..hf import attach_save_pretrained  # a transformers model's save_pretrained writes what loads right
            attach_save_pretrained(model)
        return report
    finally:
        progress.close()
        src.close()


def _declared_unused(model: nn.Module) -> Callable[[str], bool]:
    """The checkpoint keys the model's class says it does not load (transformers'
    ``_keys_to_ignore_on_load_unexpected``, regexes): layers the published checkpoints hold beside the model, such
    as DeepSeek-V3's multi-token-prediction layer 61, in FP8 like the rest."""
    return _searched(set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()))


def _refuse_unused_quantized(src: Source, fmt: QuantFormat, unused: List[str], original):
    """A quantized weight (or its scale) that went nowhere means a module of the checkpoint was not filled."""
    bad = [k for k in unused if (k.endswith(".weight") and (src.dtype(k) in QUANTIZED_DTYPES
                                                             or src.dtype(k) == torch.uint32))
           or k.endswith((f".{fmt.scale_key}", ".weight_packed"))]
    if not bad:
        return
    modules = sorted({k.rsplit(".", 1)[0] for k in bad})
    shown = ", ".join(original(m + ".weight").rsplit(".", 1)[0] for m in modules[:4])
    more = f" ({len(modules)} in all)" if len(modules) > 4 else ""
    raise CheckpointError(f"the checkpoint holds quantized weights for modules the model does not have, or does "
                          f"not have under these names: {shown}{more} (checkpoint names; in the model: "
                          f"{modules[0]!r} is missing or is not an nn.Linear / experts module). Build the model class "
                          f"the checkpoint was written for, or pass rename_keys= to map the names")


def _finish_buffers(model: nn.Module, device, report: LoadReport):
    real = next((t.device for t in list(model.parameters()) + list(model.buffers()) if not t.is_meta), None)
    target = torch.device(device) if device is not None else (real or torch.device("cpu"))
    report.recomputed_buffers = recompute_meta_buffers(model, target)
    if device is not None:
        move_non_persistent_buffers(model, target)
    meta = still_on_meta(model)
    if meta:
        shown = ", ".join(meta[:8]) + (f", ... ({len(meta)} in all)" if len(meta) > 8 else "")
        raise CheckpointError(f"after loading, these model tensors are still on the meta device (the checkpoint does "
                              f"not hold them and nothing could recompute them): {shown}. Build the model under "
                              f"torch_lowbit.parameters_on_meta() (buffers real, parameters on meta), or load a "
                              f"checkpoint that holds them")


def _add_notes(fmt: QuantFormat, report: LoadReport, activations: str):
    by_scheme: Dict[tuple, List[str]] = {}  # (scheme, kind of module) -> modules
    for name, scheme in report.activations.items():
        kind = report.converted[name].split("(")[0]
        by_scheme.setdefault((scheme, kind), []).append(name)
    for (scheme, kind), names in sorted(by_scheme.items()):
        words, n = ACTIVATION_SCHEMES.get(scheme, scheme), f"{len(names)} {kind} module{'s' * (len(names) > 1)}"
        if kind == "Fp8Linear" and scheme in FP8_LAYER_SCHEMES:
            if activations == "checkpoint":
                report.notes.append(f"running the checkpoint's {words} activations in {n} (activations='checkpoint')")
            else:
                report.notes.append(f"this checkpoint was written for {words} activations; running W8A16 (weights "
                                    f"only) in {n}, which is closer to the unquantized model; pass "
                                    f"activations='checkpoint' to run the checkpoint's scheme")
        elif kind == "Int8Linear":
            if scheme != "int8-dynamic-token":
                report.notes.append(f"the checkpoint's {words} activations are not supported: {n} quantize "
                                    f"activations per token at run time (dynamic INT8), static input scales unused")
        else:
            why = ("Fp8Experts quantizes no activations" if kind == "Fp8Experts"
                   else "torch_lowbit does not run this activation scheme")
            weights_only = "W4A16" if kind in ("W4Linear", "W4Experts") else "W8A16"
            report.notes.append(f"the checkpoint was written for {words} activations; {n} run {weights_only} "
                                f"(weights only) whatever activations= says: {why}")
    if any(v.startswith("Int8Linear") for v in report.converted.values()) and not any(
            k[1] == "Int8Linear" and k[0] != "int8-dynamic-token" for k in by_scheme):
        report.notes.append("Int8Linear quantizes activations per token at run time (dynamic INT8)")
    report.notes.extend(fmt.notes)
