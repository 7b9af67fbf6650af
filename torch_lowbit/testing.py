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


CPU_ISA_LEVELS = ("portable", "avx2", "avxvnni", "avx512")  # each implies the ones before


def supported_cpu_isas() -> tuple:
    """The levels this CPU can run, portable first (whatever cap is in force now)."""
    with forced_cpu_isa("best"):
        best = cpu_isa()
    return CPU_ISA_LEVELS[:CPU_ISA_LEVELS.index(best) + 1]


@contextlib.contextmanager
def forced_cpu_isa(name: str):
    """Cap the CPU kernels at level ``name`` (``"portable"``, ``"avx2"``, ``"avxvnni"``, ``"avx512"``, ``"best"``)
    inside this block."""
    previous = _C._cpu_set_isa(name)
    try:
        yield
    finally:
        _C._cpu_set_isa(previous)


def cpu_amx_gemm() -> bool:
    """Whether the GEMM regimes (enough rows) of ``fp8_mm`` and ``int8_mm`` run on AMX now, through
    oneDNN's brgemm in torch: the CPU has AMX, the cap is at ``"avx512"`` and ``torch.backends.mkldnn`` is enabled.
    Otherwise fp8_mm uses fp32 panels in torch's fp32 GEMM and int8_mm its own AVX-512 / AVX2 micro-kernels.
    ``torch.backends.mkldnn.enabled = False`` turns AMX off."""
    return _C._cpu_amx_gemm()


def force_portable():
    """Run the CPU kernels on their portable path inside this block."""
    return forced_cpu_isa("portable")
