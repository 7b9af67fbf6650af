"""The rank side of tests/test_tensor_parallel.py: real process groups (gloo over a file store), no mocked
collectives. :func:`launch` starts `world` processes running :func:`_rank_main` (forked: no re-import of torch and
transformers per rank; each rank runs one torch thread), waits at most `timeout` seconds, kills what is left and
returns each rank's results (or raises, with the failing rank's traceback)."""
import os
import pickle
import sys
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPT = torch.tensor([[3, 17, 42, 99, 7, 64, 21, 5]])
NEW_TOKENS = 6


def tp_model(path, **kw):
    import torch_lowbit

    return torch_lowbit.from_pretrained(path, device="cpu", dtype=torch.float32, **kw)


W4_OPTIONS = {"int4": {"group_size": 16}}  # groups that split over 4 ranks of the tiny models' K


def hf_model(path, weights, **kw):
    """transformers' from_pretrained of a dense checkpoint with TorchLowbitConfig(weights)."""
    import transformers

    import torch_lowbit

    if "tp_plan" in kw:  # transformers' current spelling of from_pretrained(..., tp_plan=...)
        kw["distributed_config"] = transformers.DistributedConfig(tp_plan=kw.pop("tp_plan"))
    config = torch_lowbit.TorchLowbitConfig(weights, **W4_OPTIONS.get(weights, {}))
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=config,
                                                             **kw).eval()


def run_model(model):
    """(logits of PROMPT [1, S, V], greedy tokens) of a loaded model."""
    with torch.no_grad():
        logits = model(PROMPT).logits
        out = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=0)
    return logits, out[0, PROMPT.shape[1]:]


def _shared_quantize_case(rank, world):
    """shared_int8_quantize of rows split over the ranks vs int8_quantize of the whole rows (the same on every
    rank: seeded), with zero, NaN, +-inf and tiny rows, and a NaN that only one rank holds."""
    import torch_lowbit
    from torch.distributed.device_mesh import init_device_mesh
    from torch_lowbit.distributed.styles import shared_int8_quantize

    g = torch.Generator().manual_seed(7)
    x = torch.randn(7, 16 * world, generator=g) * torch.logspace(-3, 3, 7)[:, None]
    x[1] = 0
    x[2, -1] = float("nan")  # held by the last rank only
    x[3, 0] = float("inf")   # held by rank 0 only
    x[4, 5] = -float("inf")
    x[5] = 1e-40  # denormal row
    mesh = init_device_mesh("cpu", (world,))
    k = x.shape[1] // world
    q, s = shared_int8_quantize(x[:, rank * k:(rank + 1) * k], mesh)
    q_ref, s_ref = torch_lowbit.int8_quantize(x)
    return {"q": q, "s": s, "q_ref": q_ref[:, rank * k:(rank + 1) * k], "s_ref": s_ref}


def _rank_main(rank, world, store_path, cases, out_dir):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    sys.path.insert(0, HERE)
    # what torchrun sets: transformers sizes its tensor-parallel mesh from WORLD_SIZE
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    result = {}
    try:
        import torch.distributed as dist

        import torch_lowbit
        from torch_lowbit.distributed import lowbit_bytes

        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world,
                                timeout=__import__("datetime").timedelta(seconds=60))
        for name, (kind, path) in cases.items():
            if kind == "model":
                model, report = tp_model(path, tp_plan="auto", return_report=True)
                logits, tokens = run_model(model)
                result[name] = {"logits": logits, "tokens": tokens, "lowbit_bytes": lowbit_bytes(model),
                                "tp": report.details["tensor_parallel"],
                                "lm_head_bytes": model.lm_head.weight.to_local().untyped_storage().nbytes()}
                if rank == 0 and "save_refused" not in result:
                    try:
                        torch_lowbit.save_quantized(model, os.path.join(out_dir, "never"))
                        result["save_refused"] = None
                    except ValueError as e:
                        result["save_refused"] = (str(e), os.path.exists(os.path.join(out_dir, "never")))
            elif kind.startswith("hf-"):  # transformers' own from_pretrained of a dense checkpoint
                model = hf_model(path, kind[3:], tp_plan="auto")
                logits, tokens = run_model(model)
                result[name] = {"logits": logits, "tokens": tokens, "lowbit_bytes": lowbit_bytes(model)}
            elif kind == "refused":
                try:
                    tp_model(path, tp_plan="auto")
                    result[name] = {"error": None}
                except ValueError as e:
                    result[name] = {"error": f"{type(e).__name__}: {e}"}
            elif kind == "shared_quantize":
                result[name] = _shared_quantize_case(rank, world)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        result = {"traceback": traceback.format_exc()}
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def launch(world, cases, timeout=120.0, start_method="fork"):
    """Run `cases` ({name: (kind, checkpoint path)}) on `world` ranks; returns [rank 0's results, rank 1's, ...]."""
    out_dir = tempfile.mkdtemp(prefix="tp-")
    store = os.path.join(out_dir, "store")
    ctx = mp.get_context(start_method)
    procs = [ctx.Process(target=_rank_main, args=(r, world, store, cases, out_dir)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join()
    results = []
    for r in range(world):
        path = os.path.join(out_dir, f"rank{r}.pkl")
        if not os.path.exists(path):
            raise AssertionError(f"rank {r} of {world} left no result (exit code {procs[r].exitcode}"
                                 f"{', killed after the time limit' if r in hung else ''})")
        with open(path, "rb") as f:
            res = pickle.load(f)
        if "traceback" in res:
            raise AssertionError(f"rank {r} of {world} failed:\n{res['traceback']}")
        results.append(res)
    if hung:
        raise AssertionError(f"ranks {hung} of {world} did not finish within {timeout} s")
    return results
