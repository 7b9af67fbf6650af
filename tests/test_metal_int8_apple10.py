"""int8_mm on Apple M5 (metal/int8_gemm_apple10.metal: Metal 4 matmul2d, int8 x int8 -> int32) through the emulator's
tensor-op model: the plan picks it on an M5 (emulator.device_caps(10, 400)) and nowhere else, and its results are
bit-identical to the portable kernel's in both thread orders and both cooperative-tensor layouts."""
import pytest
import torch

import torch_lowbit
from torch_lowbit import emulator
from reference import ref_int8_mm

pytestmark = pytest.mark.skipif(not emulator.available(), reason="the Metal emulator is not built in this install")

M5 = dict(apple_family=10, msl_version=400)
LAYOUTS = ["m5", "permuted"]


def _gen(*seed):
    return torch.Generator().manual_seed(hash(seed) % (2 ** 31))


def _case(M, N, K, g, bias_dtype=None, per_channel=True):
    xq = torch.randint(-128, 128, (M, K), dtype=torch.int8, generator=g)
    wq = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)
    xq.view(-1)[0] = -128
    wq.view(-1)[-1] = -128
    xs = torch.rand(M, generator=g) * 0.02 + 1e-3
    ws = torch.rand(N if per_channel else 1, generator=g) * 0.01 + 1e-3
    bias = None if bias_dtype is None else (torch.randn(N, generator=g) * 4).to(bias_dtype)
    return xq, xs, wq, ws, bias


def _mm(args, out_dtype, caps=None, layout="m5", reverse=False):
    run = lambda: torch.ops.lowbit_emu.int8_mm(*args, out_dtype)  # noqa: E731
    with emulator.device_caps(**(caps or {})), emulator.tensor_ops(layout=layout, seed=11):
        if reverse:
            with emulator.reversed_thread_order():
                return run()
        return run()


def _epilogue_bits(args, out_dtype):
    """The epilogue both kernels share (int8.h int8_dequant), in torch's fp32: acc * xs * ws (+ bias), rounded once."""
    xq, xs, wq, ws, bias = args
    _, acc = ref_int8_mm(xq, xs, wq, ws)
    v = acc.float() * xs.float()[:, None] * ws.float().reshape(1, -1)
    if bias is not None:
        v = v + bias.float()
    return v.to(out_dtype)


def _same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(torch.int16 if a.element_size() == 2 else torch.int32),
                       b.view(torch.int16 if b.element_size() == 2 else torch.int32))


def test_plan_picks_the_m5_gemm_only_on_m5_with_tensor_ops(monkeypatch):
    pick = torch_lowbit._C._metal_int8_mm_kernel
    with emulator.device_caps(**M5):
        assert [pick(M, 4096, 4096) for M in (9, 64, 512)] == ["int8_gemm_mpp"] * 3
        assert pick(8, 4096, 4096) == "int8_gemv"  # the GEMV class has no M5 line
        monkeypatch.setenv("TORCH_LOWBIT_NO_MPP", "1")
        assert pick(64, 4096, 4096) == "int8_gemm"
        monkeypatch.delenv("TORCH_LOWBIT_NO_MPP")
    with emulator.device_caps(apple_family=10, msl_version=301):  # an M5 whose tensor-op library did not load
        assert pick(64, 4096, 4096) == "int8_gemm"
    with emulator.device_caps(apple_family=9, msl_version=400):  # MSL 4.0 on an M4: no tensor units
        assert pick(64, 4096, 4096) == "int8_gemm"
    assert pick(64, 4096, 4096) == "int8_gemm"


def test_no_mpp_keeps_the_plan_itself_on_the_portable_kernels(monkeypatch):
    # under the test-only device the plan dispatches int8_gemm_probe_*, which does not exist; TORCH_LOWBIT_NO_MPP=1
    # turns off every line that needs MSL >= 4.0, so the same call runs the portable kernel
    args = _case(33, 17, 40, _gen("nompp"))
    test_only = dict(apple_family=1000, msl_version=9900)
    with pytest.raises(RuntimeError, match="no kernel named 'int8_gemm_probe_float"):
        _mm(args, torch.float32, test_only)
    monkeypatch.setenv("TORCH_LOWBIT_NO_MPP", "1")
    _same_bits(_mm(args, torch.float32, test_only), _epilogue_bits(args, torch.float32))


# M in {9, 33, 64, 65, 200}; N and K tails around the 64-wide tiles and K steps; K = 4099 = 64 steps + 3
SHAPES = [(9, 17, 15), (33, 64, 64), (64, 65, 63), (65, 16, 4099), (200, 63, 65), (200, 1, 1), (33, 130, 17)]


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
def test_m5_gemm_bit_identical_to_the_portable_kernel(M, N, K, layout, reverse):
    args = _case(M, N, K, _gen("bits", M, N, K), bias_dtype=torch.bfloat16)
    m5 = _mm(args, torch.float32, M5, layout=layout, reverse=reverse)
    _same_bits(m5, _mm(args, torch.float32))
    _same_bits(m5, _epilogue_bits(args, torch.float32))


# grids of at least 8 x 8 tiles: whole Morton blocks (tile_order.h), then the strips right of and below them; a
# tile walked twice or never shows as a wrong or poisoned output element
@pytest.mark.parametrize("M,N,K", [(520, 520, 16), (1100, 600, 8), (512, 1030, 3)])
def test_m5_gemm_walks_every_tile_once_in_morton_order(M, N, K):
    args = _case(M, N, K, _gen("morton", M, N, K), bias_dtype=torch.float16)
    _same_bits(_mm(args, torch.float32, M5, layout="permuted"), _epilogue_bits(args, torch.float32))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("per_channel", [True, False])
def test_m5_gemm_every_output_dtype_bias_and_scale(out_dtype, bias_dtype, per_channel):
    args = _case(65, 37, 70, _gen("dtypes", str(out_dtype), str(bias_dtype), per_channel), bias_dtype, per_channel)
    m5 = _mm(args, out_dtype, M5, layout="permuted")
    _same_bits(m5, _mm(args, out_dtype))
    _same_bits(m5, _epilogue_bits(args, out_dtype))


def test_m5_gemm_int32_sum_exact_past_2_to_the_24():
    # -128 * -128 everywhere: every sum is 2^14 K = 2^26 + 3 * 2^14 at K = 4099, exact only in int32
    M, N, K = 65, 17, 4099
    xq, wq = torch.full((M, K), -128, dtype=torch.int8), torch.full((N, K), -128, dtype=torch.int8)
    args = (xq, torch.ones(M), wq, torch.ones(N), None)
    out = _mm(args, torch.float32, M5, layout="permuted")
    assert torch.equal(out, torch.full((M, N), float(16384 * K)))


def test_m5_gemm_views_at_odd_storage_offsets():
    g = _gen("offsets")
    M, N, K = 40, 23, 37
    xbuf = torch.randint(-128, 128, (M * K + 3,), dtype=torch.int8, generator=g)
    wbuf = torch.randint(-128, 128, (N * K + 5,), dtype=torch.int8, generator=g)
    xq, wq = xbuf[3:].view(M, K), wbuf[5:].view(N, K)
    args = (xq, torch.ones(M), wq, torch.ones(N), None)
    _, acc = ref_int8_mm(xq, torch.ones(M), wq, torch.ones(N))
    assert torch.equal(_mm(args, torch.float32, M5, layout="permuted").double(), acc.double())


def test_m5_bench_suite_compares_both_paths_through_the_emulator(capsys):
    from torch_lowbit.bench import __main__ as bench_main
    assert bench_main.main(["--suite", "m5", "--device", "emu", "--shapes", "70,40,65", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "int8_mm" in out and "fp8_mm bf16" in out and "70x40x65" in out and " NO" not in out
