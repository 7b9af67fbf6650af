"""The 4-bit ops' CPU paths, each forced: every kernel set this machine has (torch_lowbit.testing.forced_cpu_isa)
x every w4_mm regime (GEMV tiles of 1 row, row groups, the panel GEMM and its K windows) x every format (value
table, scale encoding, zero points, biases, global scale) x group sizes (the vector loops' multiples of 16, one
group per row, and the portable fallback's others) x tails (odd K, partial last groups), against the float64
reference (tests/reference.py). Scratch is poisoned (conftest): a kernel reading what it did not write fails."""
import math

import pytest
import torch

from reference import W4_VALUES_F64, assert_matmul_close, ref_w4_mm, w4_codes_f64, w4_scale_f64, w4_weight_f64
from torch_lowbit import _C
from torch_lowbit.testing import cpu_isa, forced_cpu_isa, supported_cpu_isas

ISAS = supported_cpu_isas()
ops = torch.ops.lowbit
FORMATS = ["nvfp4", "mxfp4", "int4", "uint4"]
# Rows that run w4_mm's GEMM regime on every route (w4_matmul.cpp's w4_gemm_min_rows: 8 on AMX, up to 64 elsewhere)
GEMM_ROWS = 64


@pytest.fixture(params=ISAS)
def isa(request):
    with forced_cpu_isa(request.param):
        assert cpu_isa() == request.param
        yield request.param


def random_w4(fmt, N, K, group, g, offset=False, global_scale=False, scale_dtype=torch.float16):
    """(codes, scale, offset, global_scale) of a random [N, K] weight: scales spread over a few octaves, zero
    points over the int8 range, biases around the weights' size."""
    G = -(-K // group)
    codes = torch.randint(0, 256, (N, (K + 1) // 2), dtype=torch.uint8, generator=g)
    if fmt == "nvfp4":
        # e4m3 bits 0x20..0x50 (2^-5 .. 2^1), positive
        scale = torch.randint(0x20, 0x50, (N, G), dtype=torch.uint8, generator=g)
    elif fmt == "mxfp4":
        scale = torch.randint(120, 132, (N, G), dtype=torch.uint8, generator=g)
    else:
        scale = (torch.rand(N, G, generator=g) * 0.1 + 0.01).to(scale_dtype)
    off = None
    if offset and fmt == "int4":
        off = torch.randint(-128, 128, (N, G), dtype=torch.int8, generator=g)
    elif offset and fmt == "uint4":
        off = torch.randn(N, G, generator=g).to(scale_dtype)
    gs = torch.tensor([0.75]) if global_scale and fmt == "nvfp4" else None
    return codes, scale, off, gs


def check_mm(x, fmt, group, w, bias=None, acc_rtol=1e-5):
    codes, scale, off, gs = w
    out = ops.w4_mm(x, codes, scale, fmt, group, off, gs, bias)
    ref, absref = ref_w4_mm(x, fmt, codes, scale, group, off, gs, bias)
    assert out.dtype == x.dtype and out.shape == ref.shape
    assert_matmul_close(out, ref, absref, acc_rtol=acc_rtol)
    return out


@pytest.mark.parametrize("M", [1, 2, 5, 7, 8, 64])  # GEMV 1 row / 2 rows / row groups; panel GEMM
@pytest.mark.parametrize("fmt", FORMATS)
def test_w4_mm_regimes(isa, fmt, M):
    g = torch.Generator().manual_seed(M + len(fmt))
    N, K = 37, 2112 + 32 * 31 + 3  # K: past two GEMM windows, an odd tail of a partial group
    group = {"nvfp4": 16, "mxfp4": 32, "int4": 128, "uint4": 64}[fmt]
    w = random_w4(fmt, N, K, group, g, offset=True, global_scale=True)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    check_mm(x, fmt, group, w, bias=torch.randn(N, generator=g))


@pytest.mark.parametrize("M", [1, 3, 9, GEMM_ROWS])
@pytest.mark.parametrize("group", [16, 48, 128, 4096, 24, 5])  # multiples of 16, per channel, others
@pytest.mark.parametrize("K", [255, 1000])
def test_w4_mm_group_sizes_and_tails(isa, M, group, K):
    g = torch.Generator().manual_seed(M * 7 + group + K)
    for fmt, offset, sdt in [("int4", True, torch.bfloat16), ("uint4", True, torch.float32), ("nvfp4", False, None)]:
        w = random_w4(fmt, 21, K, group, g, offset=offset, global_scale=True, scale_dtype=sdt)
        x = torch.randn(M, K, generator=g)
        check_mm(x, fmt, group, w)


@pytest.mark.parametrize("M", [1, 2, 5])
@pytest.mark.parametrize("group", [16, 32, 64, 128, 256, 4096, 48])
@pytest.mark.parametrize("K", [130, 1000])
def test_w4_mm_bf16_gemv(isa, M, group, K):
    # bf16 x: where the set has a bf16 tile, each group's sum is scaled once and a zero point or bias multiplies the
    # group's sum of x (w4_kernels.h); a lane or step given the wrong group's scale or offset, or a row given another
    # row's sums of x, is off by far more than the fp32 accumulation's bound
    g = torch.Generator().manual_seed(M * 5 + group + K)
    for fmt, offset in [("nvfp4", False), ("mxfp4", False), ("int4", False), ("int4", True), ("uint4", True)]:
        w = random_w4(fmt, 23, K, group, g, offset=offset, global_scale=True, scale_dtype=torch.bfloat16)
        check_mm(torch.randn(M, K, generator=g).to(torch.bfloat16), fmt, group, w, bias=torch.randn(23, generator=g))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("N", [64, 133, 198, 259])
@pytest.mark.parametrize("M", [1, 2, 3, 5])
def test_w4_mm_bf16_gemv_row_ranges(isa, threads, N, M):
    # the bf16 GEMV takes a range of weight rows per call (W4Kernels::gemv_rows_bf16) in tiles of its own, and the
    # driver finishes 64 columns at a time: one thread's ranges of several blocks, the last partial, tiles of 1-3
    # rows at their ends, 2-4 activation rows per call and 5 rows in two calls, each row's output in its own place
    g = torch.Generator().manual_seed(N * 7 + M)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for fmt, group, offset in [("int4", 128, False), ("nvfp4", 16, False), ("uint4", 64, True)]:
            w = random_w4(fmt, N, 384, group, g, offset=offset, global_scale=True, scale_dtype=torch.bfloat16)
            check_mm(torch.randn(M, 384, generator=g).to(torch.bfloat16), fmt, group, w,
                     bias=torch.randn(N, generator=g))
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("group,K", [(16, 2 * 4096 + 53), (32, 8192 + 45), (128, 32768 + 200)])
def test_w4_mm_bf16_gemv_scale_windows(isa, M, group, K):
    # rows of more groups than the bf16 tile decodes at once (256 per row): every window, the last one partial,
    # scales (and offsets) its own groups' sums
    g = torch.Generator().manual_seed(M + group)
    for fmt, offset in [("nvfp4", False), ("int4", True), ("uint4", True)]:
        w = random_w4(fmt, 9, K, group, g, offset=offset, global_scale=True, scale_dtype=torch.bfloat16)
        check_mm(torch.randn(M, K, generator=g).to(torch.bfloat16), fmt, group, w)


@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("group", [32, 128])  # 128: several whole 128-code steps per group
def test_w4_mm_bf16_gemv_nonfinite(isa, M, group):
    # NaN / inf activations reach their row; a NaN scale its column; an inf scale makes its column nonfinite
    # (inf or NaN: the scaled group sum is inf where the float64 sum of infinite terms of both signs is NaN)
    g = torch.Generator().manual_seed(7)
    N, K = 13, 256
    for fmt, offset in [("nvfp4", False), ("mxfp4", False), ("int4", False), ("int4", True), ("uint4", True)]:
        codes, scale, off, gs = random_w4(fmt, N, K, group, g, offset=offset, scale_dtype=torch.float32)
        if fmt in ("int4", "uint4"):
            scale[5, 1] = math.inf
        scale[3, -1] = {"nvfp4": 0x7F, "mxfp4": 0xFF}.get(fmt, math.nan)
        x = torch.randn(M, K, generator=g).to(torch.bfloat16)
        x[M - 1, 40] = math.nan if M > 1 else 0.0
        out = ops.w4_mm(x, codes, scale, fmt, group, off, gs)
        ref, absref = ref_w4_mm(x, fmt, codes, scale, group, off, gs)
        assert torch.isnan(out[:, 3]).all()
        if M > 1:
            assert torch.isnan(out[M - 1]).all()
        if fmt in ("int4", "uint4"):
            assert not torch.isfinite(out[:, 5]).any()
        keep = torch.isfinite(ref)
        assert torch.equal(keep, torch.isfinite(out))
        assert_matmul_close(out[keep], ref[keep], absref[keep], acc_rtol=1e-5)


@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("fmt,group", [("int4", 128), ("nvfp4", 16), ("mxfp4", 32)])
def test_w4_mm_bf16_gemv_steps_spanning_many_binades(isa, M, fmt, group):
    # bf16 x in the digit planes (w4_kernels.h; the avx512amx set) is exact in a 128-code step whose values span
    # at most 15 binades; wider steps take the bf16 step. Here one value of each step is 2^14 .. 2^17 times the
    # others and meets codes of value 0 in every row, so each output is the small values' sum alone: a step
    # rounded to its large value's precision would lose it, a step taken as exact with 16 binades garbles it
    g = torch.Generator().manual_seed(11 + M)
    N, K = 21, 640
    codes, scale, off, gs = random_w4(fmt, N, K, group, g, global_scale=True, scale_dtype=torch.bfloat16)
    zero_code = {"int4": 8, "nvfp4": 0, "mxfp4": 0}[fmt]
    x = (torch.rand(M, K, generator=g) + 1).to(torch.bfloat16)  # one binade: [1, 2)
    for step in range(K // 128):
        k = 128 * step + 5 + 2 * step  # odd and even positions: high and low nibbles
        x[:, k] = 2.0 ** (14 + step % 4)  # 15, 16, 17, 18 binades with the rest
        byte = codes[:, k // 2]
        codes[:, k // 2] = (byte & 0x0F) | (zero_code << 4) if k % 2 else (byte & 0xF0) | zero_code
    x[:, 3] = -x[:, 3]
    out = ops.w4_mm(x, codes, scale, fmt, group, off, gs)
    ref, absref = ref_w4_mm(x, fmt, codes, scale, group, off, gs)
    assert_matmul_close(out, ref, absref, acc_rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("M", [1, 3])
def test_w4_mm_bf16_gemv_long_rows_packed_by_several_threads(isa, threads, M):
    # A row of bf16 x longer than a task of the digit-plane pack (w4_matmul.cpp) is packed by several threads, tasks
    # crossing from row to row: a step's planes written from another step or row, or into another's place, give
    # another step's sum (each step of each row in its own binade, within 16 of the others)
    g = torch.Generator().manual_seed(5 + M + threads)
    N, K = 24, 128 * 37 + 3
    codes, scale, off, gs = random_w4("int4", N, K, 128, g)
    step = torch.arange(K) // 128
    x = torch.rand(M, K, generator=g) + 1
    x = (x * torch.exp2((step[None, :] * 5 + 3 * torch.arange(M)[:, None]) % 5 - 2)).to(torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = ops.w4_mm(x, codes, scale, "int4", 128, off, gs)
    finally:
        torch.set_num_threads(before)
    ref, absref = ref_w4_mm(x, "int4", codes, scale, 128, off, gs)
    assert_matmul_close(out, ref, absref, acc_rtol=1e-5)


@pytest.mark.parametrize("M", [1, 3, GEMM_ROWS])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_w4_mm_every_byte_scale(isa, M, dtype):
    # every E4M3 scale byte (nvfp4: subnormals, negatives, NaN) and the E8M0 ones that keep fp32 sums finite (mxfp4:
    # 2^-127 .. 2^3, and NaN), spread over rows and groups: the tiles' vector scale decodes against float64's
    g = torch.Generator().manual_seed(3)
    N, K = 256, 128
    n, grp = torch.arange(N)[:, None], torch.arange(8)[None, :]
    for fmt, group, scale in [("nvfp4", 16, (n + 37 * grp) % 256),
                              ("mxfp4", 32, torch.where(n == 255, 255, (n + 29 * grp[:, :4]) % 131))]:
        codes = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=g)
        scale = scale.to(torch.uint8)
        x = torch.randn(M, K, generator=g).to(dtype)
        out = check_mm(x, fmt, group, (codes, scale, None, None))
        assert torch.isnan(out[:, scale.eq(255).any(1) | (fmt == "nvfp4") & scale.eq(127).any(1)]).all()


# 8: AMX's first GEMM row count, one tile of 8 columns; 40: a block of 32 and one of 8; 300: two M blocks of the
# GEMM (each presets its own sums)
@pytest.mark.parametrize("M", [8, 40, 70, 300])
@pytest.mark.parametrize("group", [64, 128, 192])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_w4_mm_gemm_group_scales(isa, M, group, dtype):
    # integer codes (less int8 zero points) in groups of whole bf16 chunks: on the set's bf16 GEMM, or on AMX its
    # tile kernel (the avx512amx set; the avx512 set there multiplies two terms in brgemm), the bf16 panels hold the
    # codes, the group scales multiply each group's sums, and the sums start at MLX's biases times each group's sum
    # of x (w4_matmul.cpp's w4_grouped_exact); a partial last group; a NaN scale reaches only its column, an inf
    # scale makes its column nonfinite, a NaN x only its row
    g = torch.Generator().manual_seed(M + group)
    N, K = 45, 1000 + 37
    for fmt, offset, sdt in [("int4", True, torch.float32), ("int4", False, torch.bfloat16),
                             ("uint4", False, torch.float16), ("uint4", True, torch.bfloat16)]:
        codes, scale, off, gs = random_w4(fmt, N, K, group, g, offset=offset, scale_dtype=sdt)
        scale[3, 1] = math.nan
        scale[5, -1] = math.inf
        x = torch.randn(M, K, generator=g).to(dtype)
        x[M - 1, 7] = math.nan
        bias = torch.randn(N, generator=g)
        out = ops.w4_mm(x, codes, scale, fmt, group, off, gs, bias)
        ref, absref = ref_w4_mm(x, fmt, codes, scale, group, off, gs, bias)
        assert torch.isnan(out[:, 3]).all() and torch.isnan(out[M - 1]).all()
        assert not torch.isfinite(out[:, 5]).any()
        keep = torch.isfinite(ref)
        assert torch.equal(keep, torch.isfinite(out)), fmt
        assert_matmul_close(out[keep], ref[keep], absref[keep], acc_rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 12, GEMM_ROWS])
def test_w4_mm_activation_dtypes(isa, dtype, M):
    g = torch.Generator().manual_seed(M)
    w = random_w4("int4", 45, 320, 32, g, offset=False, scale_dtype=torch.float32)
    check_mm(torch.randn(M, 320, generator=g).to(dtype), "int4", 32, w)


@pytest.mark.parametrize("M", [1, 4, 10, GEMM_ROWS])
def test_w4_mm_nonfinite_activations_and_scales(isa, M):
    # NaN / inf in x reach every output of their row; a NaN or inf scale only its column (as in float64)
    g = torch.Generator().manual_seed(5)
    N, K = 19, 200
    for fmt in FORMATS:
        codes, scale, off, gs = random_w4(fmt, N, K, 32, g, offset=True)
        if fmt == "nvfp4":
            scale[3, 2] = 0x7F  # e4m3 NaN
        elif fmt == "mxfp4":
            scale[3, 2] = 0xFF  # e8m0 NaN
        else:
            scale[3, 2] = math.nan
            scale[7, 0] = math.inf
        x = torch.randn(M, K, generator=g)
        x[0, 11] = math.inf
        if M > 1:
            x[M - 1, 150] = math.nan
        out = check_mm(x, fmt, 32, (codes, scale, off, gs))  # NaN pattern checked against the reference
        assert torch.isnan(out[:, 3]).all() and not torch.isnan(out[:, 4]).all()


@pytest.mark.parametrize("M", [1, 9, GEMM_ROWS])
def test_w4_mm_scale_inf_with_zero_codes_in_the_padding(isa, M):
    # odd K: the unused high nibble of the last byte must not reach the sum (its table entry 0 * inf is NaN)
    g = torch.Generator().manual_seed(11)
    K = 33
    codes, scale, off, gs = random_w4("int4", 6, K, 64, g, scale_dtype=torch.float32)
    codes[:, -1] = 0x8F  # the last k: code 15; the padding nibble: code 8, value 0
    scale[2, 0] = math.inf
    check_mm(torch.rand(M, K, generator=g) + 0.5, "int4", 64, (codes, scale, off, gs))


@pytest.mark.parametrize("shape", [(0, 64, 32), (3, 0, 32), (3, 5, 0), (9, 5, 0)])
def test_w4_mm_empty(isa, shape):
    M, N, K = shape
    g = torch.Generator().manual_seed(1)
    codes, scale, _, _ = random_w4("int4", N, K, 32, g)
    bias = torch.randn(N, generator=g)
    out = ops.w4_mm(torch.randn(M, K), codes, scale, "int4", 32, None, None, bias)
    assert out.shape == (M, N)
    assert torch.equal(out, bias.expand(M, N)) if K == 0 else out.numel() == 0


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("group,K", [(16, 77), (32, 200), (64, 4095), (24, 100), (128, 128)])
def test_w4_dequantize_bits(isa, fmt, group, K):
    # every decoded element rounded once from the exact (fp32) product: equal to the float64 weight rounded
    g = torch.Generator().manual_seed(group + K)
    codes, scale, off, gs = random_w4(fmt, 13, K, group, g, offset=True, global_scale=True, scale_dtype=torch.float32)
    want = w4_weight_f64(fmt, codes, scale, group, K, off, gs)
    for dtype in (torch.float32, torch.bfloat16):
        got = ops.w4_dequantize(codes, scale, fmt, group, K, off, gs, dtype)
        if fmt == "uint4" and off is not None:  # value * scale rounds to fp32 before the bias: within 1 ulp twice
            torch.testing.assert_close(got.double(), want.to(dtype).double(), rtol=2 ** -22, atol=1e-6)
        else:
            assert torch.equal(got, want.to(dtype)), (fmt, dtype)


@pytest.mark.parametrize("M", [1, 6, 70])
def test_w4_mm_t(isa, M):
    g = torch.Generator().manual_seed(M)
    N, K = 150, 301
    for fmt, group in [("nvfp4", 16), ("int4", 32), ("uint4", 48)]:
        codes, scale, off, gs = random_w4(fmt, N, K, group, g, offset=True, global_scale=True)
        go = torch.randn(M, N, generator=g).to(torch.bfloat16)
        w = transposed_weight(fmt, codes, scale, group, K, off, gs, M)
        ref, absref = go.double() @ w, go.double().abs() @ w.abs()
        out = ops.w4_mm_t(go, codes, scale, fmt, group, K, off, gs)
        assert_matmul_close(out, ref, absref, acc_rtol=1e-5)


# ---- the GEMM regimes on bf16 panels (csrc/cpu/w4_matmul.cpp) ----
def bf16_transposed_route():
    """Whether w4_mm_t's GEMM regime multiplies bf16 grad_out by bf16 panels now (torch's bf16 GEMM on AMX or
    AVX-512 BF16: the cap at avx512 and torch.backends.mkldnn enabled)."""
    return _C._cpu_transposed_panels_bf16()


def w4_weight_f32(fmt, codes, scale, group, K, off):
    """The contract's fp32 weight, rounded as the kernels decode it: the product in fp32, then the bias in fp32
    (float64 products here are exact: 4-bit values times scales of at most 24 bits)."""
    q = W4_VALUES_F64[fmt][w4_codes_f64(codes, K)]
    g = torch.arange(K) // group
    s = w4_scale_f64(fmt, scale)[..., g]
    if off is not None and fmt == "uint4":
        return (q * s).float() + off.float()[..., g]
    if off is not None and fmt == "int4":
        return ((q - off.double()[..., g]) * s).float()
    return (q * s).float()


def bf16_dequantized(fmt, codes, scale, group, K, off, gs):
    """The weight w4_dequantize(dtype=bfloat16) gives, as float64: the fp32 weight times the global scale in
    fp32, rounded to bf16."""
    w = w4_weight_f32(fmt, codes, scale, group, K, off)
    return (w if gs is None else w * gs.float()).bfloat16().double()


W4_GEMM_MIN_ROWS = 8  # w4_matmul.h's kW4GemmMinRows: from this many rows w4_mm_t runs its GEMM regime


def transposed_weight(fmt, codes, scale, group, K, off, gs, rows, dtype=torch.bfloat16):
    """The float64 weight w4_mm_t multiplies `rows` rows of `dtype` grad_out by on the CPU: the exact weight, but
    bf16 grad_out in the GEMM regime on bf16 panels (AMX, AVX-512 BF16) multiplies the bf16-dequantized one
    (test_w4_mm_t_gemm_routes)."""
    if dtype == torch.bfloat16 and rows >= W4_GEMM_MIN_ROWS and bf16_transposed_route():
        return bf16_dequantized(fmt, codes, scale, group, K, off, gs)
    return w4_weight_f64(fmt, codes, scale, group, K, off, gs)


def close(out, ref, absref, acc_rtol):
    try:
        assert_matmul_close(out, ref, absref, acc_rtol=acc_rtol)
        return True
    except AssertionError:
        return False


# Two bf16 terms per weight lose at most about 2^-15 of a product (w4_matmul.cpp); a weight rounded to one bf16
# term loses up to 2^-9, which this bound rejects at K = 2000 (checked below on the float64 reference itself).
TWO_TERM_RTOL = 2.0 ** -14


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt,scale_dtype,offset,group", [("int4", torch.float32, True, 32),
                                                          ("int4", torch.float16, False, 32),
                                                          ("int4", torch.bfloat16, True, 4096),  # per channel
                                                          ("uint4", torch.bfloat16, True, 32),
                                                          ("uint4", torch.float32, False, 4096),
                                                          ("nvfp4", None, False, 32), ("mxfp4", None, False, 32)])
def test_w4_mm_gemm_bf16_terms(isa, fmt, scale_dtype, offset, group, dtype):
    # every set; at the avx512 cap the bf16 panels: one exact term (nvfp4, mxfp4) or hi + lo (int4, uint4),
    # float x with a two-term weight on the fp32 path
    g = torch.Generator().manual_seed(len(fmt) + (offset << 3) + group)
    N, K, M = 40, 2000 + 17, 64
    codes, scale, off, gs = random_w4(fmt, N, K, group, g, offset=offset, global_scale=True, scale_dtype=scale_dtype)
    x = torch.randn(M, K, generator=g).to(dtype)
    bias = torch.randn(N, generator=g)
    out = ops.w4_mm(x, codes, scale, fmt, group, off, gs, bias)
    ref, absref = ref_w4_mm(x, fmt, codes, scale, group, off, gs, bias)
    assert_matmul_close(out, ref, absref, acc_rtol=TWO_TERM_RTOL if dtype != torch.float32 else 1e-5)
    if fmt in ("int4", "uint4") and dtype == torch.float16:
        # the bound would catch a weight rounded once to bf16 (the float64 product on such a weight, rounded)
        w1 = w4_weight_f32(fmt, codes, scale, group, K, off).bfloat16().double()
        one_term = (x.double() @ w1.T + bias.double()).to(dtype)
        assert not close(one_term, ref, absref, TWO_TERM_RTOL)


@pytest.mark.parametrize("M", [8, 70])
@pytest.mark.parametrize("fmt,group,offset,gscale", [("int4", 32, True, False), ("uint4", 48, True, False),
                                                     ("nvfp4", 16, False, False), ("nvfp4", 16, False, True),
                                                     ("mxfp4", 32, False, False)])
def test_w4_mm_t_gemm_routes(isa, M, fmt, group, offset, gscale):
    # bf16 grad_out on bf16 hardware: grad_out times the bf16-dequantized weight (global * w in fp32, rounded once to bf16;
    # exact for nvfp4 / mxfp4 without a global scale); every other set the exact weight
    g = torch.Generator().manual_seed(M + group)
    N, K = 300, 1000 + 37
    codes, scale, off, gs = random_w4(fmt, N, K, group, g, offset=offset, global_scale=gscale)
    go = torch.randn(M, N, generator=g).to(torch.bfloat16)
    w = w4_weight_f64(fmt, codes, scale, group, K, off, gs)
    if bf16_transposed_route():
        w = bf16_dequantized(fmt, codes, scale, group, K, off, gs)
    out = ops.w4_mm_t(go, codes, scale, fmt, group, K, off, gs)
    assert_matmul_close(out, go.double() @ w, go.double().abs() @ w.abs(), acc_rtol=1e-5)
