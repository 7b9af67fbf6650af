"""The emulator stays honest: kernels with planted bugs fail, their correct twins pass, and the guarantees the
project relies on (guard pages, poisoned outputs, divergence reports, both thread orders) hold.

The planted kernels (tests/planted/*.metal) are compiled at test time with the repo's csrc/emu runtime into a
library of their own (tests/emu_ctypes.py), never into the shipped emulator.
"""
import os

import numpy as np
import pytest
import torch

import torch_lowbit
from torch_lowbit import _C

import emu_ctypes as E

pytestmark = pytest.mark.skipif(E.compiler() is None, reason="needs g++ to build the planted kernels")

GEMV = os.path.join(E.PLANTED, "gemv.metal")
GUARANTEES = os.path.join(E.PLANTED, "emu_guarantees.metal")
DEQUANT_BUG = os.path.join(E.PLANTED, "fp8_dequantize_tail_bug.metal")
RULES = os.path.join(E.PLANTED, "metal_rules.metal")
CONVERTING_LOAD = os.path.join(E.PLANTED, "simdgroup_load_converting.metal")
MMA_BARRIER = os.path.join(E.PLANTED, "mma_barrier.metal")


@pytest.fixture(scope="module")
def lib():
    return E.Library(E.build([GEMV, GUARANTEES, RULES]))


def gemv_case(N, K, seed=0):
    rng = np.random.default_rng(seed)
    W = E.random_fp8(rng, (N, K))
    x = rng.standard_normal(K).astype(np.float32)
    scale = (rng.random(N) + 0.5).astype(np.float32)
    ref = (E.fp8_to_f64(W) @ x.astype(np.float64)) * scale
    args = np.array([N, K], np.uint32)
    return [W, x, scale, np.zeros(N, np.float32), args], ref


def run_gemv(lib, kernel, N, K, reverse=False, per_thread=False):
    bufs, ref = gemv_case(N, K)
    if per_thread:
        lib.run(kernel, bufs, grid=((N + 63) // 64,), tg=(64,), outputs=(3,), reverse=reverse)
    else:
        lib.run(kernel, bufs, grid=((N + 3) // 4,), tg=(128,), outputs=(3,), reverse=reverse)
    return bufs[3], ref


def close(y, ref, K):
    # fp32 accumulation of K products of magnitude <= 448 * |x|: a loose bound that a bug never meets
    return np.allclose(y, ref, rtol=1e-4, atol=1e-4 * np.sqrt(K) * 448)


# ---------------------------------------------------------------------------------------------- planted bugs
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("kernel", ["gemv_ok", "gemv_ok_ladder", "gemv_tiled_ok"])
@pytest.mark.parametrize("N,K", [(5, 131), (9, 256), (1, 7)])
def test_correct_gemvs_pass(lib, kernel, N, K, reverse):
    y, ref = run_gemv(lib, kernel, N, K, reverse)
    assert close(y, ref, K)


@pytest.mark.parametrize("N,K", [(64, 5), (32, 130)])
def test_wrong_tail_bound_is_caught(lib, N, K):
    # N * K is a multiple of 64 (buffers end < 64 bytes before the guard page, keeping their device address
    # residue modulo 64): the overread on the last row reaches the guard page -> a reported fault;
    # every other row reads into the next one and counts the tail twice -> a wrong result
    with pytest.raises(E.KernelError, match=r"(?s)gemv_bug_tail.*past the end of \[\[buffer\(0\)\]\].*threadgroup"):
        run_gemv(lib, "gemv_bug_tail", N, K)
    y, ref = run_gemv(lib, "gemv_ok", N, K)
    assert close(y, ref, K)


def test_wrong_lane_reduction_is_caught(lib):
    y, ref = run_gemv(lib, "gemv_bug_ladder", 6, 300)
    assert not close(y, ref, 300)
    y, ref = run_gemv(lib, "gemv_ok_ladder", 6, 300)
    assert close(y, ref, 300)


def test_missing_barrier_is_caught_in_one_of_the_orders(lib):
    # N = 6 with 4 rows per threadgroup: the last threadgroup has idle simdgroups, as in real dispatches
    results = [close(*run_gemv(lib, "gemv_tiled_bug_no_barrier", 6, 300, reverse=r), 300) for r in (False, True)]
    assert not all(results)


def run_mma_tiles(kernel, reverse, steps=3):
    x = np.random.default_rng(0).standard_normal(steps * 64).astype(np.float32)
    out = np.zeros(128, np.float32)
    E.Library(E.build([MMA_BARRIER])).run(kernel, [x, out, np.array([steps], np.uint32)], grid=(1,), tg=(64,),
                                          outputs=(1,), reverse=reverse)
    return out, np.tile(x.reshape(steps, 64).astype(np.float64).sum(0), 2)


@pytest.mark.parametrize("reverse", [False, True])
def test_mma_tiles_with_barriers_pass(reverse):
    assert np.allclose(*run_mma_tiles("mma_tiles_ok", reverse), rtol=1e-6, atol=1e-6)


def test_missing_barrier_after_an_mma_is_caught_in_the_reverse_order():
    """Lockstep rounds cannot show it (each simdgroup's tile reads end in an MMA all simdgroups reach in one
    round); the reverse order runs the simdgroups one at a time from barrier to barrier, as a GPU may."""
    results = [np.allclose(*run_mma_tiles("mma_tiles_bug_no_barrier", r), rtol=1e-6, atol=1e-6) for r in (False, True)]
    assert results == [True, False]


def test_barrier_skipped_by_returning_threads_is_reported(lib):
    with pytest.raises(E.KernelError, match="exited the kernel while others wait at threadgroup_barrier"):
        run_gemv(lib, "gemv_tiled_bug_early_return", 6, 300)  # rows 6, 7 of the last threadgroup return early
    y, ref = run_gemv(lib, "gemv_tiled_bug_early_return", 8, 300)  # no early return: the kernel is right
    assert close(y, ref, 300)


# ---------------------------------------------------------------------------------------------- guarantees
def test_unwritten_outputs_stay_poisoned(lib):
    out = np.zeros(64, np.float32)
    lib.run("write_even_only", [out], grid=(1,), tg=(64,), outputs=(0,))
    assert np.array_equal(out[::2], np.arange(0, 64, 2, dtype=np.float32))
    assert (out[1::2].view(np.uint32) == 0xFFFFFFFF).all()


@pytest.mark.parametrize("n", [5, 6, 7])  # 20..28 bytes: the stray store stays inside the 16-byte slack
def test_write_just_past_the_end_is_reported(lib, n):
    with pytest.raises(E.KernelError, match=r"wrote past the end of \[\[buffer\(0\)\]\] \(byte offset %d" % (4 * n)):
        lib.run("write_one_past_end", [np.zeros(n, np.float32), np.array([n], np.uint32)], grid=(1,), tg=(n,),
                outputs=(0,))


def test_write_just_before_the_start_is_reported(lib):
    with pytest.raises(E.KernelError, match=r"wrote before the start of \[\[buffer\(0\)\]\] \(byte offset -4"):
        lib.run("write_one_before_start", [np.zeros(8, np.float32)], grid=(1,), tg=(8,), outputs=(0,))


def test_kernel_taking_a_nil_buffer_is_reported(lib):
    # mps binds an empty tensor as nil, and so does the emulator: a kernel taking that buffer is an error (Metal's
    # validation layer rejects the dispatch), even where the read happens to go nowhere
    out = np.zeros(4, np.float32)
    lib.run("copy_buffer_1", [out, np.arange(4, dtype=np.float32)], grid=(1,), tg=(4,), outputs=(0,))
    assert np.array_equal(out, np.arange(4))
    with pytest.raises(E.KernelError, match=r"kernel 'copy_buffer_1' takes \[\[buffer\(1\)\]\], which the launch bound as nil"):
        lib.run("copy_buffer_1", [out, None], grid=(1,), tg=(4,), outputs=(0,))


def test_divergent_simd_op_is_reported_every_time(lib):
    for _ in range(2):  # the report must not be once per process
        with pytest.raises(E.KernelError, match="lanes wait at different simd ops"):
            lib.run("divergent_simd", [np.zeros(32, np.float32)], grid=(1,), tg=(32,), outputs=(0,))


def test_divergent_barrier_is_reported(lib):
    with pytest.raises(E.KernelError, match="wait at different threadgroup_barriers"):
        lib.run("divergent_barrier", [np.zeros(64, np.float32)], grid=(1,), tg=(64,), outputs=(0,))


def test_reversed_thread_order_changes_a_racy_result(lib):
    got = []
    for reverse in (False, True):
        out = np.zeros(64, np.uint32)
        lib.run("racy_last_writer", [out], grid=(1,), tg=(64,), outputs=(0,), reverse=reverse)
        assert (out == out[0]).all()
        got.append(int(out[0]))
    assert got == [63, 0]  # the last writer in each order


# ---------------------------------------------------------------------------------------------- through the op
@pytest.fixture
def planted_dequantize():
    """torch.ops.lowbit_emu running the kernels of DEQUANT_BUG instead of metal/*.metal."""
    if not torch_lowbit.emulator.available():
        pytest.skip("the emulator is not built")
    path = E.build([DEQUANT_BUG])
    _C._load_emulator(path)
    try:
        yield
    finally:
        _C._load_emulator(torch_lowbit.emulator._library("_msl_emu"))


def test_read_past_a_buffer_names_kernel_buffer_and_thread(planted_dequantize):
    w = torch.randint(0, 0x7E, (64, 5), dtype=torch.uint8)  # 320 bytes: the overread reaches the guard page
    with pytest.raises(RuntimeError) as e:
        torch.ops.lowbit_emu.fp8_dequantize(w, torch.ones(1), None, torch.float32)
    msg = str(e.value)
    assert "fp8_dequantize_float" in msg and "past the end of [[buffer(0)]]" in msg
    assert "threadgroup (0,15,0) thread (1,3,0)" in msg and "[[buffer(0)]] weight" in msg


def test_unwritten_output_elements_show_through_the_op(planted_dequantize):
    w = torch.randint(0, 0x7E, (5, 9), dtype=torch.uint8)
    out = torch.ops.lowbit_emu.fp8_dequantize(w, torch.ones(1), None, torch.float16)
    assert not torch.isnan(out[:, :-1]).any()
    assert (out[:, -1].view(torch.int16) == -1).all()  # 0xFFFF: never written


def test_the_real_kernels_are_back_after_the_planted_ones():
    if not torch_lowbit.emulator.available():
        pytest.skip("the emulator is not built")
    w = torch.randint(0, 0x7E, (16, 5), dtype=torch.uint8)
    out = torch.ops.lowbit_emu.fp8_dequantize(w, torch.ones(1), None, torch.float32)
    assert torch.equal(out, w.view(torch.float8_e4m3fn).float())


# ---------------------------------------------------------------------------------------------- Metal's rules
def uint4_load(lib, kernel, word, offset=0, n=4):
    src = np.arange(4 * n + 8, dtype=np.uint32)
    out = np.zeros((n, 4), np.uint32)
    lib.run(kernel, [src, out, np.array([word], np.uint32)], grid=(1,), tg=(n,), outputs=(1,), offsets=[offset, 0, 0])
    return out, src[word:word + 4 * n].reshape(n, 4)


def test_aligned_uint4_loads_run(lib):
    out, ref = uint4_load(lib, "uint4_load_at", word=4)
    assert np.array_equal(out, ref)


@pytest.mark.parametrize("word,offset", [(1, 0), (2, 0), (0, 4), (0, 8), (4, 36)])
def test_misaligned_uint4_load_faults(lib, word, offset):
    # offset: the buffer's byte offset on the device (a view at storage_offset * element_size); the emulator
    # binds the buffer at that residue modulo 64, so the load is misaligned exactly when it would be on mps
    with pytest.raises(E.KernelError, match=r"(?s)uint4_load_at.*misaligned 16-byte vector load at byte offset "
                                            r"%d of \[\[buffer\(0\)\]\] \(bound at device offset %d modulo 64\)"
                                            r".*needs 16-byte.*thread \(0,0,0\)" % (4 * word, offset % 64)):
        uint4_load(lib, "uint4_load_at", word, offset)


@pytest.mark.parametrize("word,offset", [(1, 0), (3, 8)])
def test_packed_uint4_loads_need_only_scalar_alignment(lib, word, offset):
    out, ref = uint4_load(lib, "packed_uint4_load_at", word, offset)
    assert np.array_equal(out, ref)


def test_misaligned_threadgroup_vector_store_faults(lib):
    with pytest.raises(E.KernelError, match="misaligned 16-byte vector store at .*threadgroup"):
        lib.run("threadgroup_float4_store_misaligned", [np.zeros(32, np.float32)], grid=(1,), tg=(32,), outputs=(0,))


def test_float4_stores_into_a_float_threadgroup_array_fault_at_its_natural_alignment(lib):
    # MSL promises a `float` threadgroup array 4-byte alignment only: the emulator places it there, so float4
    # stores into it fault, where the old 16-byte placement (natural_tg_alignment=False) let them pass
    out = np.zeros(32, np.float32)
    lib.run("threadgroup_float_array_float4_stores", [out], grid=(1,), tg=(32,), outputs=(0,),
            natural_tg_alignment=False)
    assert np.array_equal(out, np.arange(32))
    with pytest.raises(E.KernelError, match=r"misaligned 16-byte vector store at .*threadgroup.*alignas\(16\)"):
        lib.run("threadgroup_float_array_float4_stores", [out], grid=(1,), tg=(32,), outputs=(0,))


def test_threadgroup_array_declared_alignas_16_takes_float4_stores(lib):
    out = np.zeros(32, np.float32)
    lib.run("threadgroup_aligned_float_array_float4_stores", [out], grid=(1,), tg=(32,), outputs=(0,))
    assert np.array_equal(out, np.arange(32))


def test_threadgroup_memory_past_32k_faults(lib):
    with pytest.raises(E.KernelError, match=r"threadgroup_array_33k' uses 33792 bytes of threadgroup memory.*32768"):
        lib.run("threadgroup_array_33k", [np.zeros(32, np.float32)], grid=(1,), tg=(32,), outputs=(0,))


def test_threadgroup_arrays_and_buffers_count_together(lib):
    out = np.zeros(32, np.float32)
    lib.run("threadgroup_array_16k_plus_dynamic", [out], grid=(2,), tg=(32,), outputs=(0,), tg_mem=[16384])
    assert np.array_equal(out, (np.arange(32) + 1) % 32 + 1.0)
    with pytest.raises(E.KernelError, match=r"uses 32784 bytes of threadgroup memory \(16384 in threadgroup arrays, "
                                            r"16400 in \[\[threadgroup\(i\)\]\] buffers\)"):
        lib.run("threadgroup_array_16k_plus_dynamic", [out], grid=(1,), tg=(32,), outputs=(0,), tg_mem=[16400])


@pytest.mark.parametrize("grid,tg,match", [
    ((2 ** 26 + 1,), (64,), r"grid dimension x has 67108865 threadgroups x 64 threads = 4294967360 thread positions"),
    ((1, 2 ** 22), (1, 1025), r"1025 threads per threadgroup"),
])
def test_launches_past_metal_limits_are_refused(lib, grid, tg, match):
    with pytest.raises(E.KernelError, match=r"grid_position.*" + match):
        lib.run("grid_position", [np.zeros(64, np.uint32)], grid=grid, tg=tg, outputs=(0,))


def test_grid_of_exactly_2_to_the_32_positions_is_allowed(lib):
    # the largest grid whose positions fit; not run (4G threads): a zero-size y dimension stops it after the
    # limit checks, which look at each dimension
    lib.run("grid_position", [np.zeros(64, np.uint32)], grid=(2 ** 26, 0), tg=(64,), outputs=())


def test_converting_simdgroup_load_does_not_compile():
    with pytest.raises(RuntimeError, match="simdgroup_load: the source pointer's element type must be the matrix's"):
        E.build([CONVERTING_LOAD])


def test_device_caps_switch_sets_and_restores():
    if not torch_lowbit.emulator.available():
        pytest.skip("the emulator is not built")
    caps = _C._emu_device_caps
    assert caps() == (7, 301)  # the portable floor: M1, MSL 3.1
    with torch_lowbit.emulator.device_caps(apple_family=10):
        assert caps() == (10, 301)
        with torch_lowbit.emulator.device_caps(msl_version=400):
            assert caps() == (10, 400)
        assert caps() == (10, 301)
    with pytest.raises(ValueError, match="apple_family=6"):
        with torch_lowbit.emulator.device_caps(apple_family=6):
            pass
    with pytest.raises(RuntimeError, match="boom"):
        with torch_lowbit.emulator.device_caps(apple_family=9):
            raise RuntimeError("boom")
    assert caps() == (7, 301)


def _exported_kernel_state(path):
    """Dynamic symbols of a library that one copy per process would bind: STB_GNU_UNIQUE ones (g++'s binding of a
    template kernel's static locals: its threadgroup arrays and their epochs) and any exported threadgroup storage.
    The C++ library's own (std::, statically linked into the traffic build) are not the kernels'."""
    import re
    import subprocess
    out = subprocess.run(["readelf", "-W", "--dyn-syms", path], capture_output=True, text=True, check=True).stdout
    names = [(line.split()[-1], " UNIQUE " in line, " UND " in line) for line in out.splitlines() if line.strip()]
    return [n for n, unique, undefined in names
            if (unique and not re.match(r"_ZZ?N?St", n)) or ("msl_tg_" in n and not undefined)]


@pytest.mark.skipif(not os.uname().sysname == "Linux" or not __import__("shutil").which("readelf"),
                    reason="reads ELF symbol tables")
@pytest.mark.parametrize("which", ["_msl_emu", "_msl_trace", "planted"])
def test_each_emulator_library_keeps_its_kernel_state(which):
    # The shipped emulator, its traffic build and the planted-kernel libraries are loaded into one test process and
    # instantiate the same template kernels; with one process-wide copy of each kernel's threadgroup storage, one
    # library's run would see another's arrays and epochs. Before -fvisibility=hidden each library exported ~850.
    path = E.build([GEMV, MMA_BARRIER]) if which == "planted" else torch_lowbit.emulator._library(which)
    if path is None:
        pytest.skip(f"{which} is not built")
    shared = _exported_kernel_state(path)
    assert not shared, f"{os.path.basename(path)} exports {len(shared)} per-process kernel symbols, e.g. {shared[:3]}"
