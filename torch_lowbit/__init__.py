"""torch_lowbit: FP8 and INT8 matmul kernels for PyTorch on Apple-silicon GPUs, with a fast CPU backend.

Ops: ``torch.ops.lowbit.{fp8_mm, fp8_dequantize, fp8_grouped_mm, int8_quantize, int8_mm}`` and the
transposed products of their backward passes ``{fp8_mm_t, fp8_grouped_mm_t, int8_weight_mm_t}`` (wrapped here
with docstrings); the matmuls are differentiable w.r.t. activations and bias (weights frozen). ``torch.ops.lowbit_emu.*`` runs the Metal kernels in the MSL emulator (tests only).
Quantization: ``quantize_fp8``, ``quantize_int8``, ``quantize_w4``; layers ``torch_lowbit.nn.Fp8Linear`` /
``Int8Linear`` / ``W4Linear``; whole models: ``quantize_(model, Fp8WeightOnly(...) | Int8Dynamic() |
Int4WeightOnly(...) | Nvfp4WeightOnly() | Mxfp4WeightOnly() | AffineWeightOnly(...))`` (torchao's config names
work too); 4-bit ops ``w4_mm``, ``w4_dequantize``, ``w4_mm_t``; scale
granularities ``PerTensor``, ``PerChannel``, ``PerBlock``; checkpoints: ``load_quantized(model, path)``;
Hugging Face models: ``from_pretrained(path)`` (a quantized checkpoint -> a running transformers model),
``save_quantized(model, path)`` (-> a compressed-tensors checkpoint); ``dequantize_model(model)``: a dense copy
(to merge LoRA adapters into), ``dequantize_(model)`` the same in place (a transformers model's ``dequantize()``).
Benchmarks: ``python -m torch_lowbit.bench``.
"""
import glob as _glob
import os as _os

import torch as _torch

from . import _C  # noqa: F401  (registers the op schemas and kernels)
from ._ops import (fp8_dequantize, fp8_grouped_mm, fp8_grouped_mm_t, fp8_mm, fp8_mm_t,  # noqa: F401
                   int8_linear, int8_mm, int8_quantize, int8_weight_mm_t, w4_dequantize, w4_grouped_mm, w4_grouped_mm_t, w4_mm, w4_mm_t,
                   _register_fakes)
from ._autograd import _register_autograd  # noqa: E402
from ._autocast import register_autocast as _register_autocast  # noqa: E402
from ._import_hooks import after_import as _after_import  # noqa: E402
from ._peft_dispatch import install as _install_peft_dispatch  # noqa: E402

_register_fakes()
_register_autograd()
_install_peft_dispatch()  # PEFT's LoRA wraps the low-bit layers without torch_lowbit.peft.register


def _load_emulator():
    here = _os.path.dirname(_os.path.abspath(__file__))
    libs = sorted(_glob.glob(_os.path.join(here, "_msl_emu*.so")))
    if libs:
        _C._load_emulator(libs[0])


_load_emulator()
_register_autocast()  # after the emulator's ops exist: both namespaces

from . import emulator  # noqa: E402,F401
from . import nn  # noqa: E402,F401
from .granularity import PerBlock, PerChannel, PerTensor  # noqa: E402,F401
from .quantize import (AffineWeightOnly, Float8WeightOnlyConfig, Fp8WeightOnly, Int4WeightOnly,  # noqa: E402,F401
                       Int4WeightOnlyConfig, Int8Dynamic, Int8DynamicActivationInt8WeightConfig, Mxfp4WeightOnly,
                       Nvfp4WeightOnly, quantize_, quantize_fp8, quantize_int8, register_quantize_module_handler)
from .quantize_w4 import W4Quantized, quantize_w4  # noqa: E402,F401
from .diffusion import diffusion_filter  # noqa: E402,F401
from .formats import LoadReport, detect_format, load_quantized  # noqa: E402,F401
from .hf import enable_save_pretrained, from_pretrained, parameters_on_meta, save_quantized  # noqa: E402,F401
from .dequantize import dequantize_, dequantize_model  # noqa: E402,F401
from ._version import __version__  # noqa: E402,F401


def _register_quantization_method(_diffusers):
    # a diffusers user's process, whichever of diffusers and torch_lowbit it imports first: from_pretrained of a
    # directory save_pretrained wrote, and PipelineQuantizationConfig(quant_backend="torch_lowbit"), need the method
    # registered before any TorchLowbitConfig is made
    try:
        from . import hf_quantizer  # noqa: F401  (registers with transformers and diffusers)
    except ImportError:  # no transformers: TorchLowbitConfig needs it, and the user's import of diffusers must not fail
        pass


_after_import("diffusers", _register_quantization_method)


def _install_diffusers_lora_step(lora_pipeline):
    from ._diffusers_lora import install  # FluxPipeline.load_lora_weights into 4-bit layers

    install(lora_pipeline)


_after_import("diffusers.loaders.lora_pipeline", _install_diffusers_lora_step)


def __getattr__(name):
    # transformers is optional and slow to import: TorchLowbitConfig (which registers torch_lowbit as a
    # transformers quantization method) imports it when first asked for
    if name == "TorchLowbitConfig":
        from .hf_quantizer import TorchLowbitConfig
        return TorchLowbitConfig
    raise AttributeError(f"module 'torch_lowbit' has no attribute {name!r}")
