"""Tiny transformers 5 models (Llama, Qwen3-MoE, Mixtral, DeepSeek-V3; dims not multiples of 128) and checkpoints
written for them by the real writers installed here: compressed-tensors (apply a QuantizationConfig, calibrate the
weights' scales by compressed-tensors' own qparam rule, compress, ``save_pretrained``) and transformers'
``FineGrainedFP8Config`` quantize step. Each writer's own dequantized reload is the reference.

compressed-tensors quantizes ``nn.Linear`` modules only, and transformers 5 holds MoE experts fused in 3-D
parameters: like llmcompressor's MoE calibration modules, the writer first splits each experts module into one
Linear per projection and expert (named as the published checkpoints name them), which ``save_pretrained``
then writes under the checkpoint's names (Mixtral: ``block_sparse_moe.experts.{e}.w1``).
"""
import math

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
ct = pytest.importorskip("compressed_tensors")

from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.offload import update_offload_parameter  # noqa: E402
from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,  # noqa: E402
                                             QuantizationStatus, apply_quantization_config)
from compressed_tensors.quantization.utils.helpers import calculate_qparams  # noqa: E402

V, H, I, MOE_I, HEADS, KV_HEADS, HEAD_DIM, LAYERS, EXPERTS, TOP_K = 101, 48, 80, 112, 4, 2, 12, 2, 4, 2
CT_BLOCK = (16, 32)  # partial blocks: 48 and 80 are not multiples of 32, 24 not of 16


def tiny_config(arch, V=V, H=H, I=I, MOE_I=MOE_I, HEADS=HEADS, KV_HEADS=KV_HEADS, HEAD_DIM=HEAD_DIM):
    common = dict(vocab_size=V, hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=64, tie_word_embeddings=False)
    if arch == "llama":
        return transformers.LlamaConfig(intermediate_size=I, **common)
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(intermediate_size=I, moe_intermediate_size=MOE_I, num_experts=EXPERTS,
                                           num_experts_per_tok=TOP_K, norm_topk_prob=True, **common)
    if arch == "mixtral":
        return transformers.MixtralConfig(intermediate_size=MOE_I, num_local_experts=EXPERTS,
                                          num_experts_per_tok=TOP_K, **common)
    if arch == "deepseek_v3":  # MLA attention (a key and a value head per head), a dense first layer, routed experts
        common.pop("head_dim")
        common["num_key_value_heads"] = HEADS
        return transformers.DeepseekV3Config(intermediate_size=I, moe_intermediate_size=MOE_I, n_routed_experts=EXPERTS,
                                             num_experts_per_tok=TOP_K, n_group=2, topk_group=1,
                                             first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32,
                                             qk_rope_head_dim=8, qk_nope_head_dim=HEAD_DIM, v_head_dim=HEAD_DIM,
                                             **common)
    raise ValueError(arch)


def tiny_model(arch, seed=0, **sizes):
    """The tiny model of `arch` (sizes: overrides of the module's V, H, I, ... for tiny_config)."""
    torch.manual_seed(seed)
    config = tiny_config(arch, **sizes)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # weights of a trained-looking size, so greedy decoding is not a tie every step
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, p.shape[-1] ** -0.5)
    return model


# how published checkpoints name one expert's projections: transformers' conversion mapping stacks them
EXPERT_LEAVES = {"mixtral": ("w1", "w3", "w2")}
DEFAULT_LEAVES = ("gate_proj", "up_proj", "down_proj")


def split_experts(model, arch):
    """Replace every fused experts module by per-expert Linears (gate, up, down), with the same values."""
    gate_name, up_name, down_name = EXPERT_LEAVES.get(arch, DEFAULT_LEAVES)
    for name, mod in list(model.named_modules()):
        gu = getattr(mod, "gate_up_proj", None)
        if not (isinstance(gu, torch.Tensor) and gu.dim() == 3):
            continue
        E, I2, _ = gu.shape
        half = I2 // 2
        experts = nn.ModuleList()
        for e in range(E):
            one = nn.Module()
            for leaf, w in ((gate_name, gu[e, :half]), (up_name, gu[e, half:]), (down_name, mod.down_proj[e])):
                lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
                with torch.no_grad():
                    lin.weight.copy_(w)
                setattr(one, leaf, lin)
            experts.append(one)
        model.set_submodule(name, experts)
    return model


# ----------------------------------------------------------------------------------------- compressed-tensors
CT_SCHEMES = {  # name -> (weight type, strategy, block, input activations: True dynamic per-token, "static"
    # per-tensor with an input_scale calibrated on CALIBRATION_IDS, False none)
    "fp8-tensor": ("float", "tensor", None, True),
    "fp8-tensor-static": ("float", "tensor", None, "static"),
    "fp8-channel": ("float", "channel", None, True),
    "fp8-block": ("float", "block", CT_BLOCK, True),
    "fp8-channel-w8a16": ("float", "channel", None, False),
    "int8-w8a8": ("int", "channel", None, True),
    "int8-w8a8-static": ("int", "channel", None, "static"),
}


def ct_scheme(name):
    typ, strategy, block, acts = CT_SCHEMES[name]
    weights = QuantizationArgs(num_bits=8, type=typ, strategy=strategy, symmetric=True, dynamic=False,
                               block_structure=list(block) if block else None)
    inputs = None
    if acts == "static":
        inputs = QuantizationArgs(num_bits=8, type=typ, strategy="tensor", symmetric=True, dynamic=False)
    elif acts:
        inputs = QuantizationArgs(num_bits=8, type=typ, strategy="token", symmetric=True, dynamic=True)
    return QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs)


def _weight_min_max(w, args):
    """What an observer reduces a weight to, per the strategy (blocks padded with zeros, which change no max)."""
    if args.strategy == "tensor":
        return w.aminmax()
    if args.strategy == "channel":
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    bn, bk = args.block_structure
    N, K = w.shape
    p = nn.functional.pad(w, (0, -K % bk, 0, -N % bn)).view(math.ceil(N / bn), bn, math.ceil(K / bk), bk)
    return p.amin((1, 3)), p.amax((1, 3))


CALIBRATION_IDS = torch.tensor([[5, 9, 77, 31, 2, 60, 14, 99, 41, 8, 23, 70]])


def calibrate_input_scales(model, ids=CALIBRATION_IDS):
    """Static input scales as llmcompressor's min-max observer sets them: each quantized module's input range over
    a calibration batch (run with quantization off), through compressed-tensors' own qparam rule."""
    mins, maxs, hooks = {}, {}, []
    for name, mod in model.named_modules():
        s = getattr(mod, "quantization_scheme", None)
        if s is None or s.input_activations is None or s.input_activations.dynamic:
            continue

        def observe(m, args, name=name):
            lo, hi = args[0].detach().aminmax()
            mins[name] = torch.minimum(mins.get(name, lo), lo)
            maxs[name] = torch.maximum(maxs.get(name, hi), hi)
        mod.quantization_enabled = False
        hooks.append(mod.register_forward_pre_hook(observe))
    if not hooks:  # nothing static to calibrate (split MoE experts could not run a forward anyway)
        return
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    for name in mins:
        mod = model.get_submodule(name)
        scale, _ = calculate_qparams(mins[name], maxs[name], mod.quantization_scheme.input_activations)
        update_offload_parameter(mod, "input_scale", scale.reshape(mod.input_scale.shape).to(mod.input_scale.dtype))
        mod.quantization_enabled = True


def write_compressed_tensors(model, arch, path, scheme):
    """Quantize `model` (in place) with compressed-tensors and save it; lm_head and routers stay dense."""
    if any(isinstance(getattr(m, "gate_up_proj", None), torch.Tensor) for m in model.modules()):
        split_experts(model, arch)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": ct_scheme(scheme)},
                                                        ignore=["lm_head"]), show_progress=False)
    for _, mod in model.named_modules():
        s = getattr(mod, "quantization_scheme", None)
        if s is None:
            continue
        scale, zp = calculate_qparams(*_weight_min_max(mod.weight.detach(), s.weights), s.weights)
        update_offload_parameter(mod, "weight_scale", scale.to(mod.weight_scale.dtype))
        if hasattr(mod, "weight_zero_point"):
            update_offload_parameter(mod, "weight_zero_point", zp.to(mod.weight_zero_point.dtype))
        mod.quantization_status = QuantizationStatus.FROZEN
    calibrate_input_scales(model)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(path)
    return path


def ct_dequantized(path):
    """compressed-tensors' own reload of the checkpoint, dequantized to fp32 by transformers."""
    cfg = transformers.CompressedTensorsConfig(dequantize=True)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=cfg).eval()


# ----------------------------------------------------------------------------------- transformers FineGrainedFP8
HF_FP8_BLOCK = (8, 16)  # transformers' quantize step leaves a weight whose dims the block does not divide unquantized


def write_hf_fp8(model, arch, path, scheme="block"):
    """transformers' FineGrainedFP8Config quantize step (its ``Fp8Quantize`` conversion op: plain torch, runs on
    the CPU, unlike ``from_pretrained(..., quantization_config=FineGrainedFP8Config())``, which refuses a machine
    without a GPU) on every Linear but lm_head, saved with the config it belongs to."""
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    if any(isinstance(getattr(m, "gate_up_proj", None), torch.Tensor) for m in model.modules()):
        split_experts(model, arch)
    qc = transformers.FineGrainedFP8Config(weight_block_size=list(HF_FP8_BLOCK), modules_to_not_convert=["lm_head"])
    quantizer = type("Quantizer", (), {"quantization_config": qc})()
    op = Fp8Quantize(quantizer)
    sd = {}
    for k, v in model.state_dict().items():
        owner = k.rsplit(".", 1)[0]
        if k.endswith(".weight") and type(model.get_submodule(owner)) is nn.Linear and owner != "lm_head":
            sd.update(op.convert({k: v}))
        else:
            sd[k] = v
    model.config.quantization_config = qc
    model.save_pretrained(path, state_dict=sd)
    return path


def hf_fp8_dequantized(path):
    """transformers' own reload: on a machine without a GPU it dequantizes the checkpoint (to fp32 here)."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def dequantized_by_hand(path):
    """Where the writer's own reload fails -- transformers 5.24 cannot dequantize compressed-tensors MoE experts
    with block scales (its CompressedTensorsDequantize multiplies the stacked weight by an unexpanded block scale)
    -- the reference is the checkpoint dequantized here in float64 (``reference.expand_scale``) and loaded dense by
    transformers, which then applies its own renaming and expert stacking."""
    import json
    import os
    import tempfile

    from safetensors.torch import load_file, save_file

    from reference import expand_scale

    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    qc = config.pop("quantization_config")
    block = qc.get("weight_block_size") or next(
        (g["weights"].get("block_structure") for g in qc.get("config_groups", {}).values()), None)
    sd = load_file(os.path.join(path, "model.safetensors"))
    dense = {}
    for k, v in sd.items():
        if k.endswith(("_scale", "_scale_inv")):
            continue
        if v.dtype in (torch.float8_e4m3fn, torch.int8):
            base = k[: -len("weight")]
            scale = sd.get(base + "weight_scale", sd.get(base + "weight_scale_inv"))
            blocked = block if scale.dim() == 2 and scale.shape[1] != 1 else None
            v = v.double() * expand_scale(scale, *v.shape, blocked)
        dense[k] = v.float()
    out = tempfile.mkdtemp(prefix="dequantized-", dir=os.path.dirname(path))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(dense, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


WRITERS = {"ct": (write_compressed_tensors, ct_dequantized), "hf-fp8": (write_hf_fp8, hf_fp8_dequantized)}
# (arch, writer, scheme) whose writer's reload does not work, and why: see dequantized_by_hand
WRITER_RELOAD_FAILS = {("qwen3_moe", "ct", "fp8-block"), ("mixtral", "ct", "fp8-block")}
