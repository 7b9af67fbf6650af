"""LoRA fine-tuning on frozen low-bit bases: one training step (forward, backward, AdamW on the adapters) of one
Llama-3-8B decoder layer's linear layers, with FP8 (per channel), INT8 (W8A8) and 4-bit (W4A16, QLoRA: NVFP4,
MXFP4, INT4 per 128, MLX-affine UINT4 per 64) bases against the bf16 base.

The layer: RMSNorm, q/k/v projections, causal grouped-query attention (32 query heads, 8 KV heads of 128), o
projection with the residual, RMSNorm, the SwiGLU MLP (gate, up, down) with the residual. LoRA (PEFT, through
torch_lowbit.peft.register) of rank --rank on all seven linears; bf16 activations, batch x sequence tokens.

Columns: step / forward / backward / optimizer time (median ms over the timed steps), step_vs_bf16 = step time /
the bf16 base's, weights MB (base weights and scales) and its ratio to bf16, adapters + AdamW state MB.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..nn import Fp8Linear, Int8Linear, W4Linear
from .layer import LLAMA3_8B, W4_MODES, best_device, log, quantized, weight_bytes
from .timing import print_table, sync, write_json

HEADS, KV_HEADS = 32, 8
MODES = ("bf16", "fp8", "int8", *W4_MODES)


def _shape(name):
    for names, N, K, _ in LLAMA3_8B:
        if name in names.split(","):
            return N, K
    raise KeyError(name)


class DecoderLinears(nn.Module):
    """One decoder layer: RMSNorm, the seven linears in their data flow, attention in between."""

    def __init__(self, make):
        super().__init__()
        H = _shape("q_proj")[1]
        self.input_norm = nn.Parameter(torch.ones(H, dtype=torch.bfloat16), requires_grad=False)
        self.post_attention_norm = nn.Parameter(torch.ones(H, dtype=torch.bfloat16), requires_grad=False)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            N, K = _shape(name)
            setattr(self, name, make(K, N))

    def forward(self, h):
        B, S, H = h.shape
        x = F.rms_norm(h, (H,), self.input_norm)
        q = self.q_proj(x).view(B, S, HEADS, -1).transpose(1, 2)
        k = self.k_proj(x).view(B, S, KV_HEADS, -1).transpose(1, 2).repeat_interleave(HEADS // KV_HEADS, dim=1)
        v = self.v_proj(x).view(B, S, KV_HEADS, -1).transpose(1, 2).repeat_interleave(HEADS // KV_HEADS, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, S, -1)
        h = h + self.o_proj(a)
        x = F.rms_norm(h, (H,), self.post_attention_norm)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def build(mode, device, gen):
    def make(K, N):
        lin = nn.Linear(K, N, bias=False, dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.normal_(0, 0.02, generator=gen)
        lin.weight.requires_grad_(False)
        return lin if mode == "bf16" else quantized(mode, lin)
    return DecoderLinears(make).to(device)


def with_lora(model, rank):
    import peft

    from ..peft import register
    config = register(peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, init_lora_weights=False,
                                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                      "down_proj"]))
    return peft.get_peft_model(model, config)


def base_bytes(model):
    """Bytes of the base layers' weights and scales (the adapters' own linears excluded)."""
    return sum(weight_bytes(m) for name, m in model.named_modules()
               if isinstance(m, (nn.Linear, Fp8Linear, Int8Linear, W4Linear)) and "lora_" not in name)


def state_bytes(params, opt):
    n = sum(p.numel() * p.element_size() for p in params)
    for st in opt.state.values():
        n += sum(t.numel() * t.element_size() for t in st.values() if isinstance(t, torch.Tensor))
    return n


def measure(mode, args, gen):
    model = with_lora(build(mode, args.device, gen), args.rank)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    x = torch.randn(args.batch, args.tokens // args.batch, _shape("q_proj")[1], generator=gen).to(
        device=args.device, dtype=torch.bfloat16)
    phases = {"fwd": [], "bwd": [], "opt": []}
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        loss = model(x).float().square().mean()
        sync(args.device)
        t1 = time.perf_counter()
        loss.backward()
        sync(args.device)
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(args.device)
        t3 = time.perf_counter()
        if i >= args.warmup:
            for k, t in zip(phases, (t1 - t0, t2 - t1, t3 - t2)):
                phases[k].append(t)
    row = {"mode": mode, **{f"{k}_ms": 1e3 * statistics.median(v) for k, v in phases.items()}}
    row["step_ms"] = 1e3 * statistics.median([sum(s) for s in zip(*phases.values())])
    row["weights_mb"] = base_bytes(model) / 2 ** 20
    row["train_state_mb"] = state_bytes(params, opt) / 2 ** 20
    return row


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m torch_lowbit.bench --suite train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cpu or mps (default: mps if available, else cpu)")
    p.add_argument("--tokens", type=int, default=512, help="batch x sequence tokens per step (default 512)")
    p.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per base (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated bases (default {','.join(MODES)})")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    a = p.parse_args(argv)
    a.device = a.device or best_device()
    a.modes = a.modes.split(",")
    if any(m not in MODES for m in a.modes) or "bf16" not in a.modes:
        p.error(f"--modes must be among {MODES} and include bf16 (the baseline), got {a.modes}")
    for name in ("tokens", "batch", "rank", "steps"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be >= 1")
    if a.tokens % a.batch:
        p.error(f"--tokens ({a.tokens}) must be a multiple of --batch ({a.batch})")
    return a


def run(argv) -> int:
    args = parse(argv)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for mode in args.modes:
        log(f"[{mode}] LoRA step, {args.tokens} tokens, rank {args.rank}, on {args.device}")
        rows.append(measure(mode, args, gen))
    base = next(r for r in rows if r["mode"] == "bf16")
    for r in rows:
        r["step_vs_bf16"] = r["step_ms"] / base["step_ms"]
        r["weights_vs_bf16"] = r["weights_mb"] / base["weights_mb"]
    print(f"LoRA training step, one Llama-3-8B decoder layer's linears, {args.tokens} tokens, rank {args.rank}, "
          f"{args.device}, {torch.get_num_threads()} threads")
    print_table(rows, [("mode", "base", None), ("step_ms", "step ms", "{:.1f}"), ("fwd_ms", "fwd ms", "{:.1f}"),
                       ("bwd_ms", "bwd ms", "{:.1f}"), ("opt_ms", "opt ms", "{:.1f}"),
                       ("step_vs_bf16", "step / bf16", "{:.2f}x"), ("weights_mb", "weights MB", "{:.0f}"),
                       ("weights_vs_bf16", "weights / bf16", "{:.2f}x"),
                       ("train_state_mb", "adapters+AdamW MB", "{:.1f}")])
    if args.json:
        write_json(args.json, rows, device=args.device, tokens=args.tokens, rank=args.rank,
                   threads=torch.get_num_threads())
    return 0
