"""int8_quantize + int8_mm: rounding half-to-even, clamp, zero rows, exact int32 accumulation (-128 included),
scale layouts, dtypes, M regimes, 3-D inputs, empty sizes, bad input."""
import numpy as np
import pytest
import torch

from conftest import backends_for
from reference import ref_int8_mm, ref_int8_quantize

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_EPS = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def check_quantize(backend, x):
    q, s = backend.op("int8_quantize")(backend.to(x))
    assert q.shape == x.shape and q.dtype == torch.int8 and s.shape == x.shape[:-1] and s.dtype == torch.float32
    q, s = q.cpu(), s.cpu()
    rq, rs, ratio = ref_int8_quantize(x)
    assert torch.equal(s, rs)
    # exact, except where the fp32 ratio sits within 1e-3 of a .5 tie (a kernel may divide differently there)
    near_tie = torch.from_numpy(np.abs(np.abs(ratio.numpy() - np.trunc(ratio.numpy())) - 0.5) < 1e-3)
    diff = (q.int() - rq.int()).abs()
    assert (diff[~near_tie] == 0).all() and (diff <= 1).all()
    assert q.min() >= -127
    return q, s


@pytest.mark.parametrize("backend", backends_for("int8_quantize"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (64, 100), (2, 5, 33)])
def test_quantize_matches_reference(backend, dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    check_quantize(backend, (torch.randn(shape, generator=g) * 3).to(dtype))


@pytest.mark.parametrize("backend", backends_for("int8_quantize"))
def test_quantize_ties_round_to_even_and_clamp(backend):
    # absmax 127 -> scale 1: x / scale is exact, so ties are exact ties
    row = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -127.0, 3.49, -126.5])
    q, s = check_quantize(backend, row[None])
    assert s.item() == 1.0
    assert q[0].tolist() == [127, 0, 2, 2, 0, -2, -2, 126, -127, 3, -126]


@pytest.mark.parametrize("backend", backends_for("int8_quantize"))
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_zero_rows(backend, dtype):
    x = torch.randn(4, 40).to(dtype)
    x[1] = 0
    x[3] = -0.0
    q, s = check_quantize(backend, x)
    assert s[1] == 0 and s[3] == 0 and (q[[1, 3]] == 0).all() and torch.isfinite(s).all()


NAN_BITS = 0x7FC00000  # the quiet NaN every backend gives a non-finite row as its scale


def non_finite_rows(K, dtype):
    """Rows 0-5 hold NaN / +-inf at the first, last, middle and (K > 32) past-a-vector positions; rows 6-8 are
    finite (7 all zero), so a kernel that lets one row's state leak into the next fails too."""
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(K)) * 3
    x[0, 0] = float("nan")
    x[1, K - 1] = float("inf")
    x[2, K // 2] = -float("inf")
    x[3] = float("nan")
    x[4, 0], x[4, K - 1] = float("inf"), float("nan")
    x[5, 0] = 1e30  # a huge finite absmax does not hide the infinity
    x[5, min(K - 1, 33)] = -float("inf")
    x[7] = 0
    return x.to(dtype)


@pytest.mark.parametrize("backend", backends_for("int8_quantize"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [1, 7, 32, 33, 100, 257])
def test_quantize_non_finite_rows_give_nan_scale_and_zero_codes(backend, dtype, K):
    x = non_finite_rows(K, dtype)
    q, s = backend.op("int8_quantize")(backend.to(x))
    q, s = q.cpu(), s.cpu()
    bad = ~torch.isfinite(x.float()).all(-1)
    assert bad[:6].all() and not bad[6:].any()
    assert (s[bad].view(torch.int32) == NAN_BITS).all(), s
    assert (q[bad] == 0).all()
    rq, rs, _ = ref_int8_quantize(x)
    assert torch.equal(q, rq) and torch.equal(s.view(torch.int32), rs.view(torch.int32))


@pytest.mark.parametrize("backend", backends_for("int8_mm", emu_rev=False))
def test_mm_of_a_non_finite_row_is_nan(backend):
    # int8_quantize's contract carried through: the row's codes are 0 and its scale NaN, so its outputs are NaN
    x = non_finite_rows(40, torch.float32)
    xq, xs = backend.op("int8_quantize")(backend.to(x))
    wq = torch.randint(-127, 128, (5, 40), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    out = run_mm(backend, xq.cpu(), xs.cpu(), wq, torch.rand(5) + 0.1, torch.randn(5), torch.float32).cpu()
    assert out[:6].isnan().all() and torch.isfinite(out[6:]).all()


@pytest.mark.parametrize("backend", backends_for("int8_quantize", emu_rev=False))
@pytest.mark.parametrize("shape", [(0, 8), (3, 0), (2, 0, 5)])
def test_quantize_empty(backend, shape):
    q, s = backend.op("int8_quantize")(backend.to(torch.zeros(shape)))
    assert q.shape == shape and s.shape == shape[:-1]
    assert (s.cpu() == 0).all()


@pytest.mark.parametrize("backend", backends_for("int8_quantize", emu_rev=False))
@pytest.mark.parametrize("x,match", [(torch.zeros(3, 4, dtype=torch.int32), "x must be bfloat16, float16 or float32"),
                                     (torch.zeros(3, 4, dtype=torch.float64), "x must be bfloat16, float16 or float32"),
                                     (torch.tensor(1.0), "at least one dimension")])
def test_quantize_bad_input(backend, x, match):
    with pytest.raises((RuntimeError, ValueError), match=match):
        backend.op("int8_quantize")(backend.to(x))


def run_mm(backend, xq, xs, wq, ws, bias=None, out_dtype=None):
    return backend.op("int8_mm")(backend.to(xq), backend.to(xs), backend.to(wq), backend.to(ws), backend.to(bias),
                                 out_dtype)


@pytest.mark.parametrize("backend", backends_for("int8_mm"))
@pytest.mark.parametrize("M", [1, 2, 3, 17, 64])
@pytest.mark.parametrize("N,K", [(37, 100), (5, 3), (16, 257)])
def test_mm_accumulator_is_exact(backend, M, N, K):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    xq = torch.randint(-128, 128, (M, K), dtype=torch.int8, generator=g)
    wq = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)
    xq[0, : K // 2] = -128  # the extreme product, -128 * -128, many times over
    wq[0, :] = -128
    out = run_mm(backend, xq, torch.ones(M), wq, torch.ones(N), None, torch.float32).cpu()
    _, acc = ref_int8_mm(xq, torch.ones(M), wq, torch.ones(N))
    assert acc.abs().max() < 2 ** 24  # so that fp32 holds the accumulator exactly
    assert torch.equal(out.double(), acc.double())


@pytest.mark.parametrize("backend", backends_for("int8_mm"))
@pytest.mark.parametrize("out_dtype", [None] + DTYPES)
@pytest.mark.parametrize("w_layout", ["channel", "channel2d", "tensor", "tensor0d"])
@pytest.mark.parametrize("M", [1, 20])
def test_mm_scales_bias_dtypes(backend, out_dtype, w_layout, M):
    N, K = 23, 70
    g = torch.Generator().manual_seed(M + len(w_layout))
    xq = torch.randint(-128, 128, (M, K), dtype=torch.int8, generator=g)
    wq = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)
    xs = torch.rand(M, generator=g) / 100
    ws = {"channel": torch.rand(N, generator=g), "channel2d": torch.rand(N, 1, generator=g),
          "tensor": torch.rand(1, generator=g), "tensor0d": torch.rand((), generator=g)}[w_layout] / 100
    bias = torch.randn(N, generator=g)
    out = run_mm(backend, xq, xs, wq, ws, bias, out_dtype).cpu()
    dtype = out_dtype or torch.bfloat16
    assert out.dtype == dtype and out.shape == (M, N)
    ref, _ = ref_int8_mm(xq, xs, wq, ws.reshape(-1), bias)
    # exact accumulator; fp32 epilogue (two products and a sum) then one rounding to dtype
    tol = 1.01 * _EPS[dtype] * ref.abs() + 4 * 2.0 ** -24 * (ref.abs() + bias.double().abs())
    assert ((out.double() - ref).abs() <= tol).all()


@pytest.mark.parametrize("backend", backends_for("int8_mm"))
def test_mm_3d_and_quantize_roundtrip(backend):
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 3, 50, generator=g).to(torch.bfloat16)
    q, s = backend.op("int8_quantize")(backend.to(x))
    assert s.shape == (2, 3)
    wq = torch.randint(-127, 128, (12, 50), dtype=torch.int8, generator=g)
    ws = torch.rand(12, generator=g) / 100
    out = backend.op("int8_mm")(q, s, backend.to(wq), backend.to(ws), None, None).cpu()
    assert out.shape == (2, 3, 12) and out.dtype == torch.bfloat16
    ref, _ = ref_int8_mm(q.cpu().reshape(6, 50), s.cpu().reshape(6), wq, ws)
    torch.testing.assert_close(out.reshape(6, 12).double(), ref, rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("backend", backends_for("int8_mm", emu_rev=False))
@pytest.mark.parametrize("M,N,K", [(0, 4, 8), (3, 0, 8), (3, 4, 0), (9, 4, 0)])
def test_mm_empty(backend, M, N, K):
    bias = torch.randn(N)
    out = run_mm(backend, torch.zeros(M, K, dtype=torch.int8), torch.ones(M), torch.zeros(N, K, dtype=torch.int8),
                 torch.ones(N), bias, torch.float32)
    assert out.shape == (M, N)
    torch.testing.assert_close(out.cpu(), bias.expand(M, N))


def _bad_mm_cases():
    xq = torch.zeros(2, 8, dtype=torch.int8)
    wq = torch.zeros(4, 8, dtype=torch.int8)
    xs, ws = torch.ones(2), torch.ones(4)
    return [
        (xq.float(), xs, wq, ws, None, None, "xq must be int8"),
        (torch.zeros((), dtype=torch.int8), torch.ones(()), wq, ws, None, None, "xq must have at least one dimension"),
        (xq, xs, wq.to(torch.uint8), ws, None, None, "wq must be int8"),
        (xq, xs, wq[None], ws, None, None, r"wq must be \[N, K\]"),
        (xq, xs, torch.zeros(8, 4, dtype=torch.int8).T, ws, None, None, "wq must be contiguous"),
        (torch.zeros(2, 7, dtype=torch.int8), xs, wq, ws, None, None, "must equal wq's K"),
        (xq, torch.ones(3), wq, ws, None, None, "x_scale must have xq's leading shape"),
        (xq, xs.int(), wq, ws, None, None, "x_scale must be float32"),
        (xq, xs, wq, torch.ones(3), None, None, r"w_scale must be \[N\] or \[N, 1\]"),
        (xq, xs, wq, torch.ones(4, 2), None, None, r"w_scale must be \[N\] or \[N, 1\]"),
        (xq, xs, wq, ws, torch.ones(3), None, r"bias must be \[N\]"),
        (xq, xs, wq, ws, None, torch.int32, "out_dtype must be"),
    ]


@pytest.mark.parametrize("backend", backends_for("int8_mm", emu_rev=False))
@pytest.mark.parametrize("xq,xs,wq,ws,bias,out_dtype,match", _bad_mm_cases())
def test_mm_bad_input(backend, xq, xs, wq, ws, bias, out_dtype, match):
    with pytest.raises((RuntimeError, ValueError), match=match):
        run_mm(backend, xq, xs, wq, ws, bias, out_dtype)


@pytest.mark.parametrize("backend", backends_for("int8_mm", emu_rev=False))
@pytest.mark.parametrize("which", ["x_scale", "wq", "w_scale", "bias"])
def test_mm_devices_differ(backend, which):
    args = {"xq": torch.zeros(2, 8, dtype=torch.int8), "x_scale": torch.ones(2), "wq": torch.zeros(4, 8, dtype=torch.int8),
            "w_scale": torch.ones(4), "bias": torch.ones(4)}
    args = {k: backend.to(v) for k, v in args.items()}
    args[which] = args[which].to("meta")
    with pytest.raises((RuntimeError, ValueError), match=f"{which} is on meta"):
        backend.op("int8_mm")(args["xq"], args["x_scale"], args["wq"], args["w_scale"], args["bias"], None)
