"""The Metal 4-bit grouped (MoE) kernels (w4_grouped_mm, w4_grouped_mm_t) in the emulator (both thread orders) and
on mps (skipped off a Mac), against a float64 reference built per group (tests/reference.py's _grouped over
w4_weight_f64): the decode GEMV and prefill tile paths on empty groups, -1 ids, rows in no group, T = 1 with many
experts, partial groups, odd K, every format (scale encoding and offset kind) with its zero points / biases and a
per-expert global scale; malformed offsets and ids as mps runs them (not validated on the host: the kernels
clamp). Sizes are small: the emulator runs every GPU thread."""
import math

import pytest
import torch

import torch_lowbit
from reference import _grouped, assert_matmul_close, groups_as_on_mps, ref_matmul_t, w4_weight_f64
from test_metal_fp8 import GROUPED_CASES, MALFORMED_GROUPS
from test_metal_w4 import DTYPES, FORMATS, W4, _gen, _x, metal_backends

# T = 1 with many experts: one token's row in one of 64 one-expert groups, the others empty
CASES = dict(GROUPED_CASES, one_token_many_experts=dict(T=1, offsets=[0] * 41 + [1] * 24,
                                                        ids=[(7 * g + 3) % 64 for g in range(64)]))
GEMV_ROWS = 8  # metal/params.h kW4GemvRows: the plan runs the decode kernel up to this mean of rows per group


class W4Experts:
    """E random 4-bit experts of one FORMATS entry, stacked as the grouped ops take them; nvfp4's global scale is
    per expert (distinct values, so an expert's slice picked wrongly shows)."""

    def __init__(self, fid, E, N, K, g, group=None):
        experts = [W4(fid, N, K, g, group) for _ in range(E)]
        w = experts[0]
        self.format, self.group, self.K = w.format, w.group, K
        self.codes = torch.stack([e.codes for e in experts])
        self.scale = torch.stack([e.scale for e in experts])
        self.offset = None if w.offset is None else torch.stack([e.offset for e in experts])
        self.global_scale = None if w.global_scale is None else torch.rand(E, generator=g) + 0.5

    def f64(self, e):
        gs = None if self.global_scale is None else self.global_scale[e:e + 1]
        off = None if self.offset is None else self.offset[e]
        return w4_weight_f64(self.format, self.codes[e], self.scale[e], self.group, self.K, off, gs)

    def args(self, backend):
        return backend.to(self.codes), backend.to(self.scale), self.format, self.group

    def kwargs(self, backend):
        return dict(offset=backend.to(self.offset), global_scale=backend.to(self.global_scale))


def _i32(v):
    return None if v is None else torch.tensor(v, dtype=torch.int32)


def ref_grouped(w, x, offsets, ids, transposed):
    """(ref, absref) per group: x @ W[e]^T (w4_grouped_mm) or grad_out @ W[e] (w4_grouped_mm_t)."""
    def product(rows, e):
        w64 = w.f64(e)
        if transposed:
            return ref_matmul_t(rows, w64)
        return rows.double() @ w64.T, rows.double().abs() @ w64.abs().T
    return _grouped(x, offsets, ids, w.K if transposed else w.codes.shape[1], product)


def run_grouped(backend, w, x, offsets, ids=None, transposed=False):
    off, eid = _i32(offsets), _i32(ids)
    if transposed:
        out = backend.op("w4_grouped_mm_t")(backend.to(x), *w.args(backend), w.K, backend.to(off), backend.to(eid),
                                            **w.kwargs(backend))
    else:
        out = backend.op("w4_grouped_mm")(backend.to(x), *w.args(backend), backend.to(off), backend.to(eid),
                                          **w.kwargs(backend))
    width = w.K if transposed else w.codes.shape[1]
    assert out.shape == (x.shape[0], width) and out.dtype == x.dtype and out.device == backend.device
    ref, absref = ref_grouped(w, x, off, eid, transposed)
    assert_matmul_close(out.cpu(), ref, absref)
    return out.cpu()


def _rows_in_no_group_are_zero(out, c):
    first, last = c["offsets"][0], c["offsets"][-1]
    assert (out[:first] == 0).all() and (out[last:] == 0).all()


# ---------------------------------------------------------------------------------------------- w4_grouped_mm
# Every routing case (decode: one-row groups, an empty group, id -1, a 10-row group in two GEMV passes, rows in no
# group; prefill: several 32-row tiles per group, whole tiles; one token among 64 experts), both kernels.
@pytest.mark.parametrize("backend", metal_backends())
@pytest.mark.parametrize("case", list(CASES))
def test_grouped_mm_routing(backend, case):
    c = CASES[case]
    g = _gen("route", case)
    E = max(c["ids"] or [len(c["offsets"]) - 1]) + 1
    w = W4Experts("int4_zp_bf16", E, 9, 72, g)
    out = run_grouped(backend, w, _x((c["T"], 72), torch.bfloat16, g), c["offsets"], c["ids"])
    _rows_in_no_group_are_zero(out, c)


# every format (scale encoding, offset kind, per-expert global scale) and activation dtype, decode and prefill;
# K = 45: odd (an unused high nibble) and a partial last group for every group size
@pytest.mark.parametrize("backend", metal_backends(rev=False))
@pytest.mark.parametrize("case", ["decode", "prefill"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fid", list(FORMATS))
def test_grouped_mm_formats(backend, fid, dtype, case):
    c = GROUPED_CASES[case]
    g = _gen("fmt", fid, str(dtype), case)
    run_grouped(backend, W4Experts(fid, 4, 7, 45, g), _x((c["T"], 45), dtype, g), c["offsets"], c["ids"])


# K tails of the GEMV's lanes and steps (1 code, below / across 32 codes, past one 1024-code step) and group
# sizes that split the 8-code words, with odd N (partial threadgroups / tiles)
@pytest.mark.parametrize("backend", metal_backends(rev=False))
@pytest.mark.parametrize("case", ["decode", "prefill"])
@pytest.mark.parametrize("K,group", [(1, 32), (33, 5), (1090, 64)])
def test_grouped_mm_k_tails_and_partial_groups(backend, case, K, group):
    c = GROUPED_CASES[case]
    g = _gen("k", case, K)
    run_grouped(backend, W4Experts("uint4_bias_f16", 4, 5, K, g, group=group), _x((c["T"], K), torch.float32, g),
                c["offsets"], c["ids"])


@pytest.mark.parametrize("backend", metal_backends(rev=False))
@pytest.mark.parametrize("offsets,ids", [([0], []), ([0, 0, 0], [0, 1]), ([0, 3], [-1])])
def test_grouped_nothing_to_compute(backend, offsets, ids):
    g = _gen("none", len(offsets))
    for transposed in (False, True):
        w = W4Experts("nvfp4", 2, 6, 32, g)
        x = _x((3, 32 if not transposed else 6), torch.bfloat16, g)
        assert (run_grouped(backend, w, x, offsets, ids, transposed) == 0).all()


# a NaN scale stays in its own expert's column; NaN / inf activations stay in their rows
@pytest.mark.parametrize("backend", metal_backends(rev=False))
@pytest.mark.parametrize("case", ["decode", "prefill"])
def test_grouped_non_finite(backend, case):
    c = GROUPED_CASES[case]
    g = _gen("nan", case)
    w = W4Experts("mxfp4", 4, 7, 64, g)
    w.scale[1, 2, 1] = 0xFF  # e8m0 NaN: expert 1, column 2
    x = _x((c["T"], 64), torch.float32, g)
    x[0, 5] = math.inf  # group 0's first row
    run_grouped(backend, w, x, c["offsets"], c["ids"])


# ---------------------------------------------------------------------------------------------- w4_grouped_mm_t
@pytest.mark.parametrize("backend", metal_backends())
@pytest.mark.parametrize("case", list(CASES))
def test_grouped_mm_t_routing(backend, case):
    c = CASES[case]
    g = _gen("route_t", case)
    E = max(c["ids"] or [len(c["offsets"]) - 1]) + 1
    w = W4Experts("nvfp4", E, 40, 45, g)
    out = run_grouped(backend, w, _x((c["T"], 40), torch.bfloat16, g), c["offsets"], c["ids"], transposed=True)
    _rows_in_no_group_are_zero(out, c)


@pytest.mark.parametrize("backend", metal_backends(rev=False))
@pytest.mark.parametrize("fid", list(FORMATS))
def test_grouped_mm_t_formats(backend, fid):
    c = GROUPED_CASES["prefill"]
    g = _gen("fmt_t", fid)
    run_grouped(backend, W4Experts(fid, 4, 33, 37, g), _x((c["T"], 33), torch.float16, g), c["offsets"], c["ids"],
                transposed=True)


# ---------------------------------------------------------------------------------------------- bad input
# (the emulator validates on the host as the CPU path does; on mps the kernels clamp instead: below)
@pytest.mark.parametrize("backend", metal_backends(rev=False)[:1])
@pytest.mark.parametrize("offsets,ids,match", [
    ([0, 3, 2], [0, 1], "non-decreasing"),
    ([0, 2, 4], [0, 2], r"expert_ids\[1\] = 2 is out of range"),
])
def test_grouped_malformed_offsets_rejected_on_the_host(backend, offsets, ids, match):
    g = _gen("bad")
    w = W4Experts("int4_sym_f16", 2, 4, 16, g)
    with pytest.raises(RuntimeError, match=match):
        run_grouped(backend, w, torch.ones(4, 16), offsets, ids)


# On mps the plans cannot read offsets / expert_ids without a device sync: every kernel reads its rows from
# fp8_grouped_tiles' table (offsets clamped to [0, T], made non-decreasing) and takes ids outside [0, E) as -1.
# torch.ops.lowbit_emu_mps runs the plans that way in the emulator (guard pages after every buffer).
@pytest.mark.skipif(not torch_lowbit.emulator.available(), reason="the Metal emulator is not built in this install")
@pytest.mark.parametrize("offsets,ids", MALFORMED_GROUPS)
@pytest.mark.parametrize("transposed", [False, True], ids=["mm", "mm_t"])
@pytest.mark.parametrize("T", [5, 40])  # decode and prefill kernels
def test_grouped_kernels_clamp_malformed_values_like_on_mps(T, transposed, offsets, ids):
    g = _gen("clamp", T, transposed)
    E, N, K = 2, 9, 48
    w = W4Experts("uint4_bias_bf16", E, N, K, g)
    x = _x((T, K if not transposed else N), torch.bfloat16, g)
    ops = torch.ops.lowbit_emu_mps
    if transposed:
        out = ops.w4_grouped_mm_t(x, w.codes, w.scale, w.format, w.group, K, _i32(offsets), _i32(ids), w.offset,
                                  w.global_scale)
    else:
        out = ops.w4_grouped_mm(x, w.codes, w.scale, w.format, w.group, _i32(offsets), _i32(ids), w.offset,
                                w.global_scale)
    ok_offsets, ok_ids = groups_as_on_mps(_i32(offsets), _i32(ids), T, E)
    ref, absref = ref_grouped(w, x, ok_offsets, ok_ids, transposed)
    assert_matmul_close(out, ref, absref)


def test_kernel_choice_threshold():
    """The decode kernel runs up to GEMV_ROWS mean rows per group (the cases above reach both sides)."""
    from torch_lowbit.emulator import dry_run
    meta = torch.device("meta")
    E, N, K = 4, 8, 64
    for T, G, kernel in [(32, 4, "w4_grouped_gemv"), (33, 4, "w4_grouped_gemm"), (1, 64, "w4_grouped_gemv")]:
        with dry_run() as d:
            d.ops.w4_grouped_mm(torch.empty(T, K, dtype=torch.float16, device=meta),
                                torch.empty(E, N, K // 2, dtype=torch.uint8, device=meta),
                                torch.empty(E, N, K // 32, dtype=torch.uint8, device=meta), "mxfp4", 32,
                                torch.empty(G + 1, dtype=torch.int32, device=meta),
                                torch.empty(G, dtype=torch.int32, device=meta), None, None)
            recs = d.take()
        assert recs[-1]["kernel"] == kernel + "_half_e8m0_none", (T, G)
    for case, c in CASES.items():
        T, G = c["T"], len(c["offsets"]) - 1
        assert (T <= GEMV_ROWS * G) == case.startswith(("decode", "one_token")), case
