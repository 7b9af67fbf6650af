"""Quantized modules keep their format's dtypes through module-wide conversions (``model.half()``,
``.to(torch.bfloat16)``): fp8 / int8 codes and fp32 scales move with the module but are never converted. An fp8
tensor is a floating tensor to nn.Module, so without this ``.half()`` would turn codes into values, and a bf16
scale would lose 8 bits."""
from __future__ import annotations

import torch
import torch.nn as nn

from .._ops import _FLOAT_DTYPES
from .._storage import as_fp8_dtype, as_stored_fp8


class FormatBuffers(nn.Module):
    # buffers whose dtype is part of the format: moved by .to() / .cuda() / .mps(), never dtype-converted
    _format_buffers: tuple = ()
    # the subset holding fp8 codes: moved as uint8 bits (which no dtype cast touches and every device holds), held
    # as the device can (float8_e4m3fn, or uint8 on mps before PyTorch 2.15), saved as float8_e4m3fn
    _fp8_buffers: tuple = ()

    def _move_format_buffer(self, name: str, t: torch.Tensor, fn) -> torch.Tensor:
        if name in self._fp8_buffers:
            bits = t.view(torch.uint8)
            moved = fn(bits)
            if moved.dtype != torch.uint8:
                moved = bits.to(moved.device)
            return as_stored_fp8(moved)
        moved = fn(t)
        return moved if moved.dtype == t.dtype else t.to(moved.device)

    def _apply(self, fn, recurse=True):
        kept = {n: self._buffers[n] for n in self._format_buffers if self._buffers.get(n) is not None}
        for n in kept:
            self._buffers[n] = None  # hidden from nn.Module._apply, keeping the buffers' order
        try:
            super()._apply(fn, recurse)
            moved = {n: self._move_format_buffer(n, t, fn) for n, t in kept.items()}
        except BaseException:
            self._buffers.update(kept)
            raise
        self._buffers.update(moved)
        # a layer's `dtype` (the dense model's, which fused experts stand in for and dequantize to) follows
        # .half() / .to(dtype) as the dense layer's weight would have (what fn makes of a tensor of that dtype), to
        # the dtypes the low-bit ops compute in
        dense = self.__dict__.get("dtype")
        if isinstance(dense, torch.dtype):
            cast = fn(torch.empty(0, dtype=dense)).dtype
            if cast in _FLOAT_DTYPES:
                self.dtype = cast
        return self

    def dense_parameter_count(self) -> int:
        """How many of the dense layer's parameters this module holds as buffers (its low-bit weights, counted in
        weights, not bytes; fused experts' biases), which ``parameters()`` does not list."""
        raise NotImplementedError(f"{type(self).__name__}.dense_parameter_count")

    def _adopt_optional_buffer(self, name, state_dict, prefix, device):
        """Give a buffer that is None here the checkpoint's tensor (e.g. an input_scale), so it loads."""
        key = prefix + name
        if key in state_dict and getattr(self, name) is None:
            v = state_dict[key]
            setattr(self, name, torch.empty(v.shape, dtype=torch.float32, device=device))

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for n in self._fp8_buffers:
            if destination.get(prefix + n) is not None:
                destination[prefix + n] = as_fp8_dtype(destination[prefix + n])


def low_bit_parameter_count(model: nn.Module) -> int:
    """The parameters of the dense model that `model`'s torch_lowbit layers hold as buffers (each layer once, however
    many names it has): what PEFT's ``print_trainable_parameters`` and transformers' ``num_parameters()`` add to the
    parameters they list, as they count a bitsandbytes 4-bit weight by its weights rather than its bytes."""
    return sum(m.dense_parameter_count() for m in model.modules() if isinstance(m, FormatBuffers))
