"""Tiny Llama-style and Qwen3-MoE-style models for the checkpoint tests, and helpers that write checkpoints.

The dense experts module follows transformers >= 5 (``Qwen3MoeExperts``): stacked ``gate_up_proj [E, 2I, H]`` and
``down_proj [E, H, I]``, ``forward(hidden, top_k_index, top_k_weights)``; its forward is a plain per-expert loop
that serves as the float64 reference.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from reference import fp8_bits_to_f64


class RMSNorm(nn.Module):
    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        xf = x.float() if x.dtype != torch.float64 else x
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.to(y.dtype)).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, H, heads):
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(H, H, bias=True)  # Qwen2-style qkv bias: exercises bias loading
        self.k_proj = nn.Linear(H, H, bias=True)
        self.v_proj = nn.Linear(H, H, bias=True)
        self.o_proj = nn.Linear(H, H, bias=False)

    def forward(self, x):
        B, S, H = x.shape
        q, k, v = (p(x).view(B, S, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(a.transpose(1, 2).reshape(B, S, H))


class MLP(nn.Module):
    def __init__(self, H, I):
        super().__init__()
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DenseExperts(nn.Module):
    def __init__(self, E, H, I):
        super().__init__()
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, H) / math.sqrt(H))
        self.down_proj = nn.Parameter(torch.randn(E, H, I) / math.sqrt(I))
        self.act_fn = nn.SiLU()

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            tok, slot = torch.where(top_k_index == e)
            if tok.numel() == 0:
                continue
            gate, up = (x[tok] @ self.gate_up_proj[e].T).chunk(2, dim=-1)
            y = (self.act_fn(gate) * up) @ self.down_proj[e].T
            out.index_add_(0, tok, y * top_k_weights[tok, slot, None].to(y.dtype))
        return out


class MoEBlock(nn.Module):
    def __init__(self, H, I, E, top_k):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(H, E, bias=False)  # the router: never quantized
        self.experts = DenseExperts(E, H, I)

    def forward(self, x):
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        probs = F.softmax(self.gate(h).double(), dim=-1)
        w, ids = probs.topk(self.top_k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        return self.experts(h, ids, w.to(h.dtype)).reshape(shape)


class Layer(nn.Module):
    def __init__(self, H, I, heads, moe=None):
        super().__init__()
        self.input_layernorm = RMSNorm(H)
        self.self_attn = Attention(H, heads)
        self.post_attention_layernorm = RMSNorm(H)
        self.mlp = MLP(H, I) if moe is None else MoEBlock(H, I, *moe)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Inner(nn.Module):
    def __init__(self, V, H, I, heads, layers, moe):
        super().__init__()
        self.embed_tokens = nn.Embedding(V, H)
        self.layers = nn.ModuleList(Layer(H, I, heads, moe) for _ in range(layers))
        self.norm = RMSNorm(H)


class TinyLM(nn.Module):
    """Llama-style (moe=None) or Qwen3-MoE-style (moe=(num_experts, top_k)) causal LM, HF module names."""

    def __init__(self, V=97, H=48, I=80, heads=4, layers=2, moe=None):
        super().__init__()
        self.model = Inner(V, H, I, heads, layers, moe)
        self.lm_head = nn.Linear(H, V, bias=False)

    def forward(self, ids):
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))


def linear_names(model):
    return [n for n, m in model.named_modules() if type(m) is nn.Linear]


# ------------------------------------------------------------------------------------------ quantized tensors
def small_fp8_bits(shape, g):
    """e4m3 codes of magnitude < 2 (exponent field <= 7) with random signs: keeps activations tame."""
    sign = torch.randint(0, 2, shape, generator=g, dtype=torch.uint8) << 7
    exp = torch.randint(0, 8, shape, generator=g, dtype=torch.uint8) << 3
    man = torch.randint(0, 8, shape, generator=g, dtype=torch.uint8)
    return sign | exp | man


def make_scale(kind, N, K, g, block=None, base=0.03):
    """A random canonical fp32 scale: per tensor [1], per channel [N], per block [ceil(N/bn), ceil(K/bk)]."""
    shape = {"tensor": (1,), "channel": (N,)}.get(kind) or (math.ceil(N / block[0]), math.ceil(K / block[1]))
    return torch.rand(shape, generator=g) * base + base


def expand_scale(scale, kind, N, K, block=None):
    """The [N, K] float64 multiplier of each weight element, from the layouts' definitions (not torch_lowbit's)."""
    s = scale.double()
    if kind == "block":
        bn, bk = block
        return s[torch.arange(N) // bn][:, torch.arange(K) // bk]
    return s.reshape(-1, 1).expand(N, K)


def fp8_dense(bits, scale_full):
    return fp8_bits_to_f64(bits) * scale_full
