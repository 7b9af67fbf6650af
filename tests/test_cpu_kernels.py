"""The CPU backend's code paths, each forced: every instruction-set level this machine has (portable, avx2,
avxvnni, avx512; torch_lowbit.testing.forced_cpu_isa) x every M regime (GEMV tiles, their row groups, the panel GEMM and
its blocks) x tails, on shapes large enough to reach them (K = 4096). CPU only; the op tests run the small shapes
on every backend."""
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

_THREADS = torch.get_num_threads()

from reference import assert_matmul_close, fp8_bits_to_f64, random_fp8_bits, ref_fp8_grouped_mm, ref_fp8_mm, \
    ref_int8_mm, ref_int8_quantize
from torch_lowbit import _C
from torch_lowbit.testing import (cpu_amx_gemm, cpu_gemm_route, cpu_isa, default_cpu_isa, forced_cpu_isa,
                                  supported_cpu_isas)

ISAS = supported_cpu_isas()  # the levels this CPU supports, portable first
ops = torch.ops.lowbit


@pytest.fixture(params=ISAS)
def isa(request):
    with forced_cpu_isa(request.param):
        assert cpu_isa() == request.param
        yield request.param


def test_scratch_guard_faults_past_the_request():
    # the test switch (conftest) ends every scratch buffer at an inaccessible page: a byte inside reads as the
    # 0xFF poison, the first byte past the request (rounded up to 64) kills the process
    code = ("import torch_lowbit; from torch_lowbit import _C; _C._cpu_poison_workspaces(True); "
            "assert _C._cpu_scratch_read(100, 127) == 255; print('inside', flush=True); _C._cpu_scratch_read(100, 128)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "inside" and r.returncode == -signal.SIGSEGV, (r.returncode, r.stderr[-500:])


def test_portable_is_always_available():
    with forced_cpu_isa("portable"):
        assert cpu_isa() == "portable"
    assert cpu_isa() == default_cpu_isa()
    assert default_cpu_isa() in ISAS


@pytest.mark.parametrize("M", [1, 2, 5, 7, 8, 33, 130])  # GEMV 1 row / 2 rows / row groups; GEMM
@pytest.mark.parametrize("K", [4096, 4095])
def test_fp8_mm_regimes(isa, M, K):
    g = torch.Generator().manual_seed(M + K)
    N = 70 if M < 100 else 38
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    bits = random_fp8_bits((N, K), g)
    scale, bias = torch.rand(N, generator=g) + 0.5, torch.randn(N, generator=g)
    ref, absref = ref_fp8_mm(x, bits, scale, bias)
    assert_matmul_close(ops.fp8_mm(x, bits, scale, bias, None), ref, absref, acc_rtol=1e-5)


@pytest.mark.parametrize("M", [1, 3, 40])
@pytest.mark.parametrize("block", [[128, 128], [32, 100], [7, 1000], [64, 4096]])
def test_fp8_mm_block_scales(isa, M, block):
    g = torch.Generator().manual_seed(M + block[1])
    N, K = 90, 4000
    x = torch.randn(M, K, generator=g)
    bits = random_fp8_bits((N, K), g)
    scale = torch.rand(-(-N // block[0]), -(-K // block[1]), generator=g) + 0.5
    ref, absref = ref_fp8_mm(x, bits, scale, None, block)
    assert_matmul_close(ops.fp8_mm(x, bits, scale, None, block), ref, absref, acc_rtol=1e-5)


def test_fp8_gemm_block_scales_ignore_stale_workspace(isa):
    # The GEMM decodes weight panels into a reused per-thread workspace. Fill it with NaN (a NaN-code weight),
    # then run block scales whose last K block is short: nothing stale may leak into the result.
    torch.set_num_threads(1)  # one thread: both calls use the calling thread's workspace
    try:
        g = torch.Generator().manual_seed(7)
        x = torch.randn(40, 4096, generator=g)
        assert torch.isnan(ops.fp8_mm(x, torch.full((64, 4096), 0x7F, dtype=torch.uint8), torch.ones(1),
                                      None, None)).all()
        N, K, block = 64, 4000, [128, 128]  # the last K block holds 32 codes
        bits = random_fp8_bits((N, K), g)
        scale = torch.rand(1, 32, generator=g) + 0.5
        xk = x[:, :K].contiguous()
        ref, absref = ref_fp8_mm(xk, bits, scale, None, block)
        assert_matmul_close(ops.fp8_mm(xk, bits, scale, None, block), ref, absref, acc_rtol=1e-5)
    finally:
        torch.set_num_threads(_THREADS)


@pytest.mark.parametrize("M", [1, 3, 20])
@pytest.mark.parametrize("flush_denormal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_every_finite_code_exact(isa, M, flush_denormal, dtype):
    # bits[n, k] = the (n + k)-th finite code and x rows are unit vectors, so out[m, n] is one decoded code:
    # every finite code (subnormals included) on each path, also with denormals flushed (the F16C decode must
    # not depend on DAZ). NaN codes are pinned by test_fp8_mm.py::test_nan_codes_give_nan_columns.
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    N, K = len(codes), 256
    bits = codes[(torch.arange(N)[:, None] + torch.arange(K)[None]) % N]
    cols = torch.arange(M) * 13
    x = torch.zeros(M, K, dtype=dtype)  # bf16 x at M = 20: the bf16 GEMM where the CPU has it
    x[torch.arange(M), cols] = 1.0
    torch.set_flush_denormal(flush_denormal)
    try:
        out = ops.fp8_mm(x, bits, torch.ones(1), None, None)
    finally:
        torch.set_flush_denormal(False)
    assert torch.equal(out.double(), fp8_bits_to_f64(bits[:, cols].T))


@pytest.mark.parametrize("M", [1, 3, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [None, [4, 64]])
def test_fp8_nan_codes_only_their_columns(isa, M, dtype, block):
    # NaN codes (0x7F, 0xFF) in two rows of one 4-row GEMV tile, one in the chunk tail: their columns are NaN,
    # the tile's other rows (which share the tile's NaN tracking on some paths) are not
    g = torch.Generator().manual_seed(M)
    N, K = 12, 1000
    x = torch.randn(M, K, generator=g).to(dtype)
    bits = random_fp8_bits((N, K), g)
    bits[5, 100] = 0x7F
    bits[6, K - 1] = 0xFF
    scale = torch.rand(N, generator=g) + 0.5 if block is None else torch.rand(3, 16, generator=g) + 0.5
    ref, absref = ref_fp8_mm(x, bits, scale, None, block)
    out = ops.fp8_mm(x, bits, scale, None, block)
    assert torch.isnan(out[:, 5:7]).all() and not torch.isnan(out[:, [4, 7]]).any()
    assert_matmul_close(out, ref, absref, acc_rtol=1e-5)


@pytest.mark.parametrize("K", [1, 15, 16, 17, 300])  # around whole 16-code steps
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block", [None, [2, 7], [3, 16], [1, 128]])
def test_fp8_dequantize_exact(isa, K, dtype, block):
    # each value is dec(code) * scale in fp32, rounded once to dtype (torch's own arithmetic as the reference);
    # every code appears, NaN codes and subnormal results (tiny scales) included
    g = torch.Generator().manual_seed(K)
    N = 6
    bits = torch.randint(0, 256, (N, K), dtype=torch.uint8, generator=g)
    bits[0, : min(K, 256)] = torch.arange(min(K, 256), dtype=torch.uint8)
    if block is None:
        scale = torch.rand(N, generator=g) + 0.5
        scale[0] = 1 + 3 * 2.0 ** -8  # powers of two times these are bf16 ties, rounding up and down to even
        scale[3] = 1 + 2.0 ** -8
        scale[1] = 3e-39  # fp32 subnormal products; 2^-20 below makes fp16 subnormals
        scale[2] = 2.0 ** -20
        full = scale[:, None].expand(N, K)
    else:
        scale = torch.rand(-(-N // block[0]), -(-K // block[1]), generator=g) + 0.5
        scale[0, 1:] = 1 + 3 * 2.0 ** -8
        scale[0, 0] = 2.0 ** -20
        full = scale.repeat_interleave(block[0], 0)[:N].repeat_interleave(block[1], 1)[:, :K]
    ref = (fp8_bits_to_f64(bits).float() * full).to(dtype)
    out = ops.fp8_dequantize(bits, scale, block, dtype)
    assert out.dtype == dtype and torch.equal(out.isnan(), ref.isnan())
    assert torch.equal(out[~out.isnan()], ref[~ref.isnan()])


def test_fp8_dequantize_same_bits_on_every_path(isa):
    # NaN and infinite scales (beyond design.md) give the portable loop's bits on every level
    bits = torch.randint(0, 256, (3, 40), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    scale = torch.tensor([float("inf"), float("nan"), 1.0])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = ops.fp8_dequantize(bits, scale, None, dtype)
        with forced_cpu_isa("portable"):
            ref = ops.fp8_dequantize(bits, scale, None, dtype)
        view = torch.int32 if dtype == torch.float32 else torch.int16
        assert torch.equal(out.view(view), ref.view(view))


@pytest.fixture(params=["amx", "no_amx"])
def amx(request):
    """The GEMM regimes with and without AMX: fp8_mm's bf16 panels in oneDNN's AMX brgemm, or without it in the
    kernel set's bf16 GEMM (avx512 cap) or as fp32 panels in torch's fp32 GEMM (below it); int8_mm in oneDNN's
    AMX int8 brgemm or our micro-kernels. Without is what CPUs lacking AMX run; here it is forced by disabling
    torch.backends.mkldnn. Request it after `isa`, whose cap it depends on."""
    on = request.param == "amx"
    enabled = torch.backends.mkldnn.enabled
    if on and not cpu_amx_gemm():
        pytest.skip("no AMX brgemm on this CPU at this instruction-set cap")
    torch.backends.mkldnn.enabled = on
    try:
        assert cpu_amx_gemm() == on
        yield request.param
    finally:
        torch.backends.mkldnn.enabled = enabled


def test_gemm_route_follows_the_cap(isa, amx):
    # AMX where on; else the set's bf16 GEMM at the AVX-512 sets (AVX-512 BF16 is part of them), fp32 panels below
    want = "amx" if amx == "amx" else "bf16" if isa in ("avx512", "avx512amx") else "fp32"
    assert cpu_gemm_route() == want


def test_fp8_mm_gemm_float_x_extremes(amx):
    # float x split into bf16 terms: full 24-bit significands, values next to FLT_MAX (whose bf16 rounding would
    # overflow) and tiny ones, against float64
    g = torch.Generator().manual_seed(4)
    M, N, K = 16, 40, 256
    x = (torch.rand(M, K, generator=g) + 1) * 2.0 ** torch.randint(-60, 60, (M, K), generator=g).float()
    x[3] = 0
    x[3, 5] = torch.finfo(torch.float32).max
    x[4, 9] = -torch.finfo(torch.float32).max
    x[5] = torch.rand(K, generator=g) * 1e-30
    bits = torch.randint(0, 0x30, (N, K), dtype=torch.uint8, generator=g)  # small codes: finite products
    scale = torch.rand(N, generator=g) * 0.01 + 2.0 ** -20
    ref, absref = ref_fp8_mm(x, bits, scale, None)
    out = ops.fp8_mm(x, bits, scale, None, None)
    assert torch.isfinite(out[3:5]).all()
    assert_matmul_close(out, ref, absref, acc_rtol=1e-5)


_LAYOUTS = {"tensor": None, "channel": None, "block128": [128, 128], "block16x48": [16, 48], "block7x1000": [7, 1000],
            "block64x4096": [64, 4096]}


# M: one block of brgemm columns, several with a tail; N: panels with tails; K: brgemm depth steps and short tails
@pytest.mark.parametrize("M,N,K", [(5, 1, 64), (8, 2, 64), (9, 63, 300), (64, 70, 4096), (65, 129, 4095), (300, 65, 1000),
                                   (130, 200, 1)])
@pytest.mark.parametrize("layout", list(_LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])  # 1, 2, 3 bf16 terms on AMX
def test_fp8_mm_gemm_routes(amx, M, N, K, layout, dtype):
    g = torch.Generator().manual_seed(M * N + K)
    x = torch.randn(M, K, generator=g).to(dtype)
    bits = random_fp8_bits((N, K), g)
    block = _LAYOUTS[layout]
    if layout == "tensor":
        scale = torch.rand(1, generator=g) + 0.5
    elif layout == "channel":
        scale = torch.rand(N, generator=g) + 0.5
    else:
        scale = torch.rand(-(-N // block[0]), -(-K // block[1]), generator=g) + 0.5
    bias = torch.randn(N, generator=g)
    ref, absref = ref_fp8_mm(x, bits, scale, bias, block)
    assert_matmul_close(ops.fp8_mm(x, bits, scale, bias, block), ref, absref, acc_rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_gemm_scratch_bounded_for_one_code_k_blocks(amx, dtype):
    # issue 13: block_size [.., 1] padded every one-code K block to a whole chunk (32 / 64 positions) of packed
    # activations for all rows and all of K at once, and the fp32 route kept every block's partial sums (72 MiB
    # here; x is 256 KiB); the GEMM packs a group of K windows at a time (8 MiB at most, the whole padded K here)
    # beside its tiles
    g = torch.Generator().manual_seed(13)
    M, N, K = 64, 128, 1024
    x = torch.randn(M, K, generator=g).to(dtype)
    bits = random_fp8_bits((N, K), g)
    scale = torch.rand(1, K, generator=g) + 0.5
    _C._cpu_scratch_high_water()
    out = ops.fp8_mm(x, bits, scale, None, [128, 1])
    high = _C._cpu_scratch_high_water()
    assert high <= 12 << 20, f"{high / 2 ** 20:.1f} MiB of scratch"
    ref, absref = ref_fp8_mm(x, bits, scale, None, [128, 1])
    assert_matmul_close(out, ref, absref, acc_rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("layout", ["channel", "block128", "block7x1000"])
def test_fp8_gemm_window_groups(amx, layout, threads):
    # packed float x (fp32 panels: 4 bytes a value; AMX: three bf16 terms of 2) is 9.5 MiB or more, past what a
    # group of K windows may take (8 MiB with fp32 panels, 1 MiB on AMX): several groups, each packed and then run
    # through panel by panel, the panels handed out to the threads; the sums carry over from group to group. A K
    # tail, an N tail, and an odd thread count.
    g = torch.Generator().manual_seed(17 + threads)
    M, N, K = 600, 72, 4160 + 33
    x = torch.randn(M, K, generator=g)
    bits = random_fp8_bits((N, K), g)
    block = _LAYOUTS[layout]
    scale = torch.rand(N, generator=g) + 0.5 if block is None else \
        torch.rand(-(-N // block[0]), -(-K // block[1]), generator=g) + 0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = ops.fp8_mm(x, bits, scale, None, block)
    finally:
        torch.set_num_threads(before)
    ref, absref = ref_fp8_mm(x, bits, scale, None, block)
    assert_matmul_close(out, ref, absref, acc_rtol=1e-5)


@pytest.mark.parametrize("layout", ["channel", "block16x48"])
def test_fp8_gemm_row_blocks_and_scratch_release(amx, layout):
    # enough rows that the GEMM's fp32 sums ([N, M]) go in several row blocks, and enough columns that one block's
    # sums are past the cap of what a thread keeps under either engine (AMX: blocks of 256 rows), so that buffer is
    # given back after the call
    g = torch.Generator().manual_seed(16)
    M, N, K = 1100, 16640, 70
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    bits = random_fp8_bits((N, K), g)
    block = _LAYOUTS[layout]
    scale = torch.rand(N, generator=g) + 0.5 if block is None else \
        torch.rand(-(-N // block[0]), -(-K // block[1]), generator=g) + 0.5
    _C._cpu_scratch_high_water()
    out = ops.fp8_mm(x, bits, scale, None, block)
    during, after = _C._cpu_scratch_high_water(), _C._cpu_scratch_high_water()
    assert during - after >= 16 << 20, (during, after)
    for cols in (slice(0, 304), slice(N - 96, N)):  # all rows, both ends of N (whole 16-row scale blocks)
        rows = cols if block is None else slice(cols.start // block[0], cols.stop // block[0])
        ref, absref = ref_fp8_mm(x, bits[cols], scale[rows], None, block)
        assert_matmul_close(out[:, cols], ref, absref, acc_rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_mm_gemm_nan_and_inf(amx, dtype):
    # NaN codes make their output columns NaN, an infinite x its row (inf * 0 = NaN), as in float64
    g = torch.Generator().manual_seed(3)
    M, N, K = 40, 100, 700
    x = torch.randn(M, K, generator=g).to(dtype)
    x[5, 17] = float("inf")
    x[9, 3] = float("-inf")
    bits = random_fp8_bits((N, K), g)
    bits[7, 650] = 0x7F
    bits[64, 0] = 0xFF
    bits[:, 17] = 0  # row 5: inf * 0
    for block in (None, [16, 128]):
        scale = torch.rand(N, generator=g) + 0.5 if block is None else torch.rand(7, 6, generator=g) + 0.5
        ref, absref = ref_fp8_mm(x, bits, scale, None, block)
        out = ops.fp8_mm(x, bits, scale, None, block)
        assert torch.isnan(out[:, [7, 64]]).all() and torch.isnan(out[5]).all()
        assert_matmul_close(out, ref, absref, acc_rtol=1e-5)


@pytest.mark.parametrize("groups", [[1] * 8, [1, 0, 3, 1, 20, 2], [5, 7, 1], [40]])  # 5, 7: GEMM on AMX (bf16)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])  # bf16: big groups in the bf16 GEMM
def test_fp8_grouped_paths(isa, groups, dtype):
    E, N, K = 9, 300, 2048
    g = torch.Generator().manual_seed(len(groups))
    offsets = torch.tensor([0] + groups, dtype=torch.int32).cumsum(0).to(torch.int32)
    T = int(offsets[-1]) + 2  # two rows in no group
    ids = torch.randint(-1, E, (len(groups),), dtype=torch.int32, generator=g)
    x = torch.randn(T, K, generator=g).to(dtype)
    bits = random_fp8_bits((E, N, K), g)
    scale = torch.rand(E, N, generator=g) + 0.5
    ref, absref = ref_fp8_grouped_mm(x, bits, scale, offsets, ids)
    assert_matmul_close(ops.fp8_grouped_mm(x, bits, scale, offsets, ids, None), ref, absref, acc_rtol=1e-5)


@pytest.mark.parametrize("M", [1, 3, 7, 8, 70, 300])  # GEMV tiles; GEMM with one and two row blocks
@pytest.mark.parametrize("K", [4096, 4097, 4094])
def test_int8_mm_exact(isa, amx, M, K):
    g = torch.Generator().manual_seed(M * K)
    N = 53
    xq = torch.randint(-128, 128, (M, K), dtype=torch.int8, generator=g)
    wq = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)
    xq[0] = -128
    wq[1] = -128
    out = ops.int8_mm(xq, torch.ones(M), wq, torch.ones(N), None, torch.float32)
    _, acc = ref_int8_mm(xq, torch.ones(M), wq, torch.ones(N))
    assert torch.equal(out, acc.float())  # one rounding of the exact integer to fp32


@pytest.mark.parametrize("M", [1, 2, 4])  # the GEMV tiles (AMX takes 2 and more rows to its GEMM)
@pytest.mark.parametrize("K", [1, 63, 64, 65, 200])  # below, at and past one 64-byte vector, masked tails
def test_int8_gemv_tiles_exact(isa, M, K):
    # every tile shape (N = 7: 4 + 3 rows; 1 + 1 + ... for M > 1) and the extremes of both signs
    g = torch.Generator().manual_seed(M * 1000 + K)
    N = 7
    xq = torch.randint(-128, 128, (M, K), dtype=torch.int8, generator=g)
    wq = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)
    xq[0, :] = -128
    wq[1, :], wq[2, :] = -128, 127
    out = ops.int8_mm(xq, torch.ones(M), wq, torch.ones(N), None, torch.float32)
    _, acc = ref_int8_mm(xq, torch.ones(M), wq, torch.ones(N))
    assert torch.equal(out, acc.float())


@pytest.mark.parametrize("threads", [1, 3, 8])
@pytest.mark.parametrize("N", [17, 203, 1029])  # fewer chunks than threads, some, many; chunk tails
def test_gemv_rows_shared_out_in_chunks(isa, threads, N):
    # batch-1 GEMVs hand weight rows out in chunks to whichever thread asks next (parallel.h): every output
    # column is computed once, from its own row, whatever the thread count (more threads than chunks included)
    g = torch.Generator().manual_seed(N + threads)
    K = 200
    xq = torch.randint(-128, 128, (1, K), dtype=torch.int8, generator=g)
    wq = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)
    x = torch.randn(1, K, generator=g).to(torch.bfloat16)
    bits = random_fp8_bits((N, K), g)
    scale = torch.rand(N, generator=g) + 0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out8 = ops.int8_mm(xq, torch.ones(1), wq, torch.ones(N), None, torch.float32)
        outf = ops.fp8_mm(x, bits, scale, None, None)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(out8, ref_int8_mm(xq, torch.ones(1), wq, torch.ones(N))[1].float())
    assert_matmul_close(outf, *ref_fp8_mm(x, bits, scale), acc_rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("words", [1, 4095, 4096 * 16 + 8 * 3 + 5, 1 << 20])
def test_stream_read_reads_every_word_once(threads, words):
    # the benchmark's bandwidth baseline reads in chunks like the GEMVs: the XOR of all 64-bit words tells a
    # skipped chunk and one read twice (x ^ x = 0) alike
    t = torch.randint(-2 ** 62, 2 ** 62, (words,), dtype=torch.int64, generator=torch.Generator().manual_seed(words))
    want = int(np.bitwise_xor.reduce(t.numpy().view(np.uint64)))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _C._cpu_stream_read(t) & (2 ** 64 - 1)
    finally:
        torch.set_num_threads(before)
    assert got == want


def ref_pack_strips(xq, W, G, narrow_last):
    # int8_mm's activation layout, from its definition: element (row i of strip j, k) at
    # j * Kr * W + (k - k % G) * w_j + G * i + k % G, w_j = W or (narrow_last) the rows left for the last strip
    M, K = xq.shape
    Kr, S = -(-K // G) * G, -(-M // W)
    widths = [min(W, M - j * W) if narrow_last else W for j in range(S)]
    x = np.zeros((S * W, Kr), np.int64)
    x[:M, :K] = xq.numpy()
    out = np.full(sum(Kr * w for w in widths), -1, np.int64)
    k = np.arange(Kr)[None, :]
    for j, wj in enumerate(widths):
        i = np.arange(wj)[:, None]
        out[j * Kr * W + (k - k % G) * wj + G * i + k % G] = x[j * W + i, k]
    return out, xq.numpy().astype(np.int64).sum(1)


@pytest.mark.parametrize("G", [2, 4])  # int16 pairs (AVX2, portable), byte quads (VNNI, AMX)
@pytest.mark.parametrize("W", [16, 64])  # the AVX2 strip, the AMX block
@pytest.mark.parametrize("narrow_last", [False, True])  # zero-padded last strip (micro-kernels), narrowed (AMX)
@pytest.mark.parametrize("M", [1, 5, 65, 130])
@pytest.mark.parametrize("K", [1, 3, 257, 600])  # K tails, one and several pack items of 256 positions
def test_int8_pack_strips_layout(G, W, narrow_last, M, K):
    # the layout the GEMMs read (their results are checked on the CPUs that run them); -1 marks what the pack
    # did not write, and x holds no -1; the hook's slack past the layout must stay -1
    xq = torch.randint(-128, 128, (M, K), dtype=torch.int8, generator=torch.Generator().manual_seed(M * K + W + G))
    xq[xq == -1] = -128
    packed, sums = _C._cpu_int8_pack_strips(xq, W, G, narrow_last)
    want, want_sums = ref_pack_strips(xq, W, G, narrow_last)
    assert packed.dtype == (torch.int16 if G == 2 else torch.int8)
    got = packed.numpy().astype(np.int64)
    assert np.array_equal(got[:want.size], want)
    assert (got[want.size:] == -1).all() and got.size - want.size == (-(-K // G) * G) * W
    assert np.array_equal(sums.numpy().astype(np.int64), want_sums)


def test_int8_gemv_largest_sum(isa):
    # K = 131071, the bound: (-128) * (-128) * K is the largest sum, 2^31 - 16384; the byte dot products' offset
    # (128 * sum x) is far past int32 on the way and must cancel exactly
    K = 131071
    xq = torch.full((1, K), -128, dtype=torch.int8)
    wq = torch.stack([torch.full((K,), -128, dtype=torch.int8), torch.full((K,), 127, dtype=torch.int8)])
    out = ops.int8_mm(xq, torch.ones(1), wq, torch.ones(2), None, torch.float32)
    assert out.tolist() == [[float(128 * 128 * K), float(-128 * 127 * K)]]


# GEMM regime: weight blocks with tails (N), activation blocks with tails (M), K below a VNNI quad, not a whole
# number of quads, and past one brgemm depth step
@pytest.mark.parametrize("M,N,K", [(2, 130, 1), (9, 65, 3), (64, 64, 1030), (129, 1, 2049)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_int8_mm_gemm_epilogue(isa, amx, M, N, K, out_dtype):
    g = torch.Generator().manual_seed(M + N + K)
    xq = torch.randint(-128, 128, (M, K), dtype=torch.int8, generator=g)
    wq = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)
    xs, ws, bias = torch.rand(M, generator=g) + 0.01, torch.rand(N, generator=g) + 0.01, torch.randn(N, generator=g)
    ref, acc = ref_int8_mm(xq, xs, wq, ws, bias)
    out = ops.int8_mm(xq, xs, wq, ws, bias, out_dtype)
    # fp32 epilogue (three roundings) then one rounding to out_dtype
    assert_matmul_close(out, ref, acc.abs().double() * xs.double()[:, None] * ws.double() + bias.double().abs(),
                        acc_rtol=4 * 2.0 ** -24)


def test_int8_mm_gemm_row_blocks(isa, amx):
    # the AMX GEMM packs x a block of rows at a time (8 MiB of quads: 128 rows at K = 50001, then a block of 72, one
    # whole and one narrow brgemm column block); each row's scale and each column's must meet its own sums
    g = torch.Generator().manual_seed(50001)
    M, N, K = 200, 19, 50001
    xq = torch.randint(-128, 128, (M, K), dtype=torch.int8, generator=g)
    wq = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)
    xs, ws, bias = torch.rand(M, generator=g) + 0.01, torch.rand(N, generator=g) + 0.01, torch.randn(N, generator=g)
    ref, acc = ref_int8_mm(xq, xs, wq, ws, bias)
    out = ops.int8_mm(xq, xs, wq, ws, bias, torch.float32)
    assert_matmul_close(out, ref, acc.abs().double() * xs.double()[:, None] * ws.double() + bias.double().abs(),
                        acc_rtol=4 * 2.0 ** -24)


@pytest.mark.parametrize("K", [1, 7, 31, 32, 33, 64, 4095])  # below, at and past whole vector steps
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_quantize_rows_exact(isa, K, dtype):
    # the vectorized rows against numpy's fp32 division and rint: random rows, a zero row, a row of exact ties
    # (x / scale = n + 0.5: half to even), a row whose maximum sits in the tail
    g = torch.Generator().manual_seed(K)
    x = torch.randn(6, K, generator=g) * 3
    x[1] = 0
    x[2] = (torch.arange(K) % 9 - 4) + 0.5  # amax 4.5 -> scale 4.5 / 127; ties only where fp32 makes them so
    x[3, -1] = 50.0
    x[4, : K // 2] = -0.0
    x = x.to(dtype)
    q, s = ops.int8_quantize(x)
    q_ref, s_ref, _ = ref_int8_quantize(x)
    assert torch.equal(s, s_ref) and torch.equal(q, q_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_quantize_non_finite_rows_on_every_path(isa, dtype):
    # NaN / +-inf inside a 32-value vector step, in the lanes of its reduction, and in the scalar tail (K = 100:
    # 96 vectorized, 4 tail): scale is the quiet NaN and codes 0 at every level, finite rows exact
    x = torch.randn(8, 100, generator=torch.Generator().manual_seed(5))
    x[0, 3] = float("inf")
    x[1, 8] = 100.0  # the row's maximum, then a NaN in the same vector lane
    x[1, 40] = float("nan")
    x[2, 99] = float("nan")  # tail
    x[3, 96] = -float("inf")  # first tail element
    x[4, 95] = float("nan")  # last vectorized element
    x[5, 31], x[5, 32] = float("nan"), float("inf")
    x = x.to(dtype)
    q, s = ops.int8_quantize(x)
    q_ref, s_ref, _ = ref_int8_quantize(x)
    assert (s[:6].view(torch.int32) == 0x7FC00000).all() and (q[:6] == 0).all()
    assert torch.equal(q, q_ref) and torch.equal(s.view(torch.int32), s_ref.view(torch.int32))


def test_int8_quantize_large_rows(isa):
    x = torch.randn(9, 5000, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    q, s = ops.int8_quantize(x)
    assert torch.equal(s, x.float().abs().amax(-1) / 127)
    assert (q.float() - x.float() / s[:, None]).abs().max() <= 0.5 + 1e-3


def cpuinfo_flags():
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


@pytest.mark.skipif("avx512amx" not in ISAS, reason="the avx512amx set needs AVX-512")
def test_the_amx_tuned_set_runs_by_default_exactly_on_amx_cores():
    # avx512amx (the 4-bit GEMV on byte digit planes) is tuned for the cores with AMX; elsewhere the avx512 set runs
    # unless a cap names it. The choice reads CPUID; Linux's flags are the reference
    flags = cpuinfo_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags")
    amx = {"amx_bf16", "amx_tile", "amx_int8"} <= flags
    assert default_cpu_isa() == ("avx512amx" if amx else "avx512")
    with forced_cpu_isa("avx512amx"):
        assert cpu_isa() == "avx512amx"
    with forced_cpu_isa("avx512"):
        assert cpu_isa() == "avx512"
