"""End to end with a real transformers model: a locally built Llama (random weights, tiny but not trivial) in
bf16 is quantized with ``quantize_``, written with ``save_quantized`` (compressed-tensors), loaded back with
``torch_lowbit.from_pretrained`` and decoded greedily with ``model.generate``. Reports tokens/s and resident
memory (the model's tensors, and the process's RSS growth while building / loading it) against the same model in
bf16, both measured in this run.

``python -m torch_lowbit.bench --suite e2e [--scheme fp8-channel|fp8-block|int8 --hidden 1024 --layers 4 ...]``
Needs transformers (``pip install 'torch_lowbit[hf]'``).
"""
import argparse
import contextlib
import copy
import gc
import os
import sys
import tempfile
import time

import torch

from .._progress import ENV as PROGRESS_ENV
from .timing import median_time, print_table, write_json

SCHEMES = ("fp8-channel", "fp8-block", "int8")


def _rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _tensor_bytes(model) -> int:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _stage(what: str):
    """Where the suite is, on stderr (the results go to stdout)."""
    print(f"e2e: {what}", file=sys.stderr, flush=True)


def _config(args):
    from ..quantize import Fp8WeightOnly, Int8Dynamic

    return {"fp8-channel": Fp8WeightOnly("channel"), "fp8-block": Fp8WeightOnly("block", (128, 128)),
            "int8": Int8Dynamic()}[args.scheme]


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The scheme and the small Llama's sizes a generated checkpoint has, and the generate run timed (shared by
    the suites that write one: e2e, distributed)."""
    p.add_argument("--scheme", choices=SCHEMES, default="fp8-channel", help="quantize_ config written to the checkpoint")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--prompt", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32, help="generated tokens per timed run")
    p.add_argument("--repeat", type=int, default=3)


def run(argv) -> int:
    p = argparse.ArgumentParser(prog="python -m torch_lowbit.bench --suite e2e", description=__doc__.split("\n\n")[0])
    add_model_args(p)
    # torch's default, as a user's generate runs (and as the other suites run); on a shared, oversubscribed box
    # pass --threads 1: there every OpenMP region of a decode step waits for a descheduled thread
    p.add_argument("--threads", type=int, default=0, help="torch threads (default 0: torch's default)")
    p.add_argument("--device", default=None, help="default: mps if available, else cpu")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    _stage(f"{torch.get_num_threads()} torch threads ({'--threads' if args.threads else 'torch default'}; "
           f"--threads N to pin)")
    with _progress_lines():
        return _run(args)


@contextlib.contextmanager
def _progress_lines():
    """from_pretrained / quantize_ / save_quantized report as they go (unless TORCH_LOWBIT_PROGRESS says not)."""
    before = os.environ.get(PROGRESS_ENV)
    os.environ.setdefault(PROGRESS_ENV, "1")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(PROGRESS_ENV, None)


def _run(args) -> int:
    try:
        import transformers
    except ImportError:
        print("the e2e suite needs transformers: pip install 'torch_lowbit[hf]'")
        return 1
    from .. import from_pretrained, quantize_, save_quantized
    from ..hf import best_device

    device = torch.device(args.device) if args.device else best_device()
    dtype = torch.bfloat16
    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                      intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                                      max_position_embeddings=args.prompt + args.tokens + 8, tie_word_embeddings=False)
    torch.manual_seed(0)
    # a throwaway build first: transformers' lazy imports and the allocator's first arenas do not count below
    transformers.LlamaForCausalLM._from_config(transformers.LlamaConfig(
        vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1), dtype=dtype)
    gc.collect()
    _stage("building the bf16 model")
    rss0 = _rss_bytes()
    dense = transformers.LlamaForCausalLM._from_config(config, dtype=dtype)
    with torch.no_grad():  # a trained-looking scale keeps the greedy decode away from inf/nan
        for prm in dense.parameters():
            if prm.dim() == 2:
                prm.normal_(0, prm.shape[1] ** -0.5)
    dense = dense.to(device).eval()
    prompt = torch.randint(0, args.vocab, (1, args.prompt), device=device)

    def generate(model):
        return model.generate(prompt, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False)

    # resident memory is measured after one generate: loaded weights may be file pages mapped in lazily, which
    # count once the model has read them
    with torch.inference_mode():
        dense_tokens = generate(dense)
    dense_rss = _rss_bytes() - rss0

    with tempfile.TemporaryDirectory() as tmp:
        _stage(f"quantizing ({args.scheme}) and saving")
        save_quantized(quantize_(copy.deepcopy(dense), _config(args)), tmp)
        ckpt_bytes = sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp))
        gc.collect()
        rss1 = _rss_bytes()
        _stage("loading with from_pretrained")
        t0 = time.perf_counter()
        quant, report = from_pretrained(tmp, device=device, dtype=dtype, return_report=True)
        load_s = time.perf_counter() - t0
        with torch.inference_mode():
            same = torch.equal(dense_tokens, generate(quant))
        quant_rss = _rss_bytes() - rss1

    rows = []
    with torch.inference_mode():
        for name, model, rss in (("bf16", dense, dense_rss), (f"{args.scheme} (torch_lowbit)", quant, quant_rss)):
            _stage(f"timing generate: {name}, {args.repeat} runs of {args.tokens} tokens")
            t = median_time(lambda: generate(model), device=device.type, warmup=1, repeat=args.repeat)
            rows.append({"model": name, "weights_mb": _tensor_bytes(model) / 2 ** 20, "rss_mb": rss / 2 ** 20,
                         "tok_s": args.tokens / t, "ms_per_token": 1e3 * t / args.tokens})
    base = rows[0]
    for r in rows:
        r["speed_vs_bf16"] = r["tok_s"] / base["tok_s"]
        r["memory_vs_bf16"] = r["weights_mb"] / base["weights_mb"]

    print(f"e2e: LlamaForCausalLM, {args.layers} layers, hidden {args.hidden}, intermediate {args.intermediate}, "
          f"vocab {args.vocab}; checkpoint {ckpt_bytes / 2 ** 20:.1f} MB (compressed-tensors, {args.scheme}), "
          f"from_pretrained in {load_s:.2f} s; {len(report.converted)} layers converted, "
          f"{len(report.high_precision)} kept high precision; generate {args.tokens} tokens after a "
          f"{args.prompt}-token prompt, batch 1, {device.type}, {torch.get_num_threads()} threads")
    print_table(rows, [("model", "model", None), ("weights_mb", "weights MB", "{:.1f}"),
                       ("memory_vs_bf16", "mem vs bf16", "{:.2f}x"), ("rss_mb", "RSS growth MB", "{:.1f}"),
                       ("tok_s", "tokens/s", "{:.1f}"), ("ms_per_token", "ms/token", "{:.2f}"),
                       ("speed_vs_bf16", "speed vs bf16", "{:.2f}x")])
    print(f"greedy tokens identical to bf16: {same} (quantization may change a near-tie)")
    if args.json:
        write_json(args.json, rows, suite="e2e", args=vars(args), load_s=load_s, checkpoint_bytes=ckpt_bytes,
                   same_tokens=same)
    return 0
