"""Backends every op test runs on. A test parametrized with backends_for("op") runs on:

cpu        torch.ops.lowbit.<op> on CPU tensors
metal_emu  torch.ops.lowbit_emu.<op>: the Metal kernels in the MSL emulator (CPU tensors)
metal_emu_rev  the same, threads of every threadgroup run in reverse order
mps        torch.ops.lowbit.<op> on the mps device (a Mac only; skipped here)
"""
import contextlib
import sys
import os

import pytest
import torch

import torch_lowbit

sys.path.insert(0, os.path.dirname(__file__))

# The ops that have Metal kernels: the Metal issues add theirs here.
METAL_OPS = {"fp8_mm", "fp8_dequantize", "fp8_grouped_mm", "int8_quantize", "int8_mm", "fp8_mm_t", "fp8_grouped_mm_t",
             "int8_weight_mm_t"}


@pytest.fixture(autouse=True, scope="session")
def _poisoned_cpu_workspaces():
    """The CPU kernels reuse per-thread scratch across calls; in tests every use starts as 0xFF (NaN / -1), so
    a kernel reading scratch it did not write fails instead of passing on leftovers, and ends at an
    inaccessible page, so one reading or writing past what it asked for faults (like the emulator's poisoned
    outputs and guard pages)."""
    torch_lowbit._C._cpu_poison_workspaces(True)
    yield
    torch_lowbit._C._cpu_poison_workspaces(False)


class Backend:
    def __init__(self, name):
        self.name = name
        self.device = torch.device("mps" if name == "mps" else "cpu")
        self.is_metal = name != "cpu"

    def __repr__(self):
        return self.name

    def to(self, t):
        return None if t is None else t.to(self.device)

    def _order(self):
        if self.name == "metal_emu_rev":
            return torch_lowbit.emulator.reversed_thread_order()
        return contextlib.nullcontext()

    def transposed_weight(self, w64, rows, dtype):
        """The weight this backend's transposed products (fp8_mm_t, fp8_grouped_mm_t, int8_weight_mm_t) multiply
        `rows` rows of grad_out of `dtype` by: w64, the exact dequantized weight (decode exact, fp32 accumulation),
        except in the CPU's GEMM regime for bf16 on bf16 hardware (AMX, AVX-512 BF16), which multiplies by the
        bf16-dequantized weight:
        dec * scale rounded to fp32 (exact in w64, so w64.float()) and then to bf16, as fp8_dequantize gives it."""
        from torch_lowbit import _C
        if (self.name == "cpu" and dtype == torch.bfloat16 and rows >= _C._cpu_transposed_gemm_min_rows()
                and _C._cpu_transposed_panels_bf16()):
            return w64.float().bfloat16().double()
        return w64

    def op(self, name):
        """The op as this backend runs it (same signature as torch.ops.lowbit.<name>)."""
        ns = torch.ops.lowbit_emu if self.name.startswith("metal_emu") else torch.ops.lowbit
        fn = getattr(ns, name)

        def call(*args, **kwargs):
            with self._order():
                return fn(*args, **kwargs)
        return call


def _mps_available():
    return torch.backends.mps.is_available()


def backends_for(op, emu_rev=True):
    """pytest params for the backends that implement `op`; unavailable ones are skipped, not dropped."""
    names = ["cpu"]
    if op in METAL_OPS:
        names += ["metal_emu"] + (["metal_emu_rev"] if emu_rev else []) + ["mps"]
    params = []
    for n in names:
        marks = []
        if n.startswith("metal_emu") and not torch_lowbit.emulator.available():
            marks.append(pytest.mark.skip(reason="the Metal emulator is not built in this install"))
        if n == "mps" and not _mps_available():
            marks.append(pytest.mark.skip(reason="needs an Apple GPU (mps device)"))
        params.append(pytest.param(Backend(n), id=n, marks=marks))
    return params
