"""Device-memory traffic of the Metal kernels, measured in the emulator: ``--suite metal-traffic``.

No Apple GPU is available here, so the decode kernels' speed is predicted from what they read: each op call
runs through ``torch.ops.lowbit_emu`` (the same plans and kernels as the mps device) on the traffic build of
the emulator (torch_lowbit/_msl_trace*.so, csrc/emu/trace.cpp), which records every load and store of every
GPU thread and groups them into SIMD instructions. Per op call and shape it prints:

  read       bytes read from device memory, counted in 32 B sectors: the weight buffer (argument named
             ``weight`` or ``wq``) per threadgroup -- weights stream from DRAM, so what two threadgroups both
             read costs twice -- every other buffer once per launch (activations and scales stay in cache)
  ideal      the weights the call needs, once, plus activations, scales, bias and offsets
  line use   for the weight loads: bytes the lanes used / the 128 B lines each SIMD instruction touched
  time       (read + written) / (BW * efficiency), by default 400 GB/s at 85% (an M-series Max-class GPU)
  tg/core    threadgroups launched per GPU core (default 40 cores, an M-series Max): a GPU hides memory latency
             only with several threadgroups resident per core
  act/w      activation bytes the lanes load (argument ``x`` / ``xq``, every load instruction counted, as it
             reaches the core's L1) per weight byte loaded: a GEMV that reloads its activation rows in every
             simdgroup spends more load bandwidth on them than on the weights

Goals for the decode kernels (M = 1 fp8 GEMV, grouped decode (fp8, 4-bit), int8 GEMV, 4-bit GEMV): read <= 1.02 x ideal, line use
>= 90% and >= 4 threadgroups per core (also at N = 1024, a Llama-3-8B k/v projection); for the multi-row fp8
GEMV (M = 8): act/w <= 1 (pass/fail columns). For the M5 tensor-op GEMMs (run under emulator.device_caps of an
M5): weight bytes read <= ceil(M / BM) x the weight and activation bytes loaded <= ceil(N / BN) x the activations,
the ideal of BM x BN output tiles (tile<=1x; weights within 1.02x, counted in sectors). Ops whose Metal kernel does not exist yet are listed and skipped.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch

WEIGHT_ARGS = ("weight", "wq", "codes")  # the schemas' names of the weight argument; plans name the buffer after them
ACTIVATION_ARGS = ("x", "xq")
SECTOR = 32
READ_GOAL = 1.02
LINE_USE_GOAL = 0.90
TG_PER_CORE_GOAL = 4.0
ACT_PER_WEIGHT_GOAL = 1.0


@dataclass
class Case:
    label: str
    op: str
    make: Callable[[], tuple]      # () -> positional args of torch.ops.lowbit_emu.<op>
    ideal: Callable[[tuple], int]  # args -> ideal bytes read
    decode: bool                   # the decode goals apply (read, line use, threadgroups per core)
    act_goal: bool = False         # the activation-reuse goal applies (multi-row GEMV)
    caps: Optional[dict] = None    # emulator.device_caps to run under (the M5 cases)
    tile: Optional[tuple] = None   # (BM, BN): the tile ideal applies (weight and activations reread per tile)


@dataclass
class Measured:
    case: Case
    launches: List[dict] = field(default_factory=list)
    read: int = 0
    written: int = 0
    ideal: int = 0
    weight_line_bytes: int = 0
    weight_used_bytes: int = 0
    weight_loaded: int = 0      # bytes the lanes requested, every load instruction counted
    weight_read: int = 0        # weight bytes read, per threadgroup (32 B sectors)
    tile_limits: Optional[tuple] = None  # (weight, activation) bytes of the tile ideal
    activation_loaded: int = 0
    threadgroups: int = 0
    skipped: Optional[str] = None

    @property
    def line_use(self):
        return self.weight_used_bytes / self.weight_line_bytes if self.weight_line_bytes else float("nan")

    @property
    def read_ratio(self):
        return self.read / self.ideal if self.ideal else float("nan")

    @property
    def act_per_weight(self):
        return self.activation_loaded / self.weight_loaded if self.weight_loaded else float("nan")

    def tg_per_core(self, cores: int):
        return self.threadgroups / cores


def nbytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def buffer_read_bytes(buf: dict) -> int:
    if buf["kind"] not in ("read", "readwrite"):
        return 0
    sectors = buf["read"]["sectors_tg"] if buf["name"] in WEIGHT_ARGS else buf["read"]["sectors"]
    return sectors * SECTOR


def tile_limits(case: Case, args: tuple) -> Optional[tuple]:
    """(weight, activation) bytes of BM x BN output tiles: each weight row once per row tile of x, each
    activation row once per column tile of the weight."""
    if case.tile is None:
        return None
    bm, bn = case.tile
    x, w = args[0], args[2] if case.op == "int8_mm" else args[1]
    M, N = x.shape[0], w.shape[-2]
    return math.ceil(M / bm) * nbytes(w), math.ceil(N / bn) * nbytes(x)


def tile_ok(m: Measured) -> bool:
    """Weights within READ_GOAL of the tile ideal (reads count whole 32 B sectors, and rows of K bytes need not
    start on one); activations (bytes the lanes load) at most the tile ideal."""
    w_limit, x_limit = m.tile_limits
    return m.weight_read <= READ_GOAL * w_limit and m.activation_loaded <= x_limit


def summarize(case: Case, args: tuple, launches: List[dict]) -> Measured:
    m = Measured(case, launches, ideal=case.ideal(args), tile_limits=tile_limits(case, args))
    for rec in launches:
        gx, gy, gz = rec["grid"]
        m.threadgroups += gx * gy * gz
        for buf in rec["buffers"]:
            if buf["kind"] in ("read", "readwrite"):
                if buf["name"] in WEIGHT_ARGS:
                    m.weight_loaded += buf["read"]["requested"]
                elif buf["name"] in ACTIVATION_ARGS:
                    m.activation_loaded += buf["read"]["requested"]
            m.read += buffer_read_bytes(buf)
            if buf["name"] in WEIGHT_ARGS:
                m.weight_read += buffer_read_bytes(buf)
            if buf["kind"] != "value":
                m.written += buf["write"]["sectors"] * SECTOR
            if buf["name"] in WEIGHT_ARGS:
                m.weight_line_bytes += buf["read"]["line_bytes"]
                m.weight_used_bytes += buf["read"]["used_bytes"]
    return m


# ---------------------------------------------------------------------------------------------- cases
def _fp8(shape, gen):
    b = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    b[(b & 0x7F) == 0x7F] = 0x3F  # no NaN codes
    return b


M5 = dict(apple_family=10, msl_version=400)


def cases(N: int, K: int, experts: int = 8, tokens: int = 4, small_N: int = 1024, rows: int = 8,
          prefill: int = 128) -> List[Case]:
    gen = torch.Generator().manual_seed(0)
    bn = bk = 128

    def x(M):
        return torch.randn(M, K, generator=gen).to(torch.bfloat16)

    def fp8_mm_ideal(a):
        xx, w, s, bias, _ = a
        return nbytes(xx) + nbytes(w) + nbytes(s) + nbytes(bias)

    def grouped_ideal(a):
        xx, w, s, offsets, ids, _ = a
        used = sorted(set(int(e) for e in ids.tolist() if e >= 0))
        per_expert = (nbytes(w) + nbytes(s)) // w.shape[0]
        return nbytes(xx) + len(used) * per_expert + nbytes(offsets) + nbytes(ids)

    def int8_ideal(a):
        xq, xs, wq, ws, bias, _ = a
        return nbytes(xq) + nbytes(xs) + nbytes(wq) + nbytes(ws) + nbytes(bias)

    def mm_t_ideal(a):
        go, w, s, _ = a
        return nbytes(go) + nbytes(w) + nbytes(s)

    def w4_mm_ideal(a):
        xx, codes, s, _fmt, _group, offset, gscale, bias = a
        return nbytes(xx) + nbytes(codes) + nbytes(s) + nbytes(offset) + nbytes(gscale) + nbytes(bias)

    def dequant_ideal(a):
        w, s, _, _ = a
        return nbytes(w) + nbytes(s)

    def blocks(n, k):
        return (n + bn - 1) // bn, (k + bk - 1) // bk

    E, T = experts, tokens
    # decode MoE: every token is its own group, routed to a different expert (top-k routing after sorting)
    ids = torch.arange(T, dtype=torch.int32) * (E // T if T <= E else 1) % E
    offsets = torch.arange(T + 1, dtype=torch.int32)
    def fp8_mm_channel(M, n):
        return lambda: (x(M), _fp8((n, K), gen), torch.rand(n, generator=gen) + 0.5, None, None)

    def int8_mm_m1(n):
        return lambda: (torch.randint(-127, 128, (1, K), dtype=torch.int8, generator=gen), torch.rand(1) + 0.5,
                        torch.randint(-127, 128, (n, K), dtype=torch.int8, generator=gen),
                        torch.rand(n, generator=gen) + 0.5, None, torch.bfloat16)

    def w4_weight(lead, n, fmt):
        """(codes, scale, format, group_size, offset, global_scale) of a [*lead, n, K] 4-bit weight: nvfp4 (e4m3
        scale per 16, global scale) or int4 (bf16 scale and int8 zero point per 128)."""
        codes = torch.randint(0, 256, lead + (n, (K + 1) // 2), dtype=torch.uint8, generator=gen)
        if fmt == "nvfp4":
            G = (K + 15) // 16
            return (codes, torch.randint(0x28, 0x48, lead + (n, G), dtype=torch.uint8, generator=gen), fmt, 16, None,
                    torch.ones(lead or (1,)))
        G = (K + 127) // 128
        return (codes, (torch.rand(lead + (n, G), generator=gen) + 0.5).to(torch.bfloat16), fmt, 128,
                torch.randint(-8, 8, lead + (n, G), dtype=torch.int8, generator=gen), None)

    def w4_mm(M, n, fmt):
        return lambda: (x(M), *w4_weight((), n, fmt), None)

    def w4_grouped(n, fmt):
        codes, scale, fmt, group, offset, gscale = w4_weight((E,), n, fmt)
        return lambda: (x(T), codes, scale, fmt, group, offsets, ids, offset, gscale)

    def w4_grouped_ideal(a):
        """x, the chosen experts' codes, scales and offsets once, all global scales, offsets and ids"""
        xx, codes, s, _fmt, _group, offs, eids, offset, gscale = a
        used = len(set(int(e) for e in eids.tolist() if e >= 0))
        per_expert = (nbytes(codes) + nbytes(s) + nbytes(offset)) // codes.shape[0]
        return nbytes(xx) + used * per_expert + nbytes(gscale) + nbytes(offs) + nbytes(eids)

    return [
        *[Case(f"w4_mm M=1 N={n} K={K} {fmt} bf16", "w4_mm", w4_mm(1, n, fmt), w4_mm_ideal, True)
          for fmt in ("nvfp4", "int4") for n in (N, small_N)],
        # one 32-row tile of the GEMM: every code byte is read by the one threadgroup of its tile column
        Case(f"w4_mm M=32 N={N} K={K} nvfp4 bf16", "w4_mm", w4_mm(32, N, "nvfp4"), w4_mm_ideal, False),
        Case(f"fp8_mm M=1 N={N} K={K} per-channel bf16", "fp8_mm", fp8_mm_channel(1, N), fp8_mm_ideal, True),
        Case(f"fp8_mm M=1 N={small_N} K={K} per-channel bf16", "fp8_mm", fp8_mm_channel(1, small_N), fp8_mm_ideal,
             True),
        Case(f"fp8_mm M={rows} N={N} K={K} per-channel bf16", "fp8_mm", fp8_mm_channel(rows, N), fp8_mm_ideal,
             False, act_goal=True),
        Case(f"fp8_mm M=1 N={N} K={K} block {bn}x{bk} bf16", "fp8_mm",
             lambda: (x(1), _fp8((N, K), gen), torch.rand(*blocks(N, K), generator=gen) + 0.5, None, [bn, bk]),
             fp8_mm_ideal, True),
        Case(f"fp8_grouped_mm decode T={T} E={E} N={N} K={K} per-channel", "fp8_grouped_mm",
             lambda: (x(T), _fp8((E, N, K), gen), torch.rand(E, N, generator=gen) + 0.5, offsets, ids, None),
             grouped_ideal, True),
        # 4-bit MoE decode: one pass over the chosen experts' codes
        *[Case(f"w4_grouped_mm decode T={T} E={E} N={N} K={K} {fmt} bf16", "w4_grouped_mm", w4_grouped(N, fmt),
               w4_grouped_ideal, True) for fmt in ("nvfp4", "int4")],
        Case(f"int8_mm M=1 N={N} K={K}", "int8_mm", int8_mm_m1(N), int8_ideal, True),
        Case(f"int8_mm M=1 N={small_N} K={K}", "int8_mm", int8_mm_m1(small_N), int8_ideal, True),
        # the backward product grad_out [M, N] @ W [N, K]: decode (one row) and one 32-row tile of the GEMM
        *[Case(f"fp8_mm_t M={M} N={N} K={K} block {bn}x{bk} bf16", "fp8_mm_t",
               lambda M=M: (torch.randn(M, N, generator=gen).to(torch.bfloat16), _fp8((N, K), gen),
                            torch.rand(*blocks(N, K), generator=gen) + 0.5, [bn, bk]), mm_t_ideal, M == 1)
          for M in (1, 32)],
        Case(f"fp8_dequantize N={N} K={K} per-channel -> bf16", "fp8_dequantize",
             lambda: (_fp8((N, K), gen), torch.rand(N, generator=gen) + 0.5, None, torch.bfloat16), dequant_ideal,
             False),
        # prefill on M5's tensor units (matmul2d, 64 x 64 tiles): the tile ideal
        Case(f"int8_mm M={prefill} N={N} K={K} M5", "int8_mm",
             lambda: (torch.randint(-127, 128, (prefill, K), dtype=torch.int8, generator=gen),
                      torch.rand(prefill) + 0.5, torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=gen),
                      torch.rand(N, generator=gen) + 0.5, None, torch.bfloat16), int8_ideal, False,
             caps=M5, tile=(64, 64)),
        Case(f"fp8_mm M={prefill} N={N} K={K} block {bn}x{bk} bf16 M5", "fp8_mm",
             lambda: (x(prefill), _fp8((N, K), gen), torch.rand(*blocks(N, K), generator=gen) + 0.5, None, [bn, bk]),
             fp8_mm_ideal, False, caps=M5, tile=(64, 64)),
    ]


def measure(case: Case, trace) -> Measured:
    from .. import emulator
    args = case.make()
    try:
        with emulator.device_caps(**case.caps) if case.caps else contextlib.nullcontext():
            getattr(torch.ops.lowbit_emu, case.op)(*args)
    except NotImplementedError as e:
        trace.take()
        m = Measured(case)
        m.skipped = str(e).splitlines()[0]
        return m
    return summarize(case, args, trace.take())


# ---------------------------------------------------------------------------------------------- report
def _mb(b):
    return f"{b / 1e6:.3f}"


def _goal(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def format_table(rows: List[Measured], bandwidth_gbs: float, efficiency: float, cores: int = 40) -> str:
    bw = bandwidth_gbs * 1e9 * efficiency
    head = (f"{'op call':<56} {'kernels':<28} {'read MB':>9} {'ideal MB':>9} {'x ideal':>8} {'line use':>9} "
            f"{'write MB':>9} {'time us':>8} {'tg/core':>8} {'act/w':>6} {'read<=1.02x':>11} {'lines>=90%':>10} "
            f"{'tg/core>=4':>10} {'act/w<=1':>8} {'tile<=1x':>8}")
    out = [head, "-" * len(head)]
    for m in rows:
        if m.skipped:
            out.append(f"{m.case.label:<56} skipped: {m.skipped}")
            continue
        kernels = ",".join(sorted({r["kernel"] for r in m.launches})) or "(no launch)"
        time_us = (m.read + m.written) / bw * 1e6
        ok_read = ok_lines = ok_tg = ok_act = "-"
        if m.case.decode:
            ok_read = _goal(m.read_ratio <= READ_GOAL)
            ok_lines = _goal(m.line_use >= LINE_USE_GOAL)
            ok_tg = _goal(m.tg_per_core(cores) >= TG_PER_CORE_GOAL)
        if m.case.act_goal:
            ok_act = _goal(m.act_per_weight <= ACT_PER_WEIGHT_GOAL)
        act = f"{m.act_per_weight:.2f}" if m.activation_loaded else "-"
        ok_tile = _goal(tile_ok(m)) if m.tile_limits else "-"
        out.append(f"{m.case.label:<56} {kernels:<28} {_mb(m.read):>9} {_mb(m.ideal):>9} {m.read_ratio:>8.3f} "
                   f"{100 * m.line_use:>8.1f}% {_mb(m.written):>9} {time_us:>8.1f} {m.tg_per_core(cores):>8.1f} "
                   f"{act:>6} {ok_read:>11} {ok_lines:>10} {ok_tg:>10} {ok_act:>8} {ok_tile:>8}")
    out.append(f"time: (read + written) / ({bandwidth_gbs:g} GB/s x {efficiency:.0%}); read counts 32 B sectors, "
               f"the weight per threadgroup, other buffers once per launch; tg/core: threadgroups / {cores} cores; "
               f"act/w: activation / weight bytes loaded by the lanes; tile<=1x: weight read <= ceil(M / BM) x weight "
               f"and activations loaded <= ceil(N / BN) x activations")
    return "\n".join(out)


def source_lines(library: str, pcs: List[int]) -> dict:
    """pc offset -> 'file:line' through addr2line (the traffic build keeps line tables)."""
    tool = shutil.which("addr2line")
    if not tool or not pcs:
        return {}
    res = subprocess.run([tool, "-e", library] + [hex(p) for p in pcs], capture_output=True, text=True)
    lines = res.stdout.splitlines()
    return {p: os.path.basename(s) for p, s in zip(pcs, lines)}


def format_sites(rec: dict, library: Optional[str]) -> str:
    """Per memory instruction (buffer, direction, source line): how well its lanes' accesses coalesce."""
    where = source_lines(library, sorted({s["pc"] for s in rec["sites"]})) if library else {}
    names = {b["index"]: b["name"] for b in rec["buffers"]}
    out = [f"  {rec['kernel']} grid {tuple(rec['grid'])} x threadgroup {tuple(rec['threadgroup'])}",
           f"    {'buffer':<10} {'kind':<6} {'source':<28} {'simd instrs':>11} {'lanes':>6} {'bytes/instr':>11} "
           f"{'line use':>9}"]
    for s in rec["sites"]:
        use = s["used_bytes"] / (128 * s["lines"]) if s["lines"] else float("nan")
        out.append(f"    {names.get(s['buffer'], s['buffer']):<10} {'store' if s['write'] else 'load':<6} "
                   f"{where.get(s['pc'], hex(s['pc'])):<28} {s['instrs']:>11} {s['lanes'] / s['instrs']:>6.1f} "
                   f"{s['requested'] / s['instrs']:>11.1f} {100 * use:>8.1f}%")
    return "\n".join(out)


def run(argv) -> int:
    from .. import emulator
    p = argparse.ArgumentParser(prog="python -m torch_lowbit.bench --suite metal-traffic", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--N", type=int, default=4096, help="output features (default 4096, a Llama-3-8B projection)")
    p.add_argument("--K", type=int, default=4096, help="input features (default 4096)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=4, help="decode tokens of the grouped case, one group each")
    p.add_argument("--small-N", type=int, default=1024,
                   help="output features of the small decode cases (default 1024, a Llama-3-8B k/v projection)")
    p.add_argument("--rows", type=int, default=8, help="activation rows of the multi-row fp8 case (default 8)")
    p.add_argument("--prefill", type=int, default=128, help="activation rows of the M5 prefill cases (default 128)")
    p.add_argument("--cores", type=int, default=40, help="GPU cores for tg/core (default 40)")
    p.add_argument("--bandwidth", type=float, default=400.0, help="GB/s (default 400)")
    p.add_argument("--efficiency", type=float, default=0.85, help="share of peak bandwidth reached (default 0.85)")
    p.add_argument("--detail", action="store_true", help="also print every memory instruction with its source line")
    p.add_argument("--only", default="", help="run only the cases whose label contains this text")
    a = p.parse_args(argv)
    if not emulator.trace_available():
        print("metal-traffic: skipped: this install has no traffic build of the emulator "
              "(torch_lowbit/_msl_trace*.so; built on non-macOS unless TORCH_LOWBIT_TRACE=0)")
        return 0
    rows = []
    with emulator.traced() as trace:
        for case in cases(a.N, a.K, a.experts, a.tokens, a.small_N, a.rows, a.prefill):
            if a.only and a.only not in case.label:
                continue
            m = measure(case, trace)
            rows.append(m)
            if a.detail and not m.skipped:
                print(f"{case.label}:")
                for rec in m.launches:
                    print(format_sites(rec, trace.library))
    print(format_table(rows, a.bandwidth, a.efficiency, a.cores))
    return 0
