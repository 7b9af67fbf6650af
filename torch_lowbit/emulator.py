"""The MSL emulator, from Python: is it built, and test switches for the thread order and the device.

``torch.ops.lowbit_emu.<op>`` runs the very same metal/*.metal kernels, through the same plan code as the
mps device, on CPU tensors. It exists so that every Metal kernel runs in CI; it is slow and for tests only.
"""
import contextlib

from . import _C


def available() -> bool:
    """True when this install has the emulator (built on Linux and macOS unless TORCH_LOWBIT_EMULATOR=0)."""
    return bool(_C._emulator_loaded())


@contextlib.contextmanager
def reversed_thread_order():
    """Run the threads of every emulated threadgroup in reverse order inside this block, and its simdgroups one
    at a time (the last first) from barrier to barrier, as a GPU may schedule them.

    A kernel whose result depends on the order threads happen to run in (a missing barrier, a race on
    threadgroup memory, lanes assumed to run in lockstep) gives different results in the two orders.
    """
    _C._emu_set_reverse(True)
    try:
        yield
    finally:
        _C._emu_set_reverse(False)


# ---------------------------------------------------------------------------------------------- dry run
class DryRun:
    """Dispatch records of :func:`dry_run`."""

    @property
    def ops(self):
        """``torch.ops.lowbit_dryrun``: every op with a Metal plan (csrc/metal/planned_ops.h), on meta tensors."""
        import torch
        return torch.ops.lowbit_dryrun

    def take(self):
        """One dict per dispatch since the last call, oldest first: kernel, grid (threadgroups per grid),
        threads (per threadgroup), threadgroup_memory (bytes), buffers (name -> shape, dtype, storage_offset,
        nbytes, access), values (name -> raw bytes of the params struct), binding (names in [[buffer(i)]] order)."""
        return _C._dry_run_take()


@contextlib.contextmanager
def dry_run():
    """Run the Metal plans without running a kernel: inside this block, ``torch.ops.lowbit_dryrun.<op>`` on
    meta tensors (which allocate nothing, so real model sizes cost no memory) validates, picks kernels and
    sizes grids exactly as on the mps device (offsets and expert ids unread), and records each dispatch after
    Metal's launch-limit check. Yields a :class:`DryRun`; call ``take()`` for the records."""
    _C._dry_run_take()  # drop records of earlier runs
    try:
        yield DryRun()
    finally:
        _C._dry_run_take()


@contextlib.contextmanager
def device_caps(apple_family=None, msl_version=None):
    """Inside this block the emulator reports this device to the plans, which pick kernel variants from it.

    ``apple_family`` is N of MTLGPUFamilyAppleN (7 = M1, the default: the portable floor; 10 = M5);
    ``msl_version`` is the Metal Shading Language version as major * 100 + minor (301 = MSL 3.1, the default).
    An argument left out keeps its current value. The kernels run are still the emulator's (the same
    metal/*.metal files): the switch tests the plans' choice, not the device.
    """
    before = tuple(_C._emu_device_caps())
    family = before[0] if apple_family is None else int(apple_family)
    msl = before[1] if msl_version is None else int(msl_version)
    if family < 7 or msl < 301:
        raise ValueError(f"device_caps: the kernels need at least Apple7 (M1) and MSL 3.1 (301); got "
                         f"apple_family={family}, msl_version={msl}")
    _C._emu_set_device_caps(family, msl)
    try:
        yield
    finally:
        _C._emu_set_device_caps(*before)


TENSOR_LAYOUTS = {"m5": 0, "permuted": 1}
SUM_ORDERS = {"ascending": 0, "descending": 1, "blocks8": 2}


@contextlib.contextmanager
def tensor_ops(layout="m5", sum_order="ascending", seed=1):
    """Inside this block the emulator's Metal 4 tensor ops (matmul2d on M5, csrc/emu/include/msl_tensor.h) use
    this cooperative-tensor lane layout and float summation order.

    ``layout``: "m5", a plausible M5 layout (8x8 fragments in simdgroup-matrix order), or "permuted", a random
    permutation drawn from ``seed``; the hardware's layout is implementation-defined, so a kernel must give the
    same result under both. ``sum_order``: "ascending" / "descending" in k, or "blocks8" (8-wide partial sums):
    float results may differ between them in the last bits, integer results never.
    """
    if layout not in TENSOR_LAYOUTS:
        raise ValueError(f"tensor_ops: layout={layout!r}; expected one of {sorted(TENSOR_LAYOUTS)}")
    if sum_order not in SUM_ORDERS:
        raise ValueError(f"tensor_ops: sum_order={sum_order!r}; expected one of {sorted(SUM_ORDERS)}")
    import ctypes
    path = _library("_msl_emu")
    if not available() or path is None:
        raise RuntimeError("torch_lowbit: the Metal emulator is not built into this install")
    setter = ctypes.CDLL(path).msl_emu_set_tensor_ops  # the library the ops already run (dlopen: one instance)
    setter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_uint]
    setter(TENSOR_LAYOUTS[layout], SUM_ORDERS[sum_order], int(seed))
    try:
        yield
    finally:
        setter(0, 0, 1)


@contextlib.contextmanager
def max_threads_per_threadgroup(limit, kernels=None):
    """Inside this block every emulated pipeline takes at most ``limit`` threads per threadgroup (a multiple of
    32; Metal's 1024 by default), as a register-heavy pipeline's ``maxTotalThreadsPerThreadgroup`` may be on a
    GPU. The plans then run their narrower variants (or fewer threads); a launch past the limit is refused.
    ``kernels``: only these pipelines (full kernel names, e.g. ``"int8_gemm_mpp_bfloat"``) get the limit."""
    if kernels is None:
        before = _C._emu_max_threads_per_threadgroup()
        _C._emu_set_max_threads_per_threadgroup(int(limit))
        try:
            yield
        finally:
            _C._emu_set_max_threads_per_threadgroup(before)
        return
    kernels = [kernels] if isinstance(kernels, str) else list(kernels)
    set_limit = _C._emu_set_kernel_max_threads
    try:
        for k in kernels:
            set_limit(k, int(limit))
        yield
    finally:
        for k in kernels:
            set_limit(k, 0)


# ---------------------------------------------------------------------------------------------- traffic build
def _library(stem):
    import glob
    import os
    here = os.path.dirname(os.path.abspath(__file__))
    libs = sorted(glob.glob(os.path.join(here, stem + ".*so")))
    return libs[0] if libs else None


def trace_available() -> bool:
    """True when this install has the traffic build of the emulator (torch_lowbit/_msl_trace*.so)."""
    return available() and _library("_msl_trace") is not None


class Trace:
    """Launch records of the traffic build; see :func:`traced`."""

    def __init__(self, path):
        import ctypes
        self.library = path
        self._lib = ctypes.CDLL(path)
        self._lib.msl_emu_trace_take.restype = ctypes.c_char_p

    def take(self):
        """One dict per kernel launch since the last call: kernel, grid, threadgroup, buffers (name, kind, size,
        read / write counts), sites (per buffer, direction and instruction address). See csrc/emu/trace.cpp."""
        import json
        return json.loads(self._lib.msl_emu_trace_take().decode())


@contextlib.contextmanager
def traced():
    """Run ``torch.ops.lowbit_emu.*`` inside this block on the traffic build of the emulator.

    The same plans and kernels run; every device-memory access of every kernel is recorded (slower). Yields a
    :class:`Trace`; call ``take()`` after each op to get its launches.
    """
    path = _library("_msl_trace")
    if not available() or path is None:
        raise RuntimeError("torch_lowbit: the traffic build of the emulator (torch_lowbit/_msl_trace*.so) is not "
                           "built in this install (it is built with the emulator unless TORCH_LOWBIT_TRACE=0)")
    trace = Trace(path)
    _C._load_emulator(path)
    try:
        trace.take()  # drop records of earlier traced runs
        yield trace
    finally:
        _C._load_emulator(_library("_msl_emu"))
