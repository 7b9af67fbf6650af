"""torch_lowbit: FP8 and INT8 matmul kernels for PyTorch on Apple-silicon GPUs, with a fast CPU backend.

Ops: ``torch.ops.lowbit.{fp8_mm, fp8_dequantize, fp8_grouped_mm, int8_quantize, int8_mm}`` and the
transposed products of their backward passes ``{fp8_mm_t, fp8_grouped_mm_t, int8_weight_mm_t}`` (wrapped here
with docstrings); the matmuls are differentiable w.r.t. activations and bias (weights frozen). ``torch.ops.lowbit_emu.*`` runs the Metal kernels in the MSL emulator (tests only).
Quantization: ``quantize_fp8``, ``quantize_int8``; layers ``torch_lowbit.nn.Fp8Linear`` / ``Int8Linear``; whole
models: ``quantize_(model, Fp8WeightOnly(...) | Int8Dynamic())``; checkpoints: ``load_quantized(model, path)``.
Benchmarks: ``python -m torch_lowbit.bench``.
"""
import glob as _glob
import os as _os

import torch as _torch

from . import _C  # noqa: F401  (registers the op schemas and kernels)
from ._ops import (fp8_dequantize, fp8_grouped_mm, fp8_grouped_mm_t, fp8_mm, fp8_mm_t,  # noqa: F401
                   int8_linear, int8_mm, int8_quantize, int8_weight_mm_t, _register_fakes)
from ._autograd import _register_autograd  # noqa: E402

_register_fakes()
_register_autograd()


def _load_emulator():
    here = _os.path.dirname(_os.path.abspath(__file__))
    libs = sorted(_glob.glob(_os.path.join(here, "_msl_emu*.so")))
    if libs:
        _C._load_emulator(libs[0])


_load_emulator()

from . import emulator  # noqa: E402,F401
from . import nn  # noqa: E402,F401
from .quantize import (Fp8WeightOnly, Int8Dynamic, quantize_, quantize_fp8,  # noqa: E402,F401
                       quantize_int8)
from .formats import LoadReport, detect_format, load_quantized  # noqa: E402,F401


__version__ = "0.1.0"
