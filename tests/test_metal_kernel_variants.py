"""The kernel every Metal plan picks, over a grid of shapes at the thresholds between its kernels, for each
activation dtype, on the portable device (M1) and on M5 (emulator.device_caps). The plans choose through their
KernelVariant tables (csrc/metal/plans.h); the names expected here are written from the documented switch points
(design.md: GEMV at M = 1, multi-row GEMV up to 8 rows, tiled GEMM past them; grouped ops by mean rows per group;
M5's matmul2d GEMMs for 16-bit activations only), so a table line in the wrong class or order fails here. The
plans run on meta tensors through torch_lowbit.emulator.dry_run: nothing is computed. Then the kernels' names on
the Metal side: every instantiation goes through metal/instantiate.h's macros."""
import glob
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import backends_for
from reference import ref_int8_mm
from test_transposed_ops import check_int8_t
from torch_lowbit.emulator import device_caps, dry_run

META = torch.device("meta")
DTYPES = {torch.bfloat16: "bfloat", torch.float16: "half", torch.float32: "float"}
DEVICES = {"m1": {}, "m5": {"apple_family": 10, "msl_version": 400}}
ROWS = [1, 2, 8, 9, 33]  # GEMV | multi-row GEMV (2..8) | GEMM (9..)
K, N = 64, 48            # K a multiple of 16: the vector-load variants where an op has them


def kernels(op, *args, device="m1"):
    with device_caps(**DEVICES[device]), dry_run() as d:
        getattr(d.ops, op)(*args)
        return [r["kernel"] for r in d.take()]


def empty(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device=META)


def fp8_weight(*lead):
    return empty(*lead, N, K, dtype=torch.float8_e4m3fn), empty(*lead, 1, 1), [128, 128]


def m5_gemm(device, dtype):
    """M5 runs the matmul2d GEMMs for bf16 / fp16 activations; fp32 would be rounded there, so it never does"""
    return device == "m5" and dtype != torch.float32


def regime(M):
    return "gemv" if M == 1 else "gemv_rows" if M <= 8 else "gemm"


@pytest.mark.parametrize("device", list(DEVICES))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_dense_fp8_and_transposed_kernels(device, dtype):
    d = DTYPES[dtype]
    w, s, block = fp8_weight()
    wq = empty(N, K, dtype=torch.int8)
    for M in ROWS:
        fwd = {"gemv": "fp8_gemv", "gemv_rows": "fp8_gemv_rows",
               "gemm": "fp8_gemm_mpp" if m5_gemm(device, dtype) else "fp8_gemm"}[regime(M)]
        assert kernels("fp8_mm", empty(M, K, dtype=dtype), w, s, None, block, device=device) == [f"{fwd}_{d}"], M
        g = empty(M, N, dtype=dtype)
        # the transposed products have no M5 kernel: the portable ones run there too
        assert kernels("fp8_mm_t", g, w, s, block, device=device) == [f"fp8_mm_t_{regime(M)}_{d}"], M
        assert kernels("int8_weight_mm_t", g, wq, empty(N), device=device) == \
            [f"int8_weight_mm_t_{regime(M)}_{d}"], M


@pytest.mark.parametrize("device", list(DEVICES))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_int8_kernels(device, dtype):
    d = DTYPES[dtype]
    wq = empty(N, K, dtype=torch.int8)
    for M in ROWS:
        x = empty(M, K, dtype=dtype)
        assert kernels("int8_quantize", x, device=device) == [f"int8_quantize_{d}"]
        xq, xs = empty(M, K, dtype=torch.int8), empty(M)
        mm = kernels("int8_mm", xq, xs, wq, empty(N), None, dtype, device=device)
        # int8 x int8 feeds the tensor units exactly whatever the output dtype: M5's GEMM for every dtype
        want = ("int8_gemv_" + d + "_k16" if M <= 8 else
                "int8_gemm_mpp_" + d if device == "m5" else "int8_gemm_" + d + "_k16")
        assert mm == [want], M


@pytest.mark.parametrize("device", list(DEVICES))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_dequantize_kernels(device, dtype):
    w, s, block = fp8_weight()
    assert kernels("fp8_dequantize", w, s, block, dtype, device=device) == [f"fp8_dequantize_{DTYPES[dtype]}"]
    codes = empty(N, K // 2, dtype=torch.uint8)
    got = kernels("w4_dequantize", codes, empty(N, K // 16, dtype=torch.uint8), "nvfp4", 16, K, None, empty(1),
                  dtype, device=device)
    assert got == [f"w4_dequantize_{DTYPES[dtype]}_e4m3_none"]


@pytest.mark.parametrize("device", list(DEVICES))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_grouped_kernels(device, dtype):
    d = DTYPES[dtype]
    E = G = 4
    w, s, block = fp8_weight(E)
    offsets, ids = empty(G + 1, dtype=torch.int32), empty(G, dtype=torch.int32)
    codes, w4_scale = empty(E, N, K // 2, dtype=torch.uint8), empty(E, N, K // 32, dtype=torch.uint8)
    # decode up to 8 mean rows per group (T <= 8 G), prefill past it
    for T in [1, 8 * G, 8 * G + 1, 100]:
        decode = T <= 8 * G
        fwd = "fp8_grouped_gemv" if decode else "fp8_grouped_gemm_mpp" if m5_gemm(device, dtype) else "fp8_grouped_gemm"
        assert kernels("fp8_grouped_mm", empty(T, K, dtype=dtype), w, s, offsets, ids, block, device=device) == \
            ["fp8_grouped_tiles", f"{fwd}_{d}"], T
        bwd = "fp8_grouped_mm_t_gemv_rows" if decode else "fp8_grouped_mm_t_gemm"
        assert kernels("fp8_grouped_mm_t", empty(T, N, dtype=dtype), w, s, offsets, ids, block, device=device) == \
            ["fp8_grouped_tiles", f"{bwd}_{d}"], T
        w4 = "w4_grouped_gemv" if decode else "w4_grouped_gemm_mpp" if m5_gemm(device, dtype) else "w4_grouped_gemm"
        assert kernels("w4_grouped_mm", empty(T, K, dtype=dtype), codes, w4_scale, "mxfp4", 32, offsets, ids, None,
                       None, device=device) == ["fp8_grouped_tiles", f"{w4}_{d}_e8m0_none"], T
        # the 4-bit transposed product: the tiled GEMM for every T
        assert kernels("w4_grouped_mm_t", empty(T, N, dtype=dtype), codes, w4_scale, "mxfp4", 32, K, offsets, ids,
                       None, None, device=device) == ["fp8_grouped_tiles", f"w4_grouped_mm_t_gemm_{d}_e8m0_none"], T


@pytest.mark.parametrize("device", list(DEVICES))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_w4_dense_kernels(device, dtype):
    d = DTYPES[dtype]
    codes, scale, zp = empty(N, K // 2, dtype=torch.uint8), empty(N, K // 32, dtype=torch.bfloat16), \
        empty(N, K // 32, dtype=torch.int8)
    for M in ROWS:
        got = kernels("w4_mm", empty(M, K, dtype=dtype), codes, scale, "int4", 32, zp, None, None, device=device)
        fwd = "gemm_mpp" if regime(M) == "gemm" and m5_gemm(device, dtype) else regime(M)
        assert got == [f"w4_{fwd}_{d}_bf16_zp"], M
        got = kernels("w4_mm_t", empty(M, N, dtype=dtype), codes, scale, "int4", 32, K, zp, None, device=device)
        assert got == [f"w4_mm_t_gemm_{d}_bf16_zp"], M


# ---------------------------------------------------------------------------------------------- host names
# Kernels are instantiated through metal/instantiate.h's macros, which build each host_name in kernel_name's
# scheme; the emulator and the address-space check expand those lines themselves (csrc/emu/msl_prep.py).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "csrc", "emu"))
import msl_check  # noqa: E402
import msl_prep  # noqa: E402

METAL = sorted(glob.glob(os.path.join(ROOT, "metal", "*.metal")))


def test_no_kernel_name_is_typed_by_hand():
    for path in METAL:
        src = msl_prep.mask_comments_strings(open(path, encoding="ascii").read())
        assert "host_name" not in src, f"{path}: instantiate through metal/instantiate.h's LOWBIT_KERNEL"


@pytest.mark.skipif(msl_check.clang_binary() is None, reason="clang is not installed")
def test_macro_lines_expand_as_the_preprocessor_expands_them(tmp_path):
    lines = [line for path in METAL for line in open(path, encoding="ascii") if line.startswith("LOWBIT_KERNEL")]
    assert len(lines) > 400  # every instantiation of every kernel file (424 now)
    src = tmp_path / "all.metal"
    src.write_text('#include "instantiate.h"\n' + "".join(lines))
    # the C++14 preprocessor of MSL 3.1: -pedantic-errors refuses what C++14 does not define (empty __VA_ARGS__)
    cpp = subprocess.run([msl_check.clang_binary(), "-E", "-P", "-x", "c++", "-std=c++14", "-pedantic-errors",
                          "-I", os.path.join(ROOT, "metal"), str(src)], capture_output=True, text=True, check=True)
    # adjacent string literals are one literal to the compiler
    want = [re.sub(r'"\s*"', "", line) for line in cpp.stdout.splitlines() if line.strip()]
    got = [line for line in msl_prep.expand_kernel_macros("".join(lines)).splitlines() if line.strip()]
    assert got == want and len(got) == len(lines)


@pytest.mark.parametrize("line,match", [
    ("LOWBIT_KERNEL(fp8_gemm, fp8_gemm)\n", "want"),                      # no dtype
    ("LOWBIT_KERNEL(fp8_gemm, fp8_gemm<half>, half)\n", "identifiers"),   # a template-id for FUNC
    ("LOWBIT_KERNEL_VARIANT(int8_gemm, int8_gemm, half)\n", "want"),      # no variant
])
def test_malformed_macro_lines_are_refused(line, match):
    with pytest.raises(ValueError, match=match):
        msl_prep.expand_kernel_macros(line)


# ---------------------------------------------------------------------------------------------- int8 scale layout
# The int8 weight's scale layout is decided once, where w_scale is checked (Int8MmArgs::w_layout, as fp8's
# Fp8Weight::layout): one element is per tensor, N elements per channel. The edge: N == 1, where both hold.
@pytest.mark.parametrize("backend", backends_for("int8_mm"))
@pytest.mark.parametrize("N,ws_shape", [(1, ()), (1, (1,)), (1, (1, 1)), (5, (1,)), (5, (5,)), (5, (5, 1))])
@pytest.mark.parametrize("M", [1, 12])  # the GEMV and the GEMM
def test_int8_weight_scale_layouts(backend, N, ws_shape, M):
    g = torch.Generator().manual_seed(N * 10 + len(ws_shape) + M)
    K = 40
    xq = torch.randint(-128, 128, (M, K), dtype=torch.int8, generator=g)
    wq = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)
    xs = torch.rand(M, generator=g) + 0.5
    ws = torch.rand(ws_shape, generator=g) + 0.5
    out = backend.op("int8_mm")(backend.to(xq), backend.to(xs), backend.to(wq), backend.to(ws), None,
                                torch.float32).cpu()
    ref, _ = ref_int8_mm(xq, xs, wq, ws)
    # exact int32 sums (|acc| < 2^24), two fp32 products
    assert torch.allclose(out.double(), ref, rtol=3 * 2.0 ** -24, atol=0)
    check_int8_t(backend, torch.randn(M, N, generator=g), wq, ws)
