"""One denoising step of a FLUX.1-dev-shaped transformer, bf16 vs FP8 (W8A16) vs INT8 (W8A8) (and, asked for, INT4
W4A16), on the best device.

The transformer has FLUX.1-dev's dimensions (hidden 3072 = 24 heads x 128, MLP 4x, joint_attention_dim 4096,
pooled 768, 64 latent channels, guidance embedding) and 4096 image + 512 text tokens (a 1024 x 1024 image), but
only a few of its 19 double-stream + 38 single-stream blocks (default 1 + 1; every block of a kind has the same
shapes, so a step of the whole model costs about 19x a double block plus 38x a single one). The model is diffusers'
``FluxTransformer2DModel`` when diffusers is installed, otherwise a stand-in defined here with the same layers
(names, shapes, biases), the same attention (scaled_dot_product_attention over text + image tokens with RMS-normed
q / k and rotary embeddings) and the same adaLN modulation; the output says which one ran.

FP8, INT8 and INT4 models are the bf16 one quantized by ``quantize_`` with the diffusion default filter
(``torch_lowbit.diffusion``: embedders and the final layer stay bf16). Every round times one step of every mode in
turn (median over rounds), so the ratios come from the same minutes of the same machine. Columns: step time,
step time / bf16's, speedup = bf16 / mode, max rel err = max|y - y_bf16| / max|y_bf16| and rms rel err =
||y - y_bf16|| / ||y_bf16|| of the step's output (the predicted velocity), rms err vs fp32 = the same against the
step of a float32 copy of the bf16 model (bf16's own rounding beside the quantization error), weight MB (every
parameter and buffer of the timed model).

``python -m torch_lowbit.bench --suite diffusion [--double-blocks 1 --single-blocks 1 --image-tokens 4096 ...]``
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import math
import platform
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from .timing import print_table, sync, write_json

MODES = ("bf16", "fp8", "int8", "int4")
DEFAULT_MODES = ("fp8", "int8")
IMPLS = ("auto", "diffusers", "builtin")
# FLUX.1-dev's transformer config (diffusers' FluxTransformer2DModel for black-forest-labs/FLUX.1-dev)
FLUX_DEV = dict(hidden=3072, heads=24, joint_dim=4096, pooled_dim=768, in_channels=64, mlp_ratio=4.0,
                image_tokens=4096, text_tokens=512, double_blocks=19, single_blocks=38)


def log(msg):
    print(f"diffusion: {msg}", file=sys.stderr, flush=True)


def rope_axes(head_dim: int):
    """FLUX's split of each head's rotary dims over the (index, row, column) axes: (16, 56, 56) for 128; every
    part even."""
    first = max(2, head_dim // 8 // 2 * 2)
    second = (head_dim - first) // 2 // 2 * 2
    return first, second, head_dim - first - second


# ------------------------------------------------------------------------------- the stand-in FLUX transformer
# Used where diffusers is not installed. Module names follow diffusers' FluxTransformer2DModel, so the diffusion
# filter keeps the same layers in bf16 and the quantized layers have the same shapes.
class _Modulation(nn.Module):
    """adaLN: a LayerNorm without affine, then ``x * (1 + scale) + shift`` from ``linear(silu(temb))``."""

    def __init__(self, dim, chunks):
        super().__init__()
        self.linear = nn.Linear(dim, chunks * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, x, temb):
        return self.linear(F.silu(temb)).unsqueeze(1).chunk(self.linear.out_features // x.shape[-1], dim=-1)

    def modulate(self, x, shift, scale):
        return self.norm(x) * (1 + scale) + shift


class _GeluProj(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.proj = nn.Linear(dim, hidden)

    def forward(self, x):
        return F.gelu(self.proj(x), approximate="tanh")


class _FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.net = nn.ModuleList([_GeluProj(dim, hidden), nn.Dropout(0.0), nn.Linear(hidden, dim)])

    def forward(self, x):
        for layer in self.net:
            x = layer(x)
        return x


def _rotate(x, cos, sin):
    """Rotary embedding on interleaved pairs (FLUX's layout): x [B, H, S, D], cos / sin [S, D]."""
    pairs = x.float().unflatten(-1, (-1, 2))
    rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return (x.float() * cos + rotated * sin).to(x.dtype)


class _Attention(nn.Module):
    """Joint attention: the image stream's q / k / v (``to_*``) and, in double blocks, the text stream's
    (``add_*_proj``), RMS-normed per head, rotated, attended over text + image tokens together."""

    def __init__(self, dim, heads, joint):
        super().__init__()
        self.heads, head_dim = heads, dim // heads
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.norm_q, self.norm_k = nn.RMSNorm(head_dim, eps=1e-6), nn.RMSNorm(head_dim, eps=1e-6)
        if joint:
            self.add_q_proj, self.add_k_proj, self.add_v_proj = (nn.Linear(dim, dim), nn.Linear(dim, dim),
                                                                 nn.Linear(dim, dim))
            self.norm_added_q, self.norm_added_k = nn.RMSNorm(head_dim, eps=1e-6), nn.RMSNorm(head_dim, eps=1e-6)
            self.to_out = nn.ModuleList([nn.Linear(dim, dim), nn.Dropout(0.0)])
            self.to_add_out = nn.Linear(dim, dim)

    def _heads(self, x):
        return x.unflatten(-1, (self.heads, -1)).transpose(1, 2)

    def forward(self, x, rope, context=None):
        q, k, v = (self._heads(p(x)) for p in (self.to_q, self.to_k, self.to_v))
        q, k = self.norm_q(q), self.norm_k(k)
        if context is not None:
            cq, ck, cv = (self._heads(p(context)) for p in (self.add_q_proj, self.add_k_proj, self.add_v_proj))
            q = torch.cat([self.norm_added_q(cq), q], dim=2)
            k = torch.cat([self.norm_added_k(ck), k], dim=2)
            v = torch.cat([cv, v], dim=2)
        q, k = _rotate(q, *rope), _rotate(k, *rope)
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        if context is None:
            return out
        text = context.shape[1]
        return self.to_out[0](out[:, text:]), self.to_add_out(out[:, :text])


class _DoubleBlock(nn.Module):
    def __init__(self, dim, heads, mlp_hidden):
        super().__init__()
        self.norm1, self.norm1_context = _Modulation(dim, 6), _Modulation(dim, 6)
        self.attn = _Attention(dim, heads, joint=True)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.norm2_context = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ff, self.ff_context = _FeedForward(dim, mlp_hidden), _FeedForward(dim, mlp_hidden)

    def forward(self, x, context, temb, rope):
        shift, scale, gate, mlp_shift, mlp_scale, mlp_gate = self.norm1(x, temb)
        c_shift, c_scale, c_gate, c_mlp_shift, c_mlp_scale, c_mlp_gate = self.norm1_context(context, temb)
        attn, c_attn = self.attn(self.norm1.modulate(x, shift, scale), rope,
                                 self.norm1_context.modulate(context, c_shift, c_scale))
        x = x + gate * attn
        x = x + mlp_gate * self.ff(self.norm2(x) * (1 + mlp_scale) + mlp_shift)
        context = context + c_gate * c_attn
        context = context + c_mlp_gate * self.ff_context(self.norm2_context(context) * (1 + c_mlp_scale) + c_mlp_shift)
        return x, context


class _SingleBlock(nn.Module):
    def __init__(self, dim, heads, mlp_hidden):
        super().__init__()
        self.norm = _Modulation(dim, 3)
        self.proj_mlp = nn.Linear(dim, mlp_hidden)
        self.proj_out = nn.Linear(dim + mlp_hidden, dim)
        self.attn = _Attention(dim, heads, joint=False)

    def forward(self, x, temb, rope):
        shift, scale, gate = self.norm(x, temb)
        h = self.norm.modulate(x, shift, scale)
        mixed = torch.cat([self.attn(h, rope), F.gelu(self.proj_mlp(h), approximate="tanh")], dim=-1)
        return x + gate * self.proj_out(mixed)


class _Embedder(nn.Module):
    def __init__(self, in_dim, dim):
        super().__init__()
        self.linear_1, self.linear_2 = nn.Linear(in_dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        return self.linear_2(F.silu(self.linear_1(x)))


class _TimeTextEmbed(nn.Module):
    FREQ_DIM = 256

    def __init__(self, dim, pooled_dim):
        super().__init__()
        self.timestep_embedder = _Embedder(self.FREQ_DIM, dim)
        self.guidance_embedder = _Embedder(self.FREQ_DIM, dim)
        self.text_embedder = _Embedder(pooled_dim, dim)

    def _sinusoid(self, t):
        half = self.FREQ_DIM // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
        angles = t.float()[:, None] * 1000.0 * freqs[None]
        return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)

    def forward(self, timestep, guidance, pooled):
        dtype = pooled.dtype
        return (self.timestep_embedder(self._sinusoid(timestep).to(dtype))
                + self.guidance_embedder(self._sinusoid(guidance).to(dtype)) + self.text_embedder(pooled))


class FluxShapedTransformer(nn.Module):
    """The stand-in: FLUX's transformer layers (names and shapes of diffusers' FluxTransformer2DModel) and forward
    (``hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids, guidance`` -> the
    predicted velocity ``[B, image tokens, in_channels]``)."""

    def __init__(self, hidden, heads, joint_dim, pooled_dim, in_channels, mlp_ratio, double_blocks, single_blocks):
        super().__init__()
        mlp_hidden = int(hidden * mlp_ratio)
        self.head_dim = hidden // heads
        self.time_text_embed = _TimeTextEmbed(hidden, pooled_dim)
        self.context_embedder = nn.Linear(joint_dim, hidden)
        self.x_embedder = nn.Linear(in_channels, hidden)
        self.transformer_blocks = nn.ModuleList(_DoubleBlock(hidden, heads, mlp_hidden) for _ in range(double_blocks))
        self.single_transformer_blocks = nn.ModuleList(_SingleBlock(hidden, heads, mlp_hidden)
                                                       for _ in range(single_blocks))
        self.norm_out = _Modulation(hidden, 2)
        self.proj_out = nn.Linear(hidden, in_channels)

    def _rope(self, ids):
        """cos / sin [S, head_dim] of every token's (index, row, column), each pair of dims one frequency."""
        parts = []
        for axis, dim in enumerate(rope_axes(self.head_dim)):
            freqs = 1.0 / 10000.0 ** (torch.arange(0, dim, 2, device=ids.device, dtype=torch.float64) / dim)
            parts.append(ids[:, axis, None].double() * freqs[None])
        angles = torch.cat(parts, dim=-1).repeat_interleave(2, dim=-1)
        return angles.cos().float(), angles.sin().float()

    def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids,
                guidance, return_dict=False):
        temb = self.time_text_embed(timestep, guidance, pooled_projections)
        x, context = self.x_embedder(hidden_states), self.context_embedder(encoder_hidden_states)
        rope = self._rope(torch.cat([txt_ids, img_ids], dim=0))
        for block in self.transformer_blocks:
            x, context = block(x, context, temb, rope)
        x = torch.cat([context, x], dim=1)
        for block in self.single_transformer_blocks:
            x = block(x, temb, rope)
        x = x[:, context.shape[1]:]
        scale, shift = self.norm_out(x, temb)  # the final adaLN's chunks come scale first
        return (self.proj_out(self.norm_out.modulate(x, shift, scale)),)


# --------------------------------------------------------------------------------------------------- the suite
def build_model(args):
    """(bf16 model on args.device, what it is)."""
    dims = dict(hidden=args.hidden, heads=args.heads, joint_dim=args.joint_dim, pooled_dim=args.pooled_dim,
                in_channels=args.in_channels, mlp_ratio=FLUX_DEV["mlp_ratio"])
    impl = args.impl
    diffusers = None
    if impl in ("auto", "diffusers"):
        try:
            import diffusers
        except ImportError:
            if impl == "diffusers":
                raise SystemExit("--impl diffusers: diffusers is not installed (pip install 'torch_lowbit[diffusers]')")
    torch.manual_seed(0)
    with _default_dtype(torch.bfloat16), torch.device(args.device):  # built in place: no float32 copy
        model = _build(args, dims, diffusers)
    if diffusers is not None:
        what = f"diffusers {diffusers.__version__} FluxTransformer2DModel"
    else:
        why = "diffusers not installed" if impl == "auto" else "--impl builtin"
        what = f"torch_lowbit's FLUX-shaped stand-in ({why})"
    return model.eval(), what


@contextlib.contextmanager
def _default_dtype(dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _build(args, dims, diffusers):
    if diffusers is not None:
        return diffusers.FluxTransformer2DModel(
            patch_size=1, in_channels=args.in_channels, num_layers=args.double_blocks,
            num_single_layers=args.single_blocks, attention_head_dim=args.hidden // args.heads,
            num_attention_heads=args.heads, joint_attention_dim=args.joint_dim,
            pooled_projection_dim=args.pooled_dim, guidance_embeds=True,
            axes_dims_rope=rope_axes(args.hidden // args.heads))
    return FluxShapedTransformer(**dims, double_blocks=args.double_blocks, single_blocks=args.single_blocks)


def make_inputs(args, gen):
    """A step's inputs: noisy latents, T5 text states, the pooled CLIP vector, timestep, guidance, token ids (image
    tokens on a square-ish grid, as the pipeline's latent ids). The timestep and guidance, which diffusers rounds to
    the model's dtype and multiplies by 1000, are exact in bf16 both ways, so the float32 reference sees the same."""
    bf16, dev = torch.bfloat16, args.device
    width = math.ceil(math.sqrt(args.image_tokens))
    idx = torch.arange(args.image_tokens)
    img_ids = torch.stack([torch.zeros_like(idx), idx // width, idx % width], dim=-1).float()
    return dict(hidden_states=torch.randn(1, args.image_tokens, args.in_channels, generator=gen).to(bf16).to(dev),
                encoder_hidden_states=torch.randn(1, args.text_tokens, args.joint_dim, generator=gen).to(bf16).to(dev),
                pooled_projections=torch.randn(1, args.pooled_dim, generator=gen).to(bf16).to(dev),
                timestep=torch.tensor([0.5], device=dev), guidance=torch.tensor([4.0], device=dev),
                img_ids=img_ids.to(dev), txt_ids=torch.zeros(args.text_tokens, 3, device=dev))


def model_bytes(model) -> int:
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def errors(y, ref):
    d, r = y.double().cpu() - ref.double().cpu(), ref.double().cpu()
    return (float(d.abs().max() / r.abs().max().clamp_min(1e-30)),
            float(d.norm() / r.norm().clamp_min(1e-30)))


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m torch_lowbit.bench --suite diffusion", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cpu or mps (default: mps if available, else cpu)")
    p.add_argument("--impl", choices=IMPLS, default="auto",
                   help="auto: diffusers' FluxTransformer2DModel if installed, else the stand-in (default auto)")
    p.add_argument("--double-blocks", type=int, default=1, help="double-stream blocks (FLUX.1-dev: 19; default 1)")
    p.add_argument("--single-blocks", type=int, default=1, help="single-stream blocks (FLUX.1-dev: 38; default 1)")
    for name in ("hidden", "heads", "joint_dim", "pooled_dim", "in_channels", "image_tokens", "text_tokens"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=FLUX_DEV[name],
                       help=f"default {FLUX_DEV[name]} (FLUX.1-dev)")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help=f"comma-separated low-bit modes timed against bf16, among {','.join(MODES[1:])} "
                        f"(default {','.join(DEFAULT_MODES)})")
    p.add_argument("--rounds", type=int, default=3, help="timed steps per mode, one per mode in turn (default 3)")
    p.add_argument("--no-fp32-reference", dest="fp32_reference", action="store_false",
                   help="skip the float32 step (one untimed step of a float32 copy: twice the bf16 weight memory) "
                        "behind the 'rms err vs fp32' column")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default 0: torch's default)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    a = p.parse_args(argv)
    a.device = a.device or ("mps" if torch.backends.mps.is_available() else "cpu")
    a.modes = [m for m in a.modes.split(",") if m]
    if not a.modes or any(m not in MODES[1:] for m in a.modes):
        p.error(f"--modes must be among {MODES[1:]}, got {a.modes}")
    for name in ("hidden", "heads", "joint_dim", "pooled_dim", "in_channels", "image_tokens", "text_tokens",
                 "rounds"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.double_blocks < 0 or a.single_blocks < 0 or a.double_blocks + a.single_blocks == 0:
        p.error(f"--double-blocks / --single-blocks must be >= 0 and not both 0, got {a.double_blocks} / "
                f"{a.single_blocks}")
    if a.hidden % a.heads or (a.hidden // a.heads) % 2 or a.hidden // a.heads < 6:
        p.error(f"--hidden must be --heads times an even head dim >= 6, got {a.hidden} / {a.heads}")
    if a.threads < 0:
        p.error(f"--threads must be >= 0, got {a.threads}")
    return a


# what each mode is, for the table's header and the configs that make it
MODE_DESCRIPTIONS = {"fp8": "Fp8Linear per channel (W8A16)", "int8": "Int8Linear (W8A8 dynamic)",
                     "int4": "W4Linear int4 in groups of 128 (W4A16)"}


def _config(mode):
    from ..quantize import Fp8WeightOnly, Int4WeightOnly, Int8Dynamic

    return {"fp8": Fp8WeightOnly("channel"), "int8": Int8Dynamic(), "int4": Int4WeightOnly(128)}[mode]


def run(argv) -> int:
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        torch.empty(1, device=args.device)
    except (RuntimeError, AssertionError) as e:
        print(f"--device {args.device} is not usable here: {e}", file=sys.stderr)
        return 2
    from ..diffusion import diffusion_filter
    from ..quantize import quantize_

    from ..testing import GEMM_ROUTE_NAMES, cpu_amx_gemm, cpu_gemm_route, cpu_isa

    start = time.perf_counter()
    cpu = dict(isa=cpu_isa(), amx_gemm=cpu_amx_gemm(), gemm_route=cpu_gemm_route())
    log(f"{args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads "
        f"({'--threads' if args.threads else 'torch default'}), {platform.machine()}, cpu kernels {cpu['isa']}, "
        f"GEMM route {GEMM_ROUTE_NAMES[cpu['gemm_route']]}")
    model, what = build_model(args)
    log(f"built {what}: {args.double_blocks} double + {args.single_blocks} single blocks, hidden {args.hidden} "
        f"({args.heads} heads x {args.hidden // args.heads}), {args.image_tokens} image + {args.text_tokens} text "
        f"tokens, in {time.perf_counter() - start:.1f} s")
    models, converted = {"bf16": model}, {"bf16": 0}
    for mode in args.modes:
        t0 = time.perf_counter()
        models[mode], report = quantize_(copy.deepcopy(model), _config(mode), filter_fn=diffusion_filter,
                                         return_report=True)
        converted[mode] = len(report.converted)
        log(f"quantized to {mode}: {len(report.converted)} layers, {len(report.skipped)} kept bf16 "
            f"({', '.join(sorted({n.split('.')[0] for n in report.skipped}))}), in {time.perf_counter() - t0:.1f} s")
    x = make_inputs(args, torch.Generator().manual_seed(0))

    def step(m, inputs=x):
        return m(**inputs, return_dict=False)[0]

    outputs, times = {}, {mode: [] for mode in models}
    with torch.inference_mode():
        reference = None
        if args.fp32_reference:  # the same weights in float32: how far bf16 itself is, beside fp8 / int8
            t0 = time.perf_counter()
            reference = step(copy.deepcopy(model).float(),
                             {k: v.float() if v.is_floating_point() else v for k, v in x.items()})
            log(f"float32 reference step: {time.perf_counter() - t0:.2f} s")
        for mode, m in models.items():  # warm-up, and the output the errors compare
            t0 = time.perf_counter()
            outputs[mode] = step(m)
            sync(args.device)
            log(f"warm-up {mode}: {time.perf_counter() - t0:.2f} s")
        for r in range(args.rounds):
            for mode, m in models.items():
                t0 = time.perf_counter()
                step(m)
                sync(args.device)
                times[mode].append(time.perf_counter() - t0)
            last = {mode: ts[-1] for mode, ts in times.items()}
            log(f"[round {r + 1}/{args.rounds}] " + ", ".join(
                f"{mode} {t:.3f} s" + ("" if mode == "bf16" else f" ({t / last['bf16']:.2f}x bf16)")
                for mode, t in last.items()) + f"; {time.perf_counter() - start:.0f} s elapsed")
    base_t, base_mb = statistics.median(times["bf16"]), model_bytes(model) / 2 ** 20
    rows = []
    for mode, m in models.items():
        t = statistics.median(times[mode])
        max_err, rms_err = errors(outputs[mode], outputs["bf16"])
        mb = model_bytes(m) / 2 ** 20
        rows.append(dict(mode=mode, step_ms=t * 1e3, step_vs_bf16=t / base_t, speedup=base_t / t, max_rel_err=max_err,
                         rms_rel_err=rms_err, rms_err_vs_fp32=None if reference is None else
                         errors(outputs[mode], reference)[1], weights_mb=mb, mem_vs_bf16=mb / base_mb,
                         layers_quantized=converted[mode], step_ms_rounds=[s * 1e3 for s in times[mode]]))
    where = f"{args.device}, {torch.get_num_threads()} threads"
    if args.device == "cpu":
        where += f", cpu kernels {cpu['isa']}, GEMM route {GEMM_ROUTE_NAMES[cpu['gemm_route']]}"
    print(f"diffusion: one denoising step, {what}; {args.double_blocks} double + {args.single_blocks} single blocks "
          f"(FLUX.1-dev: 19 + 38), hidden {args.hidden} ({args.heads} heads x {args.hidden // args.heads}), MLP 4x, "
          f"joint_attention_dim {args.joint_dim}, {args.image_tokens} image + {args.text_tokens} text tokens, batch 1, "
          f"{where}; {', '.join(f'{m} = {MODE_DESCRIPTIONS[m]}' for m in args.modes)}, embedders and final layer "
          f"bf16; median of {args.rounds} rounds; err vs the bf16 step's output")
    print_table(rows, [("mode", "mode", None), ("step_ms", "step ms", "{:.1f}"),
                       ("step_vs_bf16", "time vs bf16", "{:.2f}x"),
                       ("speedup", "speedup", "{:.2f}x"), ("max_rel_err", "max rel err", "{:.2e}"),
                       ("rms_rel_err", "rms rel err", "{:.2e}"), ("rms_err_vs_fp32", "rms err vs fp32", "{:.2e}"),
                       ("weights_mb", "weights MB", "{:.1f}"),
                       ("mem_vs_bf16", "mem vs bf16", "{:.2f}x")])
    log(f"done in {time.perf_counter() - start:.0f} s")
    if args.json:
        write_json(args.json, rows, suite="diffusion", model=what, device=str(args.device), torch=torch.__version__,
                   threads=torch.get_num_threads(), machine=platform.machine(), **cpu,
                   dims={k: getattr(args, k, v) for k, v in FLUX_DEV.items()},
                   rounds=args.rounds, err="max|y - y_bf16| / max|y_bf16|; rms: ||y - y_bf16|| / ||y_bf16||; "
                       "rms_err_vs_fp32: ||y - y_fp32|| / ||y_fp32||, y_fp32: a float32 copy of the bf16 model's step")
        log(f"wrote {args.json}")
    return 0
