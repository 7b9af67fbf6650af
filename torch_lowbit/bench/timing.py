"""Timing helpers shared by the benchmark suites: warm-up, then the median of repeated runs."""
import json
import statistics
import time

import torch


def sync(device):
    if str(device).startswith("mps"):
        torch.mps.synchronize()


def median_time(fn, device="cpu", warmup=2, repeat=7, min_time=0.0):
    """Median wall time of fn() in seconds, after `warmup` calls. Repeats at least `repeat` times and until
    `min_time` seconds have been spent measuring."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    start = time.perf_counter()
    while len(times) < repeat or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def write_json(path, rows, **meta):
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)


def print_table(rows, columns):
    """rows: list of dicts; columns: list of (key, header, format)."""
    cells = [[h for _, h, _ in columns]]
    for r in rows:
        cells.append([("" if r.get(k) is None else (fmt.format(r[k]) if fmt else str(r[k]))) for k, _, fmt in columns])
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    for j, line in enumerate(cells):
        print("  ".join(c.rjust(w) if j and i else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))), flush=True)
