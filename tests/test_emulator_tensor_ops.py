"""The emulator's model of Metal 4 tensor ops (csrc/emu/include/msl_tensor.h) catches what M5 hardware would get
wrong without telling us: planted kernels (tests/planted/tensor_ops*.metal) each break one rule of matmul2d and
fail here, their correct twin passes in both thread orders and both cooperative-tensor layouts.
"""
import os

import numpy as np
import pytest

import emu_ctypes as E

pytestmark = pytest.mark.skipif(E.compiler() is None, reason="needs g++ to build the planted kernels")

TENSOR_OPS = os.path.join(E.PLANTED, "tensor_ops.metal")
BAD_TYPES = os.path.join(E.PLANTED, "tensor_ops_bad_types.metal")
RELAXED = os.path.join(E.PLANTED, "tensor_ops_relaxed.metal")
BFLOAT_OS26_0 = os.path.join(E.PLANTED, "tensor_ops_bfloat_os26_0.metal")
COOP = [os.path.join(E.PLANTED, f"tensor_ops_coop_{t}.metal") for t in "ab"]

PLAUSIBLE, PERMUTED = 0, 1


@pytest.fixture(scope="module")
def lib():
    library = E.Library(E.build([TENSOR_OPS]))
    library.lib.msl_emu_set_tensor_ops.argtypes = [E.ctypes.c_int, E.ctypes.c_int, E.ctypes.c_uint]
    yield library
    library.lib.msl_emu_set_tensor_ops(PLAUSIBLE, 0, 1)


def run_int8(lib, bug, M=50, N=61, K=40, layout=PERMUTED, reverse=False, threads=128, seed=3):
    rng = np.random.default_rng(seed)
    a = rng.integers(-128, 128, (M, K), dtype=np.int8)
    b = rng.integers(-128, 128, (N, K), dtype=np.int8)
    out = np.zeros((M, N), np.int32)
    lib.lib.msl_emu_set_tensor_ops(layout, 0, seed)
    text = lib.run("mm_int8", [a, b, out, np.array([M, N, K, bug], np.uint32)], grid=(1,), tg=(threads,),
                   outputs=(2,), reverse=reverse, check=False)
    ref = a.astype(np.int64) @ b.astype(np.int64).T
    return text, out, ref


def run_half(lib, bug, M=64, N=57, K=40, reverse=False, sum_order=0, seed=5):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((M, K)).astype(np.float16)
    b = rng.standard_normal((N, K)).astype(np.float16)
    out = np.zeros((M, N), np.float32)
    lib.lib.msl_emu_set_tensor_ops(PERMUTED, sum_order, seed)
    text = lib.run("mm_half_staged", [a, b, out, np.array([M, N, K, bug], np.uint32)], grid=(1,), tg=(128,),
                   outputs=(2,), reverse=reverse, check=False)
    ref = a.astype(np.float64) @ b.astype(np.float64).T
    bound = K * 2.0 ** -24 * (np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)).T)
    return text, out, ref, bound


def errors(text):
    return [line for line in text.splitlines() if line.startswith(("error", "warning"))]


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("layout", [PLAUSIBLE, PERMUTED])
def test_int8_matmul2d_exact_in_every_layout_and_order(lib, layout, reverse):
    text, out, ref = run_int8(lib, 0, layout=layout, reverse=reverse)
    assert errors(text) == []
    np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("layout", [PLAUSIBLE, PERMUTED])
def test_cooperative_store_writes_each_element_inside_the_extents(lib, layout):
    text, out, ref = run_int8(lib, 8, layout=layout)
    assert errors(text) == []
    np.testing.assert_array_equal(out, ref)


def test_int8_matmul2d_sums_minus_128_squares_exactly(lib):
    M = N = 64
    K = 496  # -128 * -128 everywhere: every product 2^14, no rounding anywhere
    a = np.full((M, K), -128, np.int8)
    b = np.full((N, K), -128, np.int8)
    out = np.zeros((M, N), np.int32)
    lib.lib.msl_emu_set_tensor_ops(PERMUTED, 0, 9)
    lib.run("mm_int8", [a, b, out, np.array([M, N, K, 0], np.uint32)], grid=(1,), tg=(128,), outputs=(2,))
    assert (out == 16384 * K).all()


def test_a_kernel_that_assumes_the_lane_layout_passes_only_where_its_guess_is_right(lib):
    text, out, ref = run_int8(lib, 1, layout=PLAUSIBLE)
    np.testing.assert_array_equal(out, ref)  # the guess happens to be the plausible layout...
    text, out, ref = run_int8(lib, 1, layout=PERMUTED)
    assert not np.array_equal(out, ref)  # ...which the hardware does not promise


@pytest.mark.parametrize("layout", [PLAUSIBLE, PERMUTED])
def test_missing_zero_initialisation_fails(lib, layout):
    text, out, ref = run_int8(lib, 2, layout=layout)
    assert "the destination was not zeroed" in text


def test_int32_overflow_of_the_destination_is_an_error(lib):
    text, _, _ = run_int8(lib, 7)
    assert "int32 destination overflows" in text


def test_multiply_mode_inside_a_k_loop_keeps_only_the_last_step(lib):
    text, out, ref = run_int8(lib, 3)
    assert errors(text) == []
    assert not np.array_equal(out, ref)


@pytest.mark.parametrize("reverse", [False, True])
def test_skipping_is_valid_element_corrupts_the_result(lib, reverse):
    text, out, ref = run_int8(lib, 4, M=64, N=64, reverse=reverse)
    assert not np.array_equal(out, ref)


def test_run_not_reached_by_every_thread_of_the_scope_is_an_error(lib):
    text, _, _ = run_int8(lib, 5)
    assert "exited the kernel while others wait" in text


def test_threads_passing_different_operands_is_an_error(lib):
    text, _, _ = run_int8(lib, 6)
    assert "pass different operands" in text


def test_a_threadgroup_smaller_than_the_scope_is_an_error(lib):
    text, _, _ = run_int8(lib, 0, threads=64)
    assert "execution_simdgroups<4> run by a threadgroup of 64 threads" in text


@pytest.mark.parametrize("reverse", [False, True])
def test_half_staged_in_threadgroup_memory_within_the_fp32_bound(lib, reverse):
    text, out, ref, bound = run_half(lib, 0, reverse=reverse)
    assert errors(text) == []
    assert (np.abs(out - ref) <= bound + 1e-30).all()


def test_float_sums_depend_on_the_order_but_stay_within_the_bound(lib):
    results = []
    for order in (0, 1, 2):
        text, out, ref, bound = run_half(lib, 0, K=256, sum_order=order)
        assert errors(text) == []
        assert (np.abs(out - ref) <= bound + 1e-30).all()
        results.append(out.copy())
    assert not all(np.array_equal(results[0], r) for r in results[1:])


@pytest.mark.parametrize("reverse", [False, True])
def test_missing_barrier_before_run_is_an_error(lib, reverse):
    text, _, _, _ = run_half(lib, 1, reverse=reverse)
    assert "a threadgroup_barrier is missing before run" in text


@pytest.mark.parametrize("reverse", [False, True])
def test_missing_barrier_after_run_is_an_error(lib, reverse):
    text, _, _, _ = run_half(lib, 2, reverse=reverse)
    assert "overwritten before the execution scope's next threadgroup_barrier" in text


def test_reading_a_tensor_destination_before_the_barrier_reads_poison(lib):
    text, out, ref, _ = run_half(lib, 3)
    assert np.isnan(out).all()


@pytest.mark.parametrize("path,message", [(BAD_TYPES, "not in Apple's table"),
                                          (RELAXED, "relaxed_precision = true"),
                                          (BFLOAT_OS26_0, "not in Apple's table")])
def test_refused_at_compile_time(path, message):
    with pytest.raises(RuntimeError, match=message):
        E.build([path])


# ---- the model across kernel files, and NaN sums ----
@pytest.fixture(scope="module")
def coop():
    library = E.Library(E.build(COOP))
    library.lib.msl_emu_set_tensor_ops.argtypes = [E.ctypes.c_int, E.ctypes.c_int, E.ctypes.c_uint]
    yield library
    library.lib.msl_emu_set_tensor_ops(PLAUSIBLE, 0, 1)


def run_coop(lib, kernel, a, b, reverse=False):
    M, K = a.shape
    N = b.shape[0]
    out = np.zeros((M, N), np.float32)
    lib.lib.msl_emu_set_tensor_ops(PERMUTED, 0, 7)
    text = lib.run(kernel, [a, b, out, np.array([M, N, K, 0], np.uint32)], grid=(1,), tg=(128,), outputs=(2,),
                   reverse=reverse, check=False)
    return text, out


@pytest.mark.parametrize("reverse", [False, True])
def test_one_matmul2d_type_in_two_kernel_files(coop, reverse):
    """Both files' kernels (one merged out-of-line copy of the run's resolver, each file's own inlined run) run
    several runs each without a false 'different operands' (each run resolves the pending run its run filled)."""
    rng = np.random.default_rng(11)
    a = rng.standard_normal((50, 100)).astype(np.float16)
    b = rng.standard_normal((61, 100)).astype(np.float16)
    ref = a.astype(np.float64) @ b.astype(np.float64).T
    bound = 100 * 2.0 ** -24 * (np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)).T)
    for kernel in ("mm_half_coop_a", "mm_half_coop_b", "mm_half_coop_a"):
        text, out = run_coop(coop, kernel, a, b, reverse)
        assert errors(text) == [], (kernel, text)
        assert (np.abs(out - ref) <= bound + 1e-30).all(), kernel


def test_a_nan_sum_accumulated_again_is_not_taken_for_poison(coop):
    """A NaN operand makes its row's sums NaN (the canonical quiet NaN); accumulating onto them in the next runs is
    legitimate, and the row comes out NaN, the others exact within the bound."""
    rng = np.random.default_rng(12)
    a = rng.standard_normal((20, 96)).astype(np.float16)
    b = rng.standard_normal((9, 96)).astype(np.float16)
    a[3, 0] = np.nan
    text, out = run_coop(coop, "mm_half_coop_a", a, b)
    assert errors(text) == [], text
    assert np.isnan(out[3]).all() and not np.isnan(np.delete(out, 3, axis=0)).any()
