"""The main job: the linear layers of one Llama-3-8B decoder layer, FP8 (W8A16), INT8 (W8A8) and 4-bit (W4A16:
NVFP4, MXFP4, INT4 per 128, MLX-affine UINT4 per 64) against bf16.

Each distinct weight shape is measured once (q/o share 4096x4096, k/v 1024x4096, gate/up 14336x4096) with the
real layers (nn.Linear in bf16, Fp8Linear per channel, Int8Linear, W4Linear), for decode (M = 1) and a prefill
batch, on the best device (mps if available, else cpu). The table ends with the whole decoder layer (7 linears).
Then the MoE experts of one Qwen3-30B-A3B layer (SwiGLU experts, hidden 2048, intermediate 768, top 8) in each
mode (Fp8Experts, Int8Experts, W4Experts) against the bf16 experts computed expert by expert (transformers' eager
path), for the same M; their weight GB/s counts only the experts the tokens chose (what decode reads). The layer
has 128 experts; the main job builds 32 of them by default (``--moe-experts``), since quantizing all 128 in six
modes took most of its time: decode reads the 8 chosen experts either way, and a batch of 64 tokens chooses
nearly all of 32.

Columns: bf16 / lowbit time (median, ms), speedup = bf16 / lowbit, vs fp8 = fp8 time / lowbit time (the same
run), weight GB/s = bytes of the low-bit weight and its scales / lowbit time, and the error:
max |y_lowbit - y_bf16| / max |y_bf16| over the output, where y_bf16 is what nn.Linear with the bf16 weight
returns (the path the layer replaces), so it is the quantization error seen by the model (weights normal(0, 0.02),
activations normal(0, 1)).
"""
from __future__ import annotations

import argparse
import copy
import itertools
import math
import platform
import sys
import time

import torch
import torch.nn as nn

from ..nn import Fp8Experts, Fp8Linear, Int8Experts, Int8Linear, W4Experts, W4Linear
from .timing import median_time, print_table, sync, write_json

# (names, N, K, how many of the 7 linears of a decoder layer have this shape)
LLAMA3_8B = [
    ("q_proj,o_proj", 4096, 4096, 2),
    ("k_proj,v_proj", 1024, 4096, 2),
    ("gate_proj,up_proj", 14336, 4096, 2),
    ("down_proj", 4096, 14336, 1),
]
# (num_experts, hidden, intermediate, top_k) of one MoE layer's experts
QWEN3_30B_A3B_EXPERTS = (128, 2048, 768, 8)
DEFAULT_MOE_EXPERTS = 32
MOE_LAYER = "moe experts"
# mode -> (W4Linear format, group size); the group sizes are what the formats' writers use
W4_MODES = {"nvfp4": ("nvfp4", 16), "mxfp4": ("mxfp4", 32), "int4": ("int4", 128), "uint4": ("uint4", 64)}
MODES = ("fp8", "int8", *W4_MODES)
TARGET_S = 0.5     # time spent measuring one (shape, M, mode): repeats shrink as calls get slower
LONG_CALL_S = 1.0  # a CPU call this long is timed once: warm-up has nothing left to warm at that length
# Decode streams every weight from DRAM once per token. A single weight of these sizes can stay in a large
# last-level cache (300 MB on some servers) and show cache bandwidth, so each measurement cycles through copies
# of the layer that add up to at least this many bytes.
WORKING_SET_MB = 512
MAX_COPIES = 32


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def best_device():
    return "mps" if torch.backends.mps.is_available() else "cpu"


def timed(fn, device, repeat, target_s):
    """(seconds per call, first output, calls timed). The first call is the warm-up, and its output is kept."""
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    first = time.perf_counter() - t0
    if first > LONG_CALL_S and str(device) == "cpu":
        return first, out, 1
    n = max(1, min(repeat, int(target_s / max(first, 1e-6))))
    return median_time(fn, device, warmup=0, repeat=n), out, n


def rel_err(y, ref):
    y, ref = y.double().cpu(), ref.double().cpu()
    return float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def quantized(mode, lin):
    """The low-bit layer of a mode from a bf16 nn.Linear."""
    if mode == "fp8":
        return Fp8Linear.from_float(lin, "channel")
    if mode == "int8":
        return Int8Linear.from_float(lin)
    fmt, group = W4_MODES[mode]
    return W4Linear.from_float(lin, fmt, group)


def quantized_experts(mode, gate_up, down):
    """The low-bit experts layer of a mode from bf16 stacked weights."""
    if mode == "fp8":
        return Fp8Experts.from_float(gate_up, down, "channel")
    if mode == "int8":
        return Int8Experts.from_float(gate_up, down)
    fmt, group = W4_MODES[mode]
    return W4Experts.from_float(gate_up, down, fmt, group)


class Bf16Experts(nn.Module):
    """The bf16 experts as transformers' eager experts compute them: a loop over the experts the tokens chose."""

    def __init__(self, gate_up, down):
        super().__init__()
        self.register_buffer("gate_up", gate_up)
        self.register_buffer("down", down)

    def forward(self, x, ids, weights):
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            tok, slot = torch.where(ids == e)
            gate, up = (x[tok] @ self.gate_up[e].T).chunk(2, dim=-1)
            y = (torch.nn.functional.silu(gate) * up) @ self.down[e].T
            out.index_add_(0, tok, y * weights[tok, slot, None].to(y.dtype))
        return out


def weight_bytes(layer):
    """Bytes of the weight and its scales (and zero points / biases, and nvfp4's tensor scale): every buffer, and
    nn.Linear's weight."""
    tensors = {id(t): t for t in (*layer.buffers(), getattr(layer, "weight", None)) if t is not None}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def cycling(layer, working_set_mb):
    """The layer and enough deep copies of it to exceed the working set, called in turn."""
    n = min(MAX_COPIES, max(1, math.ceil(working_set_mb * 2 ** 20 / weight_bytes(layer))))
    layers = [layer] + [copy.deepcopy(layer) for _ in range(n - 1)]
    it = itertools.cycle(layers)
    return lambda *args: next(it)(*args)


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m torch_lowbit.bench --suite layer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cpu or mps (default: mps if available, else cpu)")
    p.add_argument("--m", default=None, help="comma-separated batch sizes M (default 1,64; --quick: 1,16)")
    p.add_argument("--repeat", type=int, default=None, help="at most this many timed calls per measurement "
                                                            "(default 10; --quick: 3)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated low-bit layers (default "
                                                            f"{','.join(MODES)})")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    p.add_argument("--quick", action="store_true", help="smaller prefill batch and fewer repeats")
    p.add_argument("--moe-experts", type=int, default=None,
                   help=f"experts in the MoE layer (default {DEFAULT_MOE_EXPERTS}; Qwen3-30B-A3B has "
                        f"{QWEN3_30B_A3B_EXPERTS[0]}); at least its top k, {QWEN3_30B_A3B_EXPERTS[3]}")
    p.add_argument("--working-set-mb", type=int, default=WORKING_SET_MB,
                   help=f"cycle through copies of each layer adding up to this many MB, so weights come from "
                        f"memory, not cache (default {WORKING_SET_MB}; 0: one copy)")
    a = p.parse_args(argv)
    a.device = a.device or best_device()
    try:
        a.ms = [int(m) for m in (a.m or ("1,16" if a.quick else "1,64")).split(",")]
    except ValueError:
        p.error(f"--m must be comma-separated integers, got {a.m!r}")
    if any(m < 1 for m in a.ms):
        p.error("--m values must be >= 1")
    a.modes = a.modes.split(",")
    if not a.modes or any(m not in MODES for m in a.modes):
        p.error(f"--modes must be among {MODES}, got {a.modes}")
    a.repeat = (3 if a.quick else 10) if a.repeat is None else a.repeat
    if a.repeat < 1:
        p.error("--repeat must be >= 1")
    a.target_s = TARGET_S / 3 if a.quick else TARGET_S
    E, H, I, k = QWEN3_30B_A3B_EXPERTS
    a.moe = (min(E, DEFAULT_MOE_EXPERTS) if a.moe_experts is None else a.moe_experts, H, I, k)
    if a.moe[0] < k:
        p.error(f"--moe-experts must be at least the top k, {k}, got {a.moe[0]}")
    return a


def measure_shape(names, N, K, args, gen):
    """Rows for one weight shape: every M and mode."""
    dev = args.device
    w = (torch.randn(N, K, generator=gen) * 0.02).to(torch.bfloat16)
    lin = nn.Linear(K, N, bias=False, dtype=torch.bfloat16)
    lin.weight.data = w
    t0 = time.perf_counter()
    layers = {mode: quantized(mode, lin).to(dev) for mode in args.modes}
    log(f"  {names} {N}x{K}: quantized to {', '.join(args.modes)} in {time.perf_counter() - t0:.1f} s")
    calls = {mode: cycling(layer, args.working_set_mb) for mode, layer in layers.items()}
    calls["bf16"] = cycling(lin.to(dev), args.working_set_mb)
    rows = []
    for M in args.ms:
        x = torch.randn(M, K, generator=gen).to(torch.bfloat16).to(dev)
        t_bf16, y_bf16, n_bf16 = timed(lambda: calls["bf16"](x), dev, args.repeat, args.target_s)
        log(f"  {names} M={M} bf16: {t_bf16 * 1e3:.2f} ms ({n_bf16} timed)")
        for mode in args.modes:
            layer, call = layers[mode], calls[mode]
            t, y, n = timed(lambda: call(x), dev, args.repeat, args.target_s)
            rows.append(dict(layer=names, shape=f"{N}x{K}", N=N, K=K, M=M, mode=mode, bf16_ms=t_bf16 * 1e3,
                             lowbit_ms=t * 1e3, speedup=t_bf16 / t, weight_gbs=weight_bytes(layer) / t / 1e9,
                             max_rel_err=rel_err(y, y_bf16), timed_calls=n, weight_bytes=weight_bytes(layer)))
            log(f"  {names} M={M} {mode}: {t * 1e3:.2f} ms ({n} timed), {t_bf16 / t:.2f}x bf16, "
                f"err {rows[-1]['max_rel_err']:.2e}")
    return with_vs_fp8(rows)


def measure_experts(args, gen):
    """Rows for the MoE experts layer: every M and mode, tokens routed to top_k random experts each."""
    dev = args.device
    E, H, I, k = args.moe
    gate_up = (torch.randn(E, 2 * I, H, generator=gen) * H ** -0.5).to(torch.bfloat16)
    down = (torch.randn(E, H, I, generator=gen) * I ** -0.5).to(torch.bfloat16)
    t0 = time.perf_counter()
    layers = {mode: quantized_experts(mode, gate_up, down).to(dev) for mode in args.modes}
    log(f"  {MOE_LAYER} E={E} {H}x{I} top {k}: quantized to {', '.join(args.modes)} in "
        f"{time.perf_counter() - t0:.1f} s")
    calls = {mode: cycling(layer, args.working_set_mb) for mode, layer in layers.items()}
    calls["bf16"] = cycling(Bf16Experts(gate_up, down).to(dev), args.working_set_mb)
    rows = []
    for M in args.ms:
        x = torch.randn(M, H, generator=gen).to(torch.bfloat16).to(dev)
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(M)]).to(dev)
        w = torch.softmax(torch.randn(M, k, generator=gen), dim=-1).to(torch.bfloat16).to(dev)
        chosen = ids.unique().numel() / E  # the share of the experts' bytes this batch reads
        t_bf16, y_bf16, n_bf16 = timed(lambda: calls["bf16"](x, ids, w), dev, args.repeat, args.target_s)
        log(f"  {MOE_LAYER} M={M} bf16: {t_bf16 * 1e3:.2f} ms ({n_bf16} timed)")
        for mode in args.modes:
            layer, call = layers[mode], calls[mode]
            t, y, n = timed(lambda: call(x, ids, w), dev, args.repeat, args.target_s)
            nbytes = weight_bytes(layer) * chosen
            rows.append(dict(layer=MOE_LAYER, shape=f"E{E} {H}x{I} top{k}", N=H, K=I, M=M, mode=mode,
                             bf16_ms=t_bf16 * 1e3, lowbit_ms=t * 1e3, speedup=t_bf16 / t, weight_gbs=nbytes / t / 1e9,
                             max_rel_err=rel_err(y, y_bf16), timed_calls=n, weight_bytes=nbytes))
            log(f"  {MOE_LAYER} M={M} {mode}: {t * 1e3:.2f} ms ({n} timed), {t_bf16 / t:.2f}x bf16, "
                f"err {rows[-1]['max_rel_err']:.2e}")
    return with_vs_fp8(rows)


def with_vs_fp8(rows):
    """vs_fp8 = the fp8 layer's time / each row's, for rows whose (layer, M) has an fp8 row (same run)."""
    fp8 = {(r["layer"], r["M"]): r["lowbit_ms"] for r in rows if r["mode"] == "fp8"}
    for r in rows:
        t = fp8.get((r["layer"], r["M"]))
        r["vs_fp8"] = None if t is None else t / r["lowbit_ms"]
    return rows


def layer_totals(rows):
    """The whole decoder layer per (M, mode): times summed over the 7 linears."""
    count = {names: c for names, _, _, c in LLAMA3_8B}
    rows = [r for r in rows if r["layer"] in count]
    out = []
    for M in sorted({r["M"] for r in rows}):
        for mode in [m for m in MODES if any(r["mode"] == m for r in rows)]:
            rs = [r for r in rows if r["M"] == M and r["mode"] == mode]
            bf16 = sum(r["bf16_ms"] * count[r["layer"]] for r in rs)
            low = sum(r["lowbit_ms"] * count[r["layer"]] for r in rs)
            nbytes = sum(r["weight_bytes"] * count[r["layer"]] for r in rs)
            out.append(dict(layer="decoder layer (7)", shape="", M=M, mode=mode, bf16_ms=bf16, lowbit_ms=low,
                            speedup=bf16 / low, weight_gbs=nbytes / (low / 1e3) / 1e9,
                            max_rel_err=max(r["max_rel_err"] for r in rs)))
    return with_vs_fp8(out)


def run(argv) -> int:
    args = parse(argv)
    dev = args.device
    try:
        torch.empty(1, device=dev)
    except (RuntimeError, AssertionError) as e:
        print(f"--device {dev} is not usable here: {e}", file=sys.stderr)
        return 2
    log(f"torch_lowbit layer bench: Llama-3-8B decoder layer on {dev} (torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {platform.machine()}), M = {args.ms}")
    gen = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    rows = []
    with torch.inference_mode():
        for i, (names, N, K, _) in enumerate(LLAMA3_8B):
            log(f"[{i + 1}/{len(LLAMA3_8B)}] {names} ({N}x{K}), {time.perf_counter() - start:.0f} s elapsed")
            rows += measure_shape(names, N, K, args, gen)
        log(f"[MoE] {MOE_LAYER} {args.moe}, {time.perf_counter() - start:.0f} s elapsed")
        moe = measure_experts(args, gen)
    table = rows + layer_totals(rows) + moe
    table.sort(key=lambda r: (r["M"], r["mode"]))
    print(f"Llama-3-8B decoder layer, {dev}; fp8 = Fp8Linear (per-channel, W8A16), int8 = Int8Linear (W8A8 dynamic), "
          f"nvfp4 / mxfp4 / int4 (group 128) / uint4 (group 64) = W4Linear (W4A16); {MOE_LAYER}: Qwen3-30B-A3B "
          f"(E, hidden, intermediate, top k) = {args.moe}, Fp8Experts / Int8Experts / W4Experts vs bf16 "
          f"expert by expert, GB/s over the chosen experts; err = max|y - y_bf16| / max|y_bf16|")
    print_table(table, [("layer", "layer", None), ("shape", "N x K", None), ("M", "M", None), ("mode", "mode", None),
                        ("bf16_ms", "bf16 ms", "{:.2f}"), ("lowbit_ms", "lowbit ms", "{:.2f}"),
                        ("speedup", "speedup", "{:.2f}x"), ("vs_fp8", "vs fp8", "{:.2f}x"),
                        ("weight_gbs", "weight GB/s", "{:.1f}"),
                        ("max_rel_err", "max rel err", "{:.2e}")])
    log(f"done in {time.perf_counter() - start:.0f} s")
    if args.json:
        write_json(args.json, table, suite="layer", device=str(dev), torch=torch.__version__,
                   threads=torch.get_num_threads(), ms=args.ms, err="max|y - y_bf16| / max|y_bf16|",
                   weight_gbs="(weight + scale bytes) / lowbit time; moe experts: of the chosen experts",
                   moe_experts=dict(zip(("num_experts", "hidden", "intermediate", "top_k"), args.moe)))
        log(f"wrote {args.json}")
    return 0
