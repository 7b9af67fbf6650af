"""Property-based fuzzing of every op on every CPU instruction-set level and on the Metal emulator (both thread
orders): hypothesis draws shapes, strides, storage offsets, dtypes, scale layouts, block sizes (up to 2^63 - 1),
value classes (NaN, +-inf, denormals, huge values, int8 -128, fp8 max codes 0x7E / 0xFE and NaN codes 0x7F /
0xFF) and, in a third of the cases, one bad argument. Each case must either raise a RuntimeError / ValueError
whose message names the op and the bad argument, or return the float64 reference's result (reference.py)
within the documented tolerance; a valid case must never be refused, a bad one never accepted.

A case that crashes would take pytest down with it, so the hypothesis runs happen in a worker process, one per
op (``python tests/test_fuzz.py OP``): the worker writes each case before running it, and the test reports
the case the worker died on. The example budget and the seed are fixed; ``TORCH_LOWBIT_FUZZ_EXAMPLES=N``
(per op) and ``TORCH_LOWBIT_FUZZ_SEED=S`` run a longer or different campaign.
"""
import dataclasses
import math
import os
import re
import signal
import subprocess
import sys
from typing import Callable, Optional

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch_lowbit  # noqa: E402
from conftest import Backend  # noqa: E402
from reference import (assert_dequantized_close, assert_matmul_close, fp8_bits_to_f64, groups_as_on_mps,  # noqa: E402
                       ref_fp8_grouped_mm, ref_fp8_mm, ref_int8_mm, ref_int8_quantize, ref_w4_grouped_mm, ref_w4_mm,
                       w4_weight_f64)
from torch_lowbit.testing import forced_cpu_isa, supported_cpu_isas  # noqa: E402

from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

OPS = ("fp8_mm", "fp8_dequantize", "fp8_grouped_mm", "int8_quantize", "int8_mm", "w4_mm", "w4_grouped_mm")
EXAMPLES = int(os.environ.get("TORCH_LOWBIT_FUZZ_EXAMPLES", "60"))
SEED = int(os.environ.get("TORCH_LOWBIT_FUZZ_SEED", "0"))
WORKER_TIMEOUT_S = int(os.environ.get("TORCH_LOWBIT_FUZZ_TIMEOUT", "900"))
ACC_RTOL = 1e-5  # fp32 accumulation over K <= 300, as in test_fp8_mm.py
INT8_ACC_RTOL = 4 * 2.0 ** -24  # the int8_mm epilogue: three fp32 roundings (test_cpu_kernels.py)
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
BIG = (2 ** 63 - 1, 2 ** 31, 2 ** 31 - 1, 2 ** 32 + 1)  # legal block sizes past every dimension


# the ops whose plans read tensor values on the host where they can (the emulator), never on mps: fuzzed also as
# the mps device runs them (metal_emu_mps: torch.ops.lowbit_emu_mps, values unvalidated, clamped by the kernels)
HOST_VALIDATED_OPS = ("fp8_grouped_mm",)


def _backends(op):
    names = [f"cpu:{level}" for level in supported_cpu_isas()]
    if torch_lowbit.emulator.available():
        names += ["metal_emu", "metal_emu_rev"] + (["metal_emu_mps"] if op in HOST_VALIDATED_OPS else [])
    return names


def run_on(backend: str, op: str, *args):
    """torch.ops.lowbit.<op> on a forced CPU level, or the emulator's op in one thread order."""
    if backend.startswith("cpu:"):
        with forced_cpu_isa(backend[4:]):
            return getattr(torch.ops.lowbit, op)(*args)
    if backend == "metal_emu_mps":
        return getattr(torch.ops.lowbit_emu_mps, op)(*args)
    return Backend(backend).op(op)(*args)


@dataclasses.dataclass(repr=False)
class Case:
    """One call: the op's arguments, the argument a mutation broke (None: a valid call), and the check of a
    result. `what` says how the case was built, for the report."""
    op: str
    backend: str
    args: tuple
    bad: Optional[tuple]  # names any of which the error may cite, e.g. ("scale", "block_size")
    check: Callable
    what: str

    def __repr__(self):
        return f"{self.backend} {self.op}: {self.what}; bad {self.bad}"


def run_case(case: Case):
    try:
        out = run_on(case.backend, case.op, *case.args)
    except (RuntimeError, ValueError) as e:
        msg = str(e).split("\n")[0]
        assert case.bad is not None, f"a valid call was refused: {msg}"
        assert case.op in msg and any(re.search(rf"\b{re.escape(n)}\b", msg) for n in case.bad), (
            f"the error must name the op and one of {case.bad}: {msg}")
        return
    assert case.bad is None, f"bad {case.bad} was accepted"
    case.check(out)


# ---------------------------------------------------------------------------------------------- values
def _gen(draw):
    return torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))


FLOAT_CLASSES = ("normal", "zero", "nan", "inf", "-inf", "denormal", "huge")


def _special(cls, dtype, huge=None):
    fi = torch.finfo(dtype)
    return {"zero": 0.0, "nan": math.nan, "inf": math.inf, "-inf": -math.inf,
            # below the smallest normal of the dtype (and of fp32, for the bf16 units that read it as zero)
            "denormal": fi.smallest_normal * 0.375 if dtype == torch.float16 else 1e-39,
            # large, yet sums of K <= 300 products with weights <= 448 times a huge scale (1e4) stay far from
            # fp32's overflow (fp16: near its own maximum)
            "huge": huge or (3e4 if dtype == torch.float16 else 1e28)}[cls]


@st.composite
def float_values(draw, shape, dtype, classes=FLOAT_CLASSES, scale=3.0, huge=None):
    """A tensor of `dtype`: random normals times `scale`, with a few positions (first, last, random ones,
    so some fall in vector tails) set to drawn value classes."""
    g = _gen(draw)
    t = torch.randn(shape, generator=g) * scale
    n = t.numel()
    if n and draw(st.booleans()):
        flat = t.view(-1)
        for _ in range(draw(st.integers(1, 4))):
            cls = draw(st.sampled_from(classes))
            where = draw(st.sampled_from(("first", "last", "any")))
            i = 0 if where == "first" else n - 1 if where == "last" else draw(st.integers(0, n - 1))
            flat[i] = 0.0 if cls == "normal" else _special(cls, dtype, huge)
    return t.to(dtype)


@st.composite
def fp8_codes(draw, shape, allow_nan=True):
    """e4m3 codes: random finite ones, with max codes (0x7E / 0xFE), subnormals, zeros and NaN codes planted."""
    g = _gen(draw)
    b = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    b = torch.where((b & 0x7F) == 0x7F, b & 0xBF, b)
    planted = ["max", "subnormal", "zero"] + (["nan"] if allow_nan else [])
    flat = b.view(-1)
    if flat.numel() and draw(st.booleans()):
        for _ in range(draw(st.integers(1, 4))):
            cls = draw(st.sampled_from(planted))
            i = draw(st.integers(0, flat.numel() - 1))
            sign = draw(st.sampled_from((0, 0x80)))
            flat[i] = sign | {"max": 0x7E, "nan": 0x7F, "subnormal": draw(st.integers(1, 7)), "zero": 0}[cls]
    return b


@st.composite
def int8_values(draw, shape):
    g = _gen(draw)
    t = torch.randint(-128, 128, shape, dtype=torch.int8, generator=g)
    if t.numel() and draw(st.booleans()):
        flat = t.view(-1)
        for _ in range(draw(st.integers(1, 4))):
            flat[draw(st.integers(0, flat.numel() - 1))] = draw(st.sampled_from((-128, 127, 0, -127)))
    return t


SCALE_CLASSES = ("zero", "nan", "inf", "denormal", "huge", "normal")
# fp8 scales multiply the K sums (design.md, numerics), not each weight: with an infinite scale a sum of mixed
# signs gives +-inf where the elementwise definition gives NaN (neither is a finite number), so fp8 cases draw
# no infinite scale; int8_mm multiplies its scales in the reference's order and draws them all.
FP8_SCALE_CLASSES = tuple(c for c in SCALE_CLASSES if c != "inf")


@st.composite
def scale_values(draw, shape, dtype, classes=SCALE_CLASSES):
    """Scales: positive by default; sometimes zeros, negatives, NaN, inf, denormals or huge ones."""
    t = draw(float_values(shape, dtype, classes, 1.0, huge=3e4 if dtype == torch.float16 else 1e4)).float().abs()
    t = t + 0.01 if draw(st.integers(0, 3)) else t
    if draw(st.integers(0, 5)) == 0:
        t = -t
    return t.to(dtype)


# ---------------------------------------------------------------------------------------------- layouts
@st.composite
def laid_out(draw, t):
    """`t` (values kept) as a contiguous tensor, one at a storage offset, a transposed one, a strided slice of a
    larger one or (rows all equal) a stride-0 expansion."""
    kinds = ["contiguous", "offset", "strided"] + (["transposed"] if t.dim() >= 2 else [])
    if t.dim() >= 2 and t.shape[0] > 1:
        kinds.append("expanded")
    kind = draw(st.sampled_from(kinds))
    if kind == "offset":
        off = draw(st.integers(1, 17))
        buf = torch.zeros(t.numel() + off, dtype=t.dtype)
        v = buf[off:].view(t.shape)
        v.copy_(t)
        return v
    if kind == "strided":
        big = torch.zeros(*t.shape[:-1], 2 * t.shape[-1] + 1, dtype=t.dtype) if t.dim() else t.clone()
        v = big[..., 1::2] if t.dim() else big
        v.copy_(t)
        return v
    if kind == "transposed":
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if kind == "expanded":
        return t[:1].expand(t.shape)
    return t.contiguous()


def weight_view(draw, bits):
    """A contiguous fp8 weight, sometimes at a storage offset (unaligned rows), as uint8 or float8_e4m3fn."""
    if draw(st.booleans()):
        off = draw(st.integers(1, 15))
        buf = torch.zeros(bits.numel() + off, dtype=torch.uint8)
        w = buf[off:].view(bits.shape)
        w.copy_(bits)
    else:
        w = bits.clone()
    return w.view(torch.float8_e4m3fn) if draw(st.booleans()) else w


SIZES_M = (0, 1, 2, 3, 5, 8, 9, 17, 33)
SIZES_N = (0, 1, 2, 3, 7, 8, 16, 17, 33, 65)
SIZES_K = (0, 1, 2, 3, 7, 15, 16, 17, 31, 32, 33, 64, 100, 129, 257)


def block_entry(draw, dim):
    """Small blocks, the whole dimension, or one past every dimension (a third each)."""
    return draw(st.one_of(st.sampled_from((1, 2, 3, 7, 16, 32, 128)), st.just(max(dim, 1)), st.sampled_from(BIG)))


def denormal_atol(x, w, scale):
    """|x_sub| @ |w|^T * max |scale| for the x values below fp32's smallest normal, which bf16 units read as zero
    (design.md); None when x has none. w: float64 [N, K]."""
    xd = x.double().abs()
    sub = torch.where(xd < torch.finfo(torch.float32).smallest_normal, xd, torch.zeros_like(xd))
    if not sub.any():
        return None
    finite = lambda t: torch.nan_to_num(t.double().abs(), nan=0.0, posinf=0.0)  # noqa: E731
    return sub @ finite(w).T * (finite(scale).max() if scale.numel() else 0.0)


def block_scale_atol(K, block_size, shape):
    """The CPU's fp8 kernels decode codes as value / 256 and multiply a block's partial sum by its scale before the
    256 comes back (fp8_simd.h's kDecodeUnscale): where that product falls below fp32's normals it is rounded on a
    grid 256 times coarser than the output's, at most 2^-142 a K block. None without block scales. A known limit,
    far below any real output (it shows only for outputs near 1e-38 and smaller)."""
    if block_size is None:
        return None
    blocks = -(-K // min(max(block_size[1], 1), max(K, 1))) if K else 0
    return torch.full(shape, blocks * 2.0 ** -142, dtype=torch.float64)


def plus(*atols):
    """The sum of the absolute tolerances given (None: none)."""
    given = [a for a in atols if a is not None]
    return sum(given[1:], given[0]) if given else None


# ---------------------------------------------------------------------------------------------- fp8 weights
@st.composite
def fp8_scale(draw, lead, N, K):
    """(scale, block_size, granularity) for weights [*lead, N, K]: per tensor, per channel or per block."""
    dtype = draw(st.sampled_from(FLOATS))
    gran = draw(st.sampled_from(("tensor", "channel", "block")))
    E = lead[0] if lead else None
    if gran == "tensor":
        shape = (E,) if lead else draw(st.sampled_from(((), (1,), (1, 1))))
        return draw(scale_values(shape, dtype, FP8_SCALE_CLASSES)), None, gran
    if gran == "channel":
        shape = (E, N) if lead else draw(st.sampled_from(((N,), (N, 1))))
        return draw(scale_values(shape, dtype, FP8_SCALE_CLASSES)), None, gran
    bs = [block_entry(draw, N), block_entry(draw, K)]
    shape = (*lead, -(-N // bs[0]), -(-K // bs[1]))
    return draw(scale_values(shape, dtype, FP8_SCALE_CLASSES)), bs, gran


@st.composite
def fp8_scale_mutation(draw, lead, N, K, scale, block_size):
    """A broken (scale, block_size) and the arguments the error may name."""
    kind = draw(st.sampled_from(("block_zero", "block_negative", "block_len", "shape", "scale_dtype",
                                 "block_scale_without_size")))
    if kind in ("block_zero", "block_negative", "block_len"):
        bs = list(block_size or [16, 16])
        if kind == "block_len":
            bs = draw(st.sampled_from(([], [bs[0]], bs + [1])))
        else:
            bs[draw(st.integers(0, 1))] = 0 if kind == "block_zero" else draw(st.sampled_from((-1, -2 ** 31, -2 ** 63)))
        nb = [max(-(-N // b), 0) if b > 0 else 1 for b in (bs + [1, 1])[:2]]
        return torch.ones(*lead, *nb), bs, ("block_size",)
    if kind == "shape":
        # never one element (a per-tensor scale) nor [N] / [N, 1]
        bad_shape = draw(st.sampled_from(((*lead, N + 2), (*lead, N, 2), (*lead, 0, 3), (*lead, N + 2, 1, 1))))
        if block_size is not None:
            nb, kb = -(-N // block_size[0]), -(-K // block_size[1])
            # [0, kb] is the case: an overflowing ceil_div once made it the expected shape
            bad_shape = draw(st.sampled_from(((*lead, nb + 1, kb), (*lead, nb, kb + 1))
                                             + (((*lead, 0, kb),) if nb else ())))
        return torch.ones(bad_shape), block_size, ("scale",)
    if kind == "scale_dtype":
        return scale.to(draw(st.sampled_from((torch.float64, torch.int32, torch.uint8)))), block_size, ("scale",)
    # a 2-D block scale (per expert) given without its block_size
    return torch.ones(*lead, 2, 3), None, ("scale", "block_size")


# ---------------------------------------------------------------------------------------------- cases
@st.composite
def fp8_mm_cases(draw, backend):
    M, N, K = draw(st.sampled_from(SIZES_M)), draw(st.sampled_from(SIZES_N)), draw(st.sampled_from(SIZES_K))
    dtype = draw(st.sampled_from(FLOATS))
    lead = draw(st.sampled_from(((M,), (M,), (2, M), ()) if M else ((M,), (2, M))))
    x = draw(laid_out(draw(float_values((*lead, K), dtype))))
    bits = draw(fp8_codes((N, K)))
    scale, bs, gran = draw(fp8_scale((), N, K))
    bias = draw(laid_out(draw(float_values((N,), draw(st.sampled_from(FLOATS)))))) if draw(st.booleans()) else None
    w = weight_view(draw, bits)
    bad = None
    if draw(st.integers(0, 2)) == 0:
        kind = draw(st.sampled_from(("x_dtype", "x_rank", "weight_dtype", "weight_layout", "K", "bias", "scale")))
        if kind == "x_dtype":
            x, bad = x.to(draw(st.sampled_from((torch.float64, torch.int32, torch.int8)))), ("x",)
        elif kind == "x_rank":
            x, bad = torch.tensor(1.0, dtype=dtype), ("x",)
        elif kind == "weight_dtype":
            w, bad = bits.to(draw(st.sampled_from((torch.float32, torch.int8, torch.bfloat16)))), ("weight",)
        elif kind == "weight_layout":
            w = bits.T.contiguous().T if N > 1 and K > 1 else bits[None]
            bad = ("weight",)
        elif kind == "K":
            x, bad = torch.zeros(*lead, K + draw(st.integers(1, 3)), dtype=dtype), ("x", "K")
        elif kind == "bias":
            bias = torch.zeros(draw(st.sampled_from(((N + 1,), (N, 1), (1, N)))))
            bad = ("bias",)
        else:
            scale, bs, bad = draw(fp8_scale_mutation((), N, K, scale, bs))

    def check(out):
        assert out.dtype == dtype and tuple(out.shape) == (*lead, N)
        rows = math.prod(lead)
        ref, absref = ref_fp8_mm(x.reshape(rows, K), bits, scale, bias, bs)
        assert_matmul_close(out.reshape(rows, N), ref, absref, acc_rtol=ACC_RTOL,
                            atol=plus(denormal_atol(x.reshape(rows, K), fp8_bits_to_f64(bits), scale),
                                      block_scale_atol(K, bs, (rows, N))))
    return Case("fp8_mm", backend, (x, w, scale, bias, bs), bad, check,
                f"x {tuple(x.shape)} {dtype} strides {x.stride()} off {x.storage_offset()}, w [{N}, {K}] "
                f"{w.dtype} off {w.storage_offset()}, scale {gran} {tuple(scale.shape)} {scale.dtype}, block {bs}, "
                f"bias {None if bias is None else tuple(bias.shape)}")


@st.composite
def fp8_dequantize_cases(draw, backend):
    N, K = draw(st.sampled_from(SIZES_N)), draw(st.sampled_from(SIZES_K))
    bits = draw(fp8_codes((N, K)))
    scale, bs, gran = draw(fp8_scale((), N, K))
    dtype = draw(st.sampled_from(FLOATS))
    w = weight_view(draw, bits)
    bad = None
    if draw(st.integers(0, 2)) == 0:
        kind = draw(st.sampled_from(("dtype", "weight_dtype", "scale")))
        if kind == "dtype":
            dtype, bad = draw(st.sampled_from((torch.int8, torch.float64, torch.bool, torch.uint8))), ("dtype",)
        elif kind == "weight_dtype":
            w, bad = bits.to(torch.int8), ("weight",)
        else:
            scale, bs, bad = draw(fp8_scale_mutation((), N, K, scale, bs))

    def check(out):
        assert out.dtype == dtype and tuple(out.shape) == (N, K)
        assert_dequantized_close(out, bits, scale, bs)
    return Case("fp8_dequantize", backend, (w, scale, bs, dtype), bad, check,
                f"w [{N}, {K}] {w.dtype} off {w.storage_offset()}, scale {gran} {tuple(scale.shape)} "
                f"{scale.dtype}, block {bs}, out {dtype}")


@st.composite
def offsets_for(draw, T, G):
    cuts = sorted(draw(st.lists(st.integers(0, T), min_size=G, max_size=G)))
    return torch.tensor([0] + cuts, dtype=torch.int32)


@st.composite
def routing(draw, T, E):
    """(offsets, expert_ids, G) of a grouped product: up to 5 groups of rows (empty ones, rows in none), the ids
    given or (G <= E) left out, -1 among them."""
    G = draw(st.integers(0, 5))
    offsets = draw(offsets_for(T, G))
    ids = None
    if G > E or draw(st.booleans()):
        ids = torch.tensor(draw(st.lists(st.integers(-1, E - 1), min_size=G, max_size=G)), dtype=torch.int32)
    return offsets, ids, G


ROUTING_MUTATIONS = ("offsets_first", "offsets_order", "offsets_end", "offsets_dtype", "offsets_rank", "ids_range",
                     "ids_len", "ids_dtype", "no_ids", "x_rank")


def routing_mutation(draw, kind, x, offsets, ids, T, E, G):
    """A grouped product's routing (or x) broken as `kind` says: (x, offsets, ids, the arguments the error may
    name), bad None where the kind does not apply to this case."""
    bad = None
    if kind == "offsets_first":
        offsets = offsets.clone()
        offsets[0] = draw(st.sampled_from((1, -1, 2 ** 31 - 1, -2 ** 31)))
        bad = ("offsets",)
    elif kind == "offsets_order" and G >= 1:
        offsets = offsets.clone()
        offsets[-1] = offsets[-2] - draw(st.sampled_from((1, 2 ** 31 - 1)))
        bad = ("offsets",)
    elif kind == "offsets_end":
        offsets = offsets.clone()
        offsets[-1] = draw(st.sampled_from((T + 1, 2 ** 31 - 1)))
        bad = ("offsets",)
    elif kind == "offsets_dtype":
        offsets, bad = offsets.to(draw(st.sampled_from((torch.int64, torch.float32)))), ("offsets",)
    elif kind == "offsets_rank":
        offsets, bad = draw(st.sampled_from((torch.zeros(0, dtype=torch.int32),
                                             torch.zeros(1, 1, dtype=torch.int32)))), ("offsets",)
    elif kind == "ids_range" and G >= 1:
        ids = (ids if ids is not None else torch.arange(G, dtype=torch.int32)).clone()
        ids[draw(st.integers(0, G - 1))] = draw(st.sampled_from((E, -2, 2 ** 31 - 1, -2 ** 31)))
        bad = ("expert_ids",)
    elif kind == "ids_len":
        ids, bad = torch.zeros(G + 1, dtype=torch.int32), ("expert_ids",)
    elif kind == "ids_dtype":
        ids, bad = torch.zeros(G, dtype=torch.int64), ("expert_ids",)
    elif kind == "no_ids" and G > E:
        ids, bad = None, ("expert_ids", "G")
    elif kind == "x_rank":
        x, bad = x.reshape(1, *x.shape), ("x",)
    return x, offsets, ids, bad


@st.composite
def fp8_grouped_mm_cases(draw, backend):
    T, N, K = draw(st.sampled_from(SIZES_M)), draw(st.sampled_from(SIZES_N[:8])), draw(st.sampled_from(SIZES_K[:12]))
    E = draw(st.integers(1, 4))
    dtype = draw(st.sampled_from(FLOATS))
    x = draw(laid_out(draw(float_values((T, K), dtype))))
    bits = draw(fp8_codes((E, N, K)))
    scale, bs, gran = draw(fp8_scale((E,), N, K))
    offsets, ids, G = draw(routing(T, E))
    w = weight_view(draw, bits)
    bad, kind = None, None
    if draw(st.integers(0, 2)) == 0:
        kind = draw(st.sampled_from(ROUTING_MUTATIONS + ("scale",)))
        if kind == "scale":
            scale, bs, bad = draw(fp8_scale_mutation((E,), N, K, scale, bs))
        else:
            x, offsets, ids, bad = routing_mutation(draw, kind, x, offsets, ids, T, E, G)
    groups = (offsets, ids)
    if backend == "metal_emu_mps" and kind in ("offsets_first", "offsets_order", "offsets_end", "ids_range"):
        # as on mps, nothing reads these values on the host: the kernels' rule applies (decode and prefill alike)
        bad, groups = None, groups_as_on_mps(offsets, ids, T, E)

    def check(out):
        assert out.dtype == dtype and tuple(out.shape) == (T, N)
        ref, absref = ref_fp8_grouped_mm(x, bits, scale, *groups, bs)
        w_any = torch.nan_to_num(fp8_bits_to_f64(bits)).abs().amax(0) if E else torch.zeros(N, K)  # any expert
        assert_matmul_close(out, ref, absref, acc_rtol=ACC_RTOL,
                            atol=plus(denormal_atol(x, w_any, scale), block_scale_atol(K, bs, (T, N))))
    return Case("fp8_grouped_mm", backend, (x, w, scale, offsets, ids, bs), bad, check,
                f"x {tuple(x.shape)} {dtype} strides {x.stride()}, w [{E}, {N}, {K}] off {w.storage_offset()}, "
                f"scale {gran} {tuple(scale.shape)} {scale.dtype}, block {bs}, offsets {offsets.tolist()}, "
                f"ids {None if ids is None else ids.tolist()}")


@st.composite
def int8_quantize_cases(draw, backend):
    M, K = draw(st.sampled_from(SIZES_M)), draw(st.sampled_from(SIZES_K + (300, 1025)))
    dtype = draw(st.sampled_from(FLOATS))
    lead = draw(st.sampled_from(((M,), (2, M), ())))
    x = draw(laid_out(draw(float_values((*lead, K), dtype))))
    bad = None
    if draw(st.integers(0, 3)) == 0:
        x = draw(st.sampled_from((x.to(torch.float64), x.to(torch.int32), torch.tensor(1.0))))
        bad = ("x",)

    def check(out):
        q, s = out
        rq, rs, _ = ref_int8_quantize(x)
        assert q.shape == x.shape and s.shape == x.shape[:-1]
        assert torch.equal(s.view(torch.int32), rs.view(torch.int32)), "scale bits differ from absmax / 127"
        assert torch.equal(q, rq), "codes differ from rint(x / scale)"
    return Case("int8_quantize", backend, (x,), bad, check,
                f"x {tuple(x.shape)} {dtype} strides {x.stride()} off {x.storage_offset()}")


@st.composite
def int8_mm_cases(draw, backend):
    M, N, K = draw(st.sampled_from(SIZES_M)), draw(st.sampled_from(SIZES_N)), draw(st.sampled_from(SIZES_K))
    lead = draw(st.sampled_from(((M,), (2, M), ())))
    xq = draw(laid_out(draw(int8_values((*lead, K)))))
    wq = draw(int8_values((N, K)))
    xs_shape = draw(st.sampled_from((lead, (*lead, 1))))
    xs = draw(laid_out(draw(scale_values(xs_shape, draw(st.sampled_from(FLOATS))))))
    ws = draw(scale_values(draw(st.sampled_from(((N,), (N, 1), (1,), ()))), draw(st.sampled_from(FLOATS))))
    bias = draw(laid_out(draw(float_values((N,), draw(st.sampled_from(FLOATS)))))) if draw(st.booleans()) else None
    out_dtype = draw(st.sampled_from(FLOATS + (None,)))
    bad = None
    if draw(st.integers(0, 2)) == 0:
        kind = draw(st.sampled_from(("xq_dtype", "wq_dtype", "wq_layout", "K", "big_K", "x_scale", "w_scale",
                                     "bias", "out_dtype")))
        if kind == "xq_dtype":
            xq, bad = xq.to(draw(st.sampled_from((torch.uint8, torch.int32, torch.float32)))), ("xq",)
        elif kind == "wq_dtype":
            wq, bad = wq.to(torch.uint8), ("wq",)
        elif kind == "wq_layout" and N > 1 and K > 1:
            wq, bad = wq.T.contiguous().T, ("wq",)
        elif kind == "K":
            xq, bad = torch.zeros(*lead, K + 1, dtype=torch.int8), ("xq", "K")
        elif kind == "big_K":  # past 131071 the int32 accumulator could overflow: refused
            K = draw(st.sampled_from((131072, 2 ** 17 + 5)))
            xq, wq, bad = torch.zeros(*lead, K, dtype=torch.int8), torch.zeros(1, K, dtype=torch.int8), ("K",)
            ws = torch.ones(1)
        elif kind == "x_scale":
            xs, bad = torch.ones(*lead, 2) if lead else torch.ones(3), ("x_scale",)
        elif kind == "w_scale":
            ws, bad = torch.ones(draw(st.sampled_from(((N + 2,), (N, 2), (1, N + 2))))), ("w_scale",)
        elif kind == "bias":
            bias, bad = torch.zeros(N + 1), ("bias",)
        elif kind == "out_dtype":
            out_dtype = draw(st.sampled_from((torch.int8, torch.float64, torch.int32, torch.bool, torch.complex64)))
            bad = ("out_dtype",)

    def check(out):
        assert out.dtype == (out_dtype or torch.bfloat16) and tuple(out.shape) == (*lead, N)
        rows = math.prod(lead)
        ref, acc = ref_int8_mm(xq.reshape(rows, K), xs.reshape(rows), wq, ws, bias)
        bound = acc.abs().double() * xs.double().abs().reshape(rows, 1) * ws.double().abs().reshape(-1)
        if bias is not None:
            bound = bound + bias.double().abs()
        assert_matmul_close(out.reshape(rows, N), ref, torch.nan_to_num(bound, nan=0.0), acc_rtol=INT8_ACC_RTOL)
    return Case("int8_mm", backend, (xq, xs, wq, ws, bias, out_dtype), bad, check,
                f"xq {tuple(xq.shape)} strides {xq.stride()}, wq [{N}, {K}], x_scale {tuple(xs.shape)} {xs.dtype}, "
                f"w_scale {tuple(ws.shape)} {ws.dtype}, bias {None if bias is None else bias.dtype}, out {out_dtype}")


# ---------------------------------------------------------------------------------------------- 4-bit weights
W4_FORMATS = ("nvfp4", "mxfp4", "int4", "uint4")
# group sizes: the formats' own (16, 32, 64, 128), the vector loops' other multiples of 16, one group per row and
# sizes no vector loop takes
W4_GROUPS = (16, 32, 64, 128, 48, 256, 1, 5, 24)


@st.composite
def w4_scale(draw, fmt, shape):
    """Group scales as each format stores them: e4m3 bits (uint8 or float8_e4m3fn) with zeros, subnormals, the max
    and NaN codes planted; e8m0 bits (2^-10 .. 2^5, with 0 and the NaN byte 255); float scales of any float dtype.
    No infinite scale: the bf16 GEMV scales a group's sum once (w4_kernels.h), which gives +-inf where the per-element
    definition gives NaN."""
    if fmt == "nvfp4":
        bits = draw(fp8_codes(shape)) & 0x7F  # positive, as the writers store them
        return bits.view(torch.float8_e4m3fn) if draw(st.booleans()) else bits
    if fmt == "mxfp4":
        b = torch.randint(117, 133, shape, dtype=torch.uint8, generator=_gen(draw))
        if b.numel() and draw(st.booleans()):
            b.view(-1)[draw(st.integers(0, b.numel() - 1))] = draw(st.sampled_from((0, 255, 127)))
        return b
    return draw(scale_values(shape, draw(st.sampled_from(FLOATS)), FP8_SCALE_CLASSES))


@st.composite
def w4_weight(draw, lead, N, K):
    """A random 4-bit weight [*lead, N, K] as the ops take it: (format, group size, the ops' weight arguments
    codes / scale / format / group_size / offset / global_scale as a dict)."""
    fmt, group = draw(st.sampled_from(W4_FORMATS)), draw(st.sampled_from(W4_GROUPS))
    G = -(-K // group)
    offset = None
    if fmt == "int4" and draw(st.booleans()):
        offset = torch.randint(-128, 128, (*lead, N, G), dtype=torch.int8, generator=_gen(draw))
    scale = draw(w4_scale(fmt, (*lead, N, G)))
    if fmt == "uint4" and draw(st.booleans()):
        offset = draw(float_values((*lead, N, G), scale.dtype, ("normal", "zero", "nan"), 0.1))
    global_scale = None
    if fmt == "nvfp4" and draw(st.booleans()):
        global_scale = draw(scale_values(lead or (1,), torch.float32, FP8_SCALE_CLASSES))
    codes = torch.randint(0, 256, (*lead, N, (K + 1) // 2), dtype=torch.uint8, generator=_gen(draw))
    return fmt, group, dict(codes=codes, scale=scale, format=fmt, group_size=group, offset=offset,
                            global_scale=global_scale)


W4_WEIGHT_MUTATIONS = ("codes_dtype", "codes_layout", "format", "group_size", "scale_shape", "scale_dtype", "offset",
                       "global_scale")


def w4_weight_mutation(draw, kind, w, lead, N, K):
    """The weight arguments `w` (w4_weight's dict, changed in place) broken as `kind` says: the arguments the error
    may name, or None where the kind does not apply to this case."""
    fmt, codes, G = w["format"], w["codes"], -(-K // w["group_size"])
    if kind == "codes_dtype":
        w["codes"] = codes.to(draw(st.sampled_from((torch.int8, torch.int32, torch.float32))))
        return ("codes",)
    if kind == "codes_layout" and N > 1 and codes.shape[-1] > 1:
        w["codes"] = codes.transpose(-1, -2).contiguous().transpose(-1, -2)
        return ("codes",)
    if kind == "format":
        w["format"] = draw(st.sampled_from(("int3", "NVFP4", "", "fp8")))
        return ("format",)
    if kind == "group_size":
        w["group_size"] = draw(st.sampled_from((0, -1, -2 ** 63)))
        return ("group_size",)
    if kind == "scale_shape":
        w["scale"] = torch.ones(*lead, N, G + 1, dtype=w["scale"].dtype)
        return ("scale",)
    if kind == "scale_dtype":
        wrong = (torch.float32, torch.int32) if fmt in ("nvfp4", "mxfp4") else (torch.uint8, torch.float64)
        w["scale"] = torch.ones(*lead, N, G).to(draw(st.sampled_from(wrong)))
        return ("scale",)
    if kind == "offset":  # zero points where the format takes none, or of the wrong shape
        w["offset"] = torch.zeros(*lead, N, G + (fmt == "int4"), dtype=torch.int8)
        return ("offset",)
    if kind == "global_scale":  # one where the format takes none, or the wrong count
        w["global_scale"] = torch.ones((lead[0] if lead else 1) + (fmt == "nvfp4"))
        return ("global_scale",)
    return None


def w4_x_classes(w):
    """x's value classes for a weight: with zero points or biases, no +-inf (an infinite x times a code of value 0
    is NaN in the GEMV's sums, w4_kernels.h, where the per-element weight is not 0)."""
    return tuple(c for c in FLOAT_CLASSES if w["offset"] is None or c not in ("inf", "-inf"))


@st.composite
def w4_mm_cases(draw, backend):
    M, N, K = draw(st.sampled_from(SIZES_M)), draw(st.sampled_from(SIZES_N)), draw(st.sampled_from(SIZES_K + (384, 520)))
    fmt, group, w = draw(w4_weight((), N, K))
    dtype = draw(st.sampled_from(FLOATS))
    lead = draw(st.sampled_from(((M,), (M,), (2, M), ()) if M else ((M,), (2, M))))
    x = draw(laid_out(draw(float_values((*lead, K), dtype, w4_x_classes(w)))))
    bias = draw(laid_out(draw(float_values((N,), draw(st.sampled_from(FLOATS)))))) if draw(st.booleans()) else None
    good = dict(w)
    bad = None
    if draw(st.integers(0, 2)) == 0:
        kind = draw(st.sampled_from(W4_WEIGHT_MUTATIONS + ("x_dtype", "K", "bias")))
        if kind == "x_dtype":
            x, bad = x.to(draw(st.sampled_from((torch.float64, torch.int32, torch.int8)))), ("x",)
        elif kind == "K":
            x, bad = torch.zeros(*lead, K + draw(st.sampled_from((2, 3))), dtype=dtype), ("x", "K", "codes")
        elif kind == "bias":
            bias, bad = torch.zeros(N + 1), ("bias",)
        else:
            bad = w4_weight_mutation(draw, kind, w, (), N, K)

    def check(out):
        assert out.dtype == dtype and tuple(out.shape) == (*lead, N)
        rows = math.prod(lead)
        xr = x.reshape(rows, K)
        g = good
        ref, absref = ref_w4_mm(xr, fmt, g["codes"], g["scale"], group, g["offset"], g["global_scale"], bias)
        w64 = w4_weight_f64(fmt, g["codes"], g["scale"], group, K, g["offset"], g["global_scale"])
        # a NaN weight's column and a NaN or +-inf row of x: NaN (or inf) whatever the order of the sums
        assert_matmul_close(out.reshape(rows, N), ref, torch.nan_to_num(absref, nan=0.0, posinf=0.0),
                            acc_rtol=ACC_RTOL, atol=denormal_atol(xr, w64, torch.ones(1)))
    return Case("w4_mm", backend, (x, w["codes"], w["scale"], w["format"], w["group_size"], w["offset"],
                                   w["global_scale"], bias), bad, check,
                f"x {tuple(x.shape)} {dtype} strides {x.stride()} off {x.storage_offset()}, {fmt} g{group} [{N}, {K}] "
                f"scale {good['scale'].dtype}, offset {None if good['offset'] is None else good['offset'].dtype}, "
                f"global {good['global_scale'] is not None}, bias {None if bias is None else tuple(bias.shape)}")


@st.composite
def w4_grouped_mm_cases(draw, backend):
    T, N, K = draw(st.sampled_from(SIZES_M)), draw(st.sampled_from(SIZES_N[:8])), draw(st.sampled_from(SIZES_K[:12]))
    E = draw(st.integers(1, 4))
    fmt, group, w = draw(w4_weight((E,), N, K))
    dtype = draw(st.sampled_from(FLOATS))
    x = draw(laid_out(draw(float_values((T, K), dtype, w4_x_classes(w)))))
    offsets, ids, G = draw(routing(T, E))
    good = dict(w)
    bad = None
    if draw(st.integers(0, 2)) == 0:
        kind = draw(st.sampled_from(ROUTING_MUTATIONS + W4_WEIGHT_MUTATIONS))
        if kind in ROUTING_MUTATIONS:
            x, offsets, ids, bad = routing_mutation(draw, kind, x, offsets, ids, T, E, G)
        else:
            bad = w4_weight_mutation(draw, kind, w, (E,), N, K)

    def check(out):
        assert out.dtype == dtype and tuple(out.shape) == (T, N)
        g = good
        ref, absref = ref_w4_grouped_mm(x, fmt, g["codes"], g["scale"], group, offsets, ids, g["offset"],
                                        g["global_scale"])
        w64 = torch.stack([w4_weight_f64(fmt, g["codes"][e], g["scale"][e], group, K,
                                         None if g["offset"] is None else g["offset"][e],
                                         None if g["global_scale"] is None else g["global_scale"][e:e + 1])
                           for e in range(E)])
        w_any = torch.nan_to_num(w64, nan=0.0, posinf=0.0, neginf=0.0).abs().amax(0)  # any expert's
        assert_matmul_close(out, ref, torch.nan_to_num(absref, nan=0.0, posinf=0.0), acc_rtol=ACC_RTOL,
                            atol=denormal_atol(x, w_any, torch.ones(1)))
    return Case("w4_grouped_mm", backend, (x, w["codes"], w["scale"], w["format"], w["group_size"], offsets, ids,
                                           w["offset"], w["global_scale"]), bad, check,
                f"x {tuple(x.shape)} {dtype} strides {x.stride()}, {fmt} g{group} [{E}, {N}, {K}], scale "
                f"{good['scale'].dtype}, offset {None if good['offset'] is None else good['offset'].dtype}, global "
                f"{good['global_scale'] is not None}, offsets {offsets.tolist()}, ids {None if ids is None else ids.tolist()}")


CASES = {"fp8_mm": fp8_mm_cases, "fp8_dequantize": fp8_dequantize_cases, "fp8_grouped_mm": fp8_grouped_mm_cases,
         "int8_quantize": int8_quantize_cases, "int8_mm": int8_mm_cases, "w4_mm": w4_mm_cases,
         "w4_grouped_mm": w4_grouped_mm_cases}


# ---------------------------------------------------------------------------------------------- the worker
def fuzz(op: str, examples: int, progress_fd: Optional[int] = None):
    """Run `examples` hypothesis examples of `op` in this process. Before each call the case is written to
    progress_fd, so that a parent sees which one killed the process."""
    counter = {"n": 0}

    @seed(SEED)
    @settings(max_examples=examples, deadline=None, database=None, derandomize=False, print_blob=False,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def prop(data):
        backend = data.draw(st.sampled_from(_backends(op)), label="backend")
        case = data.draw(CASES[op](backend), label="case")
        counter["n"] += 1
        if progress_fd is not None:
            os.write(progress_fd, f"{counter['n']} {case!r}\n".encode())
        run_case(case)

    prop()
    return counter["n"]


def _run_worker(op: str, examples: int, timeout: int):
    # the worker imports the torch_lowbit this process imported, wherever that is
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(torch_lowbit.__file__)))
    path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TORCH_LOWBIT_FUZZ_EXAMPLES=str(examples), PYTHONPATH=path)
    r = subprocess.run([sys.executable, os.path.abspath(__file__), op], capture_output=True, text=True,
                       timeout=timeout, env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return r


def _last_case(stdout):
    text = stdout.decode() if isinstance(stdout, bytes) else stdout or ""
    return [line for line in text.splitlines() if line[:1].isdigit()][-1:]


@pytest.mark.parametrize("op", OPS)
def test_fuzz(op):
    try:
        r = _run_worker(op, EXAMPLES, WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:  # a hang is reported with its case, like a crash
        pytest.fail(f"the worker ran past {WORKER_TIMEOUT_S} s; last case: {_last_case(e.stdout)}")
    last = _last_case(r.stdout)
    if r.returncode < 0:
        pytest.fail(f"the worker died of signal {signal.Signals(-r.returncode).name} on case: {last}\n"
                    f"{r.stderr[-3000:]}")
    assert r.returncode == 0, f"{r.stderr[-6000:]}"
    assert last and int(last[0].split()[0]) >= min(EXAMPLES, 20), "the worker ran too few examples"


if __name__ == "__main__":
    n = fuzz(sys.argv[1], EXAMPLES, progress_fd=sys.stdout.fileno())
    print(f"done {n} examples", file=sys.stderr)
