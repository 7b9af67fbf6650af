"""The open set of checkpoint formats.

Each format is one module under ``torch_lowbit/formats/`` defining a :class:`CheckpointFormat` subclass: what it
is (the ``quant_method`` values it claims, or how it is recognized without a config), how to parse its config into
a :class:`QuantFormat` (scale name, block size, ignore list, extra per-module tensors), how its tensors map to a
weight and a scale, and how to write a small example checkpoint (:class:`Example`, used by the tests). One line in
``formats/__init__.py`` registers it; detection and loading only ever ask the registry.
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..granularity import Granularity, normalize_block_size
from .source import CheckpointError, Source

QUANTIZED_DTYPES = {torch.float8_e4m3fn: "fp8", torch.int8: "int8"}
UNSUPPORTED_WEIGHT_DTYPES = tuple(d for d in (torch.float8_e5m2, getattr(torch, "float8_e4m3fnuz", None),
                                              getattr(torch, "float8_e5m2fnuz", None)) if d is not None)


@dataclass
class QuantFormat:
    """How to read one checkpoint's quantized linear layers (what a format's parser made of its config).

    name: the format's name. scale_key: suffix of a weight's scale tensor (``{module}.{scale_key}``).
    block_size: (bn, bk) of the block scales this checkpoint may hold, or None. ignore: module-name patterns kept
    in high precision. scale_required: False only where a raw fp8 weight means scale 1 (diffusion files).
    extra_keys: per-module suffixes that belong to a quantized layer besides weight / scale / bias (static input
    scales, zero points, ...): consumed, not reported as unused. details: what the config said, for the report.
    notes: what the report should tell the caller about this checkpoint. activations: the activation quantization
    each config group was written for, ``((targets, scheme), ...)`` in the config's order (see
    :meth:`activation_scheme`). weights: the same for what a format records per group about its weights (the
    4-bit layouts: see :meth:`weight_args`).
    """
    name: str
    scale_key: str = "weight_scale"
    block_size: Optional[Tuple[int, int]] = None
    ignore: List[str] = field(default_factory=list)
    scale_required: bool = True
    extra_keys: Tuple[str, ...] = ()
    details: Dict[str, Any] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)
    activations: Tuple[Tuple[Tuple[str, ...], Optional[str]], ...] = ()
    weights: Tuple[Tuple[Tuple[str, ...], Any], ...] = ()
    format: Optional["CheckpointFormat"] = field(default=None, repr=False, compare=False)

    def __str__(self):
        return self.name

    def is_ignored(self, module_name: str) -> bool:
        return any(matches(module_name, p) for p in self.ignore)

    def activation_scheme(self, module_name: str) -> Optional[str]:
        """The activation quantization the checkpoint wrote module `module_name` for: None (weights only), one of
        :data:`ACTIVATION_SCHEMES` (``"fp8-dynamic-token"``, ...) or a description of a scheme torch_lowbit does not
        run. The first group whose targets name the module decides: a class-name target (``"Linear"``) names
        every linear layer, other targets are module names or ``re:`` regexes (compressed-tensors)."""
        return _first_group(self.activations, module_name)

    def weight_args(self, module_name: str):
        """What the first config group naming `module_name` says of its weights (None: no such group)."""
        return _first_group(self.weights, module_name)

    @property
    def scale_is_inverse(self) -> bool:
        return self.format is not None and self.format.scale_is_inverse

    @property
    def original_shape_key(self) -> Optional[str]:
        return None if self.format is None else self.format.original_shape_key

    def weight_kind(self, key: str, dtype: torch.dtype) -> Optional[str]:
        """"fp8" / "int8" for a quantized weight this format can hold, None for a high-precision one; errors for
        the rest (e5m2, int8 in an FP8-only format)."""
        if dtype in UNSUPPORTED_WEIGHT_DTYPES:
            raise CheckpointError(f"{key} is {dtype}: torch_lowbit reads float8_e4m3fn weights only")
        kind = QUANTIZED_DTYPES.get(dtype)
        kinds = self.format.weight_kinds if self.format is not None else ("fp8",)
        if kind is not None and kind not in kinds:
            raise CheckpointError(f"{key} is {kind}, but a {self.name} checkpoint holds "
                                  f"{' / '.join(k.upper() for k in kinds)} weights only")
        return kind


def _first_group(groups, module_name: str):
    for targets, value in groups:
        if any(t.endswith("Linear") and "." not in t or matches(module_name, t) for t in targets):
            return value
    return None


# the activation schemes checkpoints are written for, as QuantFormat.activations names them, and in words
ACTIVATION_SCHEMES = {"fp8-dynamic-token": "FP8 dynamic per-token", "fp8-static-tensor": "FP8 static per-tensor "
                      "(input_scale)", "int8-dynamic-token": "INT8 dynamic per-token",
                      "int8-static-tensor": "INT8 static per-tensor (input_scale)"}


# the checkpoint activation schemes torch_lowbit's FP8 layers record (and Fp8Linear runs), as their
# activation_scheme attribute names them
FP8_LAYER_SCHEMES = {"fp8-dynamic-token": "dynamic", "fp8-static-tensor": "static"}


def activation_scheme_name(typ: str, bits: int, strategy: str, dynamic, symmetric: bool = True) -> str:
    """A config's input-activation quantization as an :data:`ACTIVATION_SCHEMES` key, or in words where it is
    none of them."""
    key = f"{typ}{bits}-{'dynamic' if dynamic is True else 'static'}-{strategy}"
    if symmetric and key in ("float8-dynamic-token", "float8-static-tensor", "int8-dynamic-token",
                             "int8-static-tensor"):
        return key.replace("float8", "fp8")
    return (f"{'asymmetric ' if not symmetric else ''}{bits}-bit {typ} {strategy} "
            f"{'dynamic' if dynamic is True else 'static' if dynamic is False else f'dynamic={dynamic!r}'}")


def matches(name: str, pattern: str) -> bool:
    """Does an ignore-list entry name this module?

    ``re:REGEX``: ``re.match`` (compressed-tensors); an entry with ``*?[``: fnmatch on the full name (ModelOpt);
    a plain entry: the name itself, or any dotted run of its components -- ``lm_head``, ``mlp.gate`` and
    ``model.layers.0`` match ``model.layers.0.mlp.gate`` and what lies under ``model.layers.0``, while ``gate``
    does not match ``gate_proj`` and ``layers.1`` does not match ``layers.10``.
    """
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    p = pattern.strip(".")
    return p != "" and f".{p}." in f".{name}."


# ------------------------------------------------------------------------------- reading config fields
def config_field(cfg: dict, key: str, types, where: str, default=None):
    """``cfg[key]`` if it has one of ``types`` (None / missing gives ``default``), else a CheckpointError naming the
    file and the field."""
    v = cfg.get(key, default)
    if v is None:
        return default
    if not isinstance(v, types) or (isinstance(v, bool) and bool not in _as_tuple(types)):
        names = " or ".join(t.__name__ for t in _as_tuple(types))
        raise CheckpointError(f"{where}.{key} must be {_article(names)}{names}, got {type(v).__name__} {v!r}")
    return v


def _as_tuple(types):
    return types if isinstance(types, tuple) else (types,)


def _article(names: str) -> str:
    return "an " if names[0] in "aeiou" else "a "


def name_list(cfg: dict, key: str, where: str) -> List[str]:
    """A list of module-name patterns (a single string counts as one)."""
    v = config_field(cfg, key, (list, tuple, str), where, [])
    items = [v] if isinstance(v, str) else list(v)
    bad = [x for x in items if not isinstance(x, str)]
    if bad:
        raise CheckpointError(f"{where}.{key} must be a list of module names, but it holds "
                              f"{type(bad[0]).__name__} {bad[0]!r}")
    for pattern in items:
        problem = pattern_problem(pattern)
        if problem:
            raise CheckpointError(f"{where}.{key} holds {pattern!r}: {problem}")
    return items


def pattern_problem(pattern: str) -> Optional[str]:
    """Why an ignore-list entry cannot be used (a ``re:`` entry that is no regular expression), else None."""
    if pattern.startswith("re:"):
        try:
            re.compile(pattern[3:])
        except (re.error, RecursionError, OverflowError) as e:
            return f"not a valid regular expression ({e})"
    return None


def block_field(cfg: dict, key: str, where: str, default=None) -> Optional[Tuple[int, int]]:
    v = cfg.get(key, default)
    if v is None:
        return None
    try:
        if not isinstance(v, (list, tuple)) or any(isinstance(b, bool) or not isinstance(b, int) for b in v):
            raise ValueError
        return normalize_block_size(v)
    except ValueError:
        raise CheckpointError(f"{where}.{key} must be two positive integers [bn, bk] of at most 2**63 - 1 "
                              f"(the ops' int64), got {v!r}") from None


# ------------------------------------------------------------------------------- examples
@dataclass(frozen=True)
class Example:
    """One small example checkpoint of a format, as the tests write it.

    granularity: the layout of its weight scales (None: raw fp8 without scales). scale_layout: how the scale is
    stored: ``"0d"`` (a 0-d tensor), ``"1"`` (``[1]``), ``"N"``, ``"N1"`` (``[N, 1]``) or ``"blocks"``. kind:
    ``"fp8"`` or ``"int8"`` weights. extra: per-module scalar tensors that come with each quantized weight.
    marker: a file-level tensor the format writes (ComfyUI's ``scaled_fp8``). options: format-specific choices
    that the format's own example methods read.
    """
    granularity: Optional[Granularity]
    scale_layout: str = "1"
    scale_dtype: torch.dtype = torch.float32
    kind: str = "fp8"
    extra: Tuple[str, ...] = ()
    marker: Optional[str] = None
    options: Tuple[Tuple[str, Any], ...] = ()

    def option(self, key: str, default=None):
        return dict(self.options).get(key, default)


def stored_scale(example: Example, scale: torch.Tensor, N: int) -> torch.Tensor:
    """A canonical fp32 scale (``granularity.scale_shape``) in the shape and dtype the example stores it."""
    shapes = {"0d": (), "1": (1,), "N": (N,), "N1": (N, 1), "blocks": tuple(scale.shape)}
    return scale.reshape(shapes[example.scale_layout]).to(example.scale_dtype)


class CheckpointFormat:
    """One checkpoint format. Subclass it in one module under formats/ and register an instance.

    name: what detect_format and the report call it. quant_methods: the ``quantization_config.quant_method`` values
    it claims (lower case). side_config: a JSON file beside config.json that identifies the format by itself
    (ModelOpt's hf_quant_config.json). scale_key: default suffix of a weight's scale. scale_is_inverse: the stored
    scale divides the weight instead of multiplying it (none of the built-in formats: HF's ``weight_scale_inv``
    is a multiplier despite its name). original_shape_key: a per-module tensor holding the unpadded weight shape
    of a weight stored padded to whole blocks. weight_kinds: the quantized weight dtypes it may hold.
    upcasts_unscaled: fp8 tensors outside the converted layers mean ``float(w) * scale`` and are upcast (diffusion
    files keep whole models in fp8); elsewhere such a tensor is an error.
    """
    name: str = ""
    quant_methods: Tuple[str, ...] = ()
    side_config: Optional[str] = None
    scale_key: str = "weight_scale"
    scale_is_inverse: bool = False
    original_shape_key: Optional[str] = None
    weight_kinds: Tuple[str, ...] = ("fp8",)
    upcasts_unscaled: bool = False

    # ---- detection and parsing
    def parse(self, quantization_config: Optional[dict], side_config: Optional[dict], where: str) -> QuantFormat:
        """The QuantFormat of a checkpoint whose config claims this format. ``where`` names the config (file and
        field) for error messages."""
        raise NotImplementedError

    def is_side_config(self, cfg: dict) -> bool:
        """Is a dict passed as ``config=`` this format's side config (rather than a config.json)?"""
        return False

    def from_tensors(self, src: Source) -> Optional[QuantFormat]:
        """Without any config: the QuantFormat if the tensor names / dtypes show this format, else None."""
        return None

    def claims_config(self, quantization_config: dict) -> bool:
        """Is a quantization_config without ``quant_method`` this format's (MLX writes none)?"""
        return False

    # ---- 4-bit weights and packed tensors outside the converted layers
    def w4_weight(self, src: Source, fmt: QuantFormat, prefix: str, shape: Tuple[int, int]):
        """The :class:`~torch_lowbit.formats.tensors.W4Weight` of module `prefix` (an nn.Linear of ``shape`` [N, K])
        if the checkpoint holds it as a 4-bit weight of this format, else None."""
        return None

    def dense_tensor(self, src: Source, fmt: QuantFormat, key: str, shape: Tuple[int, ...]):
        """(tensor, keys read) for a model tensor `key` the checkpoint stores packed outside any layer torch_lowbit
        converts (MLX's quantized embeddings), dequantized once; None where it is stored as it is."""
        return None

    def experts(self, src: Source, fmt: QuantFormat, name: str, module, device, dtype):
        """For a fused experts module the format stores its own way (gpt-oss's MXFP4 blocks): (layer, keys used,
        description, True); None to leave it to the per-expert rule (``formats/moe.py``)."""
        return None

    def make(self, **kw) -> QuantFormat:
        kw.setdefault("scale_key", self.scale_key)
        return QuantFormat(self.name, format=self, **kw)

    # ---- examples
    def examples(self) -> Dict[str, Example]:
        """Named example variants (unique names across formats)."""
        return {}

    def example_config(self, example: Example, keep: Sequence[str]) -> Tuple[Optional[dict], Optional[dict]]:
        """(config.json's quantization_config or None, side config or None) of an example checkpoint whose
        ignore list names the modules in ``keep`` (dotted names or runs of components)."""
        return None, None

    def example_tensors(self, prefix: str, codes: torch.Tensor, scale: Optional[torch.Tensor],
                        example: Example) -> Dict[str, torch.Tensor]:
        """The checkpoint tensors of one quantized ``[N, K]`` weight: ``codes`` (float8_e4m3fn or int8) and its
        canonical fp32 multiplier ``scale`` (None for raw fp8)."""
        out = {f"{prefix}.weight": codes}
        if scale is not None:
            s = stored_scale(example, scale, codes.shape[0])
            out[f"{prefix}.{self.scale_key}"] = s.reciprocal() if self.scale_is_inverse else s
        for k in example.extra:
            out[f"{prefix}.{k}"] = torch.tensor(0.5)
        return out


_REGISTRY: List[CheckpointFormat] = []


def register_format(fmt: CheckpointFormat) -> CheckpointFormat:
    """Add a format. Detection without a config asks formats in registration order (the catch-all last)."""
    if not isinstance(fmt, CheckpointFormat) or not fmt.name:
        raise TypeError(f"register_format: expected a CheckpointFormat instance with a name, got {fmt!r}")
    for other in _REGISTRY:
        clash = set(fmt.quant_methods) & set(other.quant_methods)
        if other.name == fmt.name or clash:
            raise ValueError(f"format {fmt.name!r} clashes with the registered {other.name!r} "
                             f"({'quant_method ' + sorted(clash)[0] if clash else 'same name'})")
    names = set(fmt.examples())
    taken = names & {n for o in _REGISTRY for n in o.examples()}
    if taken:
        raise ValueError(f"format {fmt.name!r}: example name {sorted(taken)[0]!r} is taken")
    _REGISTRY.append(fmt)
    return fmt


def registered_formats() -> Tuple[CheckpointFormat, ...]:
    return tuple(_REGISTRY)


def format_for_method(method: str) -> Optional[CheckpointFormat]:
    method = method.lower()
    return next((f for f in _REGISTRY if method in f.quant_methods), None)


def all_examples() -> Dict[str, Tuple[CheckpointFormat, Example]]:
    return {n: (f, ex) for f in _REGISTRY for n, ex in f.examples().items()}
