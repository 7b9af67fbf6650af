"""The MSL emulator, from Python: is it built, and a test switch for the thread order.

``torch.ops.lowbit_emu.<op>`` runs the very same metal/*.metal kernels, through the same plan code as the
mps device, on CPU tensors. It exists so that every Metal kernel runs in CI; it is slow and for tests only.
"""
import contextlib

from . import _C


def available() -> bool:
    """True when this install has the emulator (built on non-macOS unless TORCH_LOWBIT_EMULATOR=0)."""
    return bool(_C._emulator_loaded())


@contextlib.contextmanager
def reversed_thread_order():
    """Run the threads of every emulated threadgroup in reverse order inside this block.

    A kernel whose result depends on the order threads happen to run in (a missing barrier, a race on
    threadgroup memory, lanes assumed to run in lockstep) gives different results in the two orders.
    """
    _C._emu_set_reverse(True)
    try:
        yield
    finally:
        _C._emu_set_reverse(False)
