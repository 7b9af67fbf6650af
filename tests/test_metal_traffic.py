"""The traffic report (`python -m torch_lowbit.bench --suite metal-traffic`): its counts are right on kernels
whose traffic is known, and the suite runs every op call it lists (or says why it skips one)."""
import ctypes
import json
import os

import numpy as np
import pytest

import torch_lowbit
from torch_lowbit.bench import metal_traffic as MT

import emu_ctypes as E

GEMV = os.path.join(E.PLANTED, "gemv.metal")
needs_gxx = pytest.mark.skipif(E.compiler() is None, reason="needs g++ to build the planted kernels")


@pytest.fixture(scope="module")
def traced_lib():
    lib = E.Library(E.build([GEMV], trace=True))
    lib.lib.msl_emu_trace_take.restype = ctypes.c_char_p
    lib.lib.msl_emu_set_arg_info.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p),
                                             ctypes.POINTER(ctypes.c_int)]
    return lib


def traced_gemv(lib, kernel, N, K, per_thread=False):
    rng = np.random.default_rng(0)
    W = E.random_fp8(rng, (N, K))
    x = rng.standard_normal(K).astype(np.float32)
    scale = np.ones(N, np.float32)
    y = np.zeros(N, np.float32)
    names = [b"weight", b"x", b"scale", b"y", b"args"]
    kinds = [1, 1, 1, 2, 0]
    lib.lib.msl_emu_set_arg_info(5, (ctypes.c_char_p * 5)(*names), (ctypes.c_int * 5)(*kinds))
    grid, tg = (((N + 63) // 64,), (64,)) if per_thread else (((N + 3) // 4,), (128,))
    lib.run(kernel, [W, x, scale, y, np.array([N, K], np.uint32)], grid=grid, tg=tg, outputs=(3,))
    assert np.allclose(y, E.fp8_to_f64(W) @ x.astype(np.float64), rtol=1e-4, atol=1e-2)
    records = json.loads(lib.lib.msl_emu_trace_take().decode())
    assert [r["kernel"] for r in records] == [kernel]
    case = MT.Case(kernel, "none", lambda: (), lambda a: N * K + 4 * K + 4 * N, True)
    return MT.summarize(case, (), records), records[0]


@needs_gxx
def test_coalesced_gemv_reads_each_weight_once_in_full_lines(traced_lib):
    m, rec = traced_gemv(traced_lib, "gemv_ok", 8, 1024)
    weight = next(b for b in rec["buffers"] if b["name"] == "weight")
    assert weight["read"]["requested"] == 8 * 1024 and weight["read"]["sectors"] * 32 == 8 * 1024
    assert weight["read"]["instrs"] == 8 * 1024 // 128  # one 128-byte SIMD load per 32 lanes x 4 bytes
    assert m.line_use == 1.0 and m.read_ratio == pytest.approx(1.0, abs=0.005)
    assert m.written == 32  # 8 floats: one sector
    assert next(b for b in rec["buffers"] if b["name"] == "args")["kind"] == "value"


@needs_gxx
def test_unaligned_rows_and_uncoalesced_loads_show_in_line_use(traced_lib):
    m, _ = traced_gemv(traced_lib, "gemv_ok", 8, 1000)  # rows start mid-line: loads straddle two lines
    assert 0.4 < m.line_use < 0.9
    m, _ = traced_gemv(traced_lib, "gemv_row_per_thread", 64, 256, per_thread=True)
    # 32 lanes x 4 bytes from 32 different lines (at most 16: consecutive loads of a thread are combined)
    assert m.line_use <= 16 / 128
    assert m.read_ratio == pytest.approx(1.0, abs=0.02)  # still every weight once


def test_suite_lists_every_op_call(capsys):
    if not torch_lowbit.emulator.trace_available():
        pytest.skip("no traffic build of the emulator in this install")
    assert MT.run(["--N", "40", "--K", "72"]) == 0
    out = capsys.readouterr().out
    for case in MT.cases(40, 72):
        assert case.label in out
    row = next(line for line in out.splitlines() if line.startswith("fp8_dequantize"))
    assert "fp8_dequantize_bfloat" in row
    # weights + per-channel scale, each once; 2 bytes written per element
    assert f"{(40 * 72 + 40 * 4) / 1e6:.3f}" in row and f"{40 * 72 * 2 / 1e6:.3f}" in row


@needs_gxx
def test_threadgroups_and_activation_bytes_per_weight_byte(traced_lib):
    m, _ = traced_gemv(traced_lib, "gemv_ok", 8, 1024)  # one simdgroup per weight row, 4 per threadgroup
    assert m.threadgroups == 2 and m.tg_per_core(40) == pytest.approx(2 / 40)
    # every simdgroup loads x itself: 4 float bytes per fp8 weight byte
    assert m.act_per_weight == pytest.approx(4.0)


def test_gemvs_meet_the_occupancy_and_activation_reuse_goals():
    """>= 4 threadgroups per core of a 40-core GPU for the decode GEMVs at N = 1024; <= 1 activation byte loaded
    per weight byte for the multi-row fp8 GEMV at M = 8 (bf16)."""
    if not torch_lowbit.emulator.trace_available():
        pytest.skip("no traffic build of the emulator in this install")
    chosen = [c for c in MT.cases(64, 512, small_N=1024, rows=8)
              if ("N=1024" in c.label and not c.op.startswith("w4")) or c.act_goal]
    assert len(chosen) == 3
    with torch_lowbit.emulator.traced() as trace:
        for case in chosen:
            m = MT.measure(case, trace)
            if case.act_goal:
                assert m.act_per_weight <= MT.ACT_PER_WEIGHT_GOAL, case.label
            else:
                assert m.tg_per_core(40) >= MT.TG_PER_CORE_GOAL, case.label


def test_w4_gemv_reads_codes_and_scales_once_in_full_lines():
    """The 4-bit GEMV (M = 1) at N = 1024: 1.00x the ideal bytes (codes + scales + offsets, activations), >= 90% of
    every 128-byte line its code loads touch used, >= 4 threadgroups per core of a 40-core GPU; for nvfp4 (e4m3
    scales per 16, a global scale) and int4 (bf16 scales and int8 zero points per 128). K = 1280: a row of 640
    bytes (whole lines, as at every Llama size), so the last 512-byte step of each row is partial."""
    if not torch_lowbit.emulator.trace_available():
        pytest.skip("no traffic build of the emulator in this install")
    chosen = [c for c in MT.cases(64, 1280, small_N=1024) if c.op == "w4_mm" and c.decode and "N=1024" in c.label]
    assert len(chosen) == 2
    with torch_lowbit.emulator.traced() as trace:
        for case in chosen:
            m = MT.measure(case, trace)
            variant = "e4m3_none" if "nvfp4" in case.label else "bf16_zp"
            assert [r["kernel"] for r in m.launches] == ["w4_gemv_bfloat_" + variant]
            assert m.read_ratio == pytest.approx(1.0, abs=0.005), case.label
            assert m.line_use >= MT.LINE_USE_GOAL, case.label
            assert m.tg_per_core(40) >= MT.TG_PER_CORE_GOAL, case.label


def test_w4_gemm_reads_each_code_once_per_tile_column():
    """One 32-row tile of the 4-bit GEMM: each code byte is read by the one threadgroup of its 32 output columns."""
    if not torch_lowbit.emulator.trace_available():
        pytest.skip("no traffic build of the emulator in this install")
    (case,) = [c for c in MT.cases(64, 256) if c.op == "w4_mm" and not c.decode]
    with torch_lowbit.emulator.traced() as trace:
        m = MT.measure(case, trace)
    assert [r["kernel"] for r in m.launches] == ["w4_gemm_bfloat_e4m3_none"]
    assert m.read_ratio == pytest.approx(1.0, abs=0.01)


def test_w4_grouped_decode_reads_the_chosen_experts_once():
    """4-bit MoE decode (4 tokens, each its own group on a different one of 8 experts): 1.00x the ideal bytes -- the
    chosen experts' codes, scales and offsets once, nothing of the others -- in full lines, for nvfp4 (per-expert
    global scale) and int4 (bf16 scales, int8 zero points). K = 1280: rows of 640 bytes, a partial last GEMV step."""
    if not torch_lowbit.emulator.trace_available():
        pytest.skip("no traffic build of the emulator in this install")
    chosen = [c for c in MT.cases(64, 1280) if c.op == "w4_grouped_mm"]
    assert len(chosen) == 2
    with torch_lowbit.emulator.traced() as trace:
        for case in chosen:
            m = MT.measure(case, trace)
            variant = "e4m3_none" if "nvfp4" in case.label else "bf16_zp"
            # the rows come from the tile table, as for prefill (one rule for malformed offsets)
            assert [r["kernel"] for r in m.launches] == ["fp8_grouped_tiles", "w4_grouped_gemv_bfloat_" + variant]
            assert m.read_ratio == pytest.approx(1.0, abs=0.005), case.label
            assert m.line_use >= MT.LINE_USE_GOAL, case.label


def test_m5_gemms_meet_the_tile_ideal():
    """int8_mm and fp8_mm prefill on M5 (matmul2d, 64 x 64 tiles): each weight byte read once per row tile of x,
    each activation byte loaded once per column tile of the weight -- 1.0x the tile ideal, past K and N tails."""
    if not torch_lowbit.emulator.trace_available():
        pytest.skip("no traffic build of the emulator in this install")
    chosen = [c for c in MT.cases(130, 200, prefill=70) if c.caps]
    assert [c.op for c in chosen] == ["int8_mm", "fp8_mm"]
    with torch_lowbit.emulator.traced() as trace:
        for case in chosen:
            m = MT.measure(case, trace)
            assert {r["kernel"] for r in m.launches} == {"int8_gemm_mpp_bfloat" if case.op == "int8_mm" else
                                                         "fp8_gemm_mpp_bfloat"}
            w_limit, x_limit = m.tile_limits
            assert w_limit == 2 * 130 * 200 and x_limit == 3 * 70 * 200 * (1 if case.op == "int8_mm" else 2)
            assert MT.tile_ok(m), (m.weight_read, m.activation_loaded, m.tile_limits)
