"""Quantized checkpoint formats: detect them and load them into torch_lowbit layers.

``load_quantized(model, path_or_state_dict)`` reads ModelOpt FP8, compressed-tensors (FP8 / INT8 W8A8),
Hugging Face fine-grained FP8, fbgemm_fp8 and diffusion FP8 checkpoints from .safetensors (never pickles);
``detect_format`` says which one a checkpoint is.
"""
from .detect import FORMATS, QuantFormat, detect_format  # noqa: F401
from .load import LoadReport, load_quantized  # noqa: F401
from .source import CheckpointError  # noqa: F401
