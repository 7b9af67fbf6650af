"""The extremes of every integer argument of every op (block_size entries, sizes through shapes, offsets values,
expert ids, dtype / out_dtype) on every backend: 0, 1, negative, 2^31, 2^63 - 1 give a clear error naming the
argument, or the float64 reference's result where the value is legal (a block larger than its dimension is one
partial block). Size arithmetic must never overflow into a wrong shape or a crash."""
import numpy as np
import pytest
import torch

import torch_lowbit
from conftest import backends_for
from reference import assert_dequantized_close, assert_matmul_close, random_fp8_bits, ref_fp8_grouped_mm, ref_fp8_mm
from torch_lowbit.nn.experts import Fp8Experts

BIG = [2 ** 31 - 1, 2 ** 31, 2 ** 32 + 1, 2 ** 62, 2 ** 63 - 1]
NOT_POSITIVE = [0, -1, -2 ** 31, -2 ** 63]
INT32_EXTREMES = [2 ** 31 - 1, -2 ** 31]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def test_issue_repro_huge_block_n_asks_for_the_right_shape():
    # ceil_div overflowed: ceil(37 / (2^63 - 1)) came out 0, so an empty scale was accepted and read
    with pytest.raises(RuntimeError, match=r"fp8_mm: with block_size \[9223372036854775807, 32\] scale must have "
                                           r"shape \[1, 3\].*got \[0, 3\]"):
        torch.ops.lowbit.fp8_mm(torch.randn(2, 70), torch.zeros(37, 70, dtype=torch.uint8), torch.rand(0, 3), None,
                                [2 ** 63 - 1, 32])


@pytest.mark.parametrize("backend", backends_for("fp8_mm", emu_rev=False))
@pytest.mark.parametrize("bn,bk", [(BIG[-1], 32), (16, BIG[-1]), (BIG[0], BIG[1]), (BIG[2], 7), (37, BIG[3])])
@pytest.mark.parametrize("M", [1, 5, 40])
def test_fp8_mm_block_larger_than_the_weight_is_one_block(backend, bn, bk, M):
    g = _gen(M)
    N, K = 37, 70
    x, bits = torch.randn(M, K, generator=g), random_fp8_bits((N, K), g)
    scale = torch.rand(-(-N // bn), -(-K // bk), generator=g) + 0.5
    out = backend.op("fp8_mm")(backend.to(x), backend.to(bits), backend.to(scale), None, [bn, bk])
    ref, absref = ref_fp8_mm(x, bits, scale, None, (bn, bk))
    assert_matmul_close(out.cpu(), ref, absref, acc_rtol=1e-5)


@pytest.mark.parametrize("backend", backends_for("fp8_dequantize", emu_rev=False))
@pytest.mark.parametrize("bn,bk", [(BIG[-1], BIG[-1]), (2, BIG[1]), (BIG[0], 1)])
def test_fp8_dequantize_block_larger_than_the_weight_is_one_block(backend, bn, bk):
    g = _gen(bn % 97)
    bits = random_fp8_bits((9, 21), g)
    scale = torch.rand(-(-9 // bn), -(-21 // bk), generator=g) + 0.5
    out = backend.op("fp8_dequantize")(backend.to(bits), backend.to(scale), [bn, bk], torch.float32)
    assert_dequantized_close(out, bits, scale, (bn, bk))


@pytest.mark.parametrize("backend", backends_for("fp8_grouped_mm", emu_rev=False))
@pytest.mark.parametrize("bn,bk", [(BIG[-1], 8), (4, BIG[-1]), (BIG[1], BIG[0])])
def test_fp8_grouped_mm_block_larger_than_the_weight_is_one_block(backend, bn, bk):
    g = _gen(bk % 89)
    E, N, K, T = 3, 10, 24, 7
    x, bits = torch.randn(T, K, generator=g), random_fp8_bits((E, N, K), g)
    scale = torch.rand(E, -(-N // bn), -(-K // bk), generator=g) + 0.5
    offsets = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    out = backend.op("fp8_grouped_mm")(backend.to(x), backend.to(bits), backend.to(scale), backend.to(offsets), None,
                                       [bn, bk])
    ref, absref = ref_fp8_grouped_mm(x, bits, scale, offsets, None, (bn, bk))
    assert_matmul_close(out.cpu(), ref, absref, acc_rtol=1e-5)


@pytest.mark.parametrize("backend", backends_for("fp8_mm", emu_rev=False))
@pytest.mark.parametrize("N,K", [(0, 70), (37, 0), (0, 0)])
def test_block_sizes_on_empty_weights(backend, N, K):
    # no block along an empty dimension: the scale is [0, kb] or [nb, 0], whatever the block size
    for bs in ([BIG[-1], BIG[-1]], [1, 1], [2 ** 31, 3]):
        scale = torch.ones(-(-N // bs[0]), -(-K // bs[1]))
        out = backend.op("fp8_mm")(backend.to(torch.randn(3, K)), backend.to(torch.zeros(N, K, dtype=torch.uint8)),
                                   backend.to(scale), None, bs)
        assert out.shape == (3, N) and (out.cpu() == 0).all()


def _fp8_call(op, backend, bs, scale_shape=(2, 3)):
    """op with a [37, 70] weight (or [2, 37, 70] experts) and block_size bs."""
    w = torch.zeros(37, 70, dtype=torch.uint8)
    if op == "fp8_mm":
        args = (torch.randn(2, 70), w, torch.ones(scale_shape), None, bs)
    elif op == "fp8_dequantize":
        args = (w, torch.ones(scale_shape), bs, torch.bfloat16)
    else:
        args = (torch.randn(2, 70), w.expand(2, 37, 70).contiguous(), torch.ones(2, *scale_shape),
                torch.tensor([0, 2], dtype=torch.int32), None, bs)
    return backend.op(op)(*[backend.to(a) if isinstance(a, torch.Tensor) else a for a in args])


FP8_OPS = ["fp8_mm", "fp8_dequantize", "fp8_grouped_mm"]


@pytest.mark.parametrize("op", FP8_OPS)
@pytest.mark.parametrize("value", NOT_POSITIVE)
@pytest.mark.parametrize("at", [0, 1])
def test_block_size_entries_must_be_positive(op, value, at):
    for p in backends_for(op, emu_rev=False):
        if p.marks:
            continue
        bs = [32, 32]
        bs[at] = value
        with pytest.raises(RuntimeError, match=rf"{op}: block_size entries must be positive, got \[.*{value}"):
            _fp8_call(op, p.values[0], bs)


@pytest.mark.parametrize("op", FP8_OPS)
@pytest.mark.parametrize("bs", [[], [32], [32, 32, 1], [BIG[-1]] * 3])
def test_block_size_must_have_two_entries(op, bs):
    for p in backends_for(op, emu_rev=False):
        if not p.marks:
            with pytest.raises(RuntimeError, match=rf"{op}: block_size must be \[block_n, block_k\]"):
                _fp8_call(op, p.values[0], bs)


@pytest.mark.parametrize("op", FP8_OPS)
@pytest.mark.parametrize("bs,want", [([BIG[-1], 32], r"\[1, 3\]"), ([2 ** 31, BIG[-1]], r"\[1, 1\]"),
                                     ([1, 1], r"\[37, 70\]"), ([36, 69], r"\[2, 2\]")])
def test_block_scale_of_the_wrong_shape_asks_for_the_right_one(op, bs, want):
    for p in backends_for(op, emu_rev=False):
        if not p.marks:
            with pytest.raises(RuntimeError, match=rf"{op}: with block_size .* scale must have shape (\[2, )?"
                                                   rf"{want[2:] if op == 'fp8_grouped_mm' else want}"):
                _fp8_call(op, p.values[0], bs, scale_shape=(5, 4))


def test_block_size_past_int64_is_refused_by_the_binding():
    # values that do not fit SymInt never reach the op; torch's own argument parser names block_size
    for bad in ([2 ** 63, 1], [1, -2 ** 63 - 1], [2 ** 64, 2 ** 64]):
        with pytest.raises(RuntimeError, match="block_size"):
            torch.ops.lowbit.fp8_mm(torch.randn(2, 70), torch.zeros(37, 70, dtype=torch.uint8), torch.ones(1, 1),
                                    None, bad)


@pytest.mark.parametrize("bs", [(2.5, 4), (2, 4.25), ("2", 4), (torch.tensor(2.5), 4)])
def test_python_wrappers_refuse_non_integral_block_sizes(bs):
    # int(2.5) used to truncate to a block of 2 silently
    w = torch.zeros(4, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"fp8_mm: block_size must be integers \[block_n, block_k\]"):
        torch_lowbit.fp8_mm(torch.randn(1, 8), w, torch.ones(2, 2), block_size=bs)
    with pytest.raises(ValueError, match=r"fp8_dequantize: block_size must be integers"):
        torch_lowbit.fp8_dequantize(w, torch.ones(2, 2), block_size=bs)
    with pytest.raises(ValueError, match=r"fp8_grouped_mm: block_size must be integers"):
        torch_lowbit.fp8_grouped_mm(torch.randn(1, 8), w[None], torch.ones(1, 2, 2), torch.tensor([0, 1]).int(),
                                    block_size=bs)
    with pytest.raises(ValueError, match=r"Fp8Experts: block_size must be two positive ints"):
        Fp8Experts(2, 8, 4, granularity="block", block_size=bs)


def test_python_wrappers_pass_integer_like_block_sizes():
    w = torch.zeros(4, 8, dtype=torch.uint8)
    for bs in [(np.int64(2), 4), (torch.tensor(2), 4), [2, 4], (2.0, 4)]:
        assert torch_lowbit.fp8_mm(torch.randn(1, 8), w, torch.ones(2, 2), block_size=bs).shape == (1, 4)


# ---------------------------------------------------------------------------------------------- grouped values
def _grouped(backend, offsets, ids, E=3, T=6):
    x, bits = torch.randn(T, 8), torch.zeros(E, 4, 8, dtype=torch.uint8)
    ids = None if ids is None else torch.tensor(ids, dtype=torch.int32)
    return backend.op("fp8_grouped_mm")(backend.to(x), backend.to(bits), backend.to(torch.ones(E)),
                                        backend.to(torch.tensor(offsets, dtype=torch.int32)), backend.to(ids))


@pytest.mark.parametrize("backend", backends_for("fp8_grouped_mm", emu_rev=False))
@pytest.mark.parametrize("offsets,ids,match", [
    ([2 ** 31 - 1, 6], None, r"offsets\[0\] must be 0, got 2147483647"),
    ([-2 ** 31, 6], None, r"offsets\[0\] must be 0, got -2147483648"),
    ([0, 2 ** 31 - 1], None, r"offsets\[G\] = 2147483647 exceeds the number of rows of x \(T = 6\)"),
    ([0, 3, -2 ** 31], None, r"offsets must be non-decreasing, but offsets\[2\] = -2147483648 < offsets\[1\] = 3"),
    ([0, 7], None, r"offsets\[G\] = 7 exceeds"),
    ([0, 2, 6], [0, 2 ** 31 - 1], r"expert_ids\[1\] = 2147483647 is out of range \[-1, E = 3\)"),
    ([0, 2, 6], [-2 ** 31, 0], r"expert_ids\[0\] = -2147483648 is out of range"),
    ([0, 2, 6], [3, 0], r"expert_ids\[0\] = 3 is out of range"),
    ([0, 2, 6], [0, -2], r"expert_ids\[1\] = -2 is out of range"),
    ([0, 1, 2, 3, 6], None, r"without expert_ids, .* G \(4\) must not exceed the number of experts E \(3\)"),
])
def test_grouped_offsets_and_expert_id_extremes(backend, offsets, ids, match):
    with pytest.raises(RuntimeError, match=rf"fp8_grouped_mm: {match}"):
        _grouped(backend, offsets, ids)


@pytest.mark.parametrize("backend", backends_for("fp8_grouped_mm", emu_rev=False))
def test_grouped_legal_extremes(backend):
    # the first group uses the last expert (E - 1), the second expert -1 (zero rows), offsets[G] == T
    g = _gen(3)
    x, bits = torch.randn(6, 8, generator=g), random_fp8_bits((3, 4, 8), g)
    offsets, ids = torch.tensor([0, 4, 6], dtype=torch.int32), torch.tensor([2, -1], dtype=torch.int32)
    out = backend.op("fp8_grouped_mm")(backend.to(x), backend.to(bits), backend.to(torch.ones(3)),
                                       backend.to(offsets), backend.to(ids)).cpu()
    ref, absref = ref_fp8_grouped_mm(x, bits, torch.ones(3), offsets, ids)
    assert_matmul_close(out, ref, absref, acc_rtol=1e-5)
    assert (out[4:] == 0).all()


# ---------------------------------------------------------------------------------------------- int8 sizes, dtypes
@pytest.mark.parametrize("backend", backends_for("int8_mm", emu_rev=False))
def test_int8_mm_k_bound_is_exact_and_one_past_it_refused(backend):
    # K = 131071 rows of -128 x -128: 2^14 * K = 2147467264 still fits int32; K + 1 is refused by name
    K = 131071
    xq, wq = torch.full((1, K), -128, dtype=torch.int8), torch.full((2, K), -128, dtype=torch.int8)
    out = backend.op("int8_mm")(backend.to(xq), backend.to(torch.ones(1)), backend.to(wq), backend.to(torch.ones(2)),
                                None, torch.float32)
    assert out.cpu().tolist() == [[float(2 ** 14 * K)] * 2]
    xq, wq = torch.zeros(1, K + 1, dtype=torch.int8), torch.zeros(2, K + 1, dtype=torch.int8)
    with pytest.raises(RuntimeError, match=r"int8_mm: K = 131072 exceeds 131071"):
        backend.op("int8_mm")(backend.to(xq), backend.to(torch.ones(1)), backend.to(wq), backend.to(torch.ones(2)))


@pytest.mark.parametrize("backend", backends_for("int8_mm", emu_rev=False))
@pytest.mark.parametrize("out_dtype", [torch.int8, torch.int64, torch.float64, torch.bool, torch.complex64,
                                       torch.float8_e4m3fn])
def test_int8_mm_out_dtype_must_be_a_float_type(backend, out_dtype):
    with pytest.raises(RuntimeError, match=rf"int8_mm: out_dtype must be bfloat16, float16 or float32, got"):
        backend.op("int8_mm")(backend.to(torch.zeros(2, 4, dtype=torch.int8)), backend.to(torch.ones(2)),
                              backend.to(torch.zeros(3, 4, dtype=torch.int8)), backend.to(torch.ones(3)), None,
                              out_dtype)


@pytest.mark.parametrize("backend", backends_for("fp8_dequantize", emu_rev=False))
@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.float64, torch.bool, torch.float8_e4m3fn])
def test_fp8_dequantize_dtype_must_be_a_float_type(backend, dtype):
    with pytest.raises(RuntimeError, match=r"fp8_dequantize: dtype must be bfloat16, float16 or float32, got"):
        backend.op("fp8_dequantize")(backend.to(torch.zeros(3, 4, dtype=torch.uint8)), backend.to(torch.ones(1)),
                                     None, dtype)


@pytest.mark.parametrize("backend", backends_for("fp8_mm", emu_rev=False))
def test_stride_zero_rows_far_past_memory_are_refused_not_crashed(backend):
    # 2^55 rows that are one row expanded: the op must make them contiguous, more bytes than any address space
    x = torch.randn(1, 8).expand(2 ** 55, 8)
    with pytest.raises(RuntimeError):
        backend.op("fp8_mm")(backend.to(x), backend.to(torch.zeros(4, 8, dtype=torch.uint8)),
                             backend.to(torch.ones(1)))
