"""Quantized drop-in replacements for nn.Linear: ``Fp8Linear`` (W8A16) and ``Int8Linear`` (W8A8 dynamic)."""
from .fp8_linear import Fp8Linear
from .int8_linear import Int8Linear

__all__ = ["Fp8Linear", "Int8Linear"]
