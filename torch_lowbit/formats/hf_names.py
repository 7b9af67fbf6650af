"""transformers models: checkpoint names -> the model's names, by transformers' own conversion mapping.

transformers 5 renames checkpoint keys when it loads (``get_model_conversion_mapping``): plain renamings
(Mixtral's ``block_sparse_moe`` -> ``mlp``, legacy ``LayerNorm.gamma`` -> ``weight``) and converters that stack
per-expert tensors into fused experts (``experts.*.w1/w3.weight`` -> ``experts.gate_up_proj``). torch_lowbit applies
the renamings as they are; of a stacking converter it takes only what each per-expert tensor *is* (w1 = gate,
w3 = up, w2 = down), since the loader stacks quantized experts with their scales itself
(``formats/moe.py``). Any other conversion (transposes, rope permutations, ...) on a tensor of the checkpoint is
an error: applied to fp8 codes it would need their scales too.
"""
from __future__ import annotations

import re
import sys
from typing import Callable, Dict, List, Optional, Tuple

from torch import nn

from .source import CheckpointError, Source

# fused-experts parameter -> the per-expert projections stacked into it, in order
_FUSED = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def _transformers_model(model: nn.Module):
    """The transformers module, if `model` is a transformers PreTrainedModel (transformers already imported)."""
    tf = sys.modules.get("transformers")
    if tf is None or not isinstance(model, getattr(tf, "PreTrainedModel", ())):
        return None
    return tf


def _in_scope(transform, key: str) -> bool:
    """Does a transform scoped to a sub-model (transformers sets ``scope_prefix`` on those) apply to `key`?"""
    scope = getattr(transform, "scope_prefix", None)
    if not scope:
        return True
    base = getattr(transform, "base_model_prefix", None) or ""
    return key.startswith(f"{scope}.") or bool(base) and key.startswith(f"{base}.{scope}.")


def _expert_leaves(converter) -> Optional[List[Tuple[str, str, str]]]:
    """(head, checkpoint leaf, model projection) per source of a converter that only stacks per-expert weights into
    fused experts -- Mixtral: (".experts.", ".w1", "gate_proj"), ... -- or None for any other converter."""
    ops = {type(op).__name__ for op in getattr(converter, "operations", [])}
    targets = list(converter.target_patterns)
    if not ops <= {"MergeModulelist", "Concatenate"} or len(targets) != 1:
        return None
    parts = _FUSED.get(targets[0].rsplit(".", 1)[-1])
    sources = list(converter.source_patterns)
    if parts is None or len(sources) != len(parts):
        return None
    out = []
    for src, part in zip(sources, parts):
        if not src.endswith(".weight") or src.count("*") != 1:
            return None
        head, leaf = src[:-len(".weight")].split("*")  # ".experts." and ".w1"
        out.append((head, leaf, part))
    return out


def _expert_rules(leaves, to_model: bool) -> List[Tuple[re.Pattern, Callable]]:
    """(regex, replacement) renaming one expert's module path (any tensor under it), checkpoint -> model or back."""
    rules = []
    for head, leaf, part in leaves:
        src, dst = (leaf, f".{part}") if to_model else (f".{part}", leaf)
        regex = re.compile(re.escape(head) + r"(\d+)" + re.escape(src) + r"\.")
        rules.append((regex, lambda m, head=head, dst=dst: f"{head}{m.group(1)}{dst}."))
    return rules


def _first_sub(rules, key: str) -> str:
    for regex, repl in rules:
        new = regex.sub(repl, key, count=1)
        if new != key:
            return new
    return key


def transformers_key_renaming(model: nn.Module) -> Optional[Callable[[str], str]]:
    """checkpoint key -> model key for a transformers model (None when `model` is not one, or transformers has no
    conversion mapping: before version 5)."""
    tf = _transformers_model(model)
    if tf is None:
        return None
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:
        return None
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    experts, others = [], []
    for c in (t for t in transforms if isinstance(t, WeightConverter)):
        leaves = _expert_leaves(c)
        if leaves is None:
            others.append(c)
        else:
            experts.append((c, _expert_rules(leaves, to_model=True)))
    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)

    def rename(key: str) -> str:
        for r in renamings:  # rename_source_key minds the transform's scope itself
            key = r.rename_source_key(key)[0]
        for c, rules in experts:
            if _in_scope(c, key):
                new = _first_sub(rules, key)
                if new != key:
                    return new
        for c in others:
            if c.rename_source_key(key)[1] is not None:
                ops = ", ".join(type(op).__name__ for op in c.operations)
                raise CheckpointError(f"transformers converts {key} ({ops}) when it loads a {model_type} model: "
                                      f"torch_lowbit cannot apply that conversion to a quantized checkpoint")
        return key
    return rename


class RenamedSource(Source):
    """A Source whose keys are renamed (model names); ``original(key)`` gives the checkpoint's name back."""

    def __init__(self, inner: Source, rename: Callable[[str], str]):
        self._inner = inner
        self._old: Dict[str, str] = {}
        for k in inner.keys():
            new = rename(k)
            if new in self._old:
                raise CheckpointError(f"checkpoint keys {self._old[new]!r} and {k!r} both map to {new!r} in the model")
            self._old[new] = k
        self.description = inner.description
        self.renamed = {old: new for new, old in self._old.items() if old != new}

    def original(self, key: str) -> str:
        return self._old.get(key, key)

    def keys(self):
        return list(self._old)

    def __contains__(self, key):
        return key in self._old

    def dtype(self, key):
        return self._inner.dtype(self._old[key])

    def shape(self, key):
        return self._inner.shape(self._old[key])

    def get(self, key):
        return self._inner.get(self._old[key])

    def read_config(self, name):
        return self._inner.read_config(name)

    def config_path(self, name):
        return self._inner.config_path(name)

    def close(self):
        self._inner.close()


def checkpoint_key_renaming(model: nn.Module) -> Optional[Callable[[str], str]]:
    """model key -> checkpoint key for the tensors of quantized layers of a transformers model: the inverse of
    the load-time renaming, as transformers' ``save_pretrained`` inverts it (the model's own conversions if
    ``from_pretrained`` attached them, else the architecture's mapping without the legacy renamings). Per-expert
    projections get the names the architecture's checkpoints use (Mixtral: ``gate_proj`` -> ``w1``). None when
    `model` is not a transformers model."""
    if _transformers_model(model) is None:
        return None
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming
    except ImportError:
        return None
    transforms = getattr(model, "_weight_conversions", None)
    if transforms is None:
        transforms = [t for t in get_model_conversion_mapping(model, add_legacy=False)
                      if not isinstance(t, PrefixChange)]
    renamings = [t.reverse_transform() for t in transforms[::-1] if isinstance(t, WeightRenaming)]
    experts = [rule for c in transforms if isinstance(c, WeightConverter)
               for rule in _expert_rules(_expert_leaves(c) or [], to_model=False)]

    def rename(key: str) -> str:
        key = _first_sub(experts, key)
        for r in renamings:
            key = r.rename_source_key(key)[0]
        return key
    return rename
