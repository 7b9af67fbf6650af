"""Tensors left on the meta device after loading: the non-persistent buffers of a model built there (rotary
``inv_freq`` and the like are in no checkpoint) are recomputed the way the model computes them; whatever else is
still on meta makes loading fail, since the model could not run."""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch
from torch import nn

from .hf_names import _transformers_model


def named_non_persistent_buffers(model: nn.Module):
    for mod_name, mod in model.named_modules():
        for name in mod._non_persistent_buffers_set:
            buf = mod._buffers.get(name)
            if buf is not None:
                yield mod_name, mod, name, buf


def recompute_meta_buffers(model: nn.Module, device) -> List[str]:
    """Non-persistent buffers (in no checkpoint: rotary ``inv_freq``, ...) left on the meta device by building the
    model there, recomputed on `device` by a transformers model's own initializer (``_init_weights``, as
    transformers' from_pretrained does). Only modules without parameters of their own are re-initialized (the
    initializer would also reset loaded weights). Returns the names recomputed; buffers no initializer wrote stay on
    meta (a NaN fill tells written from unwritten; integer buffers are not attempted)."""
    tf = _transformers_model(model)
    by_module: Dict[str, Tuple[nn.Module, List[str]]] = {}
    for mod_name, mod, name, buf in named_non_persistent_buffers(model):
        if buf.is_meta and buf.is_floating_point():
            by_module.setdefault(mod_name, (mod, []))[1].append(name)
    done = []
    if tf is None:
        return done
    for mod_name, (mod, names) in by_module.items():
        if any(True for _ in mod.parameters(recurse=False)):
            continue
        for n in names:
            b = mod._buffers[n]
            mod._buffers[n] = torch.full(b.shape, float("nan"), dtype=b.dtype, device=device)
        with torch.no_grad():
            model._init_weights(mod)
        for n in names:
            b = mod._buffers[n]
            if b.numel() and bool(torch.isnan(b).all()):
                mod._buffers[n] = torch.empty(b.shape, dtype=b.dtype, device="meta")  # not written: still missing
            else:
                done.append(f"{mod_name}.{n}" if mod_name else n)
    return done


def move_non_persistent_buffers(model: nn.Module, device) -> None:
    """Non-persistent buffers built for real (e.g. under ``parameters_on_meta()``) go where the weights went."""
    for _, mod, name, buf in list(named_non_persistent_buffers(model)):
        if not buf.is_meta and buf.device != device:
            mod._buffers[name] = buf.to(device)


def still_on_meta(model: nn.Module) -> List[str]:
    names = [n for n, p in model.named_parameters(remove_duplicate=False) if p.is_meta]
    return names + [n for n, b in model.named_buffers(remove_duplicate=False) if b.is_meta]
