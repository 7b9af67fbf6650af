"""w4_mm and w4_grouped_mm prefill on Apple M5 (metal/w4_gemm_mpp.h on Metal 4 matmul2d) through the emulator's
tensor-op model:
chosen on an M5 (emulator.device_caps(10, 400)) for bf16 / fp16 activations only; every format and scale encoding
within the float64 tolerances of the portable kernels, in both thread orders, both cooperative-tensor layouts and
every float summation order; group sizes that end K segments early (16 .. 128, odd, per channel), K and N tails
around the 64-wide tiles, output biases, NaN / inf activations and scales; for the grouped op, the routing cases
(empty groups, -1 ids, rows in no group, whole tiles) and every format."""
import math

import pytest
import torch

import torch_lowbit
from conftest import Backend
from torch_lowbit import emulator
from test_metal_fp8_apple10 import M5, MODES, _on_m5
from test_metal_fp8 import GROUPED_CASES
from test_metal_w4 import FORMATS, SUFFIX, W4, _gen, _x, non_finite_case, run_mm
from test_metal_w4_grouped import W4Experts, _rows_in_no_group_are_zero, run_grouped

pytestmark = pytest.mark.skipif(not emulator.available(), reason="the Metal emulator is not built in this install")

EMU = Backend("metal_emu")
DTYPES16 = [torch.bfloat16, torch.float16]
MODE_IDS = ["-".join(map(str, m)) for m in MODES]


def _mm(x, w, bias=None, mode=MODES[0]):
    return _on_m5(lambda: run_mm(EMU, x, w, bias), mode)


def _kernel(M, dtype, fmt="nvfp4", sdt=torch.uint8, odt=None, group=16):
    meta = torch.device("meta")
    with emulator.dry_run() as d:
        d.ops.w4_mm(torch.empty(M, 64, dtype=dtype, device=meta), torch.empty(16, 32, dtype=torch.uint8, device=meta),
                    torch.empty(16, 64 // group, dtype=sdt, device=meta), fmt, group,
                    None if odt is None else torch.empty(16, 64 // group, dtype=odt, device=meta))
        (rec,) = d.take()
    return rec["kernel"]


def test_plans_pick_the_m5_kernel_for_16_bit_prefill_only(monkeypatch):
    with emulator.device_caps(**M5):
        for dtype in DTYPES16:
            s = SUFFIX[dtype]
            assert [_kernel(M, dtype) for M in (1, 8, 9, 4096)] == [f"w4_gemv_{s}_e4m3_none", f"w4_gemv_rows_{s}_e4m3_none"] + [
                f"w4_gemm_mpp_{s}_e4m3_none"] * 2
            assert _kernel(64, dtype, "uint4", torch.bfloat16, torch.bfloat16, 32) == f"w4_gemm_mpp_{s}_bf16_bias"
        assert _kernel(64, torch.float32) == "w4_gemm_float_e4m3_none"  # fp32 activations are never rounded
        monkeypatch.setenv("TORCH_LOWBIT_NO_MPP", "1")
        assert _kernel(64, torch.bfloat16) == "w4_gemm_bfloat_e4m3_none"
    monkeypatch.delenv("TORCH_LOWBIT_NO_MPP")
    assert _kernel(64, torch.bfloat16) == "w4_gemm_bfloat_e4m3_none"  # not an M5


def test_nvfp4_stages_decoded_weights_and_the_others_fold_group_scales():
    """kW4MppScaled (decoded weights in the tile, segments across groups) only where every value times every
    scale is exact in the dtype: nvfp4 (E2M1 x E4M3) in bf16 and fp16; int4, MLX uint4, mxfp4 (E8M0 reaches
    subnormals) fold their group scales."""
    def scaled(fid, dtype):
        w = W4(fid, 4, 64, _gen("flag", fid))
        return torch_lowbit._C._metal_w4_scaled_exact(w.codes, w.scale, w.format, w.group, 64, dtype)

    for dtype, want in [(torch.bfloat16, True), (torch.float16, True), (torch.float32, False)]:
        assert scaled("nvfp4", dtype) is want and scaled("nvfp4_f8", dtype) is want
    for fid in ["mxfp4", "int4_sym_f16", "int4_zp_f32", "uint4_bias_bf16"]:
        assert scaled(fid, torch.bfloat16) is False and scaled(fid, torch.float16) is False


# M = 70: a full and a partial 64-row tile; N = 70: a partial 64-column tile; K = 200 ends every group size here in
# a partial group and the last 64-code segment early
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("dtype", DTYPES16)
@pytest.mark.parametrize("fid", list(FORMATS))
def test_mm_formats(fid, dtype, mode):
    g = _gen("m5fmt", fid, str(dtype), mode)
    _mm(_x((70, 200), dtype, g), W4(fid, 70, 200, g), mode=mode)


# K tails: half a byte, an odd K, below / at / past one 64-code segment, several segments with a partial last one
@pytest.mark.parametrize("mode", MODES[:2], ids=MODE_IDS[:2])
@pytest.mark.parametrize("fid", ["nvfp4", "int4_zp_bf16", "uint4_bias_f16", "mxfp4"])
@pytest.mark.parametrize("M,N,K", [(9, 17, 1), (33, 64, 15), (64, 65, 64), (65, 1, 65), (100, 70, 330)])
def test_mm_shapes(fid, M, N, K, mode):
    g = _gen("m5shape", fid, M, N, K, mode)
    _mm(_x((M, K), torch.bfloat16, g), W4(fid, N, K, g), mode=mode)


# groups below a segment (16, 32), equal (64), across two (128), not dividing it (48, 7), and one per row (300)
@pytest.mark.parametrize("group", [7, 16, 32, 48, 64, 128, 300])
@pytest.mark.parametrize("fid", ["int4_zp_bf16", "int4_sym_f16", "uint4_bias_bf16"])
def test_mm_group_sizes(fid, group):
    g = _gen("m5group", fid, group)
    _mm(_x((40, 300), torch.float16, g), W4(fid, 20, 300, g, group=group), mode=MODES[1])


@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16])
def test_mm_bias(bias_dtype):
    g = _gen("m5bias", str(bias_dtype))
    w = W4("nvfp4", 33, 100, g)
    _mm(_x((70, 100), torch.bfloat16, g), w, bias=torch.randn(33, generator=g).to(bias_dtype))


# NaN and inf activations propagate as in float64; a NaN or infinite scale makes only its own column NaN (an
# infinite scale: NaN, as the exact sum has 0 * inf terms). Biases are left out: there an infinite activation
# times a code of value 0 gives NaN where the exact weight is the bias (metal/w4_gemm_mpp.h).
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("fid", ["nvfp4", "mxfp4", "int4_zp_bf16", "int4_sym_f16"])
def test_mm_non_finite(fid, mode):
    x, w = non_finite_case(fid, 70, 7, 100, torch.bfloat16, _gen("m5nan", fid, mode))
    out = _mm(x, w, mode=mode)
    assert torch.isnan(out[0]).all() and torch.isnan(out[:, 2]).all()


def test_mm_matches_the_portable_gemm_on_a_larger_shape():
    """A 200 x 192 x 1024 int4 g128 product (several column tiles, 16 segments a row) against the portable
    GEMM's result (both against float64 too)."""
    g = _gen("m5large")
    w = W4("int4_zp_bf16", 192, 1024, g, group=128)
    x = _x((200, 1024), torch.bfloat16, g)
    m5 = _mm(x, w)
    portable = run_mm(EMU, x, w)
    assert torch.allclose(m5.double(), portable.double(), rtol=2e-2, atol=1e-2)


# ---------------------------------------------------------------------------------------------- w4_grouped_mm
PREFILL = ["prefill", "prefill_whole_tiles"]


def test_grouped_plan_picks_the_m5_kernel_for_16_bit_prefill_only():
    meta = torch.device("meta")

    def kernel(T, dtype):
        with emulator.device_caps(**M5), emulator.dry_run() as d:
            d.ops.w4_grouped_mm(torch.empty(T, 64, dtype=dtype, device=meta),
                                torch.empty(4, 16, 32, dtype=torch.uint8, device=meta),
                                torch.empty(4, 16, 2, dtype=torch.uint8, device=meta), "mxfp4", 32,
                                torch.empty(5, dtype=torch.int32, device=meta), None)
            return d.take()[-1]["kernel"]

    for dtype in DTYPES16:
        assert kernel(32, dtype) == f"w4_grouped_gemv_{SUFFIX[dtype]}_e8m0_none"  # decode stays on the GEMV
        assert kernel(33, dtype) == f"w4_grouped_gemm_mpp_{SUFFIX[dtype]}_e8m0_none"
    assert kernel(33, torch.float32) == "w4_grouped_gemm_float_e8m0_none"


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("case", PREFILL)
def test_grouped_mm_routing(case, mode):
    c = GROUPED_CASES[case]
    g = _gen("m5route", case, mode)
    w = W4Experts("int4_zp_bf16", 4, 70, 100, g)
    out = _on_m5(lambda: run_grouped(EMU, w, _x((c["T"], 100), torch.bfloat16, g), c["offsets"], c["ids"]), mode)
    _rows_in_no_group_are_zero(out, c)


# every format (per-expert global scales included) and 16-bit dtype; K = 45: odd and a partial last group
@pytest.mark.parametrize("dtype", DTYPES16)
@pytest.mark.parametrize("fid", list(FORMATS))
def test_grouped_mm_formats(fid, dtype):
    c = GROUPED_CASES["prefill"]
    g = _gen("m5gfmt", fid, str(dtype))
    w = W4Experts(fid, 4, 7, 45, g)
    _on_m5(lambda: run_grouped(EMU, w, _x((c["T"], 45), dtype, g), c["offsets"], c["ids"]), MODES[1])


def test_grouped_mm_non_finite():
    c = GROUPED_CASES["prefill"]
    g = _gen("m5gnan")
    w = W4Experts("mxfp4", 4, 7, 64, g)
    w.scale[1, 2, 1] = 0xFF  # e8m0 NaN: expert 1, column 2
    x = _x((c["T"], 64), torch.bfloat16, g)
    x[0, 5] = math.inf  # group 0's first row
    _on_m5(lambda: run_grouped(EMU, w, x, c["offsets"], c["ids"]), MODES[2])
