"""Test switches for the CPU backend.

The CPU kernels pick an instruction-set level at run time (portable < avx2 (AVX2 + FMA + F16C) < avxvnni
< avx512, each implying the ones before). ``cpu_isa("portable")`` forces the portable path inside a block, so tests run every path on one
machine.
"""
import contextlib

from . import _C


def cpu_isa() -> str:
    """The instruction-set level the CPU kernels use now: ``"portable"``, ``"avx2"``, ``"avxvnni"`` or ``"avx512"``."""
    return _C._cpu_isa()


@contextlib.contextmanager
def forced_cpu_isa(name: str):
    """Cap the CPU kernels at level ``name`` (``"portable"``, ``"avx2"``, ``"avxvnni"``, ``"avx512"``, ``"best"``)
    inside this block."""
    previous = _C._cpu_set_isa(name)
    try:
        yield
    finally:
        _C._cpu_set_isa(previous)


def cpu_bf16_gemm() -> bool:
    """Whether fp8_mm with bf16 x and enough rows for its GEMM runs bf16 weight panels through oneDNN's AMX brgemm
    now (AMX and AVX-512 BF16 present, the cap at ``"avx512"``, ``torch.backends.mkldnn`` enabled); otherwise it
    uses fp32 panels and torch's fp32 GEMM. ``torch.backends.mkldnn.flags(enabled=False)`` turns it off."""
    return _C._cpu_bf16_gemm()


def force_portable():
    """Run the CPU kernels on their portable path inside this block."""
    return forced_cpu_isa("portable")
