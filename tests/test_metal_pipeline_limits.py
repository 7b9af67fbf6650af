"""A pipeline's maxTotalThreadsPerThreadgroup can be below Metal's 1024 (a kernel that needs many registers):
the plans then run a narrower variant, or fewer threads, never a launch the pipeline refuses. The emulator
lowers every pipeline's limit inside torch_lowbit.emulator.max_threads_per_threadgroup, and enforces it."""
import pytest
import torch

import torch_lowbit
from reference import (assert_matmul_close, random_fp8_bits, ref_fp8_grouped_mm_t, ref_fp8_mm, ref_int8_quantize,
                       ref_matmul_t, fp8_weight_f64)

pytestmark = pytest.mark.skipif(not torch_lowbit.emulator.available(),
                                reason="the Metal emulator is not built in this install")
emu = torch.ops.lowbit_emu
limit = torch_lowbit.emulator.max_threads_per_threadgroup


def _gen(*seed):
    return torch.Generator().manual_seed(hash(seed) % (2 ** 31))


@pytest.mark.parametrize("M", [1, 5, 40])  # GEMV (64 threads), multi-row GEMV (256), GEMM (128)
def test_fp8_mm_runs_within_a_128_thread_pipeline(M):
    g = _gen("fp8_mm", M)
    x = torch.randn(M, 70, generator=g).to(torch.bfloat16)
    bits = random_fp8_bits((37, 70), g)
    scale = torch.rand(37, generator=g) + 0.5
    with limit(128):
        out = emu.fp8_mm(x, bits, scale, None, None)  # M = 5: the GEMM, not the 256-thread multi-row GEMV
    assert_matmul_close(out, *ref_fp8_mm(x, bits, scale))


@pytest.mark.parametrize("op", ["fp8_mm_t", "fp8_grouped_mm_t"])
@pytest.mark.parametrize("M", [1, 5])  # the transposed GEMVs take 256 threads: the GEMM runs instead
def test_transposed_products_run_within_a_128_thread_pipeline(op, M):
    g = _gen(op, M)
    N, K = 40, 33
    go = torch.randn(M, N, generator=g).to(torch.float16)
    if op == "fp8_mm_t":
        bits = random_fp8_bits((N, K), g)
        scale = torch.rand(N, generator=g) + 0.5
        with limit(128):
            out = emu.fp8_mm_t(go, bits, scale, None)
        ref = ref_matmul_t(go, fp8_weight_f64(bits, scale))
    else:
        bits = random_fp8_bits((2, N, K), g)
        scale = torch.rand(2, generator=g) + 0.5
        offsets, ids = torch.tensor([0, M // 2, M], dtype=torch.int32), torch.tensor([1, 0], dtype=torch.int32)
        with limit(128):
            out = emu.fp8_grouped_mm_t(go, bits, scale, offsets, ids, None)
        ref = ref_fp8_grouped_mm_t(go, bits, scale, offsets, ids)
    assert_matmul_close(out, *ref)


def test_int8_quantize_strides_with_fewer_threads():
    x = torch.randn(3, 700, generator=_gen("quantize")) * 3
    with limit(64):
        q, s = emu.int8_quantize(x)
    q_ref, s_ref, _ = ref_int8_quantize(x)
    assert torch.equal(s, s_ref) and torch.equal(q, emu.int8_quantize(x)[0])
    assert (q.int() - q_ref.int()).abs().max() <= 1  # ties may round either way (test_metal_int8.py)


def test_a_kernel_with_no_narrower_variant_is_refused_with_its_limit():
    x, bits, scale = torch.ones(1, 16), torch.zeros(4, 16, dtype=torch.uint8), torch.ones(4)
    with limit(32), pytest.raises(RuntimeError, match=r"fp8_gemv_float asks for 64 threads per threadgroup; its "
                                                      r"pipeline allows 32 \(maxTotalThreadsPerThreadgroup\)"):
        emu.fp8_mm(x, bits, scale, None, None)
    assert torch.equal(emu.fp8_mm(x, bits, scale, None, None), torch.zeros(1, 4))  # the limit is restored


@pytest.mark.parametrize("bad", [0, 48, 2048])
def test_limit_must_be_whole_simdgroups_within_metal(bad):
    with pytest.raises(RuntimeError, match=f"multiple of 32 .* from 32 to 1024, got {bad}"):
        with limit(bad):
            pass
    assert torch_lowbit._C._emu_max_threads_per_threadgroup() == 1024


@pytest.mark.parametrize("max_threads", [64, 128])  # 1 or 2 of the 4 rows of 64 threads per threadgroup
def test_dequantize_kernels_take_fewer_rows_per_threadgroup(max_threads):
    from conftest import Backend
    from test_metal_w4 import W4, assert_dequantized
    g = _gen("dequantize", max_threads)
    bits, scale = random_fp8_bits((7, 70), g), torch.rand(7, generator=g) + 0.5
    w = W4("mxfp4", 7, 75, g)
    emu_backend = Backend("metal_emu")
    with limit(max_threads):
        out = emu.fp8_dequantize(bits, scale, None, torch.float32)
        out4 = emu.w4_dequantize(*w.args(emu_backend), w.K, dtype=torch.float32, **w.kwargs(emu_backend))
    assert torch.equal(out, fp8_weight_f64(bits, scale).float())  # exact: dec * scale in fp32
    assert_dequantized(out4, w, torch.float32)


# An M5 tensor-op GEMM whose own pipeline takes fewer threads than its 4 simdgroups: the plan runs the class's
# portable line (the limit is that one pipeline's, as a register-heavy kernel's may be lower than the others')
M5 = dict(apple_family=10, msl_version=400)


@pytest.mark.parametrize("op", ["int8_mm", "fp8_mm", "fp8_grouped_mm"])
def test_an_m5_gemm_past_its_pipeline_limit_gives_way_to_the_portable_one(op):
    g = _gen("m5-limit", op)
    M, N, K = 70, 37, 66
    if op == "int8_mm":
        xq = torch.randint(-127, 128, (M, K), generator=g, dtype=torch.int8)
        wq = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
        args = (xq, torch.rand(M, generator=g) * 0.01 + 1e-3, wq, torch.rand(N, generator=g) * 0.01 + 1e-3, None,
                torch.bfloat16)
        run = lambda: emu.int8_mm(*args)  # noqa: E731
        kernel = "int8_gemm_mpp_bfloat"
    else:
        x = torch.randn(M, K, generator=g).to(torch.bfloat16)
        bits = random_fp8_bits((2, N, K) if op == "fp8_grouped_mm" else (N, K), g)
        scale = torch.rand(*bits.shape[:-2], N, generator=g) + 0.5
        if op == "fp8_mm":
            run = lambda: emu.fp8_mm(x, bits, scale, None, None)  # noqa: E731
        else:
            offsets, ids = torch.tensor([0, 30, M], dtype=torch.int32), torch.tensor([1, 0], dtype=torch.int32)
            run = lambda: emu.fp8_grouped_mm(x, bits, scale, offsets, ids, None)  # noqa: E731
        kernel = f"{op.replace('_mm', '_gemm')}_mpp_bfloat"
    portable = run()
    with torch_lowbit.emulator.device_caps(**M5):
        with limit(1024, kernels=[kernel]):  # the tensor-op kernel runs: within fp32 reduction order of portable
            m5 = run()
        with limit(64, kernels=[kernel]):
            fell_back = run()
    assert torch.equal(fell_back, portable)
    assert (m5.float() - portable.float()).abs().max() <= 1e-2 * portable.float().abs().max()
    assert torch_lowbit._C._emu_max_threads_per_threadgroup() == 1024  # only that pipeline's limit was set
