"""CPU kernels against torch baselines and the machine's read bandwidth: ``python -m torch_lowbit.bench --suite cpu``.

Each case runs our op and its baseline in the same process, alternating in rounds (other work shares these
cores: a round measures both under the same load), and reports the medians, the median of the rounds' ratios, their
spread and the issue's goal. Where the rounds' ratios disagree by more than NOISY_SPREAD, the load changed within
the case (a shared host's neighbours, a stalled VM), and the row says "noisy" instead of yes or NO.
Weight GB/s counts the bytes of the low-bit weight read per call.

The int8 M=1 rows (int8_quantize + int8_mm, both Llama-3-8B shapes) are measured the same way against the read of
their own weight bytes; the M=64 bf16-x rows of fp8_mm against F.linear bf16 (AMX where the CPU has it).
The 4-bit rows (w4_mm int4 group 128 with bf16 scales, nvfp4, and MLX's uint4 group 64 with bf16 biases, on both
Llama-3-8B shapes) stream codes, scales and biases together against the read of those bytes, and compare M=1 with fp8_mm on the same shape, F.linear bf16 and
torch's own int4 GEMV (``_weight_int4pack_mm_for_cpu``, same group size), each cycling its own weight through the
working set; M=64 (each of the three) against F.linear bf16. The 4-bit grouped rows decode one token through 8 of 128 experts at
Qwen3-30B-A3B's expert shapes (w4_grouped_mm int4 g128) against a read of the chosen experts' bytes and
fp8_grouped_mm; ``--only w4-decode`` runs just the 4-bit batch-1 rows (dense M=1 and grouped decode).
Each 4-bit batch-1 case is also run on one weight (or one set of experts) that stays in the last-level cache, its
rows cut to half that cache: a diagnostic row ("in cache") whose ratio is the kernel's rate there over the read
bandwidth. Where it is not well above 1, the row from memory is bound by the kernel's work on this machine (its
cores, its thread count), not by memory, and prefetching or scheduling cannot lift its share.
``--threads 1,2,all`` runs the suite at each thread count (the table's first column).

Batch-1 decode reads weights that are not in any cache (a model's layers are far larger than the last-level
cache), so the M=1 cases cycle through copies of their weight adding up to a working set beyond the last-level
cache (``--working-set-mb``, default max(512 MB, 2 x L3)): each call reads its weight from memory, as in real
decode. The bandwidth baseline is a plain parallel read (``_C._cpu_stream_read``) of those same copies, in the
same order, so both see the same bytes in the same cache state; it shares the bytes out among the threads the way
the GEMVs share their rows (chunks taken by whichever thread is free), so neither waits on a fixed split.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics

import torch
import torch.nn.functional as F

from .. import _C
from ..testing import CPU_ISA_LEVELS, GEMM_ROUTE_NAMES, cpu_amx_gemm, cpu_gemm_route, cpu_isa, forced_cpu_isa
from .timing import median_time, print_table, write_json


def _fp8_weight(N, K, gen):
    bits = torch.randint(0, 256, (N, K), dtype=torch.uint8, generator=gen)
    bits[(bits & 0x7F) == 0x7F] = 0x3F  # finite codes, as a quantizer produces
    return bits, torch.rand(N, generator=gen) * 0.01 + 0.001


def _last_level_cache_bytes():
    """Size of the largest CPU cache (Linux sysfs), 0 when unknown."""
    import glob
    best = 0
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            txt = open(path).read().strip().upper()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(txt[-1:], 1)
            best = max(best, int(txt.rstrip("KMG")) * mult)
        except (OSError, ValueError):
            pass
    return best


class _Rotating:
    """Calls fn on copies of a tensor in turn, so that a working set of `bytes_total` is streamed from memory."""

    def __init__(self, t, bytes_total):
        n = max(1, -(-int(bytes_total) // max(1, t.numel() * t.element_size())))
        self.copies = [t] + [t.clone() for _ in range(n - 1)]
        self.i = 0

    def next(self):
        self.i = (self.i + 1) % len(self.copies)
        return self.copies[self.i]


class _RotatingW4(_Rotating):
    """Copies of a 4-bit weight's codes and scales (and offsets) in one buffer each (what a call reads, for the read
    baseline); view() gives the current copy's (codes, scale[, offset])."""

    def __init__(self, codes, scale, bytes_total, offset=None):
        parts = [t for t in (codes, scale, offset) if t is not None]
        super().__init__(torch.cat([t.reshape(-1).view(torch.uint8) for t in parts]), bytes_total)
        ends = torch.tensor([t.numel() * t.element_size() for t in parts]).cumsum(0).tolist()
        self.views = [tuple(c[e - t.numel() * t.element_size():e].view(t.dtype).view(t.shape) for t, e in zip(parts, ends))
                      for c in self.copies]

    def view(self):
        self.next()
        return self.views[self.i]


# Rounds of one case whose ratios differ by more than this factor (largest over smallest) were measured under
# changing load: the lent 16-core machine once gave a row 5.0x its read bandwidth, read and kernel stalled unequally.
NOISY_SPREAD = 1.3


def _paired(ours, base, rounds, repeat):
    """Each round: the median of `repeat` calls of ours, then of base. Returns their medians over the rounds and
    each round's base time / ours (the two measured under the same load)."""
    a, b = [], []
    for _ in range(rounds):
        a.append(median_time(ours, warmup=1, repeat=repeat))
        b.append(median_time(base, warmup=1, repeat=repeat))
    return statistics.median(a), statistics.median(b), [tb / t for t, tb in zip(a, b)]


def _verdict(ratios, meets):
    """(ratio, met, spread) of a case from its rounds' ratios: their median; "noisy" where they disagree by more
    than NOISY_SPREAD, else "yes" or "NO" as meets(ratio); their range as text."""
    ratio, lo, hi = statistics.median(ratios), min(ratios), max(ratios)
    met = "noisy" if hi > NOISY_SPREAD * lo else "yes" if meets(ratio) else "NO"
    return ratio, met, f"{lo:.2f}-{hi:.2f}"


def _case(rows, name, ours, base, base_name, goal, rounds, repeat, weight_bytes=None, ratio_kind="faster"):
    t, tb, faster = _paired(ours, base, rounds, repeat)
    if ratio_kind == "faster":  # baseline time / our time, goal is a minimum
        (ratio, met, spread), goal_s = _verdict(faster, lambda r: r >= goal), f">= {goal:.2f}x faster"
    else:  # our time / baseline time, goal is a maximum
        (ratio, met, spread), goal_s = _verdict([1 / f for f in faster], lambda r: r <= goal), f"<= {goal:.2f}x its time"
    row = dict(case=name, ms=t * 1e3, baseline=base_name, base_ms=tb * 1e3, ratio=ratio, spread=spread, goal=goal_s,
               met=met, gbs=(weight_bytes / t / 1e9) if weight_bytes else None)
    rows.append(row)
    print(f"  {name}: {t * 1e3:.3f} ms vs {base_name} {tb * 1e3:.3f} ms -> {ratio:.2f} (rounds {spread}; "
          f"{goal_s}: {met})", flush=True)
    return t


def run(argv) -> int:
    p = argparse.ArgumentParser(prog="python -m torch_lowbit.bench --suite cpu", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller shapes and fewer rounds (a smoke run)")
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds per case (default 5, quick 2)")
    p.add_argument("--threads", default=None,
                   help="comma-separated thread counts to run the suite at, 'all' = every core, e.g. 1,2,all "
                        "(default: torch's choice)")
    p.add_argument("--json", metavar="PATH", help="also write the rows to PATH")
    p.add_argument("--working-set-mb", type=int, default=None,
                   help="bytes the M=1 cases stream per weight (default max(512, 2 x last-level cache) MB)")
    p.add_argument("--isa", default="best", choices=[*CPU_ISA_LEVELS, "best"],
                   help="cap the instruction set of our CPU kernels (AMX needs avx512), to see a slower CPU's paths")
    p.add_argument("--only", choices=["w4", "w4-decode"], default=None,
                   help="run only these rows: the 4-bit ones, or their batch-1 rows (dense M=1 and grouped decode)")
    args = p.parse_args(argv)
    try:
        counts = _thread_counts(args.threads)
    except ValueError:
        p.error(f"--threads must be comma-separated positive integers or 'all', got {args.threads!r}")
    rows, meta = [], {}
    with forced_cpu_isa(args.isa):
        ran_isa, ran_amx, ran_route = cpu_isa(), cpu_amx_gemm(), cpu_gemm_route()  # what the cap runs (read inside it)
        for n in counts:
            torch.set_num_threads(n)
            for row in _run(args, meta):
                rows.append(dict(threads=n, **row))
    print()
    print_table(rows, [("threads", "threads", None), ("case", "case", None), ("ms", "ms", "{:.3f}"),
                       ("gbs", "weight GB/s", "{:.1f}"), ("baseline", "baseline", None),
                       ("base_ms", "baseline ms", "{:.3f}"), ("ratio", "ratio", "{:.2f}"), ("spread", "rounds", None),
                       ("goal", "goal", None),
                       ("met", "met", None)])
    if args.json:
        write_json(args.json, rows, suite="cpu", threads=counts, isa=ran_isa, amx_gemm=ran_amx,
                   gemm_route=ran_route, **meta)
        print(f"wrote {args.json}")
    return 0


def _thread_counts(spec):
    """[torch's count] for None, else the listed counts in order, 'all' being every core, without repeats."""
    if spec is None:
        return [torch.get_num_threads()]
    counts = []
    for item in spec.split(","):
        n = (os.cpu_count() or 1) if item.strip() == "all" else int(item)
        if n < 1:
            raise ValueError(item)
        if n not in counts:
            counts.append(n)
    return counts


def _stream_case(rows, name, op, copies, rounds, repeat, goal):
    """op() reads one of `copies` (a _Rotating) per call; the baseline is a plain read of the same copies."""
    t_read, t_op, op_over_read = _paired(lambda: _C._cpu_stream_read(copies.next()), op, rounds, repeat)
    nbytes = copies.copies[0].numel() * copies.copies[0].element_size()
    read_gbs, op_gbs = nbytes / t_read / 1e9, nbytes / t_op / 1e9
    frac, met, spread = _verdict([1 / r for r in op_over_read], lambda f: f >= goal)
    rows.append(dict(case=name, ms=t_op * 1e3, baseline="stream read of the weight", base_ms=t_read * 1e3,
                     ratio=frac, spread=spread, goal=f">= {goal:.2f} of read GB/s", met=met, gbs=op_gbs))
    print(f"  read bandwidth: {read_gbs:.1f} GB/s; {name} streams {op_gbs:.1f} GB/s = {frac:.0%} (rounds {spread}: "
          f"{met})", flush=True)
    return read_gbs


def _in_cache_case(rows, name, op, nbytes, read_gbs, rounds, repeat):
    """op() reads the same nbytes on every call (they stay in cache): the row's rate over read_gbs, the read
    bandwidth of the case from memory (see the module's docstring)."""
    t = statistics.median(median_time(op, warmup=2, repeat=repeat) for _ in range(rounds))
    gbs = nbytes / t / 1e9
    rows.append(dict(case=f"{name} in cache", ms=t * 1e3, baseline="read of as many bytes",
                     base_ms=nbytes / read_gbs / 1e6, ratio=gbs / read_gbs, goal="diagnostic: near 1, kernel-bound",
                     met="", gbs=gbs))
    print(f"  {name} in cache: {gbs:.1f} GB/s = {gbs / read_gbs:.2f}x the read bandwidth", flush=True)


def _cached_rows(row_bytes, n, llc):
    """How many of n rows (or experts) of row_bytes each fit half the last-level cache (8 MB where its size is
    unknown); at least one."""
    return max(1, min(n, ((llc or (16 << 20)) // 2) // row_bytes))


def _run(args, meta):
    quick = args.quick
    rounds = args.rounds or (2 if quick else 5)
    rep = 3 if quick else 7
    K, N = (1024, 2048) if quick else (4096, 14336)
    gK, gN, G = (512, 384, 8) if quick else (2048, 1536, 8)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    route = cpu_gemm_route()
    gemm = GEMM_ROUTE_NAMES[route] + ("" if route == "amx" else ", int8 micro-kernels")
    print(f"cpu suite: K={K} N={N}, {torch.get_num_threads()} threads, kernels: {cpu_isa()}, GEMM regimes: {gemm}, "
          f"{platform.processor() or platform.machine()}", flush=True)
    rows = []
    ops = torch.ops.lowbit

    llc = _last_level_cache_bytes()
    ws = (args.working_set_mb << 20) if args.working_set_mb else max((64 if quick else 512) << 20, 2 * llc)
    print(f"  M=1 cases stream a {ws >> 20} MB working set per weight (last-level cache: {llc >> 20} MB)", flush=True)
    rep_big = 2 if quick else 3
    if args.only in ("w4", "w4-decode"):
        _w4_cases(rows, args, K, N, ws, rounds, rep, rep_big, gen, decode_only=args.only == "w4-decode")
        _w4_grouped_cases(rows, quick, ws, rounds, rep, gen)
        meta.update(K=K, N=N, working_set_bytes=ws, last_level_cache_bytes=llc, quick=quick)
        return rows

    bits, scale = _fp8_weight(N, K, gen)
    w_bf16 = (torch.randn(N, K, generator=gen) * 0.02).to(torch.bfloat16)
    x1 = torch.randn(1, K, generator=gen).to(torch.bfloat16)
    fp8_set = _Rotating(bits, ws)
    fp8_m1 = lambda: ops.fp8_mm(x1, fp8_set.next(), scale, None, None)  # noqa: E731

    # streaming read of the same copies: the bandwidth the GEMV could reach at best
    read_gbs = _stream_case(rows, "fp8_mm M=1 weight stream", fp8_m1, fp8_set, rounds, rep, 0.85)

    bf16_set = _Rotating(w_bf16, ws)
    _case(rows, "fp8_mm M=1 bf16", fp8_m1, lambda: F.linear(x1, bf16_set.next()), "F.linear bf16", 2.0, rounds, rep,
          bits.numel())
    del bf16_set, w_bf16
    wq = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=gen)
    wq_scale = torch.rand(N, generator=gen).to(torch.bfloat16)
    int8_set = _Rotating(wq, ws)
    _case(rows, "fp8_mm M=1 bf16", fp8_m1, lambda: torch._weight_int8pack_mm(x1, int8_set.next(), wq_scale),
          "_weight_int8pack_mm", 1.35, rounds, rep, bits.numel())
    del int8_set, fp8_set

    # W8A8 decode on both Llama-3-8B shapes (the up and down projections): a read of the int8 weight at best
    for k, n in ((K, N), (N, K)):
        wq_m1 = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
        ws_m1 = torch.rand(n, generator=gen) * 0.01
        xk = torch.randn(1, k, generator=gen).to(torch.bfloat16)
        int8_set = _Rotating(wq_m1, ws)

        def w8a8_m1(xk=xk, int8_set=int8_set, ws_m1=ws_m1):
            q, s = ops.int8_quantize(xk)
            return ops.int8_mm(q, s, int8_set.next(), ws_m1, None, torch.bfloat16)
        _stream_case(rows, f"int8_quantize+int8_mm M=1 K={k} N={n}", w8a8_m1, int8_set, rounds, rep, 0.95)
        del int8_set, wq_m1

    w_f32 = torch.randn(N, K, generator=gen) * 0.02
    x64 = torch.randn(64, K, generator=gen).to(torch.bfloat16)
    x64f = x64.float()
    _case(rows, "fp8_mm M=64 bf16", lambda: ops.fp8_mm(x64, bits, scale, None, None), lambda: F.linear(x64f, w_f32),
          "F.linear fp32", 1.15, rounds, rep_big, bits.numel(), ratio_kind="time")
    # prefill against bf16 itself (AMX where the CPU has it), on both Llama-3-8B shapes
    for k, n in ((K, N), (N, K)):
        b, sc = (bits, scale) if (k, n) == (K, N) else _fp8_weight(n, k, gen)
        wb = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)
        xb = torch.randn(64, k, generator=gen).to(torch.bfloat16)
        _case(rows, f"fp8_mm M=64 bf16 K={k} N={n}", lambda xb=xb, b=b, sc=sc: ops.fp8_mm(xb, b, sc, None, None),
              lambda xb=xb, wb=wb: F.linear(xb, wb), "F.linear bf16", 1.0, rounds, rep_big, b.numel())
        del wb
    wscale = torch.rand(N, generator=gen)
    for M in (64, 256):
        x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
        xf = x.float()

        def w8a8(x=x):
            q, s = ops.int8_quantize(x)
            return ops.int8_mm(q, s, wq, wscale, None, torch.bfloat16)
        _case(rows, f"int8_quantize+int8_mm M={M} bf16", w8a8, lambda xf=xf: F.linear(xf, w_f32), "F.linear fp32",
              2.0, rounds, rep_big, wq.numel())
    del w_f32, bits, wq

    # grouped decode: G groups of one row, each its own expert
    gbits = torch.stack([_fp8_weight(gN, gK, gen)[0] for _ in range(G)])
    gscale = torch.rand(G, gN, generator=gen) * 0.01
    gw = [(torch.randn(gN, gK, generator=gen) * 0.02).to(torch.bfloat16) for _ in range(G)]
    xg = torch.randn(G, gK, generator=gen).to(torch.bfloat16)
    offsets = torch.arange(G + 1, dtype=torch.int32)

    def loop():
        return torch.cat([F.linear(xg[g:g + 1], gw[g]) for g in range(G)])
    _case(rows, f"fp8_grouped_mm {G}x1 rows K={gK} N={gN}", lambda: ops.fp8_grouped_mm(xg, gbits, gscale, offsets,
          None, None), loop, "per-group F.linear bf16", 1.8, rounds, rep * 3, gbits.numel())

    _w4_cases(rows, args, K, N, ws, rounds, rep, rep_big, gen)
    _w4_grouped_cases(rows, quick, ws, rounds, rep, gen)

    meta.update(K=K, N=N, read_gbs=read_gbs, working_set_bytes=ws, last_level_cache_bytes=llc, quick=quick)
    return rows


def _w4_cases(rows, args, K, N, ws, rounds, rep, rep_big, gen, decode_only=False):
    """w4_mm M=1 on both Llama-3-8B shapes from memory, and M=64 (see the module's docstring); decode_only: the
    M=1 rows against the read, fp8_mm and torch's int4 GEMV only."""
    ops = torch.ops.lowbit
    for k, n in ((K, N), (N, K)):
        x1 = torch.randn(1, k, generator=gen).to(torch.bfloat16)
        codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        scale = (torch.rand(n, k // 128, generator=gen) * 0.01 + 0.001).to(torch.bfloat16)
        w4 = _RotatingW4(codes, scale, ws)

        def int4_m1(x1=x1, w4=w4):
            c, s = w4.view()
            return ops.w4_mm(x1, c, s, "int4", 128)
        read_gbs = _stream_case(rows, f"w4_mm int4 g128 M=1 K={k} N={n}", int4_m1, w4, rounds, rep, 0.85)
        _w4_in_cache(rows, f"w4_mm int4 g128 M=1 K={k} N={n}", x1, w4, ("int4", 128), read_gbs, rounds, rep)
        fp8_set = _Rotating(_fp8_weight(n, k, gen)[0], ws)
        fscale = torch.rand(n, generator=gen) * 0.01
        _case(rows, f"w4_mm int4 g128 M=1 K={k} N={n}", int4_m1,
              lambda x1=x1, fp8_set=fp8_set, fscale=fscale: ops.fp8_mm(x1, fp8_set.next(), fscale, None, None),
              "fp8_mm", 1.6, rounds, rep, codes.numel())
        del fp8_set
        if not decode_only:
            bf16_set = _Rotating((torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16), ws)
            _case(rows, f"w4_mm int4 g128 M=1 K={k} N={n}", int4_m1,
                  lambda x1=x1, bf16_set=bf16_set: F.linear(x1, bf16_set.next()), "F.linear bf16", 3.5, rounds, rep,
                  codes.numel())
            del bf16_set
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen), 1)
        sz = torch.stack([scale.t(), torch.zeros_like(scale.t())], dim=-1).contiguous()  # [K/128, N, 2]
        pk_set = _Rotating(packed, ws)
        _case(rows, f"w4_mm int4 g128 M=1 K={k} N={n}", int4_m1,
              lambda x1=x1, pk_set=pk_set, sz=sz: torch.ops.aten._weight_int4pack_mm_for_cpu(x1, pk_set.next(), 128,
                                                                                              sz),
              "_weight_int4pack_mm_for_cpu", 1.2, rounds, rep, codes.numel())
        del pk_set, w4
        # nvfp4 (e4m3 scale per 16, the format with the most scale bytes) from memory
        nv_scale = torch.randint(0x20, 0x50, (n, k // 16), dtype=torch.uint8, generator=gen)
        nv = _RotatingW4(codes, nv_scale, ws)
        gsc = torch.tensor([0.5])

        def nvfp4_m1(x1=x1, nv=nv, gsc=gsc):
            c, s = nv.view()
            return ops.w4_mm(x1, c, s, "nvfp4", 16, None, gsc)
        read_gbs = _stream_case(rows, f"w4_mm nvfp4 g16 M=1 K={k} N={n}", nvfp4_m1, nv, rounds, rep, 0.85)
        _w4_in_cache(rows, f"w4_mm nvfp4 g16 M=1 K={k} N={n}", x1, nv, ("nvfp4", 16), read_gbs, rounds, rep, gsc)
        del nv
        # MLX's affine 4-bit (mlx_lm.convert's default: uint4, group 64, bf16 scales and biases) from memory
        mlx_scale = (torch.rand(n, k // 64, generator=gen) * 0.01 + 0.001).to(torch.bfloat16)
        mlx_bias = (torch.rand(n, k // 64, generator=gen) * -0.08).to(torch.bfloat16)
        mlx = _RotatingW4(codes, mlx_scale, ws, offset=mlx_bias)

        def mlx_m1(x1=x1, mlx=mlx):
            c, s, b = mlx.view()
            return ops.w4_mm(x1, c, s, "uint4", 64, b)
        read_gbs = _stream_case(rows, f"w4_mm uint4 g64+bias (MLX) M=1 K={k} N={n}", mlx_m1, mlx, rounds, rep, 0.85)
        _w4_in_cache(rows, f"w4_mm uint4 g64+bias (MLX) M=1 K={k} N={n}", x1, mlx, ("uint4", 64), read_gbs, rounds,
                     rep)
        del mlx
        if decode_only:
            continue
        # prefill: each format's weight (one copy) against F.linear bf16
        x64 = torch.randn(64, k, generator=gen).to(torch.bfloat16)
        wb = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)
        for label, fmt, group, sc, off, glob in (("int4 g128", "int4", 128, scale, None, None),
                                                 ("nvfp4 g16", "nvfp4", 16, nv_scale, None, gsc),
                                                 ("uint4 g64+bias (MLX)", "uint4", 64, mlx_scale, mlx_bias, None)):
            _case(rows, f"w4_mm {label} M=64 K={k} N={n}",
                  lambda x64=x64, c=codes, f=fmt, g=group, sc=sc, o=off, gl=glob: ops.w4_mm(x64, c, sc, f, g, o, gl),
                  lambda x64=x64, wb=wb: F.linear(x64, wb), "F.linear bf16", 1.0, rounds, rep_big, codes.numel())
        del wb


def _w4_in_cache(rows, name, x1, weights, fmt, read_gbs, rounds, rep, global_scale=None):
    """The in-cache row of a dense 4-bit M=1 case: the leading rows of the first copy of its weight (a _RotatingW4:
    codes, scale[, offset]) that fit half the last-level cache."""
    parts = weights.views[0]
    row_bytes = sum(t[0].numel() * t.element_size() for t in parts)
    r = _cached_rows(row_bytes, parts[0].shape[0], _last_level_cache_bytes())
    codes, scale, *offset = (t[:r] for t in parts)
    _in_cache_case(rows, name,
                   lambda: torch.ops.lowbit.w4_mm(x1, codes, scale, *fmt, offset[0] if offset else None, global_scale),
                   r * row_bytes, read_gbs, rounds, rep)


class _ExpertDecode:
    """T = 1 routed to `top` of a stacked weight's E experts, each call from memory: it cycles through copies of
    the stack and, per copy, through disjoint sets of experts, so that the calls together touch copies x E experts
    (a working set beyond the last-level cache) while each reads only its own experts' bytes."""

    def __init__(self, tensors, top, bytes_total, gen):
        self.E = tensors[0].shape[0]
        per_copy = sum(t.numel() * t.element_size() for t in tensors)
        n = max(1, -(-int(bytes_total) // per_copy))
        self.copies = [tensors] + [[t.clone() for t in tensors] for _ in range(n - 1)]
        perm = torch.randperm(self.E, generator=gen).to(torch.int32)
        self.sets = [perm[i:i + top] for i in range(0, self.E - top + 1, top)]
        self.i = 0
        self.offsets = torch.arange(top + 1, dtype=torch.int32)

    def next(self):
        """(tensors of a copy, expert ids)"""
        self.i += 1
        return self.copies[self.i % len(self.copies)], self.sets[(self.i // len(self.copies)) % len(self.sets)]


def _w4_grouped_cases(rows, quick, ws, rounds, rep, gen):
    """w4_grouped_mm decode at Qwen3-30B-A3B's expert shapes (E = 128, hidden 2048, moe_intermediate 768): one
    token through 8 experts, int4 g128 bf16 scales, weights from memory; against a plain read of as many bytes as
    the chosen experts hold (from a working set as large) and fp8_grouped_mm (per-channel scales) on the same
    shapes and routing."""
    ops = torch.ops.lowbit
    E, top = (16, 4) if quick else (128, 8)
    hidden, inter = (512, 256) if quick else (2048, 768)
    for name, n, k in (("gate_up", 2 * inter, hidden), ("down", hidden, inter)):
        codes = torch.randint(0, 256, (E, n, k // 2), dtype=torch.uint8, generator=gen)
        scale = (torch.rand(E, n, k // 128, generator=gen) * 0.01 + 0.001).to(torch.bfloat16)
        x = torch.randn(1, k, generator=gen).to(torch.bfloat16).expand(top, k).contiguous()
        w4 = _ExpertDecode([codes, scale], top, ws, gen)

        def w4_call(w4=w4, x=x):
            (c, s), ids = w4.next()
            return ops.w4_grouped_mm(x, c, s, "int4", 128, w4.offsets, ids, None, None)
        chosen = top * (codes[0].numel() + scale[0].numel() * scale.element_size())
        read_set = _Rotating(torch.ones(chosen, dtype=torch.uint8), ws)
        label = f"w4_grouped_mm int4 g128 {name} T=1 top{top}/{E} K={k} N={n}"
        read_gbs = _stream_case(rows, label, w4_call, read_set, rounds, rep, 0.85)
        del read_set
        # in cache: the first copy's first set, as many of its experts as fit half the last-level cache
        (c0, s0), t = w4.copies[0], _cached_rows(chosen // top, top, _last_level_cache_bytes())
        ids0, offs0, x0 = w4.sets[0][:t], w4.offsets[:t + 1], x[:t]
        _in_cache_case(rows, label, lambda: ops.w4_grouped_mm(x0, c0, s0, "int4", 128, offs0, ids0, None, None),
                       chosen // top * t, read_gbs, rounds, rep)
        fp8 = _ExpertDecode([_fp8_weight(E * n, k, gen)[0].view(E, n, k)], top, ws, gen)
        fscale = torch.rand(E, n, generator=gen) * 0.01

        def fp8_call(fp8=fp8, x=x, fscale=fscale):
            (w,), ids = fp8.next()
            return ops.fp8_grouped_mm(x, w, fscale, fp8.offsets, ids, None)
        _case(rows, label, w4_call, fp8_call, "fp8_grouped_mm", 1.6, rounds, rep, chosen)
        del fp8, w4
