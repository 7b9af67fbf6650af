"""fp8_mm and fp8_grouped_mm prefill on Apple M5 (metal/fp8_gemm_mpp.h on Metal 4 matmul2d) through the emulator's
tensor-op model: chosen on an M5 (emulator.device_caps(10, 400)) for bf16 / fp16 activations only, within the
float64 tolerances of the portable kernels in both thread orders, both cooperative-tensor layouts and every
float summation order; block scales, NaN codes, non-finite activations, empty and -1 groups included."""
import pytest
import torch

import torch_lowbit
from torch_lowbit import emulator
from reference import assert_matmul_close, random_fp8_bits, ref_fp8_grouped_mm, ref_fp8_mm
from test_metal_fp8 import GROUPED_CASES, SUFFIX, _gen, _scale, _x

pytestmark = pytest.mark.skipif(not emulator.available(), reason="the Metal emulator is not built in this install")

M5 = dict(apple_family=10, msl_version=400)
DTYPES16 = [torch.bfloat16, torch.float16]
# (layout, sum order, reverse thread order): each M5 case runs in one of these, all of them over a file
MODES = [("m5", "ascending", False), ("permuted", "descending", True), ("permuted", "blocks8", False)]


def _on_m5(fn, mode):
    layout, order, reverse = mode
    with emulator.device_caps(**M5), emulator.tensor_ops(layout=layout, sum_order=order, seed=5):
        if reverse:
            with emulator.reversed_thread_order():
                return fn()
        return fn()


def _mm(x, bits, scale, bias=None, block=None, mode=MODES[0]):
    out = _on_m5(lambda: torch.ops.lowbit_emu.fp8_mm(x, bits, scale, bias, block), mode)
    ref, absref = ref_fp8_mm(x, bits, scale, bias, block)
    assert_matmul_close(out, ref, absref)
    return out


def _grouped(x, bits, scale, offsets, ids=None, block=None, mode=MODES[0]):
    off = torch.tensor(offsets, dtype=torch.int32)
    eid = None if ids is None else torch.tensor(ids, dtype=torch.int32)
    out = _on_m5(lambda: torch.ops.lowbit_emu.fp8_grouped_mm(x, bits, scale, off, eid, block), mode)
    ref, absref = ref_fp8_grouped_mm(x, bits, scale, off, eid, block)
    assert_matmul_close(out, ref, absref)
    return out


def test_plans_pick_the_m5_kernels_for_16_bit_prefill_only(monkeypatch):
    mm, grouped = torch_lowbit._C._metal_fp8_mm_kernel, torch_lowbit._C._metal_fp8_grouped_mm_kernel
    with emulator.device_caps(**M5):
        for dtype in DTYPES16:
            s = SUFFIX[dtype]
            assert [mm(M, dtype) for M in (1, 8, 9, 4096)] == [f"fp8_gemv_{s}", f"fp8_gemv_rows_{s}"] + [
                f"fp8_gemm_mpp_{s}"] * 2
            assert grouped(65, 8, dtype) == f"fp8_grouped_gemm_mpp_{s}"
            assert grouped(64, 8, dtype) == f"fp8_grouped_gemv_{s}"  # decode stays on the GEMV
        assert mm(64, torch.float32) == "fp8_gemm_float"  # fp32 activations are never rounded for the tensor units
        assert grouped(65, 8, torch.float32) == "fp8_grouped_gemm_float"
        monkeypatch.setenv("TORCH_LOWBIT_NO_MPP", "1")
        assert mm(64, torch.bfloat16) == "fp8_gemm_bfloat"
        assert grouped(65, 8, torch.float16) == "fp8_grouped_gemm_half"
    monkeypatch.delenv("TORCH_LOWBIT_NO_MPP")
    assert mm(64, torch.bfloat16) == "fp8_gemm_bfloat" and grouped(65, 8, torch.bfloat16) == "fp8_grouped_gemm_bfloat"


# M in {9, 33, 64, 65, 200} around the 64-row tiles; K and N tails around the 64-wide steps
@pytest.mark.parametrize("dtype", DTYPES16)
@pytest.mark.parametrize("M,N,K", [(9, 17, 15), (33, 64, 64), (64, 65, 100), (65, 1, 130), (200, 70, 63)])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: "-".join(map(str, m)))
def test_mm_shapes(dtype, M, N, K, mode):
    g = _gen("m5mm", M, N, K, str(dtype))
    _mm(_x((M, K), dtype, g), random_fp8_bits((N, K), g), torch.rand(N, generator=g) + 0.5, mode=mode)


@pytest.mark.parametrize("kind", ["tensor", "channel2d", "block_odd", "block16", "block32", "block48"])
@pytest.mark.parametrize("mode", MODES[:2], ids=lambda m: "-".join(map(str, m)))
def test_mm_scale_granularities(kind, mode):
    g = _gen("m5scale", kind)
    M, N, K = 70, 37, 150
    scale, block = _scale(kind, N, K, g)
    _mm(_x((M, K), torch.bfloat16, g), random_fp8_bits((N, K), g), scale, block=block, mode=mode)


@pytest.mark.parametrize("dtype", DTYPES16)
@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_mm_bias(dtype, bias_dtype):
    g = _gen("m5bias", str(dtype), str(bias_dtype))
    M, N, K = 20, 29, 40
    _mm(_x((M, K), dtype, g), random_fp8_bits((N, K), g), torch.rand(N, generator=g) + 0.5,
        bias=torch.randn(N, generator=g).to(bias_dtype), mode=MODES[1])


def test_mm_nan_codes_and_non_finite_activations_stay_in_place():
    g = _gen("m5nan")
    M, N, K = 70, 12, 100
    bits = random_fp8_bits((N, K), g)
    bits[3, 5] = 0x7F
    bits[8, K - 1] = 0xFF
    x = _x((M, K), torch.bfloat16, g)
    x[40, 70] = float("inf")  # row 40 becomes +-inf or NaN in every column; no other row may see it
    scale, block = _scale("block16", N, K, g)
    out = _mm(x, bits, scale, block=block, mode=MODES[1])  # the NaN pattern is compared to the reference's
    assert torch.isnan(out[:, 3]).all() and torch.isnan(out[:, 8]).all()
    assert torch.isfinite(out[41:, [0, 1, 2, 4]]).all() and torch.isfinite(out[:40, [0, 1, 2, 4]]).all()


@pytest.mark.parametrize("case", ["prefill", "prefill_whole_tiles"])
@pytest.mark.parametrize("dtype", DTYPES16)
@pytest.mark.parametrize("mode", MODES, ids=lambda m: "-".join(map(str, m)))
def test_grouped_prefill(case, dtype, mode):
    c = GROUPED_CASES[case]
    g = _gen("m5g", case, str(dtype))
    E, N, K = 4, 70, 100
    out = _grouped(_x((c["T"], K), dtype, g), random_fp8_bits((E, N, K), g), torch.rand(E, generator=g) + 0.5,
                   c["offsets"], c["ids"], mode=mode)
    assert (out[c["offsets"][-1]:] == 0).all()  # rows in no group


@pytest.mark.parametrize("kind", ["channel", "block_odd", "block32"])
def test_grouped_prefill_scale_granularities(kind):
    c = GROUPED_CASES["prefill"]
    g = _gen("m5gs", kind)
    E, N, K = 4, 21, 80
    scale, block = _scale(kind, N, K, g, E=E)
    _grouped(_x((c["T"], K), torch.float16, g), random_fp8_bits((E, N, K), g), scale, c["offsets"], c["ids"],
             block=block, mode=MODES[1])
