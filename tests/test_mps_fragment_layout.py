"""The 8x8 simdgroup_matrix lane layout the GEMM kernels assume (frag_coord, metal/fp8_gemm.h), probed on the GPU.

Apple documents no lane layout for simdgroup_matrix, and the GEMMs fill and read fragments through
thread_elements() at frag_coord: a GPU whose layout differs would give wrong products that only the device can
show. tests/planted/simdgroup_layout_probe.metal computes one 8x8 product that way; on mps it must equal the CPU
product (and simdgroup_store's result). In the emulator the same probe passes, and a transposed layout fails,
so the probe can fail."""
import os
import sys

import numpy as np
import pytest
import torch

import emu_ctypes as E

PROBE = os.path.join(E.PLANTED, "simdgroup_layout_probe.metal")
sys.path.insert(0, os.path.join(E.ROOT, "csrc", "metal"))


def operands():
    # distinct powers of two and small integers: every product and sum is exact in fp32, whatever the order
    rng = np.random.default_rng(7)
    a = rng.integers(-8, 9, size=(8, 8)).astype(np.float32)
    b = (2.0 ** rng.integers(-3, 4, size=(8, 8)) * rng.choice([-1, 1], size=(8, 8))).astype(np.float32)
    return a, b


@pytest.mark.skipif(E.compiler() is None, reason="needs g++ to build the planted kernels")
@pytest.mark.parametrize("kernel,right", [("simdgroup_layout_probe", True),
                                          ("simdgroup_layout_probe_transposed", False)])
def test_probe_in_the_emulator(kernel, right):
    lib = E.Library(E.build([PROBE]))
    a, b = operands()
    c, c_stored = np.zeros((8, 8), np.float32), np.zeros((8, 8), np.float32)
    lib.run(kernel, [a, b, c, c_stored], grid=(1,), tg=(32,), outputs=(2, 3))
    ref = a.astype(np.float64) @ b.astype(np.float64)
    assert np.array_equal(c, ref) == right and np.array_equal(c_stored, ref) == right


@pytest.mark.skipif(not torch.backends.mps.is_available(), reason="needs an Apple GPU (mps device)")
def test_probe_on_the_gpu_matches_the_cpu_product():
    import metallib  # csrc/metal: inlines the probe's metal/*.h includes, as the build does
    source = metallib.inline_local_includes(E.ROOT, os.path.relpath(PROBE, E.ROOT), set())
    lib = torch.mps.compile_shader(source)
    a, b = operands()
    ta, tb = torch.from_numpy(a).to("mps"), torch.from_numpy(b).to("mps")
    c, c_stored = torch.zeros(8, 8, device="mps"), torch.zeros(8, 8, device="mps")
    lib.simdgroup_layout_probe(ta, tb, c, c_stored, threads=32, group_size=32)
    ref = torch.from_numpy(a.astype(np.float64) @ b.astype(np.float64))
    assert torch.equal(c_stored.cpu().double(), ref), "simdgroup_store disagrees with the CPU product"
    assert torch.equal(c.cpu().double(), ref), "the GEMM's fragment layout (frag_coord) is not this GPU's"
