"""fp8_mm: every scale granularity, dtypes, tails, M regimes, 3-D x, bias, NaN codes, empty sizes, bad input."""
import math

import pytest
import torch

from conftest import backends_for
from reference import assert_matmul_close, random_fp8_bits, ref_fp8_mm

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# fp32 accumulation in any order: error bounded by a few K * eps of |x| @ |w| (K <= 300 here)
ACC_RTOL = 1e-5


def make_scale(layout, N, K, g):
    """(scale, block_size) for a layout name; block names are block_<bn>x<bk>."""
    if layout == "tensor":
        return torch.rand(1, generator=g) + 0.5, None
    if layout == "tensor0d":
        return torch.rand((), generator=g) + 0.5, None
    if layout == "channel":
        return torch.rand(N, generator=g) + 0.5, None
    if layout == "channel2d":
        return torch.rand(N, 1, generator=g) + 0.5, None
    bn, bk = (int(v) for v in layout[len("block_"):].split("x"))
    return torch.rand(math.ceil(N / bn), math.ceil(K / bk), generator=g) + 0.5, [bn, bk]


def check(backend, x, bits, scale, bias=None, block=None, as_fp8=False):
    w = bits.view(torch.float8_e4m3fn) if as_fp8 else bits
    out = backend.op("fp8_mm")(backend.to(x), backend.to(w), backend.to(scale), backend.to(bias), block)
    assert out.shape == (*x.shape[:-1], bits.shape[0]) and out.dtype == x.dtype and out.device == backend.device
    ref, absref = ref_fp8_mm(x.reshape(-1, x.shape[-1]), bits, scale, bias, block)
    assert_matmul_close(out.reshape(-1, bits.shape[0]), ref, absref, acc_rtol=ACC_RTOL)
    return out


@pytest.mark.parametrize("backend", backends_for("fp8_mm"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 2, 3, 17, 64])
@pytest.mark.parametrize("layout", ["tensor", "channel", "channel2d", "block_16x32", "block_3x7", "block_128x128"])
def test_matches_reference(backend, dtype, M, layout):
    N, K = 37, 100  # tails for every vector width and block size
    g = torch.Generator().manual_seed(M * 100 + len(layout))
    x = torch.randn(M, K, generator=g).to(dtype)
    bits = random_fp8_bits((N, K), g)
    scale, block = make_scale(layout, N, K, g)
    check(backend, x, bits, scale, torch.randn(N, generator=g), block)


@pytest.mark.parametrize("backend", backends_for("fp8_mm"))
@pytest.mark.parametrize("N,K", [(1, 1), (7, 31), (33, 65), (130, 257), (8, 288)])
@pytest.mark.parametrize("M", [1, 3, 20])
def test_tails(backend, N, K, M):
    g = torch.Generator().manual_seed(N * 7 + K + M)
    check(backend, torch.randn(M, K, generator=g), random_fp8_bits((N, K), g), torch.rand(N, generator=g) + 0.5)


@pytest.mark.parametrize("backend", backends_for("fp8_mm"))
@pytest.mark.parametrize("layout", ["tensor0d", "channel", "block_8x64"])
def test_3d_x_without_bias(backend, layout):
    g = torch.Generator().manual_seed(3)
    N, K = 24, 130
    scale, block = make_scale(layout, N, K, g)
    out = check(backend, torch.randn(2, 5, K, generator=g).to(torch.bfloat16), random_fp8_bits((N, K), g), scale,
                None, block)
    assert out.shape == (2, 5, N)


@pytest.mark.parametrize("backend", backends_for("fp8_mm"))
@pytest.mark.parametrize("M", [1, 9])
def test_fp8_and_uint8_weights_identical(backend, M):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(M, 70, generator=g).to(torch.float16)
    bits = random_fp8_bits((19, 70), g)
    s = torch.rand(19, generator=g)
    a = check(backend, x, bits, s)
    b = check(backend, x, bits, s, as_fp8=True)
    assert torch.equal(a.cpu(), b.cpu())


@pytest.mark.parametrize("backend", backends_for("fp8_mm"))
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16])
def test_low_precision_scales_are_widened(backend, scale_dtype):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 40, generator=g)
    bits = random_fp8_bits((11, 40), g)
    s = (torch.rand(11, generator=g) + 0.5).to(scale_dtype)
    check(backend, x, bits, s)  # the reference uses the same (rounded) scale values


@pytest.mark.parametrize("backend", backends_for("fp8_mm"))
@pytest.mark.parametrize("M", [1, 2, 17])
def test_nan_codes_give_nan_columns(backend, M):
    g = torch.Generator().manual_seed(6)
    bits = random_fp8_bits((10, 50), g)
    bits[3, 17] = 0x7F
    bits[8, 49] = 0xFF
    out = check(backend, torch.randn(M, 50, generator=g), bits, torch.ones(1))
    assert torch.isnan(out[:, [3, 8]]).all() and not torch.isnan(out[:, [0, 1, 2, 4, 5, 6, 7, 9]]).any()


@pytest.mark.parametrize("backend", backends_for("fp8_mm", emu_rev=False))
@pytest.mark.parametrize("M,N,K", [(0, 4, 8), (3, 0, 8), (3, 4, 0), (0, 0, 0)])
def test_empty(backend, M, N, K):
    bias = torch.randn(N)
    out = backend.op("fp8_mm")(backend.to(torch.randn(M, K).to(torch.bfloat16)),
                               backend.to(torch.zeros(N, K, dtype=torch.uint8)), backend.to(torch.ones(1)),
                               backend.to(bias), None)
    assert out.shape == (M, N) and out.dtype == torch.bfloat16
    # K == 0: an empty sum, so the output is the bias
    torch.testing.assert_close(out.cpu(), bias.to(torch.bfloat16).expand(M, N))


def _bad_cases():
    u8 = torch.zeros(4, 8, dtype=torch.uint8)
    x = torch.randn(2, 8)
    one = torch.ones(1)
    return [
        (x.to(torch.int32), u8, one, None, None, "x must be bfloat16, float16 or float32"),
        (x.double(), u8, one, None, None, "x must be bfloat16, float16 or float32"),
        (torch.tensor(1.0), u8, one, None, None, "x must have at least one dimension"),
        (x, u8.to(torch.int8), one, None, None, "weight must be float8_e4m3fn or uint8"),
        (x, torch.zeros(4, 8, 1, dtype=torch.uint8), one, None, None, r"weight must be \[N, K\]"),
        (x, torch.zeros(8, 4, dtype=torch.uint8).T, one, None, None, "weight must be contiguous"),
        (torch.randn(2, 7), u8, one, None, None, "must equal weight's K"),
        (x, u8, torch.ones(3), None, None, "scale must be"),
        (x, u8, torch.ones(4, 2), None, None, "pass block_size"),
        (x, u8, torch.ones(2, 3), None, [2, 4], "scale must have shape"),
        (x, u8, torch.ones(2, 2), None, [2], "block_size must be"),
        (x, u8, torch.ones(2, 2), None, [2, 0], "must be positive"),
        (x, u8, torch.ones(4, dtype=torch.int32), None, None, "scale must be float32"),
        (x, u8, one, torch.ones(5), None, r"bias must be \[N\]"),
        (x, u8, one, torch.ones(4, dtype=torch.int64), None, "bias must be float32, bfloat16 or float16, got Long"),
    ]


@pytest.mark.parametrize("backend", backends_for("fp8_mm", emu_rev=False))
@pytest.mark.parametrize("x,w,scale,bias,block,match", _bad_cases())
def test_bad_input(backend, x, w, scale, bias, block, match):
    with pytest.raises((RuntimeError, ValueError), match=match):
        backend.op("fp8_mm")(backend.to(x), backend.to(w), backend.to(scale), backend.to(bias), block)


@pytest.mark.parametrize("backend", backends_for("fp8_mm", emu_rev=False))
@pytest.mark.parametrize("which", ["weight", "scale", "bias"])
def test_devices_differ(backend, which):
    args = {"x": backend.to(torch.randn(2, 8)), "weight": backend.to(torch.zeros(4, 8, dtype=torch.uint8)),
            "scale": backend.to(torch.ones(1)), "bias": backend.to(torch.ones(4))}
    args[which] = args[which].to("meta")
    with pytest.raises((RuntimeError, ValueError), match=f"{which} is on meta"):
        backend.op("fp8_mm")(args["x"], args["weight"], args["scale"], args["bias"], None)
