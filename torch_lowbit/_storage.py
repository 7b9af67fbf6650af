"""How fp8 weights are held on a device.

PyTorch before 2.15 cannot hold ``float8_e4m3fn`` tensors on mps. There the layers keep the same bytes as
``uint8`` (the ops take either), and convert at the edges: state_dicts, ``.to()`` and quantization.
"""
from __future__ import annotations

import functools

import torch

FP8 = torch.float8_e4m3fn


@functools.lru_cache(maxsize=None)
def _device_type_holds_fp8(device_type: str) -> bool:
    if device_type in ("cpu", "meta", "cuda"):
        return True
    try:  # ask the device itself: an allocation and a copy are what a layer needs
        torch.zeros(1, dtype=FP8).to(device_type)
        return True
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def fp8_storage_dtype(device) -> torch.dtype:
    """``float8_e4m3fn`` if tensors of that dtype can live on ``device`` (None: the CPU), else ``uint8`` (their bits)."""
    return FP8 if _device_type_holds_fp8(torch.device(device if device is not None else "cpu").type) else torch.uint8


def as_stored_fp8(t: torch.Tensor) -> torch.Tensor:
    """fp8 codes (float8_e4m3fn or uint8 bits) as the dtype ``t``'s device holds them; a view, never a copy."""
    want = fp8_storage_dtype(t.device)
    return t if t.dtype == want else t.view(want)


def as_fp8_dtype(t: torch.Tensor) -> torch.Tensor:
    """fp8 codes as ``float8_e4m3fn`` (the checkpoint dtype). On a device that cannot hold fp8 this is a CPU copy:
    a view would give a tensor the device cannot use."""
    if t.dtype == FP8:
        return t
    if fp8_storage_dtype(t.device) != FP8:
        t = t.cpu()
    return t.view(FP8)


def to_fp8_storage(t: torch.Tensor, device=None) -> torch.Tensor:
    """Move fp8 codes to ``device`` in the dtype that device holds them (uint8 bits where it cannot hold
    float8_e4m3fn): the bytes are reinterpreted before the move, never value-converted."""
    device = t.device if device is None else torch.device(device)
    if t.dtype == FP8 and fp8_storage_dtype(device) != FP8:
        t = t.view(torch.uint8)
    return as_stored_fp8(t.to(device))
