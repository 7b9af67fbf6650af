"""Quantized checkpoint formats: detect them and load them into torch_lowbit layers.

``load_quantized(model, path_or_state_dict)`` reads ModelOpt FP8, compressed-tensors (FP8 / INT8 W8A8, and 4-bit
W4A16: int4 pack-quantized, NVFP4, MXFP4), Hugging Face fine-grained FP8, fbgemm_fp8, MLX 4-bit and diffusion FP8
checkpoints from .safetensors (never pickles);
``detect_format`` says which one a checkpoint is. Each format is one module here, registered below
(see ``registry.py``); detection without a config asks them in this order.
"""
from . import compressed_tensors, diffusion, fbgemm_fp8, gpt_oss, hf_fp8, mlx, modelopt
from .registry import (CheckpointFormat, Example, QuantFormat, register_format,  # noqa: F401
                       registered_formats)

register_format(modelopt.FORMAT)
register_format(compressed_tensors.FORMAT)
register_format(hf_fp8.FORMAT)
register_format(fbgemm_fp8.FORMAT)
register_format(mlx.FORMAT)
register_format(gpt_oss.FORMAT)
register_format(diffusion.FORMAT)  # last: it claims any file holding float8_e4m3fn tensors

FORMATS = tuple(f.name for f in registered_formats())  # the built-in formats' names

from .detect import detect_format  # noqa: E402,F401
from .load import LoadReport, load_quantized  # noqa: E402,F401
from .source import CheckpointError  # noqa: E402,F401
