"""M5 tensor-op kernels vs the portable ones: ``python -m torch_lowbit.bench --suite m5``.

On an Apple M5 (mps device, the lowbit_apple10 library loaded) times int8_mm, fp8_mm and w4_mm (int4 per 128
with zero points, and nvfp4; bf16 activations) at prefill shapes with the tensor-op kernels, and again with
``TORCH_LOWBIT_NO_MPP=1`` (the plans read it at each call), and prints both times, the ratio and Tops/s; the
outputs of the two paths are compared first (int8: the same bits; fp8 and 4-bit: within fp32 accumulation
error). Shapes: the seed's FLUX.2-like projection / MLP shapes (4096 tokens, hidden 3072, MLP 12288; the seed
claims 1.5-1.9x for int8 there) and a Llama-3-8B prefill (M = 512). ``--device emu`` runs the same comparison
through the emulator under an M5's device caps, on the shapes given by ``--shapes`` (times there mean nothing;
CI uses it to check the suite). Elsewhere it says why it skips.
"""
import argparse
import contextlib
import os

import torch

from .timing import median_time, print_table

FLUX2 = [(4096, 3072, 3072), (4096, 3072, 12288), (4096, 12288, 3072)]  # (M, K, N): qkv/proj, MLP up, MLP down
LLAMA3_8B_PREFILL = [(512, 4096, 4096), (512, 4096, 14336), (512, 14336, 4096)]
NO_MPP = "TORCH_LOWBIT_NO_MPP"


@contextlib.contextmanager
def _portable():
    before = os.environ.get(NO_MPP)
    os.environ[NO_MPP] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[NO_MPP]
        else:
            os.environ[NO_MPP] = before


def _calls(device, M, K, N, gen):
    """(name, fn) of the op calls at one shape on `device` ("mps" or "emu")."""
    ops = torch.ops.lowbit_emu if device == "emu" else torch.ops.lowbit
    dev = "cpu" if device == "emu" else device
    xq = torch.randint(-127, 128, (M, K), dtype=torch.int8, generator=gen).to(dev)
    wq = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=gen).to(dev)
    xs, ws = (torch.rand(M, generator=gen) * 0.01).to(dev), (torch.rand(N, generator=gen) * 0.01).to(dev)
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16).to(dev)
    bits = torch.randint(0, 256, (N, K), dtype=torch.uint8, generator=gen)
    bits[(bits & 0x7F) == 0x7F] = 0x38
    bits, scale = bits.to(dev), (torch.rand(N, generator=gen) + 0.5).to(dev)
    # 4-bit: int4 per 128 with bf16 scales and zero points (GPTQ / compressed-tensors), nvfp4 (decoded weights)
    codes = torch.randint(0, 256, (N, (K + 1) // 2), dtype=torch.uint8, generator=gen).to(dev)
    g128, g16 = -(-K // 128), -(-K // 16)
    s128 = ((torch.rand(N, g128, generator=gen) + 0.5) * 0.01).to(torch.bfloat16).to(dev)
    zp = torch.randint(-4, 5, (N, g128), dtype=torch.int8, generator=gen).to(dev)
    s16, gscale = torch.randint(0x28, 0x48, (N, g16), dtype=torch.uint8, generator=gen).to(dev), torch.ones(1).to(dev)
    return [("int8_mm", lambda: ops.int8_mm(xq, xs, wq, ws, None, torch.bfloat16)),
            ("fp8_mm bf16", lambda: ops.fp8_mm(x, bits, scale, None, None)),
            ("w4_mm int4 g128 bf16", lambda: ops.w4_mm(x, codes, s128, "int4", 128, zp, None, None)),
            ("w4_mm nvfp4 bf16", lambda: ops.w4_mm(x, codes, s16, "nvfp4", 16, None, gscale, None))]


def run(argv) -> int:
    p = argparse.ArgumentParser(prog="python -m torch_lowbit.bench --suite m5", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="mps", choices=["mps", "emu"])
    p.add_argument("--shapes", default="", help="M,K,N;M,K,N;... (default: the FLUX.2-like and Llama-3-8B sets)")
    p.add_argument("--repeat", type=int, default=10)
    a = p.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split(",")) for s in a.shapes.split(";") if s] or FLUX2 + LLAMA3_8B_PREFILL
    from .. import _C, emulator
    caps = contextlib.nullcontext()
    if a.device == "mps":
        info = _C._mps_info() if torch.backends.mps.is_available() else None
        if info is None or info["msl_version"] < 400:
            why = "no mps device" if info is None else "; ".join(info["libraries"])
            print(f"m5: skipped: the M5 tensor-op kernels do not run here ({why})")
            return 0
    else:
        if not emulator.available():
            print("m5: skipped: the Metal emulator is not built in this install")
            return 0
        caps = emulator.device_caps(apple_family=10, msl_version=400)
    gen = torch.Generator().manual_seed(0)
    rows = []
    with caps:
        for M, K, N in shapes:
            for name, fn in _calls(a.device, M, K, N, gen):
                fast = fn().float().cpu()
                with _portable():
                    ref = fn().float().cpu()
                    t_portable = median_time(fn, a.device, repeat=a.repeat)
                if name == "int8_mm":
                    same = torch.equal(fast, ref)
                else:
                    same = bool(((fast - ref).abs() <= 1e-2 * ref.abs() + 1e-2 * ref.abs().max()).all())
                t_m5 = median_time(fn, a.device, repeat=a.repeat)
                ops = 2.0 * M * K * N
                rows.append(dict(op=name, shape=f"{M}x{K}x{N}", m5_ms=t_m5 * 1e3, portable_ms=t_portable * 1e3,
                                 speedup=t_portable / t_m5, tops=ops / t_m5 / 1e12, agree="yes" if same else "NO"))
    print_table(rows, [("op", "op", None), ("shape", "M x K x N", None), ("m5_ms", "M5 ms", "{:.3f}"),
                       ("portable_ms", "portable ms", "{:.3f}"), ("speedup", "portable / M5", "{:.2f}"),
                       ("tops", "M5 Tops/s", "{:.2f}"), ("agree", "same result", None)])
    return 0 if all(r["agree"] == "yes" for r in rows) else 1
