"""fp8_dequantize: every code, every scale layout, tails, dtypes, bad input."""
import math

import pytest
import torch

from conftest import backends_for
from reference import assert_dequantized_close, fp8_bits_to_f64, random_fp8_bits

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _check(backend, bits, scale, block_size, dtype, as_fp8=False):
    w = bits.view(torch.float8_e4m3fn) if as_fp8 else bits
    out = backend.op("fp8_dequantize")(backend.to(w), backend.to(scale), block_size, dtype)
    assert out.shape == bits.shape and out.dtype == dtype and out.device == backend.device
    assert_dequantized_close(out, bits, scale, block_size)


@pytest.mark.parametrize("backend", backends_for("fp8_dequantize"))
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_256_codes_decode_exactly(backend, dtype):
    bits = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    out = backend.op("fp8_dequantize")(backend.to(bits), backend.to(torch.ones(1)), None, torch.float32).cpu()
    ref = fp8_bits_to_f64(bits)
    nan = torch.isnan(ref)
    assert nan.sum() == 2 and torch.isnan(out[nan]).all()
    assert torch.equal(out[~nan].double(), ref[~nan])  # exact, subnormals included
    # and torch agrees with our reference on every finite code
    assert torch.equal(bits.view(torch.float8_e4m3fn).double()[~nan], ref[~nan])


@pytest.mark.parametrize("backend", backends_for("fp8_dequantize"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K", [(1, 1), (3, 5), (17, 33), (8, 130)])
@pytest.mark.parametrize("layout", ["tensor", "channel", "channel2d", "block"])
def test_layouts_and_tails(backend, dtype, N, K, layout):
    g = torch.Generator().manual_seed(N * 1000 + K)
    bits = random_fp8_bits((N, K), g)
    block = None
    if layout == "tensor":
        scale = torch.rand(1, generator=g) + 0.5
    elif layout == "channel":
        scale = torch.rand(N, generator=g) + 0.5
    elif layout == "channel2d":
        scale = torch.rand(N, 1, generator=g) + 0.5
    else:
        block = [2, 4]
        scale = torch.rand(math.ceil(N / 2), math.ceil(K / 4), generator=g) + 0.5
    _check(backend, bits, scale, block, dtype)


@pytest.mark.parametrize("backend", backends_for("fp8_dequantize"))
def test_fp8_and_uint8_weights_identical(backend):
    g = torch.Generator().manual_seed(1)
    bits = random_fp8_bits((9, 21), g, allow_nan=True)
    s = torch.rand(9, generator=g)
    a = backend.op("fp8_dequantize")(backend.to(bits), backend.to(s), None, torch.float32).cpu()
    b = backend.op("fp8_dequantize")(backend.to(bits.view(torch.float8_e4m3fn)), backend.to(s), None,
                                     torch.float32).cpu()
    assert torch.equal(a.nan_to_num(123.0), b.nan_to_num(123.0))


@pytest.mark.parametrize("backend", backends_for("fp8_dequantize", emu_rev=False))
@pytest.mark.parametrize("N,K", [(0, 4), (4, 0), (0, 0)])
def test_empty(backend, N, K):
    out = backend.op("fp8_dequantize")(backend.to(torch.zeros(N, K, dtype=torch.uint8)), backend.to(torch.ones(1)),
                                       None, torch.bfloat16)
    assert out.shape == (N, K) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("backend", backends_for("fp8_dequantize", emu_rev=False))
@pytest.mark.parametrize("weight,scale,block,dtype,match", [
    (torch.zeros(4, 8, dtype=torch.int8), torch.ones(1), None, torch.float32, "weight must be float8_e4m3fn or uint8"),
    (torch.zeros(4, 8, 2, dtype=torch.uint8), torch.ones(1), None, torch.float32, r"weight must be \[N, K\]"),
    (torch.zeros(8, 4, dtype=torch.uint8).T, torch.ones(1), None, torch.float32, "weight must be contiguous"),
    (torch.zeros(4, 8, dtype=torch.uint8), torch.ones(3), None, torch.float32, "scale must be"),
    (torch.zeros(4, 8, dtype=torch.uint8), torch.ones(2, 2), None, torch.float32, "pass block_size"),
    (torch.zeros(4, 8, dtype=torch.uint8), torch.ones(2, 3), [2, 4], torch.float32, "scale must have shape"),
    (torch.zeros(4, 8, dtype=torch.uint8), torch.ones(2, 2), [2], torch.float32, "block_size must be"),
    (torch.zeros(4, 8, dtype=torch.uint8), torch.ones(2, 2), [0, 4], torch.float32, "must be positive"),
    (torch.zeros(4, 8, dtype=torch.uint8), torch.ones(4, dtype=torch.int32), None, torch.float32, "scale must be float32"),
    (torch.zeros(4, 8, dtype=torch.uint8), torch.ones(4), None, torch.int32, "dtype must be"),
])
def test_bad_input(backend, weight, scale, block, dtype, match):
    with pytest.raises((RuntimeError, ValueError), match=match):
        backend.op("fp8_dequantize")(backend.to(weight), backend.to(scale), block, dtype)
