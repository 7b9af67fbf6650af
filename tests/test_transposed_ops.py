"""The transposed products of the backward passes: fp8_mm_t, fp8_grouped_mm_t, int8_weight_mm_t against float64
(every scale granularity, dtypes, tails, the row-walk and panel-GEMM regimes, NaN codes, empty sizes, strides,
bad input), and the CPU paths each forced (instruction-set levels, AMX on / off)."""
import math

import pytest
import torch

from conftest import backends_for
from reference import (assert_matmul_close, fp8_weight_f64, random_fp8_bits, ref_fp8_grouped_mm_t, ref_matmul_t)
from test_cpu_kernels import amx, isa  # noqa: F401  (fixtures)
from test_fp8_mm import make_scale
from torch_lowbit.testing import cpu_isa

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ACC_RTOL = 1e-5  # fp32 accumulation over N <= a few hundred rows


def rows(t):
    """[..., C] -> [M, C] (also for C == 0)"""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def check_fp8_t(backend, g, bits, scale, block=None, as_fp8=False):
    w = bits.view(torch.float8_e4m3fn) if as_fp8 else bits
    out = backend.op("fp8_mm_t")(backend.to(g), backend.to(w), backend.to(scale), block)
    N, K = bits.shape
    assert out.shape == (*g.shape[:-1], K) and out.dtype == g.dtype and out.device == backend.device
    w64 = backend.transposed_weight(fp8_weight_f64(bits, scale, block), rows(g).shape[0], g.dtype)
    ref, absref = ref_matmul_t(rows(g), w64)
    assert_matmul_close(rows(out), ref, absref, acc_rtol=ACC_RTOL)
    return out


def check_int8_t(backend, g, wq, ws):
    out = backend.op("int8_weight_mm_t")(backend.to(g), backend.to(wq), backend.to(ws))
    N, K = wq.shape
    assert out.shape == (*g.shape[:-1], K) and out.dtype == g.dtype
    w64 = backend.transposed_weight(wq.double() * ws.double().reshape(-1, 1), rows(g).shape[0], g.dtype)
    ref, absref = ref_matmul_t(rows(g), w64)
    assert_matmul_close(rows(out), ref, absref, acc_rtol=ACC_RTOL)
    return out


def check_grouped_t(backend, go, E, N, K, layout, offsets, ids, g):
    """fp8_grouped_mm_t of go [T, N] with random weights [E, N, K] and a tensor / channel / [16, 32]-block scale
    (3 x 3 blocks for N, K <= 48, 96) against float64"""
    bits = random_fp8_bits((E, N, K), g)
    block = [16, 32] if layout == "block" else None
    scale = {"tensor": torch.rand(E, generator=g), "channel": torch.rand(E, N, generator=g),
             "block": torch.rand(E, 3, 3, generator=g)}[layout] + 0.5
    out = backend.op("fp8_grouped_mm_t")(backend.to(go), backend.to(bits), backend.to(scale), backend.to(offsets),
                                         backend.to(ids), block)
    assert out.shape == (go.shape[0], K) and out.dtype == go.dtype
    ref, absref = ref_fp8_grouped_mm_t(go, bits, scale, offsets, ids, block,
                                       weight_for=lambda r, w64: backend.transposed_weight(w64, r.shape[0], go.dtype))
    assert_matmul_close(out, ref, absref, acc_rtol=ACC_RTOL)
    return out


@pytest.mark.parametrize("backend", backends_for("fp8_mm_t"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 3, 8, 33])
@pytest.mark.parametrize("layout", ["tensor", "channel", "channel2d", "block_16x32", "block_3x7", "block_128x128"])
def test_fp8_mm_t_matches_reference(backend, dtype, M, layout):
    N, K = 37, 100
    g = torch.Generator().manual_seed(M * 100 + len(layout))
    scale, block = make_scale(layout, N, K, g)
    check_fp8_t(backend, torch.randn(M, N, generator=g).to(dtype), random_fp8_bits((N, K), g), scale, block)


@pytest.mark.parametrize("backend", backends_for("fp8_mm_t"))
@pytest.mark.parametrize("N,K", [(1, 1), (7, 31), (33, 65), (130, 257), (300, 8)])
@pytest.mark.parametrize("M", [1, 5, 20])
def test_fp8_mm_t_tails(backend, N, K, M):
    g = torch.Generator().manual_seed(N * 7 + K + M)
    check_fp8_t(backend, torch.randn(M, N, generator=g), random_fp8_bits((N, K), g), torch.rand(N, generator=g) + 0.5)


@pytest.mark.parametrize("backend", backends_for("fp8_mm_t"))
@pytest.mark.parametrize("M", [1, 12])
def test_fp8_mm_t_3d_strided_grad_and_fp8_weights(backend, M):
    g = torch.Generator().manual_seed(5)
    N, K = 24, 70
    bits = random_fp8_bits((N, K), g)
    s = torch.rand(N, generator=g) + 0.5
    go = torch.randn(2, N, M, generator=g).to(torch.bfloat16).transpose(1, 2)  # [2, M, N], not contiguous
    a = check_fp8_t(backend, go, bits, s)
    b = check_fp8_t(backend, go, bits, s, as_fp8=True)
    assert a.shape == (2, M, K) and torch.equal(a.cpu(), b.cpu())


@pytest.mark.parametrize("backend", backends_for("fp8_mm_t"))
@pytest.mark.parametrize("M", [1, 16])
@pytest.mark.parametrize("block", [None, [4, 16]])
def test_fp8_mm_t_nan_codes_poison_their_columns(backend, M, block):
    # a NaN weight code (0x7F / 0xFF) makes its column of the result NaN for every row, as with a dense weight
    g = torch.Generator().manual_seed(6)
    N, K = 20, 50
    bits = random_fp8_bits((N, K), g)
    bits[3, 7], bits[11, 40] = 0x7F, 0xFF
    scale = torch.rand(5, 4, generator=g) + 0.5 if block else torch.rand(1, generator=g) + 0.5
    out = check_fp8_t(backend, torch.randn(M, N, generator=g), bits, scale, block)
    assert torch.isnan(out[:, [7, 40]]).all() and not torch.isnan(out[:, :7]).any()


@pytest.mark.parametrize("backend", backends_for("fp8_mm_t"))
@pytest.mark.parametrize("M,N,K", [(0, 5, 7), (3, 0, 7), (3, 5, 0), (0, 0, 0)])
def test_fp8_mm_t_empty_sizes(backend, M, N, K):
    g = torch.Generator().manual_seed(7)
    out = backend.op("fp8_mm_t")(backend.to(torch.randn(M, N, generator=g)), backend.to(random_fp8_bits((N, K), g)),
                                 backend.to(torch.ones(1)), None)
    assert out.shape == (M, K) and (out.cpu() == 0).all()


@pytest.mark.parametrize("backend", backends_for("int8_weight_mm_t"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 3, 8, 33])
@pytest.mark.parametrize("scale_shape", ["channel", "channel2d", "tensor"])
def test_int8_weight_mm_t_matches_reference(backend, dtype, M, scale_shape):
    N, K = 37, 100
    g = torch.Generator().manual_seed(M + len(scale_shape))
    wq = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)  # -128 too
    ws = {"channel": torch.rand(N, generator=g), "channel2d": torch.rand(N, 1, generator=g),
          "tensor": torch.rand(1, generator=g)}[scale_shape] / 100
    check_int8_t(backend, torch.randn(M, N, generator=g).to(dtype), wq, ws)


@pytest.mark.parametrize("backend", backends_for("int8_weight_mm_t"))
@pytest.mark.parametrize("M,N,K", [(1, 1, 1), (4, 130, 257), (20, 7, 33), (0, 4, 4), (3, 0, 4), (3, 4, 0)])
def test_int8_weight_mm_t_tails_and_empty(backend, M, N, K):
    g = torch.Generator().manual_seed(M * 3 + N + K)
    check_int8_t(backend, torch.randn(M, N, generator=g), torch.randint(-127, 128, (N, K), dtype=torch.int8,
                                                                        generator=g), torch.rand(N, generator=g))


@pytest.mark.parametrize("backend", backends_for("fp8_grouped_mm_t"))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["tensor", "channel", "block"])
def test_fp8_grouped_mm_t_matches_reference(backend, dtype, layout):
    # groups: 1 row, empty, 12 rows (the GEMM regime), an expert id of -1, then rows in no group
    g = torch.Generator().manual_seed(8 + len(layout))
    E, N, K, T = 3, 40, 72, 22
    offsets = torch.tensor([0, 1, 1, 13, 17], dtype=torch.int32)
    ids = torch.tensor([2, 0, 1, -1], dtype=torch.int32)
    out = check_grouped_t(backend, torch.randn(T, N, generator=g).to(dtype), E, N, K, layout, offsets, ids, g)
    assert (out[13:].cpu() == 0).all()  # the -1 group and the rows past offsets[G]


def at_offset(t, offset):
    """t's values in a contiguous view starting `offset` elements into a larger buffer (a misaligned start)."""
    v = torch.empty(t.numel() + offset, dtype=t.dtype)[offset:].view(t.shape)
    v.copy_(t)
    return v


@pytest.mark.parametrize("backend", backends_for("fp8_mm_t"))
@pytest.mark.parametrize("M", [1, 5, 40])
@pytest.mark.parametrize("g_off,w_off", [(0, 0), (1, 0), (0, 3), (3, 1)])
def test_fp8_mm_t_misaligned_views(backend, M, g_off, w_off):
    # N, K multiples of 16 take the vector loads unless a view's start rules them out; both must be right
    N, K = 64, 96
    g = torch.Generator().manual_seed(M * 10 + g_off * 4 + w_off)
    bits = random_fp8_bits((N, K), g)
    go = torch.randn(M, N, generator=g)
    check_fp8_t(backend, at_offset(go, g_off), at_offset(bits, w_off), torch.rand(4, 3, generator=g) + 0.5, [16, 32])


@pytest.mark.parametrize("backend", backends_for("int8_weight_mm_t"))
@pytest.mark.parametrize("M", [1, 5, 40])
@pytest.mark.parametrize("g_off,w_off", [(0, 0), (1, 3)])
def test_int8_weight_mm_t_misaligned_views(backend, M, g_off, w_off):
    N, K = 48, 80
    g = torch.Generator().manual_seed(M + g_off + w_off)
    wq = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)
    go = torch.randn(M, N, generator=g).to(torch.bfloat16)
    check_int8_t(backend, at_offset(go, g_off), at_offset(wq, w_off), torch.rand(N, generator=g))


@pytest.mark.parametrize("backend", backends_for("fp8_mm_t"))
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_mm_t_large_m_several_tiles(backend, dtype):
    # M = 70: three row tiles of the GEMM (the last of 6 rows); K = 70: three column tiles; N = 45: two N steps
    N, K, M = 45, 70, 70
    g = torch.Generator().manual_seed(9)
    scale, block = make_scale("block_16x32", N, K, g)
    check_fp8_t(backend, torch.randn(M, N, generator=g).to(dtype), random_fp8_bits((N, K), g), scale, block)


@pytest.mark.parametrize("backend", backends_for("fp8_grouped_mm_t"))
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("layout", ["tensor", "channel", "block"])
def test_fp8_grouped_mm_t_prefill(backend, dtype, layout):
    # more than 8 rows a group on average (the tiled kernel): an empty group, 45 rows (two tiles, the second
    # partial), a -1 group, rows in no group; N and K tails, partial blocks, a misaligned grad_out view
    g = torch.Generator().manual_seed(10 + len(layout))
    E, N, K, T = 3, 45, 70, 60
    offsets = torch.tensor([0, 0, 45, 50], dtype=torch.int32)
    ids = torch.tensor([1, 0, -1], dtype=torch.int32)
    go = at_offset(torch.randn(T, N, generator=g).to(dtype), 1)
    out = check_grouped_t(backend, go, E, N, K, layout, offsets, ids, g)
    assert (out[45:].cpu() == 0).all()


@pytest.mark.parametrize("backend", backends_for("fp8_grouped_mm_t"))
@pytest.mark.parametrize("T,N,K", [(0, 8, 8), (5, 0, 8), (5, 8, 0)])
def test_fp8_grouped_mm_t_empty_sizes(backend, T, N, K):
    g = torch.Generator().manual_seed(11)
    offsets = torch.tensor([0, min(T, 2), T], dtype=torch.int32)
    out = backend.op("fp8_grouped_mm_t")(backend.to(torch.randn(T, N, generator=g)),
                                         backend.to(random_fp8_bits((2, N, K), g)), backend.to(torch.ones(2)),
                                         backend.to(offsets), None, None)
    assert out.shape == (T, K) and (out.cpu() == 0).all()


@pytest.mark.parametrize("call,match", [
    (lambda: torch.ops.lowbit.fp8_mm_t(torch.randn(2, 5), torch.zeros(4, 8, dtype=torch.uint8), torch.ones(1)),
     r"grad_out's last dimension \(5\) must equal weight's N \(4\)"),
    (lambda: torch.ops.lowbit.fp8_mm_t(torch.randn(2, 4).int(), torch.zeros(4, 8, dtype=torch.uint8), torch.ones(1)),
     "grad_out must be bfloat16, float16 or float32"),
    (lambda: torch.ops.lowbit.fp8_mm_t(torch.randn(2, 4), torch.zeros(4, 8, dtype=torch.uint8), torch.ones(3)),
     "scale must be"),
    (lambda: torch.ops.lowbit.fp8_mm_t(torch.randn(2, 4), torch.zeros(4, 8, dtype=torch.uint8), torch.ones(2, 2)),
     "pass block_size"),
    (lambda: torch.ops.lowbit.fp8_mm_t(torch.randn(2, 4), torch.zeros(8, 4, dtype=torch.uint8).t(), torch.ones(1)),
     "weight must be contiguous"),
    (lambda: torch.ops.lowbit.int8_weight_mm_t(torch.randn(2, 4), torch.zeros(4, 8), torch.ones(4)), "wq must be int8"),
    (lambda: torch.ops.lowbit.int8_weight_mm_t(torch.randn(2, 4), torch.zeros(4, 8, dtype=torch.int8), torch.ones(3)),
     r"w_scale must be \[N\] or \[N, 1\]"),
    (lambda: torch.ops.lowbit.int8_weight_mm_t(torch.randn(2, 3), torch.zeros(4, 8, dtype=torch.int8), torch.ones(4)),
     r"grad_out's last dimension \(3\) must equal wq's N \(4\)"),
    (lambda: torch.ops.lowbit.fp8_grouped_mm_t(torch.randn(3, 4), torch.zeros(2, 4, 8, dtype=torch.uint8),
                                               torch.ones(2), torch.tensor([0, 2, 1], dtype=torch.int32)),
     "offsets must be non-decreasing"),
    (lambda: torch.ops.lowbit.fp8_grouped_mm_t(torch.randn(3, 4), torch.zeros(2, 4, 8, dtype=torch.uint8),
                                               torch.ones(2), torch.tensor([0, 3], dtype=torch.int32),
                                               torch.tensor([2], dtype=torch.int32)), "out of range"),
    (lambda: torch.ops.lowbit.fp8_grouped_mm_t(torch.randn(3, 8), torch.zeros(2, 4, 8, dtype=torch.uint8),
                                               torch.ones(2), torch.tensor([0, 3], dtype=torch.int32)),
     r"grad_out's last dimension \(8\) must equal weight's N \(4\)"),
])
def test_bad_input_names_the_argument(call, match):
    with pytest.raises(RuntimeError, match=match):
        call()


# ---------------------------------------------------------------------------------------------- CPU paths
@pytest.mark.parametrize("M", [1, 70])
@pytest.mark.parametrize("layout", ["tensor", "channel", "block_96x80"])
def test_cpu_paths_fp8(isa, amx, M, layout):
    # K = 300: two row-walk items / GEMM column tiles, the second partial; N = 540: two fp32 GEMM panels of rows and
    # two AMX depth steps (512 + 32) in one scale group
    N, K = 540, 300
    g = torch.Generator().manual_seed(M + len(layout))
    scale, block = make_scale(layout, N, K, g)
    for dtype in (torch.float32, torch.bfloat16):
        check_fp8_t(torch_backend_cpu(), torch.randn(M, N, generator=g).to(dtype), random_fp8_bits((N, K), g), scale,
                    block)


@pytest.mark.parametrize("M", [1, 40])
def test_cpu_paths_int8(isa, amx, M):
    g = torch.Generator().manual_seed(M)
    wq = torch.randint(-128, 128, (260, 530), dtype=torch.int8, generator=g)
    for dtype in DTYPES:
        check_int8_t(torch_backend_cpu(), torch.randn(M, 260, generator=g).to(dtype), wq, torch.rand(260, generator=g))


def torch_backend_cpu():
    from conftest import Backend
    return Backend("cpu")
