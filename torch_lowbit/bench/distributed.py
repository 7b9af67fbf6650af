"""Tensor parallelism on one machine: a small Llama (random weights) quantized with ``quantize_`` and written with
``save_quantized``, then loaded with ``torch_lowbit.from_pretrained(path, tp_plan="auto")`` under ``torchrun`` at
each world size (gloo; default 1, 2 and 4 ranks) and decoded greedily with ``model.generate`` on every rank. Reports,
side by side with the same checkpoint loaded without ``tp_plan`` (the first row): tokens/s (rank 0's median over
runs), speed vs that row, the low-bit weight MB each rank holds (codes, scales and biases of its low-bit layers; the
largest over the ranks) and vs that row, all of each rank's tensors, the ranks' resident memory, and whether every
rank of every world size generated the same tokens.

Each world size gets the same CPU cores: ``--threads-per-rank`` defaults to (cores // world), so world 4 runs four
ranks of a quarter of the threads each; on one machine the ranks share memory bandwidth, and the all-reduces
(gloo, two per layer per token) cost more than they would between machines' shared nothing, so this measures the
overhead of the split, not the scaling across Macs.

``python -m torch_lowbit.bench --suite distributed [--scheme fp8-channel|fp8-block|int8 --worlds 1,2,4 ...]``
Needs transformers (``pip install 'torch_lowbit[hf]'``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from .e2e import add_model_args
from .timing import median_time, print_table, write_json


def _log(msg):
    print(f"distributed: {msg}", file=sys.stderr, flush=True)


def _parser():
    p = argparse.ArgumentParser(prog="python -m torch_lowbit.bench --suite distributed",
                                description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--worlds", default="1,2,4", help="world sizes, comma-separated")
    p.add_argument("--threads-per-rank", type=int, default=0, help="default: cores // world (at least 1)")
    p.add_argument("--timeout", type=float, default=900, help="seconds for each world size's run")
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--rank-worker", nargs=2, metavar=("CHECKPOINT", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--no-tp-plan", action="store_true", help=argparse.SUPPRESS)
    return p


def run(argv) -> int:
    args = _parser().parse_args(argv)
    if args.rank_worker:
        return _rank_worker(args, *args.rank_worker)
    try:
        worlds = [int(w) for w in args.worlds.split(",")]
        assert worlds and all(w >= 1 for w in worlds)
    except (ValueError, AssertionError):
        print(f"--worlds must be positive ints separated by commas, got {args.worlds!r}")
        return 2
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("the distributed suite needs transformers: pip install 'torch_lowbit[hf]'")
        return 1
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "checkpoint")
        _log(f"building a Llama ({args.layers} layers, hidden {args.hidden}) and saving it quantized ({args.scheme})")
        _write_checkpoint(args, ckpt)
        rows = []
        # the baseline: the same checkpoint loaded without tp_plan (no split, no style, no collective)
        for world, split in [(1, False)] + [(w, True) for w in worlds]:
            threads = args.threads_per_rank or max(1, cores // world)
            label = str(world) if split else "1, no tp_plan"
            _log(f"world {label}: torchrun --nproc-per-node {world}, {threads} threads per rank")
            ranks = _launch(args, ckpt, world, threads, os.path.join(tmp, f"world{world}-{split}"), split)
            if ranks is None:
                return 1
            r0 = ranks[0]
            rows.append({"world": label, "threads_per_rank": threads, "tok_s": r0["tok_s"],
                         "ms_per_token": 1e3 / r0["tok_s"],
                         "lowbit_mb_per_rank": max(r["lowbit_bytes"] for r in ranks) / 2 ** 20,
                         "tensor_mb_per_rank": max(r["tensor_bytes"] for r in ranks) / 2 ** 20,
                         "rss_mb_per_rank": max(r["rss_bytes"] for r in ranks) / 2 ** 20,
                         "load_s": r0["load_s"], "tokens": r0["tokens"],
                         "same_tokens_across_ranks": all(r["tokens"] == r0["tokens"] for r in ranks)})
    base = rows[0]
    for r in rows:
        r["speed_vs_first"] = r["tok_s"] / base["tok_s"]
        r["lowbit_vs_first"] = r["lowbit_mb_per_rank"] / base["lowbit_mb_per_rank"]
        r["same_tokens"] = r["same_tokens_across_ranks"] and r["tokens"] == base["tokens"]
    print(f"distributed: LlamaForCausalLM, {args.layers} layers, hidden {args.hidden}, intermediate "
          f"{args.intermediate}, vocab {args.vocab}, {args.scheme}, bf16 activations; from_pretrained(tp_plan='auto') "
          f"under torchrun (gloo, one machine, {cores} cores); generate {args.tokens} tokens after a {args.prompt}-token "
          f"prompt, batch 1, cpu")
    first = "no tp_plan"
    print_table(rows, [("world", "world", None), ("threads_per_rank", "threads/rank", None),
                       ("tok_s", "tokens/s", "{:.1f}"), ("ms_per_token", "ms/token", "{:.2f}"),
                       ("speed_vs_first", f"speed vs {first}", "{:.2f}x"),
                       ("lowbit_mb_per_rank", "low-bit MB/rank", "{:.2f}"),
                       ("lowbit_vs_first", f"vs {first}", "{:.3f}x"),
                       ("tensor_mb_per_rank", "all tensors MB/rank", "{:.2f}"),
                       ("rss_mb_per_rank", "RSS MB/rank", "{:.0f}"), ("load_s", "load s", "{:.2f}"),
                       ("same_tokens", "same tokens", None)])
    if args.json:
        write_json(args.json, rows, suite="distributed", args=vars(args), cores=cores)
    return 0


def _write_checkpoint(args, path):
    import transformers

    from .. import quantize_, save_quantized
    from .e2e import _config

    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                      intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                                      max_position_embeddings=args.prompt + args.tokens + 8, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # a trained-looking scale keeps the greedy decode away from inf/nan
        for prm in model.parameters():
            if prm.dim() == 2:
                prm.normal_(0, prm.shape[1] ** -0.5)
    save_quantized(quantize_(model.eval(), _config(args)), path)


def _launch(args, ckpt, world, threads, out, split=True):
    forwarded = [] if split else ["--no-tp-plan"]
    for name in ("prompt", "tokens", "repeat", "vocab"):
        forwarded += [f"--{name}", str(getattr(args, name))]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           "-m", "torch_lowbit.bench", "--suite", "distributed", *forwarded, "--rank-worker", ckpt, out]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    try:
        done = subprocess.run(cmd, env=env, timeout=args.timeout, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    except subprocess.TimeoutExpired:
        print(f"world {world}: torchrun did not finish within {args.timeout} s")
        return None
    paths = [f"{out}.rank{r}.json" for r in range(world)]
    written = [r for r, path in enumerate(paths) if os.path.exists(path)]
    if done.returncode != 0 or len(written) < world:
        # which ranks wrote their results tells a failure in the work from one in the process group's teardown
        print(f"world {world}: torchrun failed (exit code {done.returncode}; results written by ranks {written}):\n"
              f"{done.stdout[-4000:]}")
        return None
    ranks = []
    for path in paths:
        with open(path) as f:
            ranks.append(json.load(f))
    return ranks


def _rank_worker(args, ckpt, out) -> int:
    import torch.distributed as dist

    from .. import from_pretrained
    from ..distributed import lowbit_bytes
    from .e2e import _rss_bytes, _tensor_bytes

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    t0 = time.perf_counter()
    if args.no_tp_plan:
        dist.init_process_group("gloo")  # only for the rank number and the barrier below
    model = from_pretrained(ckpt, device="cpu", dtype=torch.bfloat16, tp_plan=None if args.no_tp_plan else "auto")
    load_s = time.perf_counter() - t0
    rank = dist.get_rank()
    prompt = torch.randint(0, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(0))

    def generate():
        return model.generate(prompt, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False)

    with torch.inference_mode():
        tokens = generate()[0, args.prompt:].tolist()
        t = median_time(generate, warmup=0, repeat=args.repeat)
    result = {"rank": rank, "tok_s": args.tokens / t, "tokens": tokens, "lowbit_bytes": lowbit_bytes(model),
              "tensor_bytes": _tensor_bytes(model), "rss_bytes": _rss_bytes(), "load_s": load_s}
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0
