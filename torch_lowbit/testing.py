"""Test switches for the CPU backend.

The CPU kernels run one kernel set, picked at run time: the last set of this build's list (``cpu_kernel_sets()``,
from _C: portable, then this architecture's levels, e.g. avx2 (AVX2 + FMA + F16C), avxvnni, avx512, avx512amx on x86)
that the CPU supports and that is tuned for it (avx512amx: for cores with AMX; ``default_cpu_isa()``).
``forced_cpu_isa("portable")`` caps it inside a block, so tests run every set the CPU supports on one machine.
"""
import contextlib

from . import _C


def cpu_isa() -> str:
    """The kernel set the CPU kernels use now: one of ``CPU_ISA_LEVELS``."""
    return _C._cpu_isa()


def cpu_kernel_sets() -> list:
    """This build's CPU kernel sets as (name, whether this CPU supports it), in order of preference."""
    return list(_C._cpu_kernel_sets())


CPU_ISA_LEVELS = tuple(name for name, _ in cpu_kernel_sets())  # this build's sets, portable first


def supported_cpu_isas() -> tuple:
    """The sets this CPU can run, portable first (whatever cap is in force now)."""
    return tuple(name for name, supported in cpu_kernel_sets() if supported)


def default_cpu_isa() -> str:
    """The set the CPU kernels use without a cap: the last supported set that is tuned for this CPU."""
    with forced_cpu_isa("best"):
        return cpu_isa()


@contextlib.contextmanager
def forced_cpu_isa(name: str):
    """Cap the CPU kernels at the set ``name`` (one of ``CPU_ISA_LEVELS``, or ``"best"``: no cap) inside this block:
    that set where the CPU supports it, else the last set before it that the CPU supports and is tuned for."""
    previous = _C._cpu_set_isa(name)
    try:
        yield
    finally:
        _C._cpu_set_isa(previous)


def cpu_amx_gemm() -> bool:
    """Whether the GEMM regimes (enough rows) of ``fp8_mm`` and ``int8_mm`` run on AMX now, through
    oneDNN's brgemm in torch: the CPU has AMX, the cap is at an AVX-512 set (``"avx512"``, ``"avx512amx"``) and
    ``torch.backends.mkldnn`` is enabled.
    Otherwise fp8_mm multiplies bf16 panels in the kernel set's bf16 GEMM (AVX-512 BF16) or fp32 panels in
    torch's fp32 GEMM (``cpu_gemm_route``), and int8_mm uses its own AVX-512 / AVX2 micro-kernels.
    ``torch.backends.mkldnn.enabled = False`` turns AMX off."""
    return _C._cpu_amx_gemm()


def cpu_gemm_route() -> str:
    """How the GEMM regimes (enough rows) of ``fp8_mm`` and ``w4_mm`` multiply now: ``"amx"`` (bf16 panels in
    oneDNN's AMX brgemm, see ``cpu_amx_gemm``), ``"bf16"`` (bf16 panels in the kernel set's own bf16 GEMM:
    AVX-512 BF16 without AMX) or ``"fp32"`` (fp32 panels in torch's fp32 GEMM: below the avx512 cap)."""
    if _C._cpu_amx_gemm():
        return "amx"
    return "bf16" if _C._cpu_bf16_panel_gemm() else "fp32"


GEMM_ROUTE_NAMES = {"amx": "AMX (oneDNN brgemm; group / block scales on the avx512amx set's tile GEMM)",
                    "bf16": "bf16 panels (AVX-512 BF16)", "fp32": "fp32 panels"}


def force_portable():
    """Run the CPU kernels on their portable path inside this block."""
    return forced_cpu_isa("portable")
