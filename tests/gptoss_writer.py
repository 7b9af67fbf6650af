"""Tiny gpt-oss MXFP4 checkpoints written by the published layout (openai/gpt-oss-20b's safetensors): no library
writes it on CPU. A small random GptOssForCausalLM in bf16 whose experts are quantized to MXFP4 and stored as
``{p}_blocks`` uint8 ``[E, rows, cols/32, 16]`` (32 E2M1 codes per 16 bytes, even one low), ``{p}_scales`` uint8
E8M0 ``[E, rows, cols/32]`` and ``{p}_bias`` bf16, with ``quantization_config: {quant_method: mxfp4,
modules_to_not_convert: [...]}`` (the published list)."""
from __future__ import annotations

import json
import os

import torch

# what openai/gpt-oss-20b's config.json keeps unconverted
MODULES_TO_NOT_CONVERT = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def tiny_config(layers: int = 2, experts: int = 4, hidden: int = 64, intermediate: int = 64, top_k: int = 2):
    from transformers import GptOssConfig

    return GptOssConfig(vocab_size=96, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=experts,
                        num_experts_per_tok=top_k, sliding_window=8, max_position_embeddings=131072,
                        tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=2)


def e8m0_e2m1(w: torch.Tensor):
    """Own MXFP4 quantizer (OCP: shared exponent floor(log2(amax)) - 2 per 32 values, values rounded to the nearest
    E2M1, saturating at 6): ``w [rows, cols]`` -> (codes uint8 [rows, cols] with sign bit 8, scales uint8 [rows,
    cols/32])."""
    rows, cols = w.shape
    g = w.float().reshape(rows, cols // 32, 32)
    amax = g.abs().amax(-1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.zeros_like(amax)).clamp(-127, 127)
    ratio = g / torch.pow(2.0, exp)[..., None]
    table = torch.tensor(E2M1)
    mag = (ratio.abs().clamp(max=6.0)[..., None] - table).abs().argmin(-1)
    codes = mag + 8 * (ratio < 0).to(mag.dtype) * (mag > 0).to(mag.dtype)
    return codes.reshape(rows, cols).to(torch.uint8), (exp + 127).to(torch.uint8)


def to_blocks(codes: torch.Tensor) -> torch.Tensor:
    """codes [rows, cols] -> uint8 [rows, cols/32, 16]: two per byte, the even column in the low nibble."""
    rows, cols = codes.shape
    pairs = codes.reshape(rows, cols // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).reshape(rows, cols // 32, 16)


def write_gptoss_checkpoint(path: str, *, seed: int = 0, expert_std: float = 0.35, **config_kw) -> dict:
    """Write a tiny gpt-oss MXFP4 checkpoint to directory `path`; returns the tensors written."""
    from safetensors.torch import save_file
    from transformers import GptOssForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(**config_kw)
    model = GptOssForCausalLM(cfg).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for k, v in model.state_dict().items():
        if ".mlp.experts." in k:
            continue
        t = torch.randn(v.shape, generator=gen) * 0.1 if v.is_floating_point() else v
        if k.endswith("norm.weight"):
            t = 1 + t
        tensors[k] = t.to(torch.bfloat16).contiguous()
    E, H, I = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts"
        for proj, rows, cols in (("gate_up_proj", 2 * I, H), ("down_proj", H, I)):
            w = (torch.randn(E, rows, cols, generator=gen) * expert_std).to(torch.bfloat16)
            parts = [e8m0_e2m1(w[e]) for e in range(E)]
            tensors[f"{p}.{proj}_blocks"] = torch.stack([to_blocks(c) for c, _ in parts]).contiguous()
            tensors[f"{p}.{proj}_scales"] = torch.stack([s for _, s in parts]).contiguous()
            tensors[f"{p}.{proj}_bias"] = (torch.randn(E, rows, generator=gen) * 0.5).to(torch.bfloat16)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config = cfg.to_dict()
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    config["architectures"] = ["GptOssForCausalLM"]
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": MODULES_TO_NOT_CONVERT}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return tensors
