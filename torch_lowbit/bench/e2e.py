"""End to end: a small generated Llama-style model is saved as an FP8 checkpoint (Hugging Face fine-grained FP8 or
compressed-tensors) in a temporary directory, loaded with ``torch_lowbit.formats.load_quantized`` into a model
built on the meta device, and decoded greedily. Reports decode tokens/s and resident weight memory against the
bf16 model, both measured in this run.

``python -m torch_lowbit.bench --suite e2e [--hidden 1024 --layers 4 ...]``
"""
import argparse
import json
import os
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

from .timing import median_time, print_table, sync, write_json


class _Attention(nn.Module):
    def __init__(self, H, heads):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(H, H, bias=False) for _ in range(4))

    def forward(self, x, cache, pos):
        B, S, H = x.shape
        q, k, v = (p(x).view(B, S, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        kc, vc = cache
        kc[:, :, pos:pos + S] = k
        vc[:, :, pos:pos + S] = v
        # no rotary embedding: it does not touch the weights this benchmark is about
        a = F.scaled_dot_product_attention(q, kc[:, :, :pos + S], vc[:, :, :pos + S], is_causal=S > 1)
        return self.o_proj(a.transpose(1, 2).reshape(B, S, H))


class _Layer(nn.Module):
    def __init__(self, H, I, heads):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(H, eps=1e-6)
        self.self_attn = _Attention(H, heads)
        self.post_attention_layernorm = nn.RMSNorm(H, eps=1e-6)
        self.mlp = nn.Module()
        self.mlp.gate_proj, self.mlp.up_proj = nn.Linear(H, I, bias=False), nn.Linear(H, I, bias=False)
        self.mlp.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x, cache, pos):
        x = x + self.self_attn(self.input_layernorm(x), cache, pos)
        h = self.post_attention_layernorm(x)
        m = self.mlp
        return x + m.down_proj(F.silu(m.gate_proj(h)) * m.up_proj(h))


class TinyLlama(nn.Module):
    """Llama-style decoder with Hugging Face module names and a preallocated KV cache."""

    def __init__(self, vocab, H, I, heads, layers):
        super().__init__()
        self.heads = heads
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, H)
        self.model.layers = nn.ModuleList(_Layer(H, I, heads) for _ in range(layers))
        self.model.norm = nn.RMSNorm(H, eps=1e-6)
        self.lm_head = nn.Linear(H, vocab, bias=False)

    def new_cache(self, B, max_len, dtype):
        H = self.model.embed_tokens.embedding_dim
        shape = (B, self.heads, max_len, H // self.heads)
        return [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in self.model.layers]

    def forward(self, ids, cache, pos):
        x = self.model.embed_tokens(ids)
        for layer, c in zip(self.model.layers, cache):
            x = layer(x, c, pos)
        return self.lm_head(self.model.norm(x[:, -1:]))


def _save_fp8(model, path, fmt):
    """Quantize every linear but lm_head and write a checkpoint directory in format `fmt`."""
    from safetensors.torch import save_file

    from ..nn.experts import quantize_fp8

    sd = {}
    for name, t in model.state_dict().items():
        owner = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and isinstance(model.get_submodule(owner), nn.Linear) and owner != "lm_head":
            if fmt == "fp8":
                q, s = quantize_fp8(t, "block", (128, 128))
                sd[name], sd[f"{owner}.weight_scale_inv"] = q, s
            else:
                q, s = quantize_fp8(t, "channel")
                sd[name], sd[f"{owner}.weight_scale"] = q, s[:, None].to(torch.bfloat16)
        else:
            sd[name] = t.to(torch.bfloat16)
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(path, "model.safetensors"))
    if fmt == "fp8":
        qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
              "modules_to_not_convert": ["lm_head"]}
    else:
        qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                  "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}}}}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "quantization_config": qc}, f)


def _weight_bytes(model):
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def _decode(model, prompt, tokens, dtype):
    cache = model.new_cache(prompt.shape[0], prompt.shape[1] + tokens, dtype)
    logits = model(prompt, cache, 0)
    pos = prompt.shape[1]
    out = []
    for _ in range(tokens):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        out.append(nxt)
        logits = model(nxt, cache, pos)
        pos += 1
    return torch.cat(out, dim=1)


def run(argv) -> int:
    p = argparse.ArgumentParser(prog="python -m torch_lowbit.bench --suite e2e", description=__doc__.split("\n\n")[0])
    p.add_argument("--format", choices=["fp8", "compressed-tensors"], default="fp8",
                   help="checkpoint format: HF fine-grained FP8 (128x128 blocks) or compressed-tensors per channel")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--prompt", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32, help="decoded tokens per timed run")
    p.add_argument("--repeat", type=int, default=3)
    # one thread by default: on a shared 2-core box, every OpenMP region of a multi-threaded decode step waits
    # for a descheduled thread (~11 ms per op measured), which swamps the weight traffic being compared
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from ..formats import load_quantized

    torch.manual_seed(0)
    dtype = torch.bfloat16
    dims = (args.vocab, args.hidden, args.intermediate, args.heads, args.layers)
    dense = TinyLlama(*dims)
    for m in dense.modules():  # a trained-looking scale: keeps the greedy decode away from inf/nan
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=m.in_features ** -0.5)
    dense = dense.to(dtype).eval()
    prompt = torch.randint(0, args.vocab, (1, args.prompt))

    with tempfile.TemporaryDirectory() as tmp:
        _save_fp8(dense, tmp, args.format)
        ckpt_bytes = sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp))
        with torch.device("meta"):
            quant = TinyLlama(*dims)
        t0 = time.perf_counter()
        report = load_quantized(quant, tmp, dtype=dtype)
        load_s = time.perf_counter() - t0
    quant.eval()

    rows = []
    with torch.inference_mode():
        same = torch.equal(_decode(dense, prompt, args.tokens, dtype), _decode(quant, prompt, args.tokens, dtype))
        for name, model in (("bf16", dense), (f"fp8 ({report.format})", quant)):
            t = median_time(lambda: _decode(model, prompt, args.tokens, dtype), warmup=1, repeat=args.repeat)
            sync("cpu")
            rows.append({"model": name, "weights_mb": _weight_bytes(model) / 2 ** 20,
                         "tok_s": args.tokens / t, "ms_per_token": 1e3 * t / args.tokens})
    base = rows[0]
    for r in rows:
        r["speed_vs_bf16"] = r["tok_s"] / base["tok_s"]
        r["memory_vs_bf16"] = r["weights_mb"] / base["weights_mb"]

    print(f"e2e: {args.layers} layers, hidden {args.hidden}, intermediate {args.intermediate}, vocab {args.vocab}; "
          f"checkpoint {ckpt_bytes / 2 ** 20:.1f} MB ({report.format}), loaded in {load_s:.2f} s; "
          f"{len(report.converted)} layers converted, {len(report.high_precision)} kept high precision; "
          f"decode {args.tokens} tokens after a {args.prompt}-token prompt, batch 1, "
          f"{torch.get_num_threads()} threads")
    print_table(rows, [("model", "model", None), ("weights_mb", "weights MB", "{:.1f}"),
                       ("memory_vs_bf16", "mem vs bf16", "{:.2f}x"), ("tok_s", "tokens/s", "{:.1f}"),
                       ("ms_per_token", "ms/token", "{:.2f}"), ("speed_vs_bf16", "speed vs bf16", "{:.2f}x")])
    print(f"greedy tokens identical to bf16: {same} (FP8 rounding may change a near-tie)")
    if report.unused_keys or report.missing_keys:
        print(f"load report: {report}")
    if args.json:
        write_json(args.json, rows, suite="e2e", args=vars(args), load_s=load_s, checkpoint_bytes=ckpt_bytes,
                   same_tokens=same)
    return 0
