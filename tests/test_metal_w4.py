"""The Metal 4-bit kernels (w4_mm, w4_dequantize, w4_mm_t) on their shape classes, in the emulator (both thread
orders) and on mps: every format and scale encoding (nvfp4 with a global scale, mxfp4, int4 with and without
zero points, uint4 with biases), every activation dtype, M = 1 (GEMV) / small (multi-row GEMV) / large (tiled
GEMM), odd K, K not a multiple of the group, odd group sizes, partial N tiles, unaligned buffers, empty sizes,
NaN / inf activations and scales, bad input; against the float64 reference of tests/reference.py. Sizes are kept
small (the emulator runs every GPU thread) but reach every tail of the kernels' loops."""
import math
import os
import sys
import zlib

import pytest
import torch

import torch_lowbit
from conftest import Backend
from reference import W4_VALUES_F64, assert_matmul_close, ref_matmul_t, ref_w4_mm, w4_codes_f64, w4_scale_f64, \
    w4_weight_f64

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SUFFIX = {torch.float32: "float", torch.float16: "half", torch.bfloat16: "bfloat"}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def metal_backends(rev=True):
    """The Metal backends of the 4-bit ops: the emulator in both thread orders, and mps (skipped off a Mac)."""
    params = []
    for name in ["metal_emu"] + (["metal_emu_rev"] if rev else []) + ["mps"]:
        marks = []
        if name.startswith("metal_emu") and not torch_lowbit.emulator.available():
            marks.append(pytest.mark.skip(reason="the Metal emulator is not built in this install"))
        if name == "mps" and not torch.backends.mps.is_available():
            marks.append(pytest.mark.skip(reason="needs an Apple GPU (mps device)"))
        params.append(pytest.param(Backend(name), id=name, marks=marks))
    return params


def _gen(*key):
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


# ---------------------------------------------------------------------------------------------- weights
# id -> (format, group_size, scale dtype, offset, global scale): every scale encoding and every offset kind
FORMATS = {
    "nvfp4": ("nvfp4", 16, torch.uint8, False, True),
    "nvfp4_f8": ("nvfp4", 16, torch.float8_e4m3fn, False, False),
    "mxfp4": ("mxfp4", 32, torch.uint8, False, False),
    "int4_zp_bf16": ("int4", 32, torch.bfloat16, True, False),
    "int4_sym_f16": ("int4", 64, torch.float16, False, False),
    "int4_zp_f32": ("int4", 24, torch.float32, True, False),
    "uint4_bias_bf16": ("uint4", 64, torch.bfloat16, True, False),
    "uint4_bias_f16": ("uint4", 32, torch.float16, True, False),
    "uint4_f32": ("uint4", 7, torch.float32, False, False),
}


class W4:
    """A random 4-bit weight of one FORMATS entry: the op's weight arguments and the float64 reference weight."""

    def __init__(self, fid, N, K, g, group=None):
        fmt, default_group, sdt, has_offset, has_global = FORMATS[fid]
        self.format, self.K = fmt, K
        self.group = group or default_group
        G = math.ceil(K / self.group) if K else 0
        self.codes = torch.randint(0, 256, (N, (K + 1) // 2), dtype=torch.uint8, generator=g)
        if fmt == "nvfp4":  # e4m3 scales 0.25 .. 4, no NaN code
            bits = torch.randint(0x28, 0x48, (N, G), dtype=torch.uint8, generator=g)
            self.scale = bits if sdt == torch.uint8 else bits.view(torch.float8_e4m3fn)
        elif fmt == "mxfp4":  # 2^-6 .. 2^5
            self.scale = torch.randint(121, 133, (N, G), dtype=torch.uint8, generator=g)
        else:
            self.scale = ((torch.rand(N, G, generator=g) + 0.25) * 0.1).to(sdt)
        self.offset = None
        if has_offset and fmt == "int4":
            self.offset = torch.randint(-4, 5, (N, G), dtype=torch.int8, generator=g)
        elif has_offset:
            self.offset = (torch.randn(N, G, generator=g) * 0.5).to(sdt)
        self.global_scale = torch.tensor([0.75]) if has_global else None

    def args(self, backend):
        return (backend.to(self.codes), backend.to(self.scale), self.format, self.group)

    def kwargs(self, backend):
        return dict(offset=backend.to(self.offset), global_scale=backend.to(self.global_scale))

    def f64(self):
        return w4_weight_f64(self.format, self.codes, self.scale, self.group, self.K, self.offset, self.global_scale)


def _x(shape, dtype, g):
    return (torch.randn(shape, generator=g) * 2).to(dtype)


def run_mm(backend, x, w, bias=None):
    out = backend.op("w4_mm")(backend.to(x), *w.args(backend), bias=backend.to(bias), **w.kwargs(backend))
    assert out.shape == x.shape[:-1] + (w.codes.shape[0],) and out.dtype == x.dtype and out.device == backend.device
    ref, absref = ref_w4_mm(x, w.format, w.codes, w.scale, w.group, w.offset, w.global_scale, bias)
    assert_matmul_close(out.cpu(), ref, absref)
    return out.cpu()


def run_mm_t(backend, g, w):
    out = backend.op("w4_mm_t")(backend.to(g), *w.args(backend), w.K, **w.kwargs(backend))
    assert out.shape == g.shape[:-1] + (w.K,) and out.dtype == g.dtype
    ref, absref = ref_matmul_t(g.reshape(-1, g.shape[-1]), w.f64())
    assert_matmul_close(out.cpu().reshape(-1, w.K), ref, absref)
    return out.cpu()


# ---------------------------------------------------------------------------------------------- w4_mm
# M = 1 (GEMV), 5 (multi-row GEMV), 40 (GEMM: a full and a partial 32-row tile); N = 9 leaves partial GEMV
# threadgroups (4 columns) and a partial GEMM tile; K = 200 ends every group size here in a partial group.
@pytest.mark.parametrize("backend", metal_backends())
@pytest.mark.parametrize("M", [1, 5, 40])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fid", list(FORMATS))
def test_mm_formats(backend, fid, dtype, M):
    g = _gen("fmt", fid, str(dtype), M)
    run_mm(backend, _x((M, 200), dtype, g), W4(fid, 9, 200, g))


# K tails of every loop: 1 code (half a byte), odd K (an unused high nibble), K below / across a GEMV lane's 32
# codes and a GEMM step's 32, two and three 1024-code GEMV steps with a partial last one. K = 64 / 1088: 16-byte
# aligned code rows (uint4 loads); the others take word or byte loads.
@pytest.mark.parametrize("backend", metal_backends())
@pytest.mark.parametrize("M", [1, 5, 40])
@pytest.mark.parametrize("K", [1, 7, 15, 33, 64, 1088, 2113])
def test_mm_k_tails(backend, M, K):
    g = _gen("k", M, K)
    fid = "nvfp4" if K % 2 else "int4_zp_bf16"
    run_mm(backend, _x((M, K), torch.bfloat16, g), W4(fid, 6, K, g))


@pytest.mark.parametrize("backend", metal_backends())
@pytest.mark.parametrize("M", [1, 8, 9, 33])
@pytest.mark.parametrize("N", [1, 3, 33, 65])
def test_mm_n_tails(backend, M, N):
    g = _gen("n", M, N)
    run_mm(backend, _x((M, 48), torch.float16, g), W4("mxfp4", N, 48, g))


# group sizes that split the kernels' 8-code words (3, 5, 12) or hold one (8); per channel (group >= K, also past
# 32 bits); a group of 1
@pytest.mark.parametrize("backend", metal_backends(rev=False))
@pytest.mark.parametrize("M", [1, 5, 40])
@pytest.mark.parametrize("group", [1, 3, 5, 8, 12, 72, 2 ** 40])
def test_mm_group_sizes(backend, M, group):
    g = _gen("grp", M, group)
    run_mm(backend, _x((M, 72), torch.float32, g), W4("uint4_bias_f16", 5, 72, g, group=group))


@pytest.mark.parametrize("backend", metal_backends(rev=False))
@pytest.mark.parametrize("bias_dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 6, 33])
def test_mm_bias(backend, bias_dtype, M):
    g = _gen("b", M, str(bias_dtype))
    bias = (torch.randn(7, generator=g) * 8).to(bias_dtype)
    run_mm(backend, _x((M, 40), torch.float32, g), W4("nvfp4", 7, 40, g), bias)


@pytest.mark.parametrize("backend", metal_backends(rev=False))
@pytest.mark.parametrize("lead", [(1, 1), (2, 3), (3, 12)])  # M = 1 / 6 / 36 through a 3-D x
def test_mm_3d_x(backend, lead):
    g = _gen("3d", lead)
    run_mm(backend, _x(lead + (40,), torch.bfloat16, g), W4("int4_zp_f32", 5, 40, g))


# x and codes at storage offsets that break 16- and 4-byte alignment: the kernels fall back to narrower loads
@pytest.mark.parametrize("backend", metal_backends(rev=False))
@pytest.mark.parametrize("M", [1, 5, 40])
def test_mm_unaligned_buffers(backend, M):
    g = _gen("unaligned", M)
    N, K = 6, 128
    x = _x((M * K + 3,), torch.bfloat16, g)[3:].view(M, K)
    w = W4("nvfp4", N, K, g)
    w.codes = torch.randint(0, 256, (N * K // 2 + 1,), dtype=torch.uint8, generator=g)[1:].view(N, K // 2)
    run_mm(backend, x, w)


@pytest.mark.parametrize("backend", metal_backends(rev=False))
@pytest.mark.parametrize("M", [1, 5, 40])
def test_mm_strided_x_and_scales(backend, M):
    g = _gen("strided", M)
    N, K = 6, 64
    x = _x((M, 2 * K), torch.float16, g)[:, ::2]
    w = W4("int4_zp_bf16", N, K, g)
    w.scale = torch.cat([w.scale, w.scale], 1)[:, ::2]
    run_mm(backend, x, w)


def non_finite_case(fid, M, N, K, dtype, g):
    """x [M, K] with a NaN in row 0 and an inf in row M - 1, and a weight whose column 2 has a NaN scale (one-byte
    encodings) or an infinite one (column 4 then a NaN one)."""
    x = _x((M, K), dtype, g)
    x[0, 3] = math.nan
    x[M - 1, K - 1] = math.inf
    w = W4(fid, N, K, g)
    if w.format == "nvfp4":
        w.scale[2, 1] = 0x7F  # e4m3 NaN
    elif w.format == "mxfp4":
        w.scale[2, 1] = 0xFF  # e8m0 NaN
    else:
        w.scale[2, 1] = math.inf
        w.scale[4, 0] = math.nan
    return x, w


# NaN and inf activations propagate as in float64 (inf times a zero weight is NaN); a NaN or infinite scale
# makes only its own column NaN / inf, also in the GEMV lanes and GEMM tiles that pad past K with zeros.
@pytest.mark.parametrize("backend", metal_backends())
@pytest.mark.parametrize("M", [1, 5, 40])
@pytest.mark.parametrize("fid", ["nvfp4", "mxfp4", "int4_zp_bf16"])
def test_mm_non_finite(backend, fid, M):
    x, w = non_finite_case(fid, M, 7, 45, torch.float32, _gen("nan", fid, M))
    out = run_mm(backend, x, w)
    assert torch.isnan(out[0]).all() and not torch.isfinite(out[:, 2]).any()


@pytest.mark.parametrize("backend", metal_backends(rev=False))
@pytest.mark.parametrize("M,N,K", [(0, 5, 8), (3, 0, 8), (3, 5, 0), (40, 5, 0)])
def test_mm_empty_sizes(backend, M, N, K):
    g = _gen("empty", M, N, K)
    w = W4("int4_zp_bf16", N, K, g)
    bias = torch.randn(N, generator=g)
    out = backend.op("w4_mm")(backend.to(torch.ones(M, K)), *w.args(backend), bias=backend.to(bias),
                              **w.kwargs(backend)).cpu()
    assert out.shape == (M, N)
    assert torch.equal(out, bias.expand(M, N) if K == 0 else torch.empty(M, N))


@pytest.mark.parametrize("backend", metal_backends(rev=False))
def test_mm_bad_input(backend):
    g = _gen("bad")
    w = W4("nvfp4", 4, 32, g)
    x = backend.to(torch.ones(2, 32))
    with pytest.raises(RuntimeError, match="w4_mm: format must be one of 'nvfp4', .* got 'nf3'"):
        backend.op("w4_mm")(x, backend.to(w.codes), backend.to(w.scale), "nf3", 16)
    with pytest.raises(RuntimeError, match=r"w4_mm: codes rows must hold ceil\(K/2\) = 16 bytes for K = 32"):
        backend.op("w4_mm")(x, backend.to(w.codes[:, :15].contiguous()), backend.to(w.scale), "nvfp4", 16)
    with pytest.raises(RuntimeError, match="w4_mm: scale of format 'mxfp4' must be uint8"):
        backend.op("w4_mm")(x, backend.to(w.codes), backend.to(torch.ones(4, 1)), "mxfp4", 32)
    with pytest.raises(RuntimeError, match="w4_mm: format 'mxfp4' takes no global_scale"):
        backend.op("w4_mm")(x, backend.to(w.codes), backend.to(w.scale[:, :1]), "mxfp4", 32,
                            global_scale=backend.to(torch.ones(1)))


# ---------------------------------------------------------------------------------------------- w4_dequantize
def assert_dequantized(out, w, dtype):
    """out vs the float64 weight: the fp32 decode ((v - z) * s + b, then times the global scale: a rounding of
    each step, relative to its terms) and one rounding to dtype; NaN where the reference has NaN."""
    ref = w.f64()
    q = W4_VALUES_F64[w.format][w4_codes_f64(w.codes, w.K)].abs()
    s = w4_scale_f64(w.format, w.scale)[..., torch.arange(w.K) // w.group].abs()
    terms = q * s
    if w.offset is not None:
        terms = terms + w.offset.double()[..., torch.arange(w.K) // w.group].abs() * (s if w.format == "int4" else 1)
    if w.global_scale is not None:
        terms = terms * float(w.global_scale)
    o = out.double()
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(o), nan)
    tol = 1.01 * 2.0 ** -24 * 4 * terms + {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11,
                                              torch.bfloat16: 2.0 ** -8}[dtype] * ref.abs() + 1e-30
    assert ((o - ref).abs() <= tol)[~nan].all()


@pytest.mark.parametrize("backend", metal_backends())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fid", list(FORMATS))
def test_dequantize_formats(backend, fid, dtype):
    g = _gen("dq", fid, str(dtype))
    w = W4(fid, 5, 75, g)  # odd K, partial groups, partial last 8-code word
    out = backend.op("w4_dequantize")(*w.args(backend), w.K, dtype=dtype, **w.kwargs(backend))
    assert out.shape == (5, 75) and out.dtype == dtype
    assert_dequantized(out.cpu(), w, dtype)


@pytest.mark.parametrize("backend", metal_backends(rev=False))
@pytest.mark.parametrize("K,codes_offset", [(64, 0), (64, 1), (1, 0), (0, 0)])
def test_dequantize_alignment_and_empty(backend, K, codes_offset):
    g = _gen("dqa", K, codes_offset)
    w = W4("mxfp4", 3, K, g)
    rb = (K + 1) // 2
    w.codes = torch.randint(0, 256, (3 * rb + codes_offset,), dtype=torch.uint8, generator=g)[codes_offset:].view(3, rb)
    if K:
        w.scale[1, 0] = 0xFF  # e8m0 NaN: row 1's first group only
    out = backend.op("w4_dequantize")(*w.args(backend), K, dtype=torch.float32, **w.kwargs(backend)).cpu()
    assert out.shape == (3, K)
    assert_dequantized(out, w, torch.float32)


# ---------------------------------------------------------------------------------------------- w4_mm_t
# M = 1 / 5 / 40: partial 32-row tiles; N = 37 (a partial 32-row step of the reduction); K = 75 / 64: odd K,
# partial groups and a partial 32-column output tile, or aligned code rows.
@pytest.mark.parametrize("backend", metal_backends())
@pytest.mark.parametrize("M", [1, 5, 40])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fid", list(FORMATS))
def test_mm_t_formats(backend, fid, dtype, M):
    g = _gen("t", fid, str(dtype), M)
    K = 64 if M == 5 else 75
    run_mm_t(backend, _x((M, 37), dtype, g), W4(fid, 37, K, g))


@pytest.mark.parametrize("backend", metal_backends(rev=False))
@pytest.mark.parametrize("fid", ["nvfp4", "int4_zp_f32"])
def test_mm_t_non_finite_and_3d(backend, fid):
    g = _gen("tnan", fid)
    w = W4(fid, 9, 40, g)
    if w.format == "nvfp4":
        w.scale[2, 1] = 0x7F
    else:
        w.scale[2, 1] = math.inf
    grad = _x((2, 3, 9), torch.float32, g)
    grad[0, 1, 4] = math.nan
    run_mm_t(backend, grad, w)


@pytest.mark.parametrize("backend", metal_backends(rev=False))
@pytest.mark.parametrize("M,N,K", [(0, 5, 8), (3, 0, 8), (3, 5, 0)])
def test_mm_t_empty_sizes(backend, M, N, K):
    w = W4("uint4_bias_bf16", N, K, _gen("tempty", M, N, K))
    out = backend.op("w4_mm_t")(backend.to(torch.ones(M, N)), *w.args(backend), K, **w.kwargs(backend)).cpu()
    assert out.shape == (M, K) and torch.equal(out, torch.zeros(M, K))


# ---------------------------------------------------------------------------------------------- instantiations
def test_kernel_instantiations_are_generated():
    """Every w4 .metal file carries the instantiation block csrc/metal/w4_instances.py generates (one line per
    variant; run it after changing the list)."""
    sys.path.insert(0, os.path.join(ROOT, "csrc", "metal"))
    import w4_instances
    for path in w4_instances.KERNELS:
        assert w4_instances.current(ROOT, path) == w4_instances.block(path), path


@pytest.mark.skipif(not torch_lowbit.emulator.available(), reason="the Metal emulator is not built in this install")
@pytest.mark.parametrize("dtype", DTYPES)
def test_plan_picks_kernel_per_m_and_scale_encoding(dtype):
    """M = 1: the GEMV; 2 .. 8: the multi-row GEMV; more: the GEMM; the scale encoding and the offset kind pick
    the variant (a format that may carry an offset runs the offset-free variant without one)."""
    meta = torch.device("meta")
    s = SUFFIX[dtype]
    cases = [("nvfp4", torch.uint8, None, "e4m3_none"), ("mxfp4", torch.uint8, None, "e8m0_none"),
             ("int4", torch.float32, torch.int8, "f32_zp"), ("int4", torch.float16, None, "f16_none"),
             ("uint4", torch.bfloat16, torch.bfloat16, "bf16_bias")]
    for fmt, sdt, odt, variant in cases:
        for M, kernel in [(1, "w4_gemv"), (2, "w4_gemv_rows"), (8, "w4_gemv_rows"), (9, "w4_gemm"), (4096, "w4_gemm")]:
            with torch_lowbit.emulator.dry_run() as d:
                d.ops.w4_mm(torch.empty(M, 64, dtype=dtype, device=meta),
                            torch.empty(16, 32, dtype=torch.uint8, device=meta),
                            torch.empty(16, 2, dtype=sdt, device=meta), fmt, 32,
                            None if odt is None else torch.empty(16, 2, dtype=odt, device=meta))
                (rec,) = d.take()
            assert rec["kernel"] == f"{kernel}_{s}_{variant}", (fmt, M)
