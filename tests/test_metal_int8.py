"""INT8 W8A8: int8_quantize and int8_mm on every backend (the Metal kernels through the emulator, in both
thread orders), against the independent references in reference.py."""
import pytest
import torch

import torch_lowbit
from conftest import backends_for
from reference import assert_matmul_close, ref_int8_mm, ref_int8_quantize

FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
K_TAILS = [1, 15, 16, 17, 100, 255, 257]


def _gen(*seed):
    return torch.Generator().manual_seed(hash(seed) % (2 ** 31))


def _int8(shape, g, with_min=True):
    """Random int8 over the whole range; -128 (allowed in xq and wq) is planted at the first element."""
    t = torch.randint(-128, 128, shape, dtype=torch.int8, generator=g)
    if with_min and t.numel():
        t.view(-1)[0] = -128
    return t


# ---------------------------------------------------------------------------------------------- int8_quantize

def _check_quantize(backend, x):
    q, s = backend.op("int8_quantize")(backend.to(x))
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert q.shape == x.shape and s.shape == x.shape[:-1]
    assert q.device == backend.device and s.device == backend.device
    q_ref, s_ref, ratio = ref_int8_quantize(x)
    q, s = q.cpu(), s.cpu()
    assert not torch.isnan(s).any()
    assert torch.equal(s, s_ref), "scale must be absmax / 127 in fp32"
    diff = (q.to(torch.int32) - q_ref.to(torch.int32)).abs()
    if diff.any():
        # only x / scale values within 1e-3 of a .5 tie may round the other way, and by one step at most
        near_tie = ((ratio.abs() - ratio.abs().floor()) - 0.5).abs() < 1e-3
        bad = (diff > 1) | ((diff == 1) & ~near_tie)
        assert not bad.any(), f"{int(bad.sum())} q values differ from rint(x / scale) away from ties"
    return q, s


@pytest.mark.parametrize("backend", backends_for("int8_quantize"))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 15), (2, 16), (2, 17), (4, 100), (2, 255), (3, 257), (1, 700),
                                   (2, 3, 33)])
def test_quantize_matches_reference(backend, dtype, shape):
    x = (torch.randn(shape, generator=_gen(shape, str(dtype))) * 3).to(dtype)
    _check_quantize(backend, x)


@pytest.mark.parametrize("backend", backends_for("int8_quantize"))
def test_quantize_extremes_map_to_127(backend):
    x = torch.tensor([[0.5, -2.0, 1.0, 2.0], [-3.0, 1.5, 0.0, 0.75]])
    q, s = _check_quantize(backend, x)
    assert q[0].tolist() == [32, -127, 64, 127]  # 0.5 / (2 / 127) = 31.75
    assert q[1, 0] == -127 and s[1] == torch.tensor(3.0) / 127


@pytest.mark.parametrize("backend", backends_for("int8_quantize"))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_quantize_rounds_ties_to_even(backend, dtype):
    # absmax 127 makes scale exactly 1, so x / scale is x itself and .5 ties are exact
    x = torch.tensor([[127.0, 2.5, -3.5, 0.5, 1.5, -0.5, 6.5, -126.5]], dtype=dtype)
    q, s = backend.op("int8_quantize")(backend.to(x))
    assert s.cpu().item() == 1.0
    assert q.cpu()[0].tolist() == [127, 2, -4, 0, 2, 0, 6, -126]


@pytest.mark.parametrize("backend", backends_for("int8_quantize"))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_quantize_zero_rows_give_zero_not_nan(backend, dtype):
    x = torch.randn(5, 40, generator=_gen("zero")).to(dtype)
    x[1] = 0
    x[3] = -0.0
    q, s = _check_quantize(backend, x)
    assert s[1] == 0 and s[3] == 0
    assert not q[1].any() and not q[3].any()


@pytest.mark.parametrize("backend", backends_for("int8_quantize", emu_rev=False))
@pytest.mark.parametrize("shape", [(0, 8), (4, 0), (0, 0), (2, 0, 5)])
def test_quantize_empty(backend, shape):
    q, s = backend.op("int8_quantize")(backend.to(torch.zeros(shape)))
    assert q.shape == shape and s.shape == shape[:-1]
    assert not s.cpu().any()  # an empty row's absmax is 0


@pytest.mark.parametrize("backend", backends_for("int8_quantize", emu_rev=False))
@pytest.mark.parametrize("x,match", [
    (torch.zeros(2, 4, dtype=torch.int32), "x must be bfloat16, float16 or float32"),
    (torch.zeros((), dtype=torch.float32), "x must have at least one dimension"),
])
def test_quantize_bad_input(backend, x, match):
    with pytest.raises((RuntimeError, ValueError), match=match):
        backend.op("int8_quantize")(backend.to(x))


# ---------------------------------------------------------------------------------------------- int8_mm

def _run_mm(backend, xq, xs, wq, ws, bias=None, out_dtype=None):
    out = backend.op("int8_mm")(backend.to(xq), backend.to(xs), backend.to(wq), backend.to(ws), backend.to(bias),
                                out_dtype)
    assert out.device == backend.device
    assert out.dtype == (out_dtype or torch.bfloat16)
    assert out.shape == (*xq.shape[:-1], wq.shape[0])
    return out.cpu()


# M = 6: two x-slices of the GEMV, the second partial; K = 1100: three 512-byte GEMV steps, the last partial
@pytest.mark.parametrize("backend", backends_for("int8_mm"))
@pytest.mark.parametrize("M", [1, 2, 3, 6, 17, 64])
@pytest.mark.parametrize("K", K_TAILS + [1100])
def test_mm_int32_accumulation_is_exact(backend, M, K):
    # unit scales, fp32 output, |acc| <= 257 * 2^14 < 2^24: the output is the integer product itself
    g = _gen("exact", M, K)
    N = 33
    xq, wq = _int8((M, K), g), _int8((N, K), g)
    out = _run_mm(backend, xq, torch.ones(M), wq, torch.ones(N), out_dtype=torch.float32)
    _, acc = ref_int8_mm(xq, torch.ones(M), wq, torch.ones(N))
    assert torch.equal(out.double(), acc.double())


@pytest.mark.parametrize("backend", backends_for("int8_mm"))
@pytest.mark.parametrize("M", [1, 5, 9])
def test_mm_all_minus_128(backend, M):
    # the largest products (-128 * -128 = 2^14) in every position: an int8 or int16 product would overflow
    K, N = 257, 9
    xq = torch.full((M, K), -128, dtype=torch.int8)
    wq = torch.full((N, K), -128, dtype=torch.int8)
    out = _run_mm(backend, xq, torch.ones(M), wq, torch.ones(N), out_dtype=torch.float32)
    assert torch.equal(out, torch.full((M, N), float(K * 16384)))


@pytest.mark.parametrize("backend", backends_for("int8_mm"))
@pytest.mark.parametrize("K", [1100, 4096, 28672])  # 1100: a partial chunk after the first flush, a K tail
def test_mm_int32_sum_is_exact_past_2_to_the_24(backend, K):
    # Worst-case sums: +-127 codes whose products share one sign along a whole row (|acc| = 127^2 K, up to
    # 2^28.8), -128 x 127 in another, random signs elsewhere. M > 8 runs the tiled GEMM, whose fp32 fragments
    # round once a partial sum passes 2^24 unless flushed into int32 in time. Unit scales and an fp32 output:
    # the output is float32(acc), rounded once from the exact int64 sum.
    g = _gen("exact-past-2^24", K)
    M, N = 12, 4
    sign = lambda *shape: torch.randint(0, 2, shape, generator=g) * 2 - 1  # noqa: E731
    xq, wq = 127 * sign(M, K), 127 * sign(N, K)
    xq[0], xq[1], xq[2] = 127, -127, -128
    wq[0] = 127
    wq[1] = xq[3]  # row 3 x column 1: 127^2 K
    xq, wq = xq.to(torch.int8), wq.to(torch.int8)
    out = _run_mm(backend, xq, torch.ones(M), wq, torch.ones(N), out_dtype=torch.float32)
    acc = xq.long() @ wq.long().T
    assert acc.abs().max() == 128 * 127 * K
    assert torch.equal(out, acc.to(torch.float32))


@pytest.mark.parametrize("backend", backends_for("int8_mm"))
@pytest.mark.parametrize("M", [1, 17])
@pytest.mark.parametrize("x_off,w_off", [(1, 0), (0, 3), (8, 16), (16, 32)])
def test_mm_views_at_any_storage_offset(backend, M, x_off, w_off):
    # K % 16 == 0, but mps binds a view at storage_offset bytes: the 16-byte int4 loads of the _k16 kernels
    # are only aligned when both offsets are multiples of 16 (the emulator faults on a misaligned one)
    g = _gen("offset", M, x_off, w_off)
    N, K = 9, 64
    xq = _int8((M * K + x_off,), g)[x_off:].view(M, K)
    wq = _int8((N * K + w_off,), g)[w_off:].view(N, K)
    assert xq.storage_offset() == x_off and wq.storage_offset() == w_off
    out = _run_mm(backend, xq, torch.ones(M), wq, torch.ones(N), out_dtype=torch.float32)
    _, acc = ref_int8_mm(xq, torch.ones(M), wq, torch.ones(N))
    assert torch.equal(out.double(), acc.double())


@pytest.mark.parametrize("backend", backends_for("int8_mm"))
@pytest.mark.parametrize("M", [1, 4, 17])
@pytest.mark.parametrize("N", [1, 7, 63, 64, 65, 130])
def test_mm_n_tails(backend, M, N):
    g = _gen("ntail", M, N)
    K = 48
    xq, wq = _int8((M, K), g), _int8((N, K), g)
    out = _run_mm(backend, xq, torch.ones(M), wq, torch.ones(N), out_dtype=torch.float32)
    _, acc = ref_int8_mm(xq, torch.ones(M), wq, torch.ones(N))
    assert torch.equal(out.double(), acc.double())


@pytest.mark.parametrize("backend", backends_for("int8_mm"))
@pytest.mark.parametrize("M", [1, 3, 17])
@pytest.mark.parametrize("w_scale_kind", ["channel", "channel2d", "tensor", "tensor0d"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("out_dtype", [None, torch.float32, torch.bfloat16, torch.float16])
def test_mm_scales_bias_out_dtype(backend, M, w_scale_kind, with_bias, out_dtype):
    g = _gen("scales", M, w_scale_kind, with_bias, str(out_dtype))
    N, K = 37, 70
    xq, wq = _int8((M, K), g), _int8((N, K), g)
    xs = torch.rand(M, generator=g) * 0.02 + 1e-3
    ws = {"channel": lambda: torch.rand(N, generator=g) * 0.01 + 1e-3,
          "channel2d": lambda: torch.rand(N, 1, generator=g) * 0.01 + 1e-3,
          "tensor": lambda: torch.rand(1, generator=g) * 0.01 + 1e-3,
          "tensor0d": lambda: torch.tensor(0.004)}[w_scale_kind]()
    bias = torch.randn(N, generator=g) if with_bias else None
    out = _run_mm(backend, xq, xs, wq, ws, bias, out_dtype)
    ref, acc = ref_int8_mm(xq, xs, wq, ws, bias)
    # acc is exact; the epilogue rounds acc * xs * ws (+ bias) a few times in fp32
    absref = acc.abs().double() * xs.double().reshape(M, 1) * ws.double().reshape(1, -1).abs()
    if bias is not None:
        absref = absref + bias.double().abs()
    assert_matmul_close(out, ref, absref, acc_rtol=4e-7)


# The kernels read the bias in its own dtype; fp32 output shows a bias read as the wrong type or rounded.
@pytest.mark.parametrize("backend", backends_for("int8_mm"))
@pytest.mark.parametrize("bias_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("M", [1, 6, 17])
def test_mm_bias_in_its_own_dtype(backend, bias_dtype, M):
    g = _gen("bias_dtype", M, str(bias_dtype))
    N, K = 13, 40
    xq, wq = _int8((M, K), g), _int8((N, K), g)
    xs, ws = torch.rand(M, generator=g) * 0.02 + 1e-3, torch.rand(N, generator=g) * 0.01 + 1e-3
    bias = (torch.randn(N, generator=g) * 8).to(bias_dtype)
    out = _run_mm(backend, xq, xs, wq, ws, bias, torch.float32)
    ref, acc = ref_int8_mm(xq, xs, wq, ws, bias)
    absref = acc.abs().double() * xs.double().reshape(M, 1) * ws.double().reshape(1, -1) + bias.double().abs()
    assert_matmul_close(out, ref, absref, acc_rtol=4e-7)


@pytest.mark.parametrize("backend", backends_for("int8_mm"))
@pytest.mark.parametrize("lead", [(2, 3), (4, 5)])
@pytest.mark.parametrize("x_scale_trailing_1", [False, True])
def test_mm_3d_x(backend, lead, x_scale_trailing_1):
    g = _gen("3d", lead, x_scale_trailing_1)
    N, K = 20, 40
    xq, wq = _int8((*lead, K), g), _int8((N, K), g)
    xs = torch.rand(*lead, *((1,) if x_scale_trailing_1 else ()), generator=g) + 0.5
    ws = torch.rand(N, generator=g) + 0.5
    out = _run_mm(backend, xq, xs, wq, ws, out_dtype=torch.float32)
    ref, acc = ref_int8_mm(xq, xs.reshape(lead), wq, ws)
    absref = acc.abs().double() * xs.double().reshape(*lead, 1) * ws.double()
    assert_matmul_close(out, ref, absref, acc_rtol=4e-7)


@pytest.mark.parametrize("backend", backends_for("int8_mm"))
@pytest.mark.parametrize("M", [3, 20])
def test_mm_zero_rows_and_zero_scales(backend, M):
    # a row quantized from zeros (q = 0, scale = 0) gives exactly the bias: never NaN
    g = _gen("zrows", M)
    N, K = 11, 30
    xq, wq = _int8((M, K), g), _int8((N, K), g)
    xq[1] = 0
    xs = torch.rand(M, generator=g) + 0.1
    xs[1] = 0
    bias = torch.randn(N, generator=g)
    out = _run_mm(backend, xq, xs, wq, torch.rand(N, generator=g), bias, torch.float32)
    assert torch.equal(out[1], bias)
    assert not torch.isnan(out).any()


@pytest.mark.parametrize("backend", backends_for("int8_mm", emu_rev=False))
@pytest.mark.parametrize("M,N,K", [(0, 4, 8), (3, 0, 8), (3, 4, 0), (0, 0, 0)])
def test_mm_empty(backend, M, N, K):
    bias = torch.arange(N, dtype=torch.float32)
    out = _run_mm(backend, torch.zeros(M, K, dtype=torch.int8), torch.ones(M), torch.zeros(N, K, dtype=torch.int8),
                  torch.ones(N), bias, torch.float32)
    assert torch.equal(out, bias.expand(M, N))  # K == 0: the empty sum is 0


@pytest.mark.parametrize("backend", backends_for("int8_mm", emu_rev=False))
def test_mm_k0_goes_through_the_epilogue(backend):
    # K == 0 never reaches a kernel on Metal (xq and wq would be nil buffers), yet the result is the epilogue's:
    # 0 * x_scale[m] * w_scale[n] + bias, so a NaN or infinite scale still gives NaN, as on the CPU
    xs, ws = torch.tensor([1.0, float("nan"), 2.0]), torch.tensor([0.5, float("inf")])
    bias = torch.tensor([1.0, -2.0], dtype=torch.bfloat16)
    out = _run_mm(backend, torch.zeros(3, 0, dtype=torch.int8), xs, torch.zeros(2, 0, dtype=torch.int8), ws, bias,
                  torch.float32)
    ref, _ = ref_int8_mm(torch.zeros(3, 0, dtype=torch.int8), xs, torch.zeros(2, 0, dtype=torch.int8), ws, bias)
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out[~ref.isnan()], ref[~ref.isnan()].float())


def test_mm_plan_picks_gemv_for_small_m_and_gemm_above():
    pick = torch_lowbit._C._metal_int8_mm_kernel
    assert [pick(M, 4096, 4096) for M in range(1, 9)] == ["int8_gemv"] * 8
    assert [pick(M, 4096, 4096) for M in (9, 17, 64, 4096)] == ["int8_gemm"] * 4
    assert pick(1, 7, 3) == "int8_gemv" and pick(33, 7, 3) == "int8_gemm"  # tails do not change the choice


@pytest.mark.skipif(not torch_lowbit.emulator.available(), reason="the Metal emulator is not built in this install")
def test_mm_kernel_follows_the_device_caps():
    """The plans pick kernels from the launcher's device capabilities: plan_int8_mm.cpp's test-only table line
    (a GEMM for a device no GPU reports) is taken under the emulator's switch, and only there."""
    pick = torch_lowbit._C._metal_int8_mm_kernel
    g = _gen("caps")
    xq, wq = _int8((33, 32), g), _int8((5, 32), g)
    run = lambda: torch.ops.lowbit_emu.int8_mm(xq, torch.ones(33), wq, torch.ones(5), None,  # noqa: E731
                                               torch.float32)
    with torch_lowbit.emulator.device_caps(apple_family=10, msl_version=400):  # an M5: test_metal_int8_apple10.py
        assert pick(33, 5, 32) == "int8_gemm_mpp"
    with torch_lowbit.emulator.device_caps(apple_family=1000, msl_version=9900):
        assert pick(33, 5, 32) == "int8_gemm_probe"
        assert pick(8, 5, 32) == "int8_gemv"  # a class without a variant keeps its portable kernel
        with pytest.raises(RuntimeError, match="no kernel named 'int8_gemm_probe_float_k16'"):
            run()  # the plan dispatches what the chooser picked
    assert torch_lowbit._C._emu_device_caps() == (7, 301)
    assert pick(33, 5, 32) == "int8_gemm"
    _, acc = ref_int8_mm(xq, torch.ones(33), wq, torch.ones(5))
    assert torch.equal(run().double(), acc.double())


@pytest.mark.parametrize("backend", backends_for("int8_mm", emu_rev=False))
@pytest.mark.parametrize("args,match", [
    (dict(xq=torch.zeros(2, 8)), "xq must be int8"),
    (dict(wq=torch.zeros(4, 8, 1, dtype=torch.int8)), r"wq must be \[N, K\]"),
    (dict(wq=torch.zeros(4, 9, dtype=torch.int8)), "xq's last dimension"),
    (dict(wq=torch.zeros(8, 4, dtype=torch.int8).T), "wq must be contiguous"),
    (dict(w_scale=torch.ones(3)), "w_scale must be"),
    (dict(x_scale=torch.ones(3)), "x_scale must have xq's leading shape"),
    (dict(x_scale=torch.ones(2, dtype=torch.int32)), "x_scale must be float32"),
    (dict(bias=torch.ones(5)), r"bias must be \[N\]"),
    (dict(out_dtype=torch.int32), "out_dtype must be"),
])
def test_mm_bad_input(backend, args, match):
    a = dict(xq=torch.zeros(2, 8, dtype=torch.int8), x_scale=torch.ones(2), wq=torch.zeros(4, 8, dtype=torch.int8),
             w_scale=torch.ones(4), bias=None, out_dtype=None)
    a.update(args)
    with pytest.raises((RuntimeError, ValueError), match=match):
        backend.op("int8_mm")(*(backend.to(a[k]) if isinstance(a[k], torch.Tensor) else a[k]
                                for k in ("xq", "x_scale", "wq", "w_scale", "bias", "out_dtype")))


@pytest.mark.parametrize("backend", backends_for("int8_mm", emu_rev=False))
def test_mm_refuses_k_that_could_overflow_int32(backend):
    K = 131072  # 131072 * (-128)^2 = 2^31
    xq = torch.zeros(1, K, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="int32 accumulator"):
        backend.op("int8_mm")(backend.to(xq), backend.to(torch.ones(1)), backend.to(xq), backend.to(torch.ones(1)))
