"""The low-bit matmuls under ``torch.autocast``, as ``F.linear`` is: inside ``torch.autocast("cpu" | "mps",
dtype=...)`` the floating activations and bias are cast to autocast's dtype and the product comes out in it; the
low-bit weights and their scales are never cast. Without this an fp32 model trained with autocast (Trainer's
``bf16=True``, a diffusers pipeline under ``torch.autocast``) ran its low-bit layers in fp32 and handed fp32 to a
model whose every other matmul gives the autocast dtype.

The matmul ops get a kernel on each autocast dispatch key torch has (``AutocastCPU``, ``AutocastMPS``), for both
namespaces (``lowbit`` and the emulator's ``lowbit_emu``): the kernel runs only while autocast is on for that device
(outside it the dispatcher skips the key, so the ops cost nothing more), casts, and calls the op again below
autocast, where autograd records the cast and the product. ``int8_linear`` (W8A8, a Python function over two ops)
casts at its entry with :func:`autocast_dtype`.
"""
from __future__ import annotations

from typing import Optional

import torch

from ._ops import _NAMESPACES
# the ops that are to autocast what F.linear is (lower-precision ops), and the arguments it casts
_MATMULS = ("fp8_mm", "fp8_grouped_mm", "w4_mm", "w4_grouped_mm")
_CAST = ("x", "bias")
# dispatch key -> the device type whose autocast state it follows
_KEYS = {"AutocastCPU": "cpu", "AutocastMPS": "mps"}
_libraries = []  # the registrations live as long as these objects


def autocast_dtype(t: torch.Tensor) -> Optional[torch.dtype]:
    """The dtype autocast casts ``t``'s floating activations to, or None where autocast is off for ``t``'s device."""
    device = t.device.type
    if device not in _KEYS.values() or not torch.is_autocast_enabled(device):
        return None
    return torch.get_autocast_dtype(device)


def cast(t, dtype: torch.dtype):
    """``t`` in autocast's ``dtype`` if it is a floating tensor autocast casts (not float64, as ATen's autocast)."""
    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype not in (dtype, torch.float64):
        return t.to(dtype)
    return t


def _kernel(op, device: str, key: str):
    names = [a.name for a in op._schema.arguments]
    below = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

    def autocast_kernel(*args, **kwargs):
        dtype = torch.get_autocast_dtype(device)
        args = [cast(a, dtype) if names[i] in _CAST else a for i, a in enumerate(args)]
        kwargs = {k: cast(v, dtype) if k in _CAST else v for k, v in kwargs.items()}
        with torch._C._ExcludeDispatchKeyGuard(below):
            return op(*args, **kwargs)

    return autocast_kernel


def register_autocast() -> None:
    """Idempotent (a reloaded torch_lowbit finds its kernels registered)."""
    if _libraries:
        return
    for ns in _NAMESPACES:
        if not hasattr(torch.ops, ns) or not hasattr(getattr(torch.ops, ns), _MATMULS[0]):
            continue  # the emulator is not built into this install
        lib = torch.library.Library(ns, "IMPL")
        for key, device in _KEYS.items():
            if not hasattr(torch._C.DispatchKey, key):
                continue  # an older torch without this device's autocast
            for name in _MATMULS:
                op = getattr(getattr(torch.ops, ns), name).default
                lib.impl(name, _kernel(op, device, key), key)
        _libraries.append(lib)
