"""Quantized drop-in modules: ``Fp8Linear`` (W8A16), ``Int8Linear`` (W8A8 dynamic), ``W4Linear`` (W4A16), and the MoE experts layers
``Fp8Experts`` (W8A16), ``Int8Experts`` (W8A8 dynamic) and ``W4Experts`` (W4A16)."""
from ._format_buffers import low_bit_parameter_count
from .experts import Fp8Experts
from .fp8_linear import Fp8Linear
from .gptoss_experts import GptOssW4Experts
from .int8_experts import Int8Experts
from .int8_linear import Int8Linear
from .w4_experts import W4Experts
from .w4_linear import W4Linear

__all__ = ["Fp8Linear", "Int8Linear", "W4Linear", "Fp8Experts", "Int8Experts", "W4Experts", "GptOssW4Experts",
           "low_bit_parameter_count"]
