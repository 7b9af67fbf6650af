"""Real writers of 4-bit checkpoints, for the tests: llmcompressor 0.14 (``oneshot`` with W4A16, W4A16_ASYM,
NVFP4A16, MXFP4A16, and GPTQ on a tiny calibration set) and ``mlx_lm.convert -q`` (MLX affine 4-bit at two group sizes,
mxfp4, nvfp4), on tiny Llama and Qwen3 models saved by transformers, and on tiny Qwen3-MoE and Mixtral models (MOE_ARCHS:
llmcompressor linearizes transformers 5's fused experts itself and writes one Linear per expert and projection;
mlx_lm writes them stacked, ``switch_mlp.{gate,up,down}_proj`` [E, N, ...], with Qwen3-MoE's routers at 8 bits).

llmcompressor pins transformers <= 5.17 and compressed-tensors 0.19, so neither it nor mlx goes into the test
environment: each is installed with ``pip install --no-deps --target`` (its pure-Python dependencies listed here;
torch, numpy, transformers for mlx-lm are the environment's own) into a cache directory once, and runs in a
subprocess with PYTHONPATH pointing there. Without a reachable package index the tests skip, except in CI
(TORCH_LOWBIT_CI=1), where they fail.

References, independent of torch_lowbit: compressed-tensors checkpoints dequantized in float64 by the writer's
formula (its own unpack helpers, ``(q - zp) * scale`` per group, ``e2m1 * (scale / global_scale)``,
``e2m1 * 2^(e8m0 - 127)``) and loaded
dense by transformers; MLX checkpoints dequantized by mlx's own ``mx.dequantize``.
"""
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

transformers = pytest.importorskip("transformers")

CI = os.environ.get("TORCH_LOWBIT_CI") == "1"
CACHE = os.environ.get("TORCH_LOWBIT_TEST_CACHE", os.path.join(tempfile.gettempdir(), "torch_lowbit-test-cache"))

PACKAGES = {
    # llmcompressor and what it imports that the environment lacks; transformers 5.17 wants huggingface-hub < 2
    "llmcompressor": ["llmcompressor==0.14.0.1", "transformers==5.17.*", "compressed-tensors==0.19.*",
                      "huggingface-hub>=1.5,<2", "httpx", "httpcore", "datasets==5.2.*", "pyarrow==24.*", "dill",
                      "multiprocess", "xxhash", "pandas", "python-dateutil", "tzdata"],
    # mlx's Linux CPU wheels; mlx-lm runs on the environment's transformers
    "mlx": ["mlx==0.32.*", "mlx-cpu==0.32.*", "mlx-lm==0.32.*", "sentencepiece", "protobuf"],
}

V, H, I, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 160, 128, 256, 4, 2, 32, 2  # K = 128 / 256: MLX needs K % group == 0
ARCHS = ("llama", "qwen3")
MOE_ARCHS = ("qwen3_moe", "mixtral")
MOE_I, EXPERTS, TOP_K = 128, 4, 2
PROMPT = torch.tensor([[5, 9, 77, 31, 2, 60, 14, 99]])


def _fail_or_skip(msg):
    if CI:
        pytest.fail(msg)
    pytest.skip(msg)


def installed(name: str) -> str:
    """The directory `name`'s packages are installed in (installed on first use; cached across sessions)."""
    specs = PACKAGES[name]
    digest = hashlib.sha256(json.dumps([sys.version_info[:2], specs]).encode()).hexdigest()[:12]
    target = os.path.join(CACHE, f"{name}-{digest}")
    if os.path.isfile(os.path.join(target, ".complete")):
        return target
    os.makedirs(CACHE, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f"{name}-", dir=CACHE)
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", tmp, *specs]
    try:
        done = subprocess.run(pip, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        _fail_or_skip(f"the package index did not serve {name} within 300 s")
    if done.returncode != 0:
        _fail_or_skip(f"the package index cannot serve {name}: {done.stderr.strip()[-400:]}")
    open(os.path.join(tmp, ".complete"), "w").close()
    try:
        os.rename(tmp, target)
    except OSError:  # another session got there first
        pass
    return target


def run_with(name: str, script: str, *args, timeout=600):
    env = {**os.environ, "PYTHONPATH": installed(name), "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=timeout)
    assert done.returncode == 0, f"{name} writer failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done.stdout


# --------------------------------------------------------------------------------------------- tiny dense models
def tiny_config(arch):
    common = dict(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                  max_position_embeddings=64, tie_word_embeddings=False)
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(moe_intermediate_size=MOE_I, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                                           norm_topk_prob=True, **common)
    if arch == "mixtral":
        return transformers.MixtralConfig(**{**common, "intermediate_size": MOE_I}, num_local_experts=EXPERTS,
                                          num_experts_per_tok=TOP_K)
    return (transformers.LlamaConfig if arch == "llama" else transformers.Qwen3Config)(**common)


def write_dense(arch, path, seed=0):
    """A tiny fp32 model with trained-looking weight sizes and a word-level tokenizer (mlx_lm.convert loads one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, p.shape[-1] ** -0.5)
    model.save_pretrained(path)
    if arch in MOE_ARCHS:  # the names published MoE configs (and mlx_lm) use beside transformers 5's
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        cfg.update(rope_theta=cfg["rope_parameters"]["rope_theta"], num_experts=EXPERTS)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1",
                                         bos_token="t2").save_pretrained(path)
    return path


# ------------------------------------------------------------------------------------------------ llmcompressor
LLMC_SCHEMES = ("W4A16", "W4A16_ASYM", "NVFP4A16", "MXFP4A16", "GPTQ")  # GPTQ: W4A16 weights by GPTQModifier

_LLMC_SCRIPT = """
    import json, sys, torch, transformers
    from torch.utils.data import DataLoader
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    assert transformers.__version__.startswith("5.17"), transformers.__version__
    for dense, out, scheme in json.loads(sys.argv[1]):
        model = transformers.AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32)
        if scheme == "GPTQ":
            g = torch.Generator().manual_seed(0)
            calib = DataLoader([{"input_ids": torch.randint(0, model.config.vocab_size, (16,), generator=g),
                                 "attention_mask": torch.ones(16, dtype=torch.long)} for _ in range(4)], batch_size=1)
            oneshot(model=model, dataset=calib, recipe=GPTQModifier(targets="Linear", scheme="W4A16",
                                                                     ignore=["lm_head"]),
                    num_calibration_samples=4, max_seq_length=16)
        else:
            oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"]))
        model.save_pretrained(out, save_compressed=True)
        print("written", out)
"""


def write_llmcompressor(jobs):
    """jobs: [(dense dir, out dir, scheme)], all in one subprocess (its imports take most of the time)."""
    run_with("llmcompressor", _LLMC_SCRIPT, json.dumps([[str(a) for a in j] for j in jobs]))


def write_dense_archs(root, archs):
    """{arch: dense dir} for each architecture, under root."""
    return {arch: write_dense(arch, root / arch) for arch in archs}


def write_llmcompressor_cases(root, dense_dirs, cases):
    """{(arch, scheme): checkpoint dir} of each case written by llmcompressor under root, in one subprocess."""
    paths = {(arch, scheme): root / f"{arch}-{scheme}" for arch, scheme in cases}
    write_llmcompressor([(dense_dirs[arch], path, scheme) for (arch, scheme), path in paths.items()])
    return paths


def ct_float64_reference(path, out):
    """The compressed-tensors checkpoint at `path` dequantized in float64 by the writer's formula (its own unpack
    helpers), rounded once to fp32, saved dense at `out` (no quantization_config)."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.torch import load_file, save_file

    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    qc = config.pop("quantization_config")
    (group,) = qc["config_groups"].values()
    sd = load_file(os.path.join(path, "model.safetensors"))
    dense = {}
    for k, v in sd.items():
        if not k.endswith(".weight_packed"):
            if not k.endswith((".weight_scale", ".weight_shape", ".weight_zero_point", ".weight_global_scale")):
                dense[k] = v
            continue
        base = k[: -len("_packed")]
        scale = sd[base + "_scale"]
        if group["format"] == "pack-quantized":
            N, K = sd[base + "_shape"].tolist()
            q = unpack_from_int32(v, 4, torch.Size([N, K])).double()
            zkey = base + "_zero_point"
            if zkey in sd:
                zp = unpack_from_int32(sd[zkey], 4, torch.Size([N, scale.shape[1]]), packed_dim=0).double()
                q = q - zp.repeat_interleave(-(-K // scale.shape[1]), 1)[:, :K]
            s = scale.double()
        else:
            N, K = v.shape[0], v.shape[1] * 2
            q = unpack_fp4_from_uint8(v, N, K, dtype=torch.float32).double()
            if group["format"] == "mxfp4-pack-quantized":  # E8M0: 2 ** (bits - 127)
                s = torch.pow(2.0, scale.double() - 127)
            else:
                s = scale.float().double() / sd[base + "_global_scale"].double()
        dense[base] = (q * s.repeat_interleave(-(-K // s.shape[1]), 1)[:, :K]).float()
    if config.get("model_type") == "mixtral":
        # llmcompressor writes Mixtral's experts under its linearized names (experts.{e}.gate_proj), which
        # transformers' dense Mixtral loader does not read: the dense reference takes the published w1 / w3 / w2
        leaves = {".gate_proj.": ".w1.", ".up_proj.": ".w3.", ".down_proj.": ".w2."}
        dense = {_renamed(k, leaves) if ".experts." in k else k: v for k, v in dense.items()}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(dense, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out


def _renamed(key, leaves):
    for old, new in leaves.items():
        key = key.replace(old, new)
    return key


# --------------------------------------------------------------------------------------------------------- mlx
MLX_CASES = {  # name -> mlx_lm.convert arguments
    "affine-g64": dict(q_group_size=64),  # mlx_lm's default group size
    "affine-g32": dict(q_group_size=32),
    "mxfp4": dict(q_mode="mxfp4"),
    "nvfp4": dict(q_mode="nvfp4"),
    "mixed-3-4": dict(quant_predicate="mixed_3_4"),  # 3-bit layers: refused
}

_MLX_SCRIPT = """
    import json, os, sys
    import numpy as np
    import mlx.core as mx
    from mlx_lm.convert import convert
    from safetensors.numpy import save_file
    for dense, out, kwargs, ref in json.loads(sys.argv[1]):
        convert(dense, out, quantize=True, **kwargs)
        if not ref:
            continue
        # the reference: mlx's own dequantize of every quantized tensor, saved dense with the config minus its
        # quantization
        cfg = json.load(open(os.path.join(out, "config.json")))
        q = cfg.pop("quantization"); cfg.pop("quantization_config", None)
        weights = mx.load(os.path.join(out, "model.safetensors"))
        dense_sd = {}
        for k, w in weights.items():
            if k.endswith((".scales", ".biases")):
                continue
            base = k[: -len(".weight")]
            if k.endswith(".weight") and base + ".scales" in weights:
                args = {**q, **(q.get(base) or {})}
                w = mx.dequantize(w, weights[base + ".scales"], weights.get(base + ".biases"),
                                  group_size=args["group_size"], bits=args["bits"], mode=args.get("mode", "affine"),
                                  dtype=mx.float32)
            dense_sd[k] = np.array(w.astype(mx.float32))
        for k in [k for k in dense_sd if k.endswith(".switch_mlp.gate_proj.weight")]:
            # mlx_lm's stacked experts, as the fused experts of transformers 5 (gate rows, then up rows)
            block = k[: -len(".switch_mlp.gate_proj.weight")]
            gate, up, down = (dense_sd.pop(f"{block}.switch_mlp.{p}_proj.weight") for p in ("gate", "up", "down"))
            dense_sd[f"{block}.experts.gate_up_proj"] = np.concatenate([gate, up], axis=1)
            dense_sd[f"{block}.experts.down_proj"] = down
        os.makedirs(ref, exist_ok=True)
        json.dump(cfg, open(os.path.join(ref, "config.json"), "w"))
        save_file(dense_sd, os.path.join(ref, "model.safetensors"), metadata={"format": "pt"})
        print("written", out)
"""


def write_mlx(jobs):
    """jobs: [(dense dir, out dir, convert kwargs, reference dir or None)], in one subprocess."""
    run_with("mlx", _MLX_SCRIPT, json.dumps([[str(d), str(o), kw, str(r) if r else None] for d, o, kw, r in jobs]))


def write_mlx_cases(root, dense_dirs, cases, without_reference=()):
    """{(arch, case): (checkpoint dir, mlx's own dequantized reference dir or None)} of each MLX_CASES case written
    by mlx_lm.convert under root, in one subprocess; the cases in without_reference get no reference."""
    paths = {(arch, case): (root / f"{arch}-{case}", None if case in without_reference else root / f"{arch}-{case}-ref")
             for arch, case in cases}
    write_mlx([(dense_dirs[arch], out, MLX_CASES[case], ref) for (arch, case), (out, ref) in paths.items()])
    return paths


# ------------------------------------------------------------------------------------------------- comparisons
def transformers_reload(path):
    """transformers 5.24 + compressed-tensors 0.20 decompressing the checkpoint to fp32 (the writer's stack)."""
    cfg = transformers.CompressedTensorsConfig(dequantize=True)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             quantization_config=cfg).eval()


def dense_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def logits(model, ids=PROMPT):
    with torch.no_grad():
        return model(ids).logits.float()


def greedy(model, ids=PROMPT, n=8):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0)


def assert_same_model(ours, reference, rtol=1e-5):
    """fp32 logits within `rtol` of the reference's largest, and the same greedy tokens."""
    a, b = logits(ours), logits(reference)
    err = float((a - b).abs().max())
    assert err <= rtol * float(b.abs().max()), f"logits differ by {err} (largest {float(b.abs().max())})"
    assert torch.equal(greedy(ours), greedy(reference))
