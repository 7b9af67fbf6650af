"""The 4-bit ops w4_mm, w4_dequantize, w4_mm_t against the float64 reference of each format's own arithmetic:
every format and scale encoding, dtypes, empty sizes, odd K and partial groups, per-channel scales, bias, every
code of every format, non-finite activations and scales, strided inputs, bad input with its message, opcheck."""
import math

import pytest
import torch
from torch.library import opcheck

from conftest import backends_for
from reference import (W4_VALUES_F64, assert_matmul_close, ref_matmul_t, ref_w4_mm, w4_scale_f64, w4_weight_f64)
from test_w4_cpu_kernels import transposed_weight

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ACC_RTOL = 1e-5  # fp32 accumulation over K (or N) <= a few hundred
FP8 = torch.float8_e4m3fn

# (format, scale encoding, offset kind, global scale): every stored form the contract names
VARIANTS = {
    "nvfp4-fp8": ("nvfp4", "fp8", None, False),
    "nvfp4-bits-global": ("nvfp4", "bits", None, True),
    "nvfp4-fp8-global": ("nvfp4", "fp8", None, True),
    "mxfp4": ("mxfp4", "e8m0", None, False),
    "int4-f32": ("int4", torch.float32, None, False),
    "int4-f16-zp": ("int4", torch.float16, "zp", False),
    "int4-bf16": ("int4", torch.bfloat16, None, False),
    "int4-bf16-zp": ("int4", torch.bfloat16, "zp", False),
    "uint4-bf16-bias": ("uint4", torch.bfloat16, "bias", False),
    "uint4-f32": ("uint4", torch.float32, None, False),
}


def make_w4(variant, N, K, group_size, g):
    """Random codes (every nibble, the unused high nibble of odd K included) and finite scales of a variant:
    kwargs for the ops beside the format name."""
    fmt, enc, off, glob = VARIANTS[variant]
    G = -(-K // group_size)
    codes = torch.randint(0, 256, (N, (K + 1) // 2), dtype=torch.uint8, generator=g)
    if enc in ("fp8", "bits"):
        bits = torch.randint(0x08, 0x60, (N, G), dtype=torch.uint8, generator=g)  # positive, normal, finite
        scale = bits.view(FP8) if enc == "fp8" else bits
    elif enc == "e8m0":
        scale = torch.randint(120, 134, (N, G), dtype=torch.uint8, generator=g)
    else:
        scale = (torch.rand(N, G, generator=g) * 0.2 + 0.01).to(enc)
    offset = None
    if off == "zp":
        offset = torch.randint(-8, 8, (N, G), dtype=torch.int8, generator=g)
    elif off == "bias":
        offset = (torch.randn(N, G, generator=g) * 0.5).to(enc)
    global_scale = torch.tensor([0.37], dtype=torch.float32) if glob else None
    return dict(codes=codes, scale=scale, format=fmt, group_size=group_size, offset=offset, global_scale=global_scale)


def rows(t):
    """[..., C] -> [M, C] (also for C == 0)"""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def w64_of(w, K):
    return w4_weight_f64(w["format"], w["codes"], w["scale"], w["group_size"], K, w["offset"], w["global_scale"])


def run_mm(backend, x, w, bias=None):
    return backend.op("w4_mm")(backend.to(x), backend.to(w["codes"]), backend.to(w["scale"]), w["format"],
                               w["group_size"], backend.to(w["offset"]), backend.to(w["global_scale"]),
                               backend.to(bias))


def check_mm(backend, x, w, bias=None):
    out = run_mm(backend, x, w, bias)
    N, K = w["codes"].shape[0], x.shape[-1]
    assert out.shape == (*x.shape[:-1], N) and out.dtype == x.dtype and out.device == backend.device
    ref, absref = ref_w4_mm(rows(x), w["format"], w["codes"], w["scale"], w["group_size"], w["offset"],
                            w["global_scale"], bias)
    assert_matmul_close(rows(out), ref, absref, acc_rtol=ACC_RTOL)
    return out


def check_mm_t(backend, go, w, K):
    out = backend.op("w4_mm_t")(backend.to(go), backend.to(w["codes"]), backend.to(w["scale"]), w["format"],
                                w["group_size"], K, backend.to(w["offset"]), backend.to(w["global_scale"]))
    assert out.shape == (*go.shape[:-1], K) and out.dtype == go.dtype
    N = w["codes"].shape[0]
    # the CPU's GEMM regime may multiply by the bf16-dequantized weight (test_w4_cpu_kernels.transposed_weight)
    w64 = (transposed_weight(w["format"], w["codes"], w["scale"], w["group_size"], K, w["offset"], w["global_scale"],
                             rows(go).shape[0], go.dtype) if backend.name == "cpu" else w64_of(w, K))
    ref, absref = ref_matmul_t(rows(go), w64)
    assert_matmul_close(rows(out), ref, absref, acc_rtol=ACC_RTOL)
    return out


# ---------------------------------------------------------------------------------------------- w4_mm
@pytest.mark.parametrize("backend", backends_for("w4_mm"))
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_w4_mm__every_format_matches_float64(backend, variant, dtype):
    g = torch.Generator().manual_seed(1)
    K, gs = 75, 16 if variant.startswith("nvfp4") else 32  # odd K, partial last group
    w = make_w4(variant, 13, K, gs, g)
    for M in (1, 3, 9):
        check_mm(backend, torch.randn(M, K, generator=g).to(dtype), w)


@pytest.mark.parametrize("backend", backends_for("w4_mm"))
@pytest.mark.parametrize("M,N,K", [(0, 5, 32), (3, 0, 32), (3, 5, 0), (1, 1, 1), (64, 7, 33), (9, 1, 130),
                                   (3, 17, 128)])
@pytest.mark.parametrize("variant", ["nvfp4-bits-global", "mxfp4", "int4-bf16-zp", "uint4-bf16-bias"])
def test_w4_mm__sizes_empty_and_odd(backend, M, N, K, variant):
    g = torch.Generator().manual_seed(M * 1000 + N * 10 + K)
    w = make_w4(variant, N, K, 32, g)
    out = check_mm(backend, torch.randn(M, K, generator=g), w)
    if K == 0:
        assert (out == 0).all()


@pytest.mark.parametrize("backend", backends_for("w4_mm"))
@pytest.mark.parametrize("group_size", [16, 32, 64, 128, 200, 1000])  # 200 = K: per channel; 1000 > K
@pytest.mark.parametrize("variant", ["int4-f32", "int4-bf16-zp", "uint4-bf16-bias", "nvfp4-fp8"])
def test_w4_mm__group_sizes_and_per_channel(backend, group_size, variant):
    g = torch.Generator().manual_seed(group_size)
    w = make_w4(variant, 11, 200, group_size, g)
    assert w["scale"].shape == (11, math.ceil(200 / group_size))
    check_mm(backend, torch.randn(4, 200, generator=g).to(torch.bfloat16), w)


@pytest.mark.parametrize("backend", backends_for("w4_mm"))
@pytest.mark.parametrize("bias_dtype", DTYPES)
def test_w4_mm__bias_and_batch_dims(backend, bias_dtype):
    g = torch.Generator().manual_seed(2)
    w = make_w4("int4-bf16-zp", 9, 40, 16, g)
    bias = torch.randn(9, generator=g).to(bias_dtype)
    check_mm(backend, torch.randn(2, 3, 40, generator=g).to(torch.bfloat16), w, bias)


@pytest.mark.parametrize("backend", backends_for("w4_mm"))
def test_w4_mm__strided_and_offset_x(backend):
    g = torch.Generator().manual_seed(3)
    w = make_w4("nvfp4-fp8-global", 6, 48, 16, g)
    big = torch.randn(7, 100, generator=g)
    for x in (big[1:5, 3:51], big[:, :96].reshape(7, 2, 48)[:, 1], big.t()[:48].t()[2:6]):
        assert not x.is_contiguous() or x.storage_offset() > 0
        check_mm(backend, x, w)


@pytest.mark.parametrize("backend", backends_for("w4_mm"))
@pytest.mark.parametrize("dtype", DTYPES)
def test_w4_mm__nan_and_inf_in_x_propagate_as_the_reference(backend, dtype):
    g = torch.Generator().manual_seed(4)
    w = make_w4("int4-bf16", 8, 64, 32, g)
    x = torch.randn(5, 64, generator=g)
    x[0, 3] = float("nan")
    x[1, 10] = float("inf")
    x[2, 10] = -float("inf")
    x[3, 0] = float("inf")
    x[3, 1] = -float("inf")  # inf - inf: NaN
    out = check_mm(backend, x.to(dtype), w)
    assert torch.isnan(out[0]).all() and torch.isfinite(out[4]).all()


@pytest.mark.parametrize("backend", backends_for("w4_mm"))
@pytest.mark.parametrize("variant,bad", [("int4-f32", float("nan")), ("int4-bf16", float("inf")),
                                         ("nvfp4-bits-global", 0x7F), ("nvfp4-fp8", 0xFF), ("mxfp4", 0xFF)])
def test_w4_mm__a_non_finite_scale_affects_only_its_column(backend, variant, bad):
    g = torch.Generator().manual_seed(5)
    w = make_w4(variant, 6, 64, 16 if variant.startswith("nvfp4") else 32, g)
    s = w["scale"].view(torch.uint8) if w["scale"].dtype == FP8 else w["scale"]
    s[2, 1] = bad
    out = check_mm(backend, torch.randn(3, 64, generator=g), w)
    assert torch.isfinite(out[:, [0, 1, 3, 4, 5]]).all() and not torch.isfinite(out[:, 2]).any()


# ---------------------------------------------------------------------------------------------- w4_dequantize
def _scale_of_value(fmt, enc, value):
    if fmt == "mxfp4":
        return torch.tensor([[int(math.log2(value)) + 127]], dtype=torch.uint8)
    if fmt == "nvfp4":
        t = torch.tensor([[value]]).to(FP8)
        return t if enc == "fp8" else t.view(torch.uint8)
    return torch.tensor([[value]], dtype=enc)


@pytest.mark.parametrize("backend", backends_for("w4_dequantize"))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_w4_dequantize__every_code_of_every_format_decodes_exactly(backend, variant):
    fmt, enc, off, glob = VARIANTS[variant]
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes[0::2] | (codes[1::2] << 4)).reshape(1, 8)
    scale = _scale_of_value(fmt, enc, 0.5)
    offset = {None: None, "zp": torch.tensor([[3]], dtype=torch.int8),
              "bias": torch.tensor([[0.25]], dtype=enc if off == "bias" else torch.float32)}[off]
    gs = torch.tensor([0.125]) if glob else None
    out = backend.op("w4_dequantize")(backend.to(packed), backend.to(scale), fmt, 16, 16, backend.to(offset),
                                      backend.to(gs), torch.float32)
    table = {"nvfp4": [0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6],
             "mxfp4": [0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6],
             "int4": list(range(-8, 8)), "uint4": list(range(16))}[fmt]  # written from the formats' definitions
    v = torch.tensor(table, dtype=torch.float64)
    want = (v - 3) * 0.5 if off == "zp" else v * 0.5 + 0.25 if off == "bias" else v * 0.5
    if glob:
        want = want * 0.125
    assert torch.equal(out.cpu().double().reshape(16), want)
    assert torch.equal(torch.signbit(out.cpu()).reshape(16), torch.signbit(want))  # -0 stays -0


@pytest.mark.parametrize("backend", backends_for("w4_dequantize"))
@pytest.mark.parametrize("b", [0, 1, 127, 254, 255])
def test_w4_dequantize__e8m0_extremes(backend, b):
    packed = torch.tensor([[0x72, 0xF1]], dtype=torch.uint8)  # codes 2 (1.0), 7 (6.0), 1 (0.5), 15 (-6.0)
    out = backend.op("w4_dequantize")(backend.to(packed), backend.to(torch.tensor([[b]], dtype=torch.uint8)),
                                      "mxfp4", 32, 4, None, None, torch.float32).cpu().double()
    if b == 255:
        assert torch.isnan(out).all()
    else:
        want = torch.tensor([[1.0, 6.0, 0.5, -6.0]], dtype=torch.float64) * 2.0 ** (b - 127)
        assert torch.equal(out, want.float().double())  # 6 * 2^127 is past fp32's range: inf, as the reference
    if hasattr(torch, "float8_e8m0fnu") and b != 255:
        s = torch.tensor([[b]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
        out2 = backend.op("w4_dequantize")(backend.to(packed), backend.to(s), "mxfp4", 32, 4, None, None,
                                           torch.float32)
        assert torch.equal(out2.cpu(), out.float())


@pytest.mark.parametrize("backend", backends_for("w4_dequantize"))
@pytest.mark.parametrize("variant", ["nvfp4-bits-global", "mxfp4", "int4-f16-zp", "uint4-bf16-bias"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [0, 1, 37])
def test_w4_dequantize__matches_float64_rounded_once(backend, variant, dtype, K):
    g = torch.Generator().manual_seed(K + 7)
    w = make_w4(variant, 5, K, 16, g)
    out = backend.op("w4_dequantize")(backend.to(w["codes"]), backend.to(w["scale"]), w["format"], 16, K,
                                      backend.to(w["offset"]), backend.to(w["global_scale"]), dtype)
    assert out.shape == (5, K) and out.dtype == dtype
    ref = w64_of(w, K)
    # fp32 arithmetic (exact products of exact factors except the global scale and bias: an fp32 rounding), then
    # one rounding to dtype
    torch.testing.assert_close(out.cpu().double(), ref.to(dtype).double(), rtol=2 * torch.finfo(dtype).eps,
                               atol=1e-30)


# ---------------------------------------------------------------------------------------------- w4_mm_t
@pytest.mark.parametrize("backend", backends_for("w4_mm_t"))
@pytest.mark.parametrize("variant", ["nvfp4-fp8-global", "mxfp4", "int4-bf16-zp", "int4-f32", "uint4-bf16-bias"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K", [(1, 7, 33), (9, 16, 64), (0, 4, 8), (3, 0, 8), (3, 4, 0)])
def test_w4_mm_t__matches_float64(backend, variant, dtype, M, N, K):
    g = torch.Generator().manual_seed(M + N + K)
    w = make_w4(variant, N, K, 16, g)
    out = check_mm_t(backend, torch.randn(M, N, generator=g).to(dtype), w, K)
    if N == 0:
        assert (out == 0).all()


@pytest.mark.parametrize("backend", backends_for("w4_mm_t"))
def test_w4_mm_t__strided_grad_out_and_non_finite(backend):
    g = torch.Generator().manual_seed(8)
    w = make_w4("int4-bf16", 6, 40, 16, g)
    go = torch.randn(5, 12, generator=g)[:, ::2]
    go[1, 2] = float("nan")
    go[2, 0] = float("inf")
    check_mm_t(backend, go, w, 40)


# ---------------------------------------------------------------------------------------------- bad input
def _args(**over):
    g = torch.Generator().manual_seed(0)
    w = make_w4("int4-bf16-zp", 4, 32, 16, g)
    a = dict(x=torch.randn(2, 32), codes=w["codes"], scale=w["scale"], format="int4", group_size=16,
             offset=w["offset"], global_scale=None, bias=None)
    a.update(over)
    return a


def _call(op, a):
    if op == "w4_mm":
        return torch.ops.lowbit.w4_mm(a["x"], a["codes"], a["scale"], a["format"], a["group_size"], a["offset"],
                                      a["global_scale"], a["bias"])
    if op == "w4_dequantize":
        return torch.ops.lowbit.w4_dequantize(a["codes"], a["scale"], a["format"], a["group_size"], 32, a["offset"],
                                              a["global_scale"])
    return torch.ops.lowbit.w4_mm_t(torch.randn(2, a["codes"].shape[0]) if a["codes"].dim() == 2 else
                                    torch.randn(2, 4), a["codes"], a["scale"], a["format"], a["group_size"], 32,
                                    a["offset"], a["global_scale"])


NVFP4_SCALE = torch.ones(4, 2).to(FP8)
BAD = [
    ({"codes": torch.zeros(4, 16, dtype=torch.int8)}, "codes must be uint8 \\(two 4-bit codes per byte\\), got Char"),
    ({"codes": torch.zeros(4, 16, 1, dtype=torch.uint8)}, "codes must be \\[N, ceil\\(K/2\\)\\], got shape"),
    ({"codes": torch.zeros(16, 4, dtype=torch.uint8).t()}, "codes must be contiguous"),
    ({"codes": torch.zeros(4, 15, dtype=torch.uint8)}, "codes rows must hold ceil\\(K/2\\) = 16 bytes for K = 32"),
    ({"scale": torch.ones(4, 3, dtype=torch.bfloat16)}, "scale must be \\[N, ceil\\(K/group_size\\)\\] = \\[4, 2\\]"),
    ({"scale": torch.ones(4, 2, dtype=torch.uint8)}, "scale of format 'int4' must be float32, float16 or bfloat16"),
    ({"scale": torch.ones(4, 2, dtype=torch.float64)}, "scale of format 'int4' must be float32, float16 or bfloat16"),
    ({"format": "nvfp4", "offset": None, "scale": torch.ones(4, 2)},
     "scale of format 'nvfp4' must be float8_e4m3fn or uint8 \\(e4m3 bits\\)"),
    ({"format": "mxfp4", "offset": None, "scale": torch.ones(4, 2).to(FP8)},
     "scale of format 'mxfp4' must be uint8 \\(e8m0 bits\\) or float8_e8m0fnu"),
    ({"format": "nf4"}, "format must be one of 'nvfp4', 'mxfp4', 'int4', 'uint4', got 'nf4'"),
    ({"format": "nvfp4", "scale": NVFP4_SCALE}, "format 'nvfp4' takes no offset"),
    ({"global_scale": torch.ones(1)}, "format 'int4' takes no global_scale"),
    ({"format": "nvfp4", "offset": None, "scale": NVFP4_SCALE, "global_scale": torch.ones(2)},
     "global_scale must have one element"),
    ({"offset": torch.zeros(4, 2, dtype=torch.int32)}, "offset of format 'int4' holds zero points and must be int8"),
    ({"format": "uint4", "offset": torch.zeros(4, 2)},
     "offset of format 'uint4' holds biases and must have scale's dtype \\(BFloat16\\), got Float"),
    ({"offset": torch.zeros(4, 3, dtype=torch.int8)}, "offset must have scale's shape \\[4, 2\\]"),
    ({"scale": torch.ones(4, 2, dtype=torch.bfloat16, device="meta")}, "scale"),
    ({"group_size": 0}, "group_size must be >= 1, got 0"),
]


@pytest.mark.parametrize("op", ["w4_mm", "w4_dequantize", "w4_mm_t"])
@pytest.mark.parametrize("over,match", BAD, ids=[str(i) for i in range(len(BAD))])
def test_w4_ops__bad_input_is_refused_with_a_message(op, over, match):
    if op == "w4_dequantize" and "codes rows" in match:
        match = "codes rows must hold ceil\\(K/2\\)"
    with pytest.raises((RuntimeError, ValueError), match=match):
        _call(op, _args(**over))


def test_w4_mm__bad_x_and_bias():
    with pytest.raises(RuntimeError, match="w4_mm: x must be bfloat16, float16 or float32, got Double"):
        _call("w4_mm", _args(x=torch.randn(2, 32, dtype=torch.float64)))
    with pytest.raises(RuntimeError, match="codes rows must hold ceil\\(K/2\\) = 17 bytes for K = 34"):
        _call("w4_mm", _args(x=torch.randn(2, 34)))
    with pytest.raises(RuntimeError, match="bias must be \\[N\\] = \\[4\\]"):
        _call("w4_mm", _args(bias=torch.zeros(5)))
    with pytest.raises(RuntimeError, match="w4_mm_t: grad_out's last dimension \\(5\\) must equal the weight's N"):
        a = _args()
        torch.ops.lowbit.w4_mm_t(torch.randn(2, 5), a["codes"], a["scale"], "int4", 16, 32, a["offset"])
    with pytest.raises(RuntimeError, match="w4_dequantize: dtype must be bfloat16, float16 or float32"):
        a = _args()
        torch.ops.lowbit.w4_dequantize(a["codes"], a["scale"], "int4", 16, 32, a["offset"], None, torch.float64)


# ---------------------------------------------------------------------------------------------- opcheck
def _opcheck_args(op):
    g = torch.Generator().manual_seed(0)
    w = make_w4("int4-bf16-zp", 6, 33, 16, g)
    nv = make_w4("nvfp4-bits-global", 6, 33, 16, g)
    if op == "w4_mm":
        return [(torch.randn(3, 33, generator=g), w["codes"], w["scale"], "int4", 16, w["offset"], None,
                 torch.randn(6, generator=g)),
                (torch.randn(2, 33, generator=g).bfloat16(), nv["codes"], nv["scale"], "nvfp4", 16, None,
                 nv["global_scale"], None)]
    if op == "w4_dequantize":
        return [(w["codes"], w["scale"], "int4", 16, 33, w["offset"], None, torch.float32),
                (nv["codes"], nv["scale"], "nvfp4", 16, 33, None, nv["global_scale"], torch.bfloat16)]
    return [(torch.randn(3, 6, generator=g), w["codes"], w["scale"], "int4", 16, 33, w["offset"], None),
            (torch.randn(3, 6, generator=g).half(), nv["codes"], nv["scale"], "nvfp4", 16, 33, None,
             nv["global_scale"])]


@pytest.mark.parametrize("op", ["w4_mm", "w4_dequantize", "w4_mm_t"])
def test_w4_ops__opcheck(op):
    for args in _opcheck_args(op):
        opcheck(getattr(torch.ops.lowbit, op).default, args)


def test_w4_values_of_the_reference_are_the_formats_tables():
    # the reference tables themselves, pinned against the formats' definitions written out
    assert W4_VALUES_F64["int4"].tolist() == list(range(-8, 8))
    assert W4_VALUES_F64["nvfp4"][:8].tolist() == [0, .5, 1, 1.5, 2, 3, 4, 6]
    assert w4_scale_f64("mxfp4", torch.tensor([127], dtype=torch.uint8)).item() == 1.0


@pytest.mark.parametrize("over,match", [({"group_size": 0}, "group_size must be >= 1, got 0"),
                                        ({"scale": torch.ones(4, 3)}, "scale must be \\[N, ceil\\(K/group_size\\)\\]"),
                                        ({"codes": torch.zeros(4, 15, dtype=torch.uint8)}, "codes rows must hold"),
                                        ({"codes": torch.zeros(4, 16, dtype=torch.int8)}, "codes must be uint8")])
def test_w4_mm__fake_refuses_what_the_kernel_refuses(over, match):
    a = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in _args(**over).items()}
    with pytest.raises(RuntimeError, match=match):
        _call("w4_mm", a)
